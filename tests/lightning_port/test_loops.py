"""Ported from Lightning-AI/pytorch-lightning: tests/tests_pytorch/loops/test_loops.py.

``accumulate_grad_batches=K`` is replaced by ``GradientAccumulationCallback(K)``. The loop state saved on an
exception is unchanged by the callback; the callback's own state (the open window) is checked and a fit
resumed from that checkpoint. Validation in the middle of a window must not touch the window; a
plain-PyTorch loop is the oracle.
"""

from __future__ import annotations

import copy
import os
from unittest.mock import ANY

import pytest
import torch
from pytorch_lightning import Trainer
from pytorch_lightning.callbacks import OnExceptionCheckpoint
from pytorch_lightning.demos.boring_classes import BoringModel
from torch import nn
from torch.utils.data import DataLoader

from lightning_gradacc import GradientAccumulationCallback
from tests.helpers import max_abs_diff, weights_only


class CustomException(Exception):
    pass


def _callback_state(checkpoint: dict) -> dict:
    (state,) = [v for k, v in checkpoint["callbacks"].items() if "GradientAccumulationCallback" in k]
    return state


# Original: test_loop_state_on_exception (callback state and a resumed fit added)
@pytest.mark.parametrize("accumulate_grad_batches", [1, 2, 3])
@pytest.mark.parametrize("stop_epoch", [1, 2])
@pytest.mark.parametrize("stop_batch", [1, 2])
def test_loop_state_on_exception(accumulate_grad_batches, stop_epoch, stop_batch, tmp_path):
    n_epochs = 3
    n_batches = 3

    class TestModel(BoringModel):
        crash = True

        def training_step(self, batch, batch_idx):
            if self.crash and self.trainer.current_epoch == stop_epoch and batch_idx == stop_batch:
                raise CustomException
            return super().training_step(batch, batch_idx)

    model = TestModel()

    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        max_epochs=n_epochs,
        limit_train_batches=n_batches,
        limit_val_batches=0,
        enable_progress_bar=False,
        logger=False,
        callbacks=[OnExceptionCheckpoint(tmp_path), GradientAccumulationCallback(accumulate_grad_batches)],
    )

    # simulate a failure
    with pytest.raises(CustomException):
        trainer.fit(model)

    ckpt_path = str(tmp_path / "on_exception.ckpt")
    assert os.path.exists(ckpt_path)
    checkpoint = torch.load(ckpt_path, weights_only=True)

    optim_progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress
    sch_progress = trainer.fit_loop.epoch_loop.scheduler_progress

    # `nbe_`: non-breaking epoch, as in, no exception will be raised. `be_`: breaking epoch
    nbe_batches_completed = stop_epoch * n_batches
    be_batches_completed = stop_batch
    # lightning applies leftover accumulated gradients when the epoch ends
    has_leftover_accumulation_batches = n_batches % accumulate_grad_batches != 0
    # number of batches that will call `optimizer.step()` during non-breaking and breaking epochs
    nbe_stepping_batches = nbe_batches_completed // accumulate_grad_batches
    be_stepping_batches = be_batches_completed // accumulate_grad_batches

    nbe_total_opt_steps = nbe_stepping_batches + has_leftover_accumulation_batches
    be_total_opt_steps = be_stepping_batches
    assert optim_progress.optimizer_steps == nbe_total_opt_steps + be_total_opt_steps
    assert optim_progress.optimizer.step.current.completed == be_total_opt_steps
    has_opt_stepped_in_be = stop_batch + 1 >= accumulate_grad_batches

    nbe_total_zero_grad = nbe_stepping_batches + has_leftover_accumulation_batches
    # `max` because the first batch always zero-grads
    be_total_zero_grad = max(1, be_stepping_batches)
    assert optim_progress.optimizer.zero_grad.total.completed == nbe_total_zero_grad + be_total_zero_grad
    assert optim_progress.optimizer.zero_grad.current.completed == be_total_zero_grad

    nbe_sch_steps = stop_epoch
    be_sch_steps = 0  # the current epoch did not complete
    assert sch_progress.total.completed == nbe_sch_steps + be_sch_steps
    assert sch_progress.current.completed == be_sch_steps

    expected = {
        "state_dict": ANY,
        "epoch_progress": {
            "total": {
                "ready": stop_epoch + 1,
                "started": stop_epoch + 1,
                "processed": stop_epoch,
                "completed": stop_epoch,
            },
            "current": {
                "ready": stop_epoch + 1,
                "started": stop_epoch + 1,
                "processed": stop_epoch,
                "completed": stop_epoch,
            },
        },
        "epoch_loop.state_dict": ANY,
        "epoch_loop.batch_progress": {
            "total": {
                "ready": nbe_batches_completed + be_batches_completed + 1,
                "started": nbe_batches_completed + be_batches_completed + 1,
                "processed": nbe_batches_completed + be_batches_completed,
                "completed": nbe_batches_completed + be_batches_completed,
            },
            "current": {
                "ready": stop_batch + 1,
                "started": stop_batch + 1,
                "processed": stop_batch,
                "completed": stop_batch,
            },
            "is_last_batch": (stop_batch + 1) == n_batches,
        },
        "epoch_loop.scheduler_progress": {
            "total": {"ready": nbe_sch_steps + be_sch_steps, "completed": nbe_sch_steps + be_sch_steps},
            "current": {"ready": be_sch_steps, "completed": be_sch_steps},
        },
        "epoch_loop.manual_optimization.state_dict": ANY,
        "epoch_loop.manual_optimization.optim_step_progress": {
            "total": {"ready": 0, "completed": 0},
            "current": {"ready": 0, "completed": 0},
        },
        "epoch_loop.automatic_optimization.state_dict": {},
        "epoch_loop.automatic_optimization.optim_progress": {
            "optimizer": {
                "step": {
                    "total": {
                        "ready": nbe_total_opt_steps + be_total_opt_steps + has_opt_stepped_in_be,
                        "completed": nbe_total_opt_steps + be_total_opt_steps,
                    },
                    "current": {
                        "ready": be_total_opt_steps + has_opt_stepped_in_be,
                        "completed": be_total_opt_steps,
                    },
                },
                "zero_grad": {
                    "total": {
                        "ready": nbe_total_zero_grad + be_total_zero_grad,
                        "started": nbe_total_zero_grad + be_total_zero_grad,
                        "completed": nbe_total_zero_grad + be_total_zero_grad,
                    },
                    "current": {
                        "ready": be_total_zero_grad,
                        "started": be_total_zero_grad,
                        "completed": be_total_zero_grad,
                    },
                },
            },
        },
        "epoch_loop.val_loop.state_dict": ANY,
        "epoch_loop.val_loop.batch_progress": ANY,
    }
    assert checkpoint["loops"]["fit_loop"] == expected

    # the callback saved its counters and the micro-batches of the open window
    state = _callback_state(checkpoint)
    assert state["accumulator"]["windows"] == nbe_total_opt_steps + be_total_opt_steps
    assert state["accumulator"]["total_micro_batches"] == nbe_batches_completed + be_batches_completed
    open_micro_batches = stop_batch % accumulate_grad_batches
    if open_micro_batches:
        assert state["window"]["micro_batches"] == open_micro_batches
    else:
        assert state["window"] is None

    trainer.fit_loop.load_state_dict(checkpoint["loops"]["fit_loop"])
    state_dict = trainer.fit_loop.state_dict()

    # need to remove these elements for comparison; comparing with `fit_loop.state_dict()` would require the
    # fit loop to have an iterator, which is only available during training
    state_dict["epoch_loop.state_dict"]["dataloader_state_dict"] = ANY
    checkpoint["loops"]["fit_loop"]["epoch_loop.state_dict"]["dataloader_state_dict"] = ANY
    assert state_dict == checkpoint["loops"]["fit_loop"]

    trainer.fit_loop.load_state_dict(checkpoint["loops"]["fit_loop"])
    # test resetting manually, we expect the `ready` counter for batch to be reset to `completed`
    # but the `ready` counter for epoch to not be reset, since we are still mid epoch
    trainer.fit_loop.reset()
    trainer.fit_loop.epoch_loop.reset()

    epoch_progress = trainer.fit_loop.epoch_progress
    assert epoch_progress.current.ready == stop_epoch + 1
    assert epoch_progress.current.completed == stop_epoch

    batch_progress = trainer.fit_loop.epoch_loop.batch_progress
    assert batch_progress.current.ready == be_batches_completed
    assert batch_progress.current.completed == be_batches_completed

    optim_progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress
    assert optim_progress.optimizer.step.current.ready == be_total_opt_steps
    assert optim_progress.optimizer.step.current.completed == be_total_opt_steps
    assert optim_progress.optimizer.zero_grad.current.ready == be_total_zero_grad
    assert optim_progress.optimizer.zero_grad.current.completed == be_total_zero_grad

    state_dict = trainer.fit_loop.state_dict()
    assert state_dict != checkpoint["loops"]["fit_loop"]
    assert state_dict["epoch_progress"]["total"]["started"] == stop_epoch + 1
    assert state_dict["epoch_progress"]["current"]["started"] == stop_epoch + 1

    # resume from the exception checkpoint: the open window continues; the run ends with the counts of
    # an uninterrupted one
    model.crash = False
    callback = GradientAccumulationCallback(accumulate_grad_batches)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        max_epochs=n_epochs,
        limit_train_batches=n_batches,
        limit_val_batches=0,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        callbacks=[callback],
    )
    trainer.fit(model, ckpt_path=ckpt_path, **weights_only(True))
    steps_per_epoch = -(-n_batches // accumulate_grad_batches)
    assert trainer.global_step == n_epochs * steps_per_epoch
    assert callback.stats.windows == n_epochs * steps_per_epoch
    assert callback.stats.total_micro_batches == n_epochs * n_batches
    assert callback.stats.micro_batches_last_step == (
        n_batches % accumulate_grad_batches or accumulate_grad_batches
    )


# Original: test_validation_during_gradient_accumulation_window (oracle added)
def test_validation_during_gradient_accumulation_window(tmp_path):
    data = torch.randn(6, 32, generator=torch.Generator().manual_seed(17))

    class ValidationModel(BoringModel):
        def train_dataloader(self):
            return DataLoader(data, batch_size=1)

        def on_validation_start(self):
            batch_idx = self.trainer.fit_loop.epoch_loop.batch_progress.current.completed
            grad_expected = batch_idx % self.trainer.accumulate_grad_batches != 0
            if grad_expected:
                assert batch_idx in (2, 4)
                assert all(p.grad is not None for p in self.parameters())
            else:
                assert batch_idx == 6
                assert all(p.grad is None for p in self.parameters())
            self.ran_assert = True

    model = ValidationModel()
    initial = copy.deepcopy(model.layer)
    callback = GradientAccumulationCallback(3)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        limit_train_batches=6,
        limit_val_batches=1,
        callbacks=[callback],
        # validation happens in the middle of the first two accumulations, and at the end of the third
        val_check_interval=2,
        max_epochs=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(model)
    assert model.ran_assert

    expected = copy.deepcopy(initial)
    opt = torch.optim.SGD(expected.parameters(), lr=0.1)
    for window in ([0, 1, 2], [3, 4, 5]):
        opt.zero_grad()
        for b in window:
            out = expected(data[b : b + 1])
            (nn.functional.mse_loss(out, torch.ones_like(out)) / 3).backward()
        opt.step()
    assert max_abs_diff(model.layer, expected) < 1e-6
    assert callback.stats.windows == 2
