"""fp32 accumulation buffers for low-precision parameters, per-micro-batch overflow and clipping."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_gradacc import GradAccumulator, GradientAccumulationCallback
from tests import helpers as h
from tests.syncs import SyncCounter

BATCH = 4


# ------------------------------------------------------------------------------- bf16 accumulation


# The README's table comes from this example; the test holds its K=1024 row to the targets.
relative_error = runpy.run_path(str(Path(__file__).parents[1] / "examples" / "bf16_accumulation.py"))[
    "relative_error"
]


def test_fp32_buffers_keep_bf16_accumulation_at_the_rounding_floor() -> None:
    plain = relative_error(1024, None)
    buffered = relative_error(1024, "float32")
    assert buffered <= 0.005
    assert buffered * 10 <= plain


def test_buffer_bytes_are_the_exact_size_of_the_buffers() -> None:
    net = nn.Linear(10, 3).to(torch.bfloat16)
    accumulator = GradAccumulator(net.parameters(), 2, accumulation_dtype="float32")
    assert accumulator.stats.buffer_bytes == 0  # allocated lazily, at the first micro-batch
    accumulator.backward(net(torch.randn(4, 10, dtype=torch.bfloat16)).float().pow(2).mean())
    assert accumulator.stats.buffer_bytes == 4 * (10 * 3 + 3)
    assert all(p.grad is None for p in net.parameters())  # .grad is released after every micro-batch
    accumulator.backward(net(torch.randn(4, 10, dtype=torch.bfloat16)).float().pow(2).mean())
    assert accumulator.finalize()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in net.parameters())


def test_buffers_on_float32_parameters_warn_that_they_change_nothing() -> None:
    with pytest.warns(UserWarning, match="changes nothing: the parameters are already torch.float32"):
        GradAccumulator(nn.Linear(2, 1).parameters(), accumulation_dtype="float32")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"accumulation_dtype": "int32"}, "`accumulation_dtype` to be a floating dtype .* but got 'int32'"),
        ({"overflow": "skip_micro_batch"}, "`overflow='skip_micro_batch'` .* set `accumulation_dtype`"),
        (
            {"clip_mode": "micro_batch", "max_grad_norm": 1.0},
            "`clip_mode='micro_batch'` .* `accumulation_dtype`",
        ),
        (
            {"clip_mode": "micro_batch", "accumulation_dtype": "float64"},
            "clips to `max_grad_norm`, which is not",
        ),
        ({"clip_mode": "layer"}, "`clip_mode` to be one of .* but got 'layer'"),
    ],
)
def test_invalid_buffer_settings(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GradientAccumulationCallback(4, **kwargs)
    with pytest.raises(ValueError, match=match):
        GradAccumulator(nn.Linear(2, 1).parameters(), 4, **kwargs)


def test_buffer_dtype_narrower_than_a_parameter_is_refused_before_training() -> None:
    match = r"`accumulation_dtype=torch.float16` is narrower than parameter `0.weight` \(torch.float32\)"
    with pytest.raises(ValueError, match=match):
        GradAccumulator(h.regression_net().named_parameters(), accumulation_dtype="float16")
    module = h.RegressionModule(h.regression_data(8))
    with pytest.raises(ValueError, match=match.replace("`0.weight`", "`net.0.weight`")):
        h.trainer(callbacks=[GradientAccumulationCallback(2, accumulation_dtype="float16")]).fit(module)
    assert module.micro_batches_seen == 0


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


def test_skip_micro_batch_does_not_sync_while_accumulating() -> None:
    net = h.regression_net()
    accumulator = GradAccumulator(
        net.parameters(), 4, overflow="skip_micro_batch", accumulation_dtype="float64"
    )
    x, y = h.regression_data(16).tensors
    counter = SyncCounter()
    with counter.patched():
        for index in range(4):
            loss = h.mse(net, x[index * 4 : index * 4 + 4], y[index * 4 : index * 4 + 4])
            with counter.counting():
                accumulator.backward(loss * (float("nan") if index == 1 else 1.0), items=torch.tensor(4))
        assert counter.calls == []
        with counter.counting():
            assert accumulator.finalize()
        assert counter.calls == ["tolist"]
    assert (accumulator.stats.dropped_micro_batches, accumulator.stats.non_finite_windows) == (1, 0)


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
