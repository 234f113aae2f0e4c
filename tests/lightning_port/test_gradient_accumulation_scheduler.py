"""Ported from Lightning-AI/pytorch-lightning:
tests/tests_pytorch/callbacks/test_gradient_accumulation_scheduler.py.

``Trainer(accumulate_grad_batches=K)`` and ``GradientAccumulationScheduler(schedule)`` are replaced by
``GradientAccumulationCallback(K or schedule)``. Where Lightning only counted calls, a plain-PyTorch oracle
checks the parameters as well.
"""

from __future__ import annotations

import copy
import math
from unittest.mock import Mock, patch

import pytest
import torch
from pytorch_lightning import Trainer
from pytorch_lightning.callbacks import GradientAccumulationScheduler
from pytorch_lightning.demos.boring_classes import BoringModel
from pytorch_lightning.strategies import DeepSpeedStrategy
from torch import nn
from torch.utils.data import DataLoader

from lightning_gradacc import GradientAccumulationCallback
from tests.helpers import max_abs_diff, windows
from tests.lightning_port.reference import boring_reference

QUIET = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)


class FixedDataModel(BoringModel):
    """BoringModel whose training data is fixed at construction (so that a plain loop can replay it)."""

    def __init__(self, length: int = 64, batch_size: int = 1) -> None:
        super().__init__()
        self.data = torch.randn(length, 32, generator=torch.Generator().manual_seed(7))
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


def plain_reference(layer: nn.Module, data: torch.Tensor, num_batches: int, ks: list[int]) -> nn.Module:
    """One epoch per K in ``ks``; the last window of an epoch may be partial."""
    return boring_reference(layer, data, [windows(num_batches, k) for k in ks])


# Original: test_trainer_accumulate_grad_batches_zero_grad
@pytest.mark.parametrize("accumulate_grad_batches", [1, 2, 3])
def test_trainer_accumulate_grad_batches_zero_grad(tmp_path, accumulate_grad_batches):
    with patch("torch.optim.SGD.zero_grad") as sgd_zero_grad:
        model = BoringModel()
        trainer = Trainer(
            default_root_dir=tmp_path,
            limit_train_batches=20,
            limit_val_batches=1,
            max_epochs=1,
            callbacks=[GradientAccumulationCallback(accumulate_grad_batches)],
            **QUIET,
        )
        trainer.fit(model)
        assert trainer.accumulate_grad_batches == accumulate_grad_batches
        assert sgd_zero_grad.call_count == math.ceil(trainer.limit_train_batches / accumulate_grad_batches)


# Original: test_trainer_accumulate_grad_batches_with_callback
@pytest.mark.parametrize(
    ("accumulate_grad_batches", "expected_call_count"),
    [
        ({1: 2, 3: 4}, 10 + 5 + 5 + 3),
        ({0: 2, 2: 1}, 5 + 5 + 10 + 10),
    ],
)
def test_trainer_accumulate_grad_batches_with_callback(
    tmp_path, accumulate_grad_batches, expected_call_count
):
    with patch("torch.optim.SGD.zero_grad") as sgd_zero_grad:
        model = BoringModel()
        trainer = Trainer(
            default_root_dir=tmp_path,
            limit_train_batches=10,
            limit_val_batches=1,
            max_epochs=4,
            callbacks=[GradientAccumulationCallback(accumulate_grad_batches)],
            **QUIET,
        )
        assert trainer.accumulate_grad_batches == 1  # initial value of Trainer argument
        trainer.fit(model)

        assert sum(isinstance(cb, GradientAccumulationCallback) for cb in trainer.callbacks) == 1
        assert sgd_zero_grad.call_count == expected_call_count


# Original: test_trainer_accumulate_grad_batches_with_callback (oracle added: the schedule's parameters)
@pytest.mark.parametrize(
    ("schedule", "ks"),
    [({1: 2, 3: 4}, [1, 2, 2, 4]), ({0: 2, 2: 1}, [2, 2, 1, 1]), ({0: 3}, [3, 3, 3, 3])],
)
def test_accumulation_schedule_matches_plain_loop(tmp_path, schedule, ks):
    model = FixedDataModel()
    initial = copy.deepcopy(model.layer)
    callback = GradientAccumulationCallback(schedule)
    trainer = Trainer(
        default_root_dir=tmp_path,
        limit_train_batches=10,
        limit_val_batches=0,
        max_epochs=4,
        callbacks=[callback],
        enable_checkpointing=False,
        **QUIET,
    )
    trainer.fit(model)
    # With K=4 (or 3) on 10 batches the last window has 2 (or 1) micro-batches: divided by what it had.
    expected = plain_reference(initial, model.data, 10, ks)
    assert max_abs_diff(model.layer, expected) < 1e-6
    assert trainer.global_step == sum(math.ceil(10 / k) for k in ks)
    assert callback.stats.windows == trainer.global_step
    assert callback.stats.total_micro_batches == 40


# Original: test_invalid_keys_for_grad_accum_scheduler
@pytest.mark.parametrize("scheduling", [{1: 2, -3: 4}, {0: 2, "2": 1}])
def test_invalid_keys_for_grad_accum_scheduler(scheduling):
    with pytest.raises(ValueError, match=r"epochs .* to be ints >= 0"):
        _ = GradientAccumulationCallback(scheduling)


# Original: test_invalid_values_for_grad_accum_scheduler
@pytest.mark.parametrize("scheduling", [{1: 0, 3: 4}, {0: 2, 2: "2"}])
def test_invalid_values_for_grad_accum_scheduler(scheduling):
    with pytest.raises((ValueError, TypeError), match="to be a positive int"):
        _ = GradientAccumulationCallback(scheduling)


# Original: test_unsupported_strategies
# Lightning's scheduler refuses DeepSpeed (it accumulates itself); the callback drives DeepSpeed's engine
# instead (tests/distributed/test_deepspeed.py), so the port checks what it does at `setup`: a fixed or a
# scheduled K is accepted on ZeRO 0-3, and `max_grad_norm` becomes DeepSpeed's `gradient_clipping`.
@pytest.mark.parametrize("strategy_class", [DeepSpeedStrategy])
def test_unsupported_strategies(strategy_class):
    for steps in ({1: 2}, 2):
        callback = GradientAccumulationCallback(steps, max_grad_norm=0.5, overflow="ignore")
        model = BoringModel()
        trainer = Trainer(**QUIET)
        strategy = Mock(spec=strategy_class)
        strategy.config = {"zero_optimization": {"stage": 2}}
        strategy.handles_gradient_accumulation = True
        trainer._accelerator_connector.strategy = strategy
        callback.setup(trainer, model, "fit")
        assert strategy.config["gradient_clipping"] == 0.5
        # ZeRO-3 is driven as ZeRO 0-2 (exact in tests/distributed/test_deepspeed.py): accepted the same way.
        strategy.config = {"zero_optimization": {"stage": 3}}
        callback.setup(trainer, model, "fit")
        assert strategy.config["gradient_clipping"] == 0.5


# Original: test_unsupported_manual_optimization
def test_unsupported_manual_optimization():
    callback = GradientAccumulationCallback({1: 2})
    model = BoringModel()
    model.automatic_optimization = False
    trainer = Trainer(**QUIET)
    with pytest.raises(RuntimeError, match="works with automatic optimization only"):
        callback.setup(trainer, model, "fit")


# Original: test_warn_if_model_has_overridden_optimization_hooks
# Lightning's scheduler warns that overridden hooks run only at window boundaries; the callback does not
# warn, so the port checks the behaviour instead: overriding (and calling super) keeps the result exact.
def test_overridden_optimization_hooks_keep_exact_accumulation(tmp_path):
    calls = {"step": 0, "zero_grad": 0}

    class OverriddenHooksModel(FixedDataModel):
        def optimizer_step(self, *args, **kwargs):
            calls["step"] += 1
            super().optimizer_step(*args, **kwargs)

        def optimizer_zero_grad(self, *args, **kwargs):
            calls["zero_grad"] += 1
            super().optimizer_zero_grad(*args, **kwargs)

    model = OverriddenHooksModel()
    initial = copy.deepcopy(model.layer)
    trainer = Trainer(
        default_root_dir=tmp_path,
        limit_train_batches=10,
        limit_val_batches=0,
        max_epochs=2,
        callbacks=[GradientAccumulationCallback({1: 4})],
        enable_checkpointing=False,
        **QUIET,
    )
    trainer.fit(model)
    assert calls == {"step": 10 + 3, "zero_grad": 10 + 3}
    assert max_abs_diff(model.layer, plain_reference(initial, model.data, 10, [1, 4])) < 1e-6


# Original: test_raises_when_accumulate_grad_batches_with_callback
def test_raises_when_accumulate_grad_batches_with_callback(tmp_path):
    """Setting a different Trainer K as well as the callback's is refused, and so is Lightning's scheduler."""
    trainer = Trainer(
        default_root_dir=tmp_path,
        accumulate_grad_batches=2,
        callbacks=[GradientAccumulationCallback({0: 4})],
        **QUIET,
    )
    with pytest.raises(ValueError, match="The callback owns the accumulation factor"):
        trainer.fit(BoringModel())

    trainer = Trainer(
        default_root_dir=tmp_path,
        callbacks=[GradientAccumulationScheduler({0: 2}), GradientAccumulationCallback(2)],
        **QUIET,
    )
    with pytest.raises(RuntimeError, match="Remove the scheduler"):
        trainer.fit(BoringModel())
