"""What the callback refuses or warns about: setups it cannot accumulate correctly under.

Manual optimization, Lightning's own scheduler, a second instance, a conflicting K, strategies that accumulate
themselves or that it does not support, FSDP without original parameters, clipping twice, an overridden
``optimizer_step``, LBFGS beyond K=1 (its closure's evaluations are not windows),
``training_step(dataloader_iter)``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pytorch_lightning.callbacks import GradientAccumulationScheduler
from pytorch_lightning.strategies import FSDPStrategy, SingleDeviceStrategy
from torch import Tensor, nn

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h
from tests.helpers import fit

reference = h.regression_reference


def test_manual_optimization_points_to_the_core() -> None:
    class Manual(h.RegressionModule):
        def __init__(self) -> None:
            super().__init__(h.regression_data(8))
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            return None

    with pytest.raises(RuntimeError, match=r"automatic optimization only.*GradAccumulator"):
        h.trainer(callbacks=[GradientAccumulationCallback(2)]).fit(Manual())


def test_lightning_scheduler_is_rejected() -> None:
    callbacks = [GradientAccumulationCallback(2), GradientAccumulationScheduler({0: 2})]
    with pytest.raises(RuntimeError, match="Remove the scheduler"):
        h.trainer(callbacks=callbacks).fit(h.RegressionModule(h.regression_data(8)))


def test_two_instances_are_rejected() -> None:
    # Lightning itself refuses two instances passed to the constructor (their state keys collide) ...
    with pytest.raises(
        RuntimeError, match="more than one stateful callback of type `GradientAccumulationCallback`"
    ):
        h.trainer(callbacks=[GradientAccumulationCallback(2), GradientAccumulationCallback(2)])
    # ... and the callback refuses one added later
    trainer = h.trainer(callbacks=[GradientAccumulationCallback(2)])
    trainer.callbacks.append(GradientAccumulationCallback(2))
    with pytest.raises(RuntimeError, match="Two `GradientAccumulationCallback` instances"):
        trainer.fit(h.RegressionModule(h.regression_data(8)))


def test_conflicting_trainer_k_is_rejected_and_equal_k_accepted() -> None:
    with pytest.raises(
        ValueError,
        match=r"accumulate_grad_batches=2\)` and `GradientAccumulationCallback\(accumulation_steps=4\)",
    ):
        h.trainer(accumulate_grad_batches=2, callbacks=[GradientAccumulationCallback(4)]).fit(
            h.RegressionModule(h.regression_data(8))
        )
    trainer = h.trainer(accumulate_grad_batches=4, callbacks=[GradientAccumulationCallback(4)])
    trainer.fit(h.RegressionModule(h.regression_data(32)))
    assert trainer.global_step == 2


def test_deepspeed_like_strategy_is_rejected() -> None:
    class AccumulatingStrategy(SingleDeviceStrategy):
        @property
        def handles_gradient_accumulation(self) -> bool:
            return True

    callback = GradientAccumulationCallback(2)
    trainer = SimpleNamespace(strategy=AccumulatingStrategy(device=torch.device("cpu")), callbacks=[callback])
    with pytest.raises(RuntimeError, match="performs gradient accumulation itself"):
        callback._verify("configuration", trainer, h.RegressionModule(h.regression_data(8)))  # type: ignore[arg-type]


def _third_party_strategy(base: type) -> Any:
    """A strategy of another package (e.g. lightning-hivemind's), built without its dependencies."""
    strategy = type("HivemindStrategy", (base,), {})
    strategy.__abstractmethods__ = frozenset()  # type: ignore[attr-defined]
    return strategy.__new__(strategy)


def test_an_unsupported_strategy_is_rejected() -> None:
    from pytorch_lightning.strategies import Strategy

    callback = GradientAccumulationCallback(2)
    trainer = SimpleNamespace(strategy=_third_party_strategy(Strategy), callbacks=[callback])
    with pytest.raises(
        RuntimeError,
        match=r"supports DeepSpeed \(ZeRO 0-3\), single-device, DDP, FSDP and ModelParallel \(FSDP2\)"
        r" strategies.*HivemindStrategy",
    ):
        callback._verify("configuration", trainer, h.RegressionModule(h.regression_data(8)))  # type: ignore[arg-type]


def test_fsdp_is_accepted_with_original_parameters_only() -> None:
    callback = GradientAccumulationCallback(2)
    module = h.RegressionModule(h.regression_data(8))
    trainer = SimpleNamespace(strategy=FSDPStrategy(), callbacks=[callback])
    callback._verify("configuration", trainer, module)  # type: ignore[arg-type]
    trainer = SimpleNamespace(strategy=FSDPStrategy(use_orig_params=False), callbacks=[callback])
    with pytest.raises(RuntimeError, match=r"needs `FSDPStrategy\(use_orig_params=True\)`.*flat parameters"):
        callback._verify("configuration", trainer, module)  # type: ignore[arg-type]


def test_double_clipping_warns() -> None:
    trainer = h.trainer(callbacks=[GradientAccumulationCallback(2, max_grad_norm=1.0)], gradient_clip_val=1.0)
    with pytest.warns(UserWarning, match="clipped twice"):
        trainer.fit(h.RegressionModule(h.regression_data(8)))


class OverridesOptimizerStep(h.RegressionModule):
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)


def test_overridden_optimizer_step_warns_as_lightnings_scheduler_does() -> None:
    with pytest.warns(
        UserWarning, match="override `LightningModule.optimizer_step` or `optimizer_zero_grad`"
    ):
        fit(OverridesOptimizerStep(h.regression_data(40)), GradientAccumulationCallback(4))


class LBFGSModule(h.RegressionModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


def test_lbfgs_closure_evaluations_are_not_counted_as_windows() -> None:
    module = LBFGSModule(h.regression_data(40))
    callback = GradientAccumulationCallback(1, max_grad_norm=100.0)
    trainer = fit(module, callback)
    plain = LBFGSModule(h.regression_data(40))
    fit(plain)
    assert h.max_abs_diff(module.net, plain.net) < 1e-6  # K=1: nothing to change
    assert callback.stats.windows == trainer.global_step == 10
    assert callback.stats.total_micro_batches == 10


def test_lbfgs_with_accumulation_is_refused_before_training() -> None:
    with pytest.raises(RuntimeError, match=r"LBFGS.*Use K=1"):
        fit(LBFGSModule(h.regression_data(40)), GradientAccumulationCallback(2))


class IteratesItself(h.RegressionModule):
    def training_step(self, dataloader_iter: Any) -> Tensor:  # type: ignore[override]
        (x, y), _, _ = next(dataloader_iter)
        return nn.functional.mse_loss(self.net(x), y)


def test_training_step_with_dataloader_iter_is_refused_when_accumulating() -> None:
    """Lightning zeroes gradients there with a stale batch index: the first micro-batch would be lost."""
    with pytest.raises(RuntimeError, match=r"`training_step\(self, dataloader_iter\)` cannot accumulate"):
        fit(IteratesItself(h.regression_data(40)), GradientAccumulationCallback(4))
    with pytest.raises(RuntimeError, match=r"K=3 adopted from `Trainer\(accumulate_grad_batches=3\)`"):
        fit(IteratesItself(h.regression_data(40)), GradientAccumulationCallback(), accumulate_grad_batches=3)
    module = IteratesItself(h.regression_data(40))
    fit(module, GradientAccumulationCallback(1))
    assert h.max_abs_diff(module.net, reference(h.windows(10, 1))) < 1e-6
