"""Ported from Lightning-AI/pytorch-lightning: tests/tests_pytorch/trainer/test_trainer.py.

The tests there that use ``accumulate_grad_batches``, with ``GradientAccumulationCallback(K)`` in its place;
where the original checks when the parameters change, a plain-PyTorch loop also checks their values.
"""

from __future__ import annotations

import copy
import math
from copy import deepcopy

import pytest
import torch
from pytorch_lightning import Trainer
from pytorch_lightning.demos.boring_classes import BoringModel
from torch.optim import SGD
from torch.utils.data import DataLoader

from lightning_gradacc import GradientAccumulationCallback
from tests.helpers import max_abs_diff, windows
from tests.lightning_port.reference import boring_reference

QUIET = dict(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, logger=False)
DATA = torch.randn(64, 32, generator=torch.Generator().manual_seed(19))


def plain_reference(layer, num_batches, k, epochs):
    """Every window (the last one of an epoch may be partial) is the mean over its micro-batches."""
    return boring_reference(layer, DATA, [windows(num_batches, k)] * epochs)


# Original: test_gradient_accumulation_scheduling_last_batch (oracle added)
@pytest.mark.parametrize(
    ("accumulate_grad_batches", "limit_train_batches"),
    [
        (3, 1.0),  # 64 batches: the last window has 1
        (3, 0.8),
        (4, 1.0),
        (4, 0.7),
        (5, 0.7),  # 44 batches: the last window has 4
    ],
)
def test_gradient_accumulation_scheduling_last_batch(tmp_path, accumulate_grad_batches, limit_train_batches):
    """Verify optimizer.step() applied to last batch while grad accumulation."""

    class TestModel(BoringModel):
        def state_dict(self, *args, **kwargs):
            return deepcopy(super().state_dict(*args, **kwargs))

        def check(self, d1, d2, equal=True):
            keys = d1.keys() | d2.keys()
            values = [torch.equal(d1[k], d2[k]) for k in keys]
            return all(values) if equal else not any(values)

        def backward(self, *args, **kwargs) -> None:
            pre_bwd_state_dict = self.state_dict()
            assert self.check(self.start_state_dict, pre_bwd_state_dict)

            out = super().backward(*args, **kwargs)

            # state dict is equal, just the gradients changed
            assert self.check(pre_bwd_state_dict, self.state_dict())

            return out

        def optimizer_step(self, *args, **kwargs):
            pre_opt_step_state_dict = self.state_dict()
            assert self.check(self.start_state_dict, pre_opt_step_state_dict)

            # this calls `backward` and `on_after_backward` inside the closure
            out = super().optimizer_step(*args, **kwargs)

            # the state dict changed
            assert self.check(pre_opt_step_state_dict, self.state_dict(), equal=False)

            self.opt_step_called = True
            return out

        def on_train_batch_start(self, *_):
            self.start_state_dict = self.state_dict()
            self.opt_step_called = False

        def on_train_batch_end(self, outputs, batch, batch_idx):
            end_state_dict = self.state_dict()
            is_last_batch = (batch_idx + 1) == self.trainer.num_training_batches

            if is_last_batch or self.opt_step_called:
                assert self.check(self.start_state_dict, end_state_dict, equal=False)
            else:
                assert self.check(self.start_state_dict, end_state_dict)

        def train_dataloader(self):
            return DataLoader(DATA, batch_size=1)

    model = TestModel()
    initial = copy.deepcopy(model.layer)
    callback = GradientAccumulationCallback(accumulate_grad_batches)
    trainer = Trainer(
        callbacks=[callback],
        max_epochs=2,
        limit_train_batches=limit_train_batches,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        enable_checkpointing=False,
        **QUIET,
    )

    trainer.fit(model)

    num_batches = trainer.num_training_batches
    expected = plain_reference(initial, num_batches, accumulate_grad_batches, 2)
    assert max_abs_diff(model.layer, expected) < 1e-6
    assert callback.stats.micro_batches_last_step == (
        num_batches % accumulate_grad_batches or accumulate_grad_batches
    )


# Original: test_trainer_max_steps_accumulate_batches
def test_trainer_max_steps_accumulate_batches(tmp_path):
    """Verify model trains according to specified max steps with grad accumulated batches."""
    model = BoringModel()
    num_train_samples = math.floor(len(model.train_dataloader()) * 0.5)

    # define less train steps than epochs
    callback = GradientAccumulationCallback(10)
    trainer = Trainer(
        limit_train_batches=0.5,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        max_steps=num_train_samples + 10,
        callbacks=[callback],
        **QUIET,
    )
    trainer.fit(model)

    assert trainer.state.finished, f"Training failed with {trainer.state}"
    assert trainer.global_step == trainer.max_steps, "Model did not stop at max_steps"
    assert callback.stats.windows == trainer.max_steps
    # 32 batches per epoch: windows 10, 10, 10, 2; 42 steps = 10 epochs and 2 windows of 10
    assert callback.stats.total_micro_batches == 10 * 32 + 20
    assert callback.stats.open_window_micro_batches == 0


# Original: test_train_loop_system
def test_train_loop_system(tmp_path):
    """
    Test the following methods are called in the order in automatic optimization.
    1. optimizer.step (skip when gradient accumulation)
    2. model.training_step
    3. optimizer.zero_grad (run when the first batch of gradient accumulation)
    4. model.backward

    Note that the order is NOT `training_step`->`zero_grad`->`backward`->`step`.
    This is because `optimizer.step(closure)` calls `closure()` which then calls
    the three remaining methods `training_step`, `zero_grad` and `backward` inside.
    """
    called_methods = []

    trainer_options = {
        "default_root_dir": tmp_path,
        "max_epochs": 1,
        "limit_train_batches": 5,
        "limit_val_batches": 1,
        "limit_test_batches": 1,
        **QUIET,
    }

    class TestOptimizer(SGD):
        def step(self, *args, **kwargs):
            called_methods.append("step")
            return super().step(*args, **kwargs)

        def zero_grad(self, *args, **kwargs):
            called_methods.append("zero_grad")
            return super().zero_grad(*args, **kwargs)

    class TestModel(BoringModel):
        def configure_optimizers(self):
            return TestOptimizer(self.parameters(), lr=0.1)

        def training_step(self, *args, **kwargs):
            called_methods.append("training_step")
            return super().training_step(*args, **kwargs)

        def backward(self, *args, **kwargs):
            called_methods.append("backward")
            return super().backward(*args, **kwargs)

    model = TestModel()
    trainer = Trainer(**trainer_options, callbacks=[GradientAccumulationCallback(1)])

    # No methods are called yet.
    assert called_methods == []

    trainer.fit(model)
    assert called_methods == ["step", "training_step", "zero_grad", "backward"] * trainer.limit_train_batches

    called_methods.clear()
    trainer = Trainer(**trainer_options, callbacks=[GradientAccumulationCallback(3)])

    # No methods are called yet.
    assert called_methods == []

    trainer.fit(model)
    assert called_methods == [
        # 0
        "training_step",
        "zero_grad",
        "backward",
        # 1
        "training_step",
        "backward",
        # 2
        "step",
        "training_step",
        "backward",
        # 3
        "training_step",
        "zero_grad",
        "backward",
        # 4
        "step",
        "training_step",
        "backward",
    ]
