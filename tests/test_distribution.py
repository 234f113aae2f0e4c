"""The package as a user installs it: the wheel, in a fresh virtual environment outside the checkout.

The wheel is built from this checkout, installed without its dependencies into a new venv that sees the
test environment's packages (torch, Lightning) through a ``.pth`` line but not this checkout, and the
README's main job runs from an empty folder: ``lightning-gradacc fit --config quickstart``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.helpers import QUICK, ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(ROOT)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    (built,) = out.glob("lightning_gradacc-*.whl")
    return built


def test_the_wheel_carries_its_license_configs_and_a_description_without_repository_links(
    wheel: Path,
) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
    shipped = {
        Path(name).stem for name in names if re.fullmatch(r"lightning_gradacc/configs/\w+\.yaml", name)
    }
    assert shipped == {path.stem for path in (ROOT / "configs").glob("*.yaml")}
    assert "Classifier: Programming Language :: Python :: 3.10" in metadata
    assert "License-Expression: Apache-2.0" in metadata
    description = metadata.partition("\n\n")[2]
    assert "## The demo and the tests" in description  # the README
    assert not re.findall(r"\]\((?![a-z]+://|#)[^)]*\)", description)  # no link into the repository


def test_the_readme_s_main_job_runs_from_the_installed_wheel_outside_the_checkout(
    wheel: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # the test environment's dependencies, appended after the new venv's own site-packages; its `.pth` files
    # (this checkout's editable install among them) are not read from there
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = [
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(python),
        "install",
        "--no-deps",
        "--quiet",
        str(wheel),
    ]
    subprocess.run(install, check=True, capture_output=True, text=True)
    where = subprocess.run(
        [python, "-c", "import lightning_gradacc; print(lightning_gradacc.__file__)"],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    ).stdout
    assert where.startswith(str(site)), where
    run = tmp_path / "run"
    run.mkdir()
    result = subprocess.run(
        [venv / "bin" / "lightning-gradacc", "fit", "--config", "quickstart", *QUICK],
        capture_output=True,
        text=True,
        cwd=run,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Gradient accumulation summary" in result.stdout
    assert (run / "logs" / "quickstart").is_dir()
