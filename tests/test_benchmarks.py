"""Tiny runs of ``python -m benchmarks --quick``, ``benchmarks.hook_cost`` and ``benchmarks.call_path``.

Both run in one child process (each would import torch and Lightning again), as their command lines do.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

BOTH = """
import runpy, sys
sys.argv = ["benchmarks", "--quick", "--only", *{sections!r}, "--out", {out!r}]
runpy.run_module("benchmarks", run_name="__main__")
print("=== hook_cost ===", flush=True)
sys.argv = ["benchmarks.hook_cost", "--quick", "--ks", "2"]
runpy.run_module("benchmarks.hook_cost", run_name="__main__")
print("=== call_path ===", flush=True)
sys.argv = ["benchmarks.call_path", "--modes", "default", "--list"]
runpy.run_module("benchmarks.call_path", run_name="__main__")
"""


def test_benchmarks_and_the_hook_cost_run_tiny_and_report(tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    # every section but "memory", whose fresh-process measurement "gradient-memory" runs as well (the suite's
    # time: each of those processes imports torch and Lightning)
    sections = ["throughput", "boundary", "gradient-memory", "syncs", "operators", "sharded", "auto-batch"]
    script = BOTH.format(sections=sections, out=str(out))
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = out.read_text()
    headings = ("Time per micro-batch", "boundary pass", "Peak gradient memory", "Host syncs")
    for heading in (*headings, "Operators launched", '`accumulation_steps="auto"` against fixed K'):
        assert heading in report
    assert out.with_suffix(".svg").read_text().startswith("<svg")  # the plot of the "auto" runs
    assert "nan" not in report.lower()
    sync_rows = [line for line in report.splitlines() if line.startswith("| callback")][-3:]
    assert all(line.split("|")[2].strip() == "0" for line in sync_rows)  # no sync while accumulating
    hook_cost, call_path = result.stdout.split("=== hook_cost ===", 1)[1].split("=== call_path ===")
    row = next(line for line in call_path.splitlines() if line.startswith("| default |"))
    files, entries = (int(cell) for cell in row.split("|")[2:4])
    assert files > 0 and entries > 0  # a stepping micro-batch passes the callback and enters the core
    assert "callback.py" in call_path and "core/window_end.py" in call_path
    for heading in (
        "K=2: time per micro-batch",
        "K=2: µs per micro-batch inside each hook",
        "_call_callback_hooks",
    ):
        assert heading in hook_cost
    assert "nan" not in hook_cost.lower()
