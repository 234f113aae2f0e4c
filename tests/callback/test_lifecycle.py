"""What a fit leaves behind and what the next fit with the same callback starts from.

A fit that raised inside a window, training or an epoch that ended inside one, a callback reused by the next
fit (its K adopted or resolved again, pickled for ``ddp_spawn``), a validated mid-window checkpoint.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h
from tests.helpers import fit

BATCH = 4


reference = h.regression_reference


class FailsAt(h.RegressionModule):
    """Raises in ``training_step`` at one micro-batch index (inside a window)."""

    def __init__(self, fail_at: int | None, **kwargs: Any) -> None:
        super().__init__(h.regression_data(40), **kwargs)
        self.fail_at = fail_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == self.fail_at:
            raise RuntimeError("preempted")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("next_k", ["trainer", "target_batch_size"])
def test_a_fit_after_a_fit_that_raised_inside_a_window_starts_afresh_with_another_k(next_k: str) -> None:
    callback = (
        GradientAccumulationCallback()
        if next_k == "trainer"
        else GradientAccumulationCallback(target_batch_size=16)  # micro-batches of 4: K=4, then 2 of 8
    )
    module = FailsAt(fail_at=6)  # window 1 holds micro-batches 4 and 5 when it raises
    first = h.trainer(callbacks=[callback], accumulate_grad_batches=4 if next_k == "trainer" else 1)
    with pytest.raises(RuntimeError, match="preempted"):
        first.fit(module)
    start = copy.deepcopy(module.net)
    module.fail_at = None
    if next_k == "target_batch_size":
        module.batch_size = 8
    second = h.trainer(callbacks=[callback], accumulate_grad_batches=2 if next_k == "trainer" else 1)
    second.fit(module)
    batch_size = 4 if next_k == "trainer" else 8
    windows = h.windows(40 // batch_size, 2)
    expected = h.big_batch_reference(start, h.regression_data(40), batch_size, windows, h.mse)
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert callback.stats.accumulation_steps == 2


class StopsInsideAWindow(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if args[-1] == 5:  # batch_idx: window 1 holds 2 of its 4 micro-batches
            trainer.should_stop = True


def test_training_that_ends_inside_a_window_discards_its_gradients() -> None:
    module = h.RegressionModule(h.regression_data(40))
    callback = GradientAccumulationCallback(4)
    trainer = h.trainer(callbacks=[callback, StopsInsideAWindow()], min_epochs=0)
    with pytest.warns(UserWarning, match="Training ended inside a window: 2 micro-batch"):
        trainer.fit(module)
    assert all(p.grad is None for p in module.net.parameters())
    assert h.max_abs_diff(module.net, h.regression_reference([[0, 1, 2, 3]])) < 1e-6


class StopsEpochZeroAt(h.RegressionModule):
    """`on_train_batch_start` returns -1 at batch `stop` of epoch 0 (Lightning ends the epoch there)."""

    def __init__(self, stop: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stop = stop

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if self.current_epoch == 0 and batch_idx == self.stop else None


@pytest.mark.parametrize("accumulation_dtype", [None, "float64"])
def test_window_cut_by_an_early_epoch_end_is_discarded_not_merged(accumulation_dtype: str | None) -> None:
    module = StopsEpochZeroAt(6, data=h.regression_data(40))  # epoch 0 runs batches 0-5: window 4-5 is cut
    callback = GradientAccumulationCallback(4, accumulation_dtype=accumulation_dtype)
    with pytest.warns(UserWarning, match="never reached its optimizer step"):
        fit(module, callback, max_epochs=2)
    expected = reference([[0, 1, 2, 3], *h.windows(10, 4)])
    assert h.max_abs_diff(module.net, expected) < 1e-6


# ------------------------------------------------------------------- the next fit with the same callback


def test_an_adopted_k_is_adopted_again_by_the_next_trainer() -> None:
    callback = GradientAccumulationCallback()
    fit(h.RegressionModule(h.regression_data(40)), callback, accumulate_grad_batches=4)
    module = h.RegressionModule(h.regression_data(40))
    fit(module, callback, accumulate_grad_batches=3)
    assert h.max_abs_diff(module.net, reference(h.windows(10, 3))) < 1e-6
    assert callback.plan.policy.k is None  # the configuration stays what the user gave


def test_a_target_batch_size_is_resolved_again_for_the_next_fit() -> None:
    callback = GradientAccumulationCallback(target_batch_size=16)
    fit(h.RegressionModule(h.regression_data(40), batch_size=4), callback)
    assert callback.stats.accumulation_steps == 4
    module = h.RegressionModule(h.regression_data(40), batch_size=8)
    fit(module, callback)
    assert callback.stats.accumulation_steps == 2
    expected = h.big_batch_reference(h.regression_net(), h.regression_data(40), 8, h.windows(5, 2), h.mse)
    assert h.max_abs_diff(module.net, expected) < 1e-6


def test_a_used_callback_pickles_for_ddp_spawn() -> None:
    import pickle

    callback = GradientAccumulationCallback(2)
    fit(h.RegressionModule(h.regression_data(40)), callback)
    restored = pickle.loads(pickle.dumps(callback))
    assert restored.stats.windows == callback.stats.windows == 5


class ValidatedModule(h.RegressionModule):
    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(h.regression_data(12, seed=1), batch_size=4)


def test_validating_a_mid_window_checkpoint_leaves_the_next_fit_alone(tmp_path: Any) -> None:
    path = tmp_path / "mid.ckpt"
    h.preempt(ValidatedModule(h.regression_data(40)), [GradientAccumulationCallback(4)], 5, path)
    module = ValidatedModule(h.regression_data(40))
    callback = GradientAccumulationCallback(4)
    h.trainer(callbacks=[callback]).validate(module, ckpt_path=path)
    loaded = copy.deepcopy(module.net)
    fit(module, callback)  # a fresh fit from the validated weights: the checkpoint's window is not its
    expected = h.big_batch_reference(loaded, h.regression_data(40), BATCH, h.windows(10, 4), h.mse)
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert (callback.stats.windows, callback.stats.total_micro_batches) == (3, 10)


class AddsAGroupAfterBackward(h.RegressionModule):
    """The optimizer steps `net.0` only; the module's own `on_after_backward` (after the callback's) adds
    `net.2` at micro-batch 2, the last of window 0 (K=3)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net[0].parameters(), lr=self.lr)

    def on_after_backward(self) -> None:
        optimizer = self.trainer.optimizers[0]
        if self.micro_batches_seen == 3 and len(optimizer.param_groups) == 1:
            optimizer.add_param_group({"params": list(self.net[2].parameters())})


def test_a_group_added_in_the_module_s_on_after_backward_is_normalized_and_clipped_in_its_window() -> None:
    module = AddsAGroupAfterBackward(h.regression_data(36))
    fit(module, GradientAccumulationCallback(3, max_grad_norm=0.1))
    # `net.2` held its gradient since the window opened: it steps as if it were there from the start
    expected = h.big_batch_reference(
        h.regression_net(), h.regression_data(36), 4, h.windows(9, 3), h.mse, max_grad_norm=0.1
    )
    assert h.max_abs_diff(module.net, expected) < 1e-6
