"""Ported from Lightning-AI/pytorch-lightning: tests/tests_pytorch/trainer/flags/test_val_check_interval.py.

Only ``test_validation_check_interval_exceed_data_length_correct``, whose ``accumulate_grad_batches`` is
replaced by ``GradientAccumulationCallback``: ``max_steps`` counts optimizer steps, so with K=2 training
runs twice as many micro-batches, across epochs of 4, and validation still runs every 3 micro-batches.
"""

from __future__ import annotations

import pytest
from pytorch_lightning import Trainer
from pytorch_lightning.demos.boring_classes import BoringModel, RandomDataset, RandomIterableDataset
from torch.utils.data import DataLoader

from lightning_gradacc import GradientAccumulationCallback


# Original: test_validation_check_interval_exceed_data_length_correct
@pytest.mark.parametrize("use_infinite_dataset", [True, False])
@pytest.mark.parametrize("accumulate_grad_batches", [1, 2])
def test_validation_check_interval_exceed_data_length_correct(
    tmp_path, use_infinite_dataset, accumulate_grad_batches
):
    data_samples_train = 4
    max_epochs = 3
    max_steps = data_samples_train * max_epochs
    max_opt_steps = max_steps // accumulate_grad_batches

    class TestModel(BoringModel):
        def __init__(self):
            super().__init__()
            self.validation_called_at_step = set()

        def validation_step(self, *args):
            self.validation_called_at_step.add(self.trainer.fit_loop.total_batch_idx + 1)
            return super().validation_step(*args)

        def train_dataloader(self):
            train_ds = (
                RandomIterableDataset(32, count=max_steps + 100)
                if use_infinite_dataset
                else RandomDataset(32, length=data_samples_train)
            )
            return DataLoader(train_ds)

    model = TestModel()
    callback = GradientAccumulationCallback(accumulate_grad_batches)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        limit_val_batches=1,
        max_steps=max_opt_steps,
        val_check_interval=3,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )

    trainer.fit(model)

    assert trainer.current_epoch == 1 if use_infinite_dataset else max_epochs
    assert trainer.global_step == max_opt_steps
    assert sorted(model.validation_called_at_step) == [3, 6, 9, 12]
    assert callback.stats.windows == max_opt_steps
    assert callback.stats.total_micro_batches == max_steps
