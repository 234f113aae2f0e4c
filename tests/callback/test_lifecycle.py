"""What a fit leaves behind and what the next one starts from: a fit that raised inside a window, training
ended inside a window."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h


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
