"""Tiny runs of ``python -m benchmarks --quick`` and ``benchmarks.hook_cost``: the code keeps working."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT


def test_benchmarks_run_tiny_and_write_a_report(tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    # every section but "memory", whose fresh-process measurement "gradient-memory" runs as well (the suite's
    # time: each of those processes imports torch and Lightning)
    sections = ["throughput", "boundary", "gradient-memory", "syncs", "operators", "sharded", "auto-batch"]
    command = [sys.executable, "-m", "benchmarks", "--quick", "--only", *sections, "--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = out.read_text()
    headings = ("Time per micro-batch", "boundary pass", "Peak gradient memory", "Host syncs")
    for heading in (*headings, "Operators launched", '`accumulation_steps="auto"` against fixed K'):
        assert heading in report
    assert out.with_suffix(".svg").read_text().startswith("<svg")  # the plot of the "auto" runs
    assert "nan" not in report.lower()
    sync_rows = [line for line in report.splitlines() if line.startswith("| callback")][-3:]
    assert all(line.split("|")[2].strip() == "0" for line in sync_rows)  # no sync while accumulating


def test_hook_cost_runs_tiny() -> None:
    command = [sys.executable, "-m", "benchmarks.hook_cost", "--quick", "--ks", "2"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for heading in (
        "K=2: time per micro-batch",
        "K=2: µs per micro-batch inside each hook",
        "_call_callback_hooks",
    ):
        assert heading in result.stdout
    assert "nan" not in result.stdout.lower()
