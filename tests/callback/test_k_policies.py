"""How many micro-batches a window holds through ``Trainer.fit``, and the step count LR schedulers see.

A target batch size is resolved before ``configure_optimizers`` (with data built in ``setup``, under a batch
size finder) and needs a fixed batch size; a step-interval LR scheduler gets the exact step count of an epoch
schedule.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_gradacc import GradientAccumulationCallback, estimated_stepping_batches
from tests import helpers as h
from tests.helpers import BatchList, fit

reference = h.regression_reference


def test_target_batch_size_needs_a_fixed_batch_size() -> None:
    class NoBatchSize(h.RegressionModule):
        def train_dataloader(self):
            sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(self.data), 4, False)
            return torch.utils.data.DataLoader(self.data, batch_sampler=BatchList(sampler))

    with pytest.raises(RuntimeError, match="has no fixed `batch_size`"):
        h.trainer(callbacks=[GradientAccumulationCallback(target_batch_size=8)]).fit(
            NoBatchSize(h.regression_data(8))
        )


class OneCycleModule(h.RegressionModule):
    def __init__(self, exact: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.exact = exact
        self.estimate: float | None = None

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        self.estimate = (
            estimated_stepping_batches(self.trainer)
            if self.exact
            else self.trainer.estimated_stepping_batches
        )
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=int(self.estimate))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_onecycle_with_a_decreasing_schedule_gets_the_exact_step_count() -> None:
    module = OneCycleModule(True, data=h.regression_data(40))
    trainer = fit(module, GradientAccumulationCallback({0: 4, 2: 1}), max_epochs=3)
    assert module.estimate == trainer.global_step == 3 + 3 + 10


def test_onecycle_from_lightnings_estimate_with_a_schedule_fails_before_training() -> None:
    module = OneCycleModule(False, data=h.regression_data(40))
    with pytest.raises(RuntimeError, match=r"OneCycleLR\(total_steps=9\).*takes up to 16 optimizer steps"):
        fit(module, GradientAccumulationCallback({0: 4, 2: 1}), max_epochs=3)
    assert h.max_abs_diff(module.net, h.regression_net()) == 0


def test_target_batch_size_is_resolved_before_configure_optimizers() -> None:
    module = OneCycleModule(False, data=h.regression_data(40))  # Lightning's own estimate
    trainer = fit(module, GradientAccumulationCallback(target_batch_size=16), max_epochs=3)
    assert module.estimate == trainer.global_step == 9  # 30 before: K was resolved after the estimate


class DataInSetup(h.RegressionModule):
    """Builds its data in `setup`, which Lightning calls after the callbacks' `setup`."""

    def __init__(self) -> None:
        super().__init__(data=h.regression_data(40))
        self.data = None  # type: ignore[assignment]

    def setup(self, stage: str) -> None:
        self.data = h.regression_data(40)


def test_target_batch_size_with_data_built_in_module_setup_warns_and_still_trains() -> None:
    module = DataInSetup()
    with pytest.warns(UserWarning, match="could not read the train dataloader in `setup`"):
        fit(module, GradientAccumulationCallback(target_batch_size=16))
    assert h.max_abs_diff(module.net, reference(h.windows(10, 4))) < 1e-6


def test_batch_size_finder_inside_fit_with_a_target_batch_size() -> None:
    from pytorch_lightning.callbacks import BatchSizeFinder

    data = h.regression_data(64)
    module = h.RegressionModule(data, batch_size=2)
    finder = BatchSizeFinder(mode="power", steps_per_trial=1, init_val=2, max_trials=3)
    with pytest.warns(UserWarning, match="micro-batch size changed after `setup`"):
        trainer = fit(module, GradientAccumulationCallback(target_batch_size=32), finder)
    assert (module.batch_size, trainer.accumulate_grad_batches) == (8, 4)  # 8 x 4 = the target again
    expected = h.big_batch_reference(h.regression_net(), data, 8, h.windows(8, 4), h.mse)
    assert h.max_abs_diff(module.net, expected) < 1e-6
