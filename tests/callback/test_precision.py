"""fp32 accumulation buffers for low-precision parameters, per-micro-batch overflow and clipping."""

from __future__ import annotations

import pytest
import torch

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h

BATCH = 4


# ------------------------------------------------------------------------ per-micro-batch overflow


reference = h.regression_reference


@pytest.mark.parametrize("bad", [[0], [3], [5], [9], [4, 6]])
def test_skip_micro_batch_steps_with_the_rest_of_the_window(bad: list[int]) -> None:
    callback = GradientAccumulationCallback(
        4, overflow="skip_micro_batch", accumulation_dtype="float64", scaling="weighted"
    )
    module = h.RegressionModule(h.regression_data(40), nan_at=bad)
    h.trainer(callbacks=[callback]).fit(module)
    windows = [[b for b in window if b not in bad] for window in h.windows(10, 4)]
    assert h.max_abs_diff(module.net, reference(windows)) < 1e-6
    stats = callback.stats
    assert (stats.dropped_micro_batches, stats.non_finite_windows, stats.skipped_steps) == (len(bad), 0, 0)
    assert stats.windows == stats.steps_taken == 3
    # the last window has micro-batches 8 and 9 of 4 samples; a dropped one does not count
    assert stats.items_last_step == 4 * len(windows[-1])


def test_skip_micro_batch_mean_divides_by_the_micro_batches_kept() -> None:
    callback = GradientAccumulationCallback(4, overflow="skip_micro_batch", accumulation_dtype="float64")
    module = h.RegressionModule(h.regression_data(40), nan_at=[1])
    h.trainer(callbacks=[callback]).fit(module)
    assert h.max_abs_diff(module.net, reference([[0, 2, 3], [4, 5, 6, 7], [8, 9]])) < 1e-6


def test_a_window_without_any_finite_micro_batch_is_skipped() -> None:
    callback = GradientAccumulationCallback(2, overflow="skip_micro_batch", accumulation_dtype="float64")
    module = h.RegressionModule(h.regression_data(40), nan_at=[2, 3])
    with pytest.warns(UserWarning, match="skipped"):
        h.trainer(callbacks=[callback]).fit(module)
    stats = callback.stats
    assert (stats.dropped_micro_batches, stats.non_finite_windows, stats.skipped_steps) == (2, 0, 1)
    windows = h.windows(10, 2)
    assert h.max_abs_diff(module.net, reference(windows, skip_windows=[1])) < 1e-6


def test_micro_batch_clipping_clips_each_micro_batch_before_adding() -> None:
    callback = GradientAccumulationCallback(
        4, accumulation_dtype="float64", clip_mode="micro_batch", max_grad_norm=0.3
    )
    module = h.RegressionModule(h.regression_data(40))
    h.trainer(callbacks=[callback]).fit(module)
    # plain PyTorch: each micro-batch's gradient clipped with torch's clip_grad_norm_, then the mean
    expected = h.regression_net()
    optimizer = torch.optim.SGD(expected.parameters(), lr=0.1)
    x, y = h.regression_data(40).tensors
    for window in h.windows(10, 4):
        total = [torch.zeros_like(p) for p in expected.parameters()]
        for b in window:
            expected.zero_grad()
            h.mse(expected, x[b * 4 : b * 4 + 4], y[b * 4 : b * 4 + 4]).backward()
            torch.nn.utils.clip_grad_norm_(expected.parameters(), 0.3)
            for t, p in zip(total, expected.parameters(), strict=True):
                t += p.grad
        for t, p in zip(total, expected.parameters(), strict=True):
            p.grad = t / len(window)
        optimizer.step()
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert callback.stats.clipped_steps > 0


# ---------------------------------------------------------------------------------- 16-mixed + buffers


def test_16_mixed_with_buffers_unscales_and_keeps_the_scaler_working() -> None:
    plugin = h.amp_plugin()
    callback = GradientAccumulationCallback(4, accumulation_dtype="float64")
    module = h.RegressionModule(h.regression_data(40), nan_at=[5])
    h.trainer(callbacks=[callback], plugins=[plugin]).fit(module)
    # the reference runs the same fp16 autocast: what is left is micro- vs big-batch fp16 rounding (4e-5)
    expected = reference(h.windows(10, 4), skip_windows=[1], fp16_autocast=True)
    assert h.max_abs_diff(module.net, expected) < 2e-4
    assert (callback.stats.non_finite_windows, callback.stats.skipped_steps) == (1, 1)
    assert plugin.scaler.get_scale() == 2.0**7  # the scaler saw the overflow and backed off


def test_skip_micro_batch_is_refused_under_a_grad_scaler() -> None:
    callback = GradientAccumulationCallback(4, overflow="skip_micro_batch", accumulation_dtype="float64")
    with pytest.raises(RuntimeError, match="cannot be used with a GradScaler"):
        h.trainer(callbacks=[callback], plugins=[h.amp_plugin()]).fit(
            h.RegressionModule(h.regression_data(8))
        )
