"""The examples behind the README's tables keep their claims true.

``examples/partial_window.py``'s comparison and ``examples/bf16_accumulation.py``'s rounding error.
"""

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


# The precision table in docs/guides.md comes from this example; the test holds its K=1024 row.
relative_error = runpy.run_path(str(Path(__file__).parents[1] / "examples" / "bf16_accumulation.py"))[
    "relative_error"
]


def test_fp32_buffers_keep_bf16_accumulation_at_the_rounding_floor() -> None:
    plain = relative_error(1024, None)
    buffered = relative_error(1024, "float32")
    assert buffered <= 0.005
    assert buffered * 10 <= plain
