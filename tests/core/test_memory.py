"""The process's memory peak: read when asked, never reset."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_gradacc import GradAccumulator, GradientAccumulationCallback
from tests import helpers as h


def _process_peak() -> int:
    """The kernel's resident-set peak of this process (what a user, `ru_maxrss` or a monitor reads)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")
def test_the_memory_peak_is_read_and_never_reset_for_the_whole_process() -> None:
    """A 128 MiB peak made before the accumulator exists is still the process's peak after a fit with the
    callback logging every step (it used to reset it: a user's own reading fell by the difference)."""
    big = torch.ones(128 * 2**20 // 4)  # touched, then freed
    big.add_(1.0)
    del big
    peak = _process_peak()
    accumulator = GradAccumulator(nn.Linear(3, 1).parameters(), 1)
    assert accumulator.stats.peak_memory_bytes >= peak
    module = h.RegressionModule(h.regression_data(40))
    callback = GradientAccumulationCallback(2)
    h.trainer(callbacks=[callback], logger=h.MetricsRecorder(), log_every_n_steps=1).fit(module)
    assert _process_peak() >= peak
    assert callback.stats.peak_memory_bytes >= peak
