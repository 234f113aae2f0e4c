"""Fused optimizers through ``Trainer.fit``: the window's verdict and multiplier reach the step on the device.

torch's fused Adam/AdamW/SGD read ``found_inf`` and ``grad_scale`` in their step: the callback decides a
window on the device and lets the step skip itself, with no host read. Oracles: the big-batch loop with the
same fused optimizer; a skipped window leaves parameters and state (Adam's ``step``) as if it never was.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h
from tests.syncs import CountingCallback, SyncCounter


def fused_fit(
    optimizer: str = "adam_fused", *, lr: float = 0.01, nan_at: tuple[int, ...] = (), **kwargs: Any
) -> tuple[h.RegressionModule, GradientAccumulationCallback]:
    callback = GradientAccumulationCallback(4, **kwargs)
    module = h.RegressionModule(h.regression_data(40), optimizer=optimizer, lr=lr, nan_at=nan_at)
    h.trainer(callbacks=[callback]).fit(module)
    return module, callback


@pytest.mark.parametrize("optimizer", ["adam_fused", "adamw_fused", "sgd_fused"])
@pytest.mark.parametrize("nan_window", [0, 1])  # the first: fused SGD's momentum would start uninitialized
def test_a_non_finite_window_is_skipped_by_the_fused_step_itself(optimizer: str, nan_window: int) -> None:
    module, callback = fused_fit(optimizer, nan_at=(4 * nan_window + 1,), max_grad_norm=0.5)
    expected = h.regression_reference(
        h.windows(10, 4), optimizer=optimizer, lr=0.01, max_grad_norm=0.5, skip_windows=[nan_window]
    )
    # fused step's x / (1/m) against the loop's x * m after clipping: float32 rounding
    assert h.max_abs_diff(module.net, expected) < 2e-7
    stats = callback.stats
    assert (stats.skipped_steps, stats.non_finite_windows, stats.windows) == (1, 1, 3)
    assert math.isnan(stats.last_grad_norm) is False
    state = module.trainer.optimizers[0].state
    if optimizer != "sgd_fused":  # the skipped window did not advance Adam's step count
        assert {float(s["step"]) for s in state.values()} == {2.0}


def test_skip_micro_batch_with_a_fused_optimizer_divides_by_the_micro_batches_kept() -> None:
    """Micro-batch 5 is not finite: window 1 steps on micro-batches 4, 6 and 7, their mean (not / 4), with
    the factor decided on the device (the first window is decided on the host: fused SGD's momentum)."""
    callback = GradientAccumulationCallback(4, overflow="skip_micro_batch", accumulation_dtype="float64")
    module = h.RegressionModule(h.regression_data(40), optimizer="sgd_fused", lr=0.1, nan_at=(5,))
    h.trainer(callbacks=[callback]).fit(module)
    assert callback.accumulator.device_step is not None  # type: ignore[union-attr]
    windows = [[0, 1, 2, 3], [4, 6, 7], [8, 9]]
    expected = h.regression_reference(windows, optimizer="sgd_fused", lr=0.1)
    assert h.max_abs_diff(module.net, expected) < 2e-7
    assert callback.stats.dropped_micro_batches == 1


@pytest.mark.parametrize("fold", [True, False])
def test_the_multiplier_is_folded_into_the_step_only_where_no_hook_reads_the_gradient(fold: bool) -> None:
    seen: list[float] = []

    class ReadsGradients(h.RegressionModule):
        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            seen.append(float(torch.cat([p.grad.flatten() for p in self.parameters()]).norm()))

    module_type = h.RegressionModule if fold else ReadsGradients
    callback = GradientAccumulationCallback(4, max_grad_norm=0.5)
    module = module_type(h.regression_data(40), optimizer="sgd_fused", lr=0.01)  # SGD: sees the scale
    h.trainer(callbacks=[callback]).fit(module)
    step = callback.accumulator.device_step  # type: ignore[union-attr]
    assert step is not None and (step.grad_scale is not None) is fold
    expected = h.regression_reference(h.windows(10, 4), optimizer="sgd_fused", lr=0.01, max_grad_norm=0.5)
    assert h.max_abs_diff(module.net, expected) < 2e-7
    if not fold:  # the module's hook saw the final, clipped gradient
        assert len(seen) == 3 and all(norm == pytest.approx(0.5, rel=1e-5) for norm in seen)


def test_16_mixed_with_a_fused_optimizer_clips_the_unscaled_gradient() -> None:
    """Lightning leaves the AMP scale in for fused optimizers: the callback unscales before it measures."""
    callback = GradientAccumulationCallback(4, max_grad_norm=0.5)
    module = h.RegressionModule(h.regression_data(40), optimizer="adam_fused", lr=0.01, nan_at=(5,))
    plugin = h.amp_plugin()
    h.trainer(callbacks=[callback], plugins=[plugin]).fit(module)
    expected = h.regression_reference(
        h.windows(10, 4), optimizer="adam", lr=0.01, max_grad_norm=0.5, fp16_autocast=True, skip_windows=[1]
    )
    # same arithmetic as the non-fused 16-mixed oracle (4e-6 there); the AMP scale in the norm: 8e-5
    assert h.max_abs_diff(module.net, expected) < 1e-5
    assert callback.stats.last_grad_norm < 10  # not the scaled norm (about 2.3 x 256)
    assert plugin.scaler.get_scale() == 2.0**7  # the scaler saw the overflow


def test_token_weighted_steps_read_nothing_back_and_match_the_big_batch() -> None:
    counter = SyncCounter()
    callback = CountingCallback(
        counter, 4, scaling="weighted", item_count_fn=h.count_tokens, max_grad_norm=1.0
    )
    module = h.TokenModule(h.token_data(), optimizer="adamw_fused", lr=0.05)
    with counter.patched():
        h.trainer(callbacks=[callback], logger=h.MetricsRecorder(), log_every_n_steps=100).fit(module)
    assert [syncs for _, syncs in callback.per_batch] == [0] * 12
    expected = h.big_batch_reference(
        h.token_net(),
        h.token_data(),
        2,
        h.windows(12, 4),
        h.token_loss,
        lr=0.05,
        optimizer="adamw_fused",
        max_grad_norm=1.0,
    )
    assert h.max_abs_diff(module.net, expected) < 2e-7
    assert callback.stats.windows == 3  # read at the end: one sync, outside the hooks


def test_an_invalid_count_found_on_the_device_skips_its_step_and_raises_when_read() -> None:
    def count(batch: Any) -> torch.Tensor:
        tokens = h.count_tokens(batch)
        count.calls += 1  # type: ignore[attr-defined]
        return -tokens if count.calls == 6 else tokens  # type: ignore[attr-defined]

    count.calls = 0  # type: ignore[attr-defined]
    callback = GradientAccumulationCallback(4, scaling="weighted", item_count_fn=count)
    module = h.TokenModule(h.token_data(), optimizer="adam_fused", lr=0.05)
    with pytest.raises(
        ValueError, match=r"1 invalid item count\(s\) in the windows since optimizer step 0 .*skipped"
    ):
        h.trainer(callbacks=[callback], log_every_n_steps=100).fit(module)
    state = module.trainer.optimizers[0].state
    assert {float(s["step"]) for s in state.values()} == {2.0}  # windows 0 and 2 stepped, 1 did not


def test_overflow_ignore_steps_a_non_finite_window_on_the_device_as_on_the_host() -> None:
    """`overflow="ignore"` counts a non-finite window and steps it: the fused step must be told to take it.
    Oracle: the same fit with the non-fused Adam, decided on the host (parameters and Adam's step count)."""
    fused, fused_callback = fused_fit("adam_fused", nan_at=(5,), overflow="ignore")
    host, host_callback = fused_fit("adam", nan_at=(5,), overflow="ignore")
    for got, expected in zip(fused.net.parameters(), host.net.parameters(), strict=True):
        torch.testing.assert_close(got, expected, rtol=0.0, atol=2e-7, equal_nan=True)
    assert any(bool(torch.isnan(p).any()) for p in fused.net.parameters())  # the nan window was stepped
    steps = [{float(s["step"]) for s in m.trainer.optimizers[0].state.values()} for m in (fused, host)]
    assert steps == [{3.0}, {3.0}]
    for callback in (fused_callback, host_callback):  # windows 1 and 2 (nan parameters): counted, stepped
        assert (callback.stats.non_finite_windows, callback.stats.skipped_steps) == (2, 0)


class ZeroItemsInWindow:
    """An item counter (samples) that counts 0 for micro-batches `first`..`last` of the fit."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last, self.calls = first, last, 0

    def __call__(self, batch: Any) -> int:
        index, self.calls = self.calls, self.calls + 1
        return 0 if self.first <= index <= self.last else len(batch[0])


@pytest.mark.parametrize("optimizer", ["adam_fused", "adam"])
def test_a_weighted_window_of_zero_items_takes_no_step_on_the_device_either(optimizer: str) -> None:
    """Window 1 (micro-batches 4-7) counts 0 items: no step, whether decided on the device (fused Adam's
    `found_inf`) or on the host. Oracle: the big batch of windows 0 and 2 with the same optimizer; Adam's
    `step` counts 2, and its momentum does not move the parameters in the empty window."""
    callback = GradientAccumulationCallback(4, scaling="weighted", item_count_fn=ZeroItemsInWindow(4, 7))
    module = h.RegressionModule(h.regression_data(40), optimizer=optimizer, lr=0.01)
    h.trainer(callbacks=[callback]).fit(module)
    expected = h.regression_reference(h.windows(10, 4), optimizer=optimizer, lr=0.01, skip_windows=[1])
    assert h.max_abs_diff(module.net, expected) < 2e-7
    assert {float(s["step"]) for s in module.trainer.optimizers[0].state.values()} == {2.0}
    assert (callback.stats.empty_windows, callback.stats.windows) == (1, 3)


@pytest.mark.parametrize("nan_at", [(), (5,)])
def test_buffers_with_a_fused_optimizer_are_multiplied_before_they_leave_for_the_step(
    nan_at: tuple[int, ...],
) -> None:
    """With `accumulation_dtype` the window's sums are in buffers at the boundary: the multiplier cannot ride
    in the fused step's `grad_scale` (it would step on gradients that never left the buffers). Oracle: the
    big batch with the same fused Adam, clipped, the nan window skipped."""
    module, callback = fused_fit("adam_fused", nan_at=nan_at, accumulation_dtype="float64", max_grad_norm=0.5)
    expected = h.regression_reference(
        h.windows(10, 4),
        optimizer="adam_fused",
        lr=0.01,
        max_grad_norm=0.5,
        skip_windows=[1] if nan_at else [],
    )
    assert h.max_abs_diff(module.net, expected) < 2e-7
    assert callback.stats.skipped_steps == len(nan_at)
    assert callback.stats.clipped_steps > 0
