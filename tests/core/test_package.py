"""The core is torch only (importing it imports no Lightning), and no core module imports back the
accumulator that wires them together."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def test_core_imports_without_lightning() -> None:
    code = textwrap.dedent(
        """
        import sys
        import lightning_gradacc.core
        from lightning_gradacc import GradAccumulator, AccumulationStats
        loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('pytorch_lightning', 'lightning'))
        assert not loaded, loaded
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


CORE = Path(__file__).resolve().parents[2] / "src" / "lightning_gradacc" / "core"
MODULES = sorted(path for path in CORE.glob("*.py") if path.name != "__init__.py")


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.stem)
def test_a_core_module_imports_neither_lightning_nor_the_accumulator(path: Path) -> None:
    imports = _imports(path)
    assert not {name for name in imports if "lightning" in name}, imports
    assert path.stem == "accumulator" or ".accumulator" not in imports, imports


def test_private_reads_of_torch_lightning_and_deepspeed_live_in_the_internals_modules() -> None:
    """Every private attribute of torch, Lightning or DeepSpeed the package reads is read in
    `core/torch_internals.py`, `lightning_internals.py` or `deepspeed_internals.py`, one named function each;
    elsewhere only torch's foreach kernels (the `torch.nn.utils` convention) and the package's own objects'
    privates."""
    package = CORE.parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name in ("torch_internals.py", "lightning_internals.py", "deepspeed_internals.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                owner = ast.unparse(node.value)
                if owner in ("self", "cls", "other") or (
                    owner == "torch" and node.attr.startswith("_foreach_")
                ):
                    continue
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr")
                and isinstance(node.args[1], ast.Constant)
                and str(node.args[1].value).startswith("_")
                and not str(node.args[1].value).startswith("__")
            ):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not found, found
