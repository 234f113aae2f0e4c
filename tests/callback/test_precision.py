"""Low precision through ``Trainer.fit``: 16-mixed with a GradScaler, fp16 with huge item counts.

16-mixed with wider buffers and on an item budget (unscaled, and the GradScaler still backs off), a
GradScaler without a tensor scale refused, fp16 weights with huge item counts (the reference count follows
the counts from window to window).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pytorch_lightning.plugins import MixedPrecision

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h
from tests.helpers import fit

BATCH = 4


reference = h.regression_reference


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


class FloatScaleScaler(torch.amp.GradScaler):
    """A scaler that keeps its scale as a Python float: the callback cannot read it without a sync."""

    def scale(self, outputs: Any) -> Any:  # type: ignore[override]
        return outputs * 1024.0

    def unscale_(self, optimizer: Any) -> None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.div_(1024.0)

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        return optimizer.step()

    def update(self, new_scale: Any = None) -> None:
        pass


def test_a_grad_scaler_without_a_tensor_scale_is_an_error_not_a_wrong_statistic() -> None:
    plugin = MixedPrecision("16-mixed", "cpu", FloatScaleScaler("cpu"))
    with pytest.raises(RuntimeError, match="keeps no tensor `_scale`"):
        fit(h.RegressionModule(h.regression_data(40)), GradientAccumulationCallback(4), plugins=[plugin])


def many_tokens(batch: Any) -> int:
    return len(batch[0]) * 65_536  # 262,144 "tokens" in a micro-batch of 4


def test_weighted_with_huge_counts_does_not_overflow_fp16() -> None:
    data = h.regression_data(38)
    module = h.RegressionModule(data, lr=0.05)
    callback = GradientAccumulationCallback(4, scaling="weighted", item_count_fn=many_tokens)
    fit(module, callback, precision="16-true", max_epochs=1)
    assert callback.stats.skipped_steps == 0 and callback.stats.non_finite_windows == 0
    assert callback.stats.items_last_step == 6 * 65_536
    # fp16 weights against an fp32 reference from the same (fp16-rounded) start: fp16 rounding only
    start = h.regression_net().half().float()
    expected = h.big_batch_reference(start, data, BATCH, h.windows(10, 4), h.mse, lr=0.05)
    assert h.max_abs_diff(module.net.float(), expected) < 2e-3


class TinyFirstCount:
    """1 item in the very first micro-batch, 262,144 in every other one (equal in the big batch's rows)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, batch: Any) -> float:
        self.calls += 1
        return 1.0 if self.calls == 1 else 262_144.0


def test_weighted_reference_count_follows_the_counts_from_window_to_window() -> None:
    """Relative to the first count, every weight would be 262,144 and overflow fp16 in every window (3 of 3
    skipped with a fixed reference); the reference follows each window's mean, so only the first overflows."""
    data = h.regression_data(40)
    module = h.RegressionModule(data, lr=0.05)
    callback = GradientAccumulationCallback(4, scaling="weighted", item_count_fn=TinyFirstCount())
    fit(module, callback, precision="16-true")
    assert callback.stats.skipped_steps == 1
    start = h.regression_net().half().float()
    # windows 1 and 2 hold equal counts: their weighted mean is the plain mean of their rows
    expected = h.big_batch_reference(start, data, BATCH, h.windows(10, 4), h.mse, lr=0.05, skip_windows=[0])
    assert h.max_abs_diff(module.net.float(), expected) < 2e-3


def test_16_mixed_on_an_item_budget_skips_the_overflowing_window_and_steps_the_others() -> None:
    """A budget's windows (3, 3, 2 and 2 micro-batches) under a GradScaler, the second one non-finite."""
    data = h.regression_data(40)
    counts = [h.positive_targets(data[i : i + BATCH]) for i in range(0, 40, BATCH)]
    assert counts == [2, 1, 2, 2, 1, 2, 3, 2, 3, 3]  # a budget of 5 closes after micro-batches 2, 5, 7 and 9
    plugin = h.amp_plugin()
    callback = GradientAccumulationCallback(items_per_step=5, budget_count_fn=h.positive_targets)
    module = h.RegressionModule(data, nan_at=[5])
    trainer = h.trainer(callbacks=[callback], plugins=[plugin])
    trainer.fit(module)
    assert trainer.global_step == 4
    expected = reference([[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]], skip_windows=[1], fp16_autocast=True)
    assert h.max_abs_diff(module.net, expected) < 2e-4  # fp16 rounding (4e-5); no loss correction: 0.14
    assert (callback.stats.non_finite_windows, callback.stats.skipped_steps) == (1, 1)
    assert plugin.scaler.get_scale() == 2.0**7  # the scaler saw the overflow once and backed off
