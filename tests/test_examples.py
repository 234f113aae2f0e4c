"""The README's comparison table comes from examples/partial_window.py: keep its claims true."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "partial_window.py"


def test_partial_window_example_shows_builtin_error_and_fix(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\| (10|padded)", line)]
    assert len(rows) == 2
    for row in rows:
        builtin, fixed = (float(cell) for cell in row.strip("|").split("|")[1:])
        assert builtin > 1e-3
        assert fixed < 1e-6
