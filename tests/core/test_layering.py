"""The core's layering: no Lightning import, and no module importing back the accumulator that wires them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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
