"""AccumulationStats of a run with clipped, skipped and empty windows."""

from __future__ import annotations

import math

from tests.helpers import linear_accumulator, linear_backward


def test_stats_of_a_run_with_skipped_and_empty_windows() -> None:
    model, accumulator = linear_accumulator(max_grad_norm=1e-3)
    linear_backward(model, accumulator)
    linear_backward(model, accumulator)
    assert accumulator.finalize()  # stepped and clipped
    linear_backward(model, accumulator, scale=math.nan)
    linear_backward(model, accumulator)
    assert not accumulator.finalize()  # not finite: skipped
    assert model.weight.grad is None
    assert not accumulator.finalize()  # empty
    linear_backward(model, accumulator)
    stats = accumulator.stats
    assert (stats.windows, stats.skipped_steps, stats.empty_windows, stats.non_finite_windows) == (3, 1, 1, 1)
    assert stats.steps_taken == 1 == stats.windows - stats.skipped_steps - stats.empty_windows
    assert stats.clipped_steps == 1 and stats.open_window_micro_batches == 1
    assert accumulator.window.micro_batches == 1
    assert stats.as_dict()["steps_taken"] == 1
