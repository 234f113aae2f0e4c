"""Ported from Lightning-AI/pytorch-lightning: tests/tests_pytorch/tuner/test_scale_batch_size.py.

Only the parts that touch accumulation: the batch size finder changes the micro-batch size before training,
so the optimizer steps per epoch follow the found size and K, and ``target_batch_size`` must be resolved
against the size the finder chose.
"""

from __future__ import annotations

import math
import os
from copy import deepcopy

import pytest
import torch
from pytorch_lightning import Trainer
from pytorch_lightning.callbacks.batch_size_finder import BatchSizeFinder
from pytorch_lightning.demos.boring_classes import BoringModel, RandomDataset
from pytorch_lightning.tuner.tuning import Tuner
from torch.utils.data import DataLoader

from lightning_gradacc import GradientAccumulationCallback

QUIET = dict(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, logger=False)


class BatchSizeModel(BoringModel):
    def __init__(self, batch_size):
        super().__init__()
        if batch_size is not None:
            self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 64), batch_size=getattr(self, "batch_size", 1))

    def val_dataloader(self):
        return DataLoader(RandomDataset(32, 64), batch_size=getattr(self, "batch_size", 1))


# Original: test_batch_size_finder_callback (trainer_fn="fit" only: accumulation applies to fit)
@pytest.mark.parametrize(
    ("accumulation", "expected_k"),
    [({"accumulation_steps": 3}, 3), ({"target_batch_size": 32}, 2), ({"target_batch_size": 48}, 3)],
)
def test_batch_size_finder_callback(tmp_path, accumulation, expected_k):
    before_batch_size = 2
    max_trials = 4
    max_epochs = 2
    # the last successful batch size, 2^4 = 16
    expected_scaled_batch_size = before_batch_size**max_trials

    model = BatchSizeModel(batch_size=before_batch_size)
    batch_size_finder = BatchSizeFinder(max_trials=max_trials, batch_arg_name="batch_size")
    callback = GradientAccumulationCallback(**accumulation)
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=max_epochs,
        callbacks=[batch_size_finder, callback],
        limit_val_batches=2,
        **QUIET,
    )
    trainer.fit(model)
    after_batch_size = model.batch_size
    loop = trainer.fit_loop

    assert expected_scaled_batch_size == after_batch_size
    # K follows the micro-batch size the finder chose (target_batch_size: items per optimizer step)
    assert trainer.accumulate_grad_batches == expected_k
    assert callback.stats.accumulation_steps == expected_k
    micro_batches = trainer.train_dataloader.dataset.len // after_batch_size
    expected_steps = math.ceil(micro_batches / expected_k)
    assert trainer.global_step == expected_steps * max_epochs
    assert trainer.current_epoch == max_epochs
    assert loop.epoch_loop.batch_progress.total.completed == micro_batches * max_epochs
    assert callback.stats.windows == expected_steps * max_epochs
    assert callback.stats.total_micro_batches == micro_batches * max_epochs  # the trials are not counted

    assert not any(f for f in os.listdir(tmp_path) if f.startswith(".scale_batch_size_temp_model"))


# Original: test_trainer_reset_correctly (trainer_fn="fit", with the callback among the Trainer's callbacks)
def test_trainer_reset_correctly(tmp_path):
    """Check that model and all trainer parameters are reset correctly after scaling batch size."""
    model = BatchSizeModel(batch_size=2)
    before_state_dict = deepcopy(model.state_dict())

    callback = GradientAccumulationCallback(2)
    trainer = Trainer(
        default_root_dir=tmp_path, max_epochs=1, callbacks=[callback], limit_val_batches=2, **QUIET
    )
    tuner = Tuner(trainer)

    changed_attributes = [
        "accumulate_grad_batches",  # the user's (1) again, as with Lightning's scheduler: nothing trained
        "loggers",
        "callbacks",
        "global_step",
        "max_steps",
        "limit_train_batches",
        "limit_val_batches",
        "limit_test_batches",
        "limit_predict_batches",
    ]

    expected = {ca: getattr(trainer, ca) for ca in changed_attributes}
    expected_loop_state_dict = trainer.fit_loop.state_dict()

    tuner.scale_batch_size(model, max_trials=4, method="fit")

    actual = {ca: getattr(trainer, ca) for ca in changed_attributes}
    actual_loop_state_dict = trainer.fit_loop.state_dict()
    assert expected_loop_state_dict == actual_loop_state_dict
    assert actual == expected

    after_state_dict = model.state_dict()
    for key in before_state_dict:
        assert torch.all(torch.eq(before_state_dict[key], after_state_dict[key])), (
            "Model was not reset correctly after scaling batch size"
        )

    assert not any(f for f in os.listdir(tmp_path) if f.startswith(".scale_batch_size_temp_model"))

    # a fit afterwards with the found batch size (16): 4 micro-batches in windows of 2
    trainer.fit(model)
    assert callback.stats.windows == 2
    assert callback.stats.total_micro_batches == 4
