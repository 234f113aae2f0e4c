"""Ported from Lightning-AI/pytorch-lightning: tests/tests_pytorch/tuner/test_lr_finder.py.

Only the parts that touch accumulation. ``Tuner.lr_find`` runs its own short fit with the Trainer's
callbacks replaced by its ``_LRCallback``, reading ``trainer.accumulate_grad_batches``: the accumulation
factor must be the callback's during the search, and the Trainer and callback must be intact afterwards.
"""

from __future__ import annotations

import pytest
import torch
from pytorch_lightning import Trainer, seed_everything
from pytorch_lightning.callbacks import LearningRateFinder
from pytorch_lightning.demos.boring_classes import BoringModel
from pytorch_lightning.tuner.tuning import Tuner

from lightning_gradacc import GradientAccumulationCallback

QUIET = dict(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, logger=False)


class TestModel(BoringModel):
    def __init__(self):
        super().__init__()
        self.lr = 1e-3

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


# Original: test_accumulation_and_early_stopping (K adopted from the Trainer's accumulate_grad_batches)
def test_accumulation_and_early_stopping(tmp_path):
    """Early stopping of the learning rate finder works, and accumulation also works for this feature."""
    seed_everything(1)

    model = TestModel()
    callback = GradientAccumulationCallback()
    trainer = Trainer(
        default_root_dir=tmp_path,
        accumulate_grad_batches=2,
        callbacks=[callback],
        max_epochs=4,
        limit_val_batches=0,
        **QUIET,
    )
    tuner = Tuner(trainer)
    lr_finder = tuner.lr_find(model, early_stop_threshold=None)

    assert lr_finder.suggestion() != 1e-3
    assert len(lr_finder.results["lr"]) == len(lr_finder.results["loss"]) == 100
    assert lr_finder._total_batch_idx == 199

    # the callback is back and trains with the Trainer's K afterwards
    assert trainer.callbacks.count(callback) == 1
    trainer.fit(model)
    assert callback.stats.accumulation_steps == 2
    assert callback.stats.windows == 128


# Original: test_accumulation_and_early_stopping (K given to the callback only)
@pytest.mark.parametrize("use_tuner", [True, False])
def test_accumulation_and_early_stopping_with_callback_k(tmp_path, use_tuner):
    """The callback's K also holds in the search: through `Tuner.lr_find` and the `LearningRateFinder`
    callback (which runs the search inside `fit`, after the callbacks' `setup`)."""
    seed_everything(1)

    model = TestModel()
    callback = GradientAccumulationCallback(2)
    finder = LearningRateFinder(early_stop_threshold=None)
    trainer = Trainer(
        default_root_dir=tmp_path,
        callbacks=[callback] if use_tuner else [callback, finder],
        max_epochs=4,
        limit_val_batches=0,
        **QUIET,
    )
    if use_tuner:
        lr_finder = Tuner(trainer).lr_find(model, early_stop_threshold=None)
    else:
        trainer.fit(model)
        lr_finder = finder.optimal_lr
        assert callback.stats.windows == 128  # the real fit: 4 epochs of 64 micro-batches, K=2

    assert lr_finder.suggestion() != 1e-3
    assert len(lr_finder.results["lr"]) == len(lr_finder.results["loss"]) == 100
    assert lr_finder._total_batch_idx == 199


def getattr_recursive(obj, attr):
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


# Original: test_trainer_reset_correctly (with the callback among the Trainer's callbacks)
def test_trainer_reset_correctly(tmp_path):
    """Check that all trainer parameters are reset correctly after lr_find()"""
    model = BoringModel()
    model.lr = 0.1

    callback = GradientAccumulationCallback()
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=1,
        accumulate_grad_batches=2,
        callbacks=[callback],
        limit_val_batches=0,
    )
    tuner = Tuner(trainer)

    changed_attributes = [
        "accumulate_grad_batches",
        "callbacks",
        "checkpoint_callback",
        "current_epoch",
        "loggers",
        "global_step",
        "max_steps",
        "fit_loop.max_steps",
        "strategy.setup_optimizers",
        "should_stop",
    ]
    expected = {ca: getattr_recursive(trainer, ca) for ca in changed_attributes}

    tuner.lr_find(model, num_training=5)

    actual = {ca: getattr_recursive(trainer, ca) for ca in changed_attributes}
    assert actual == expected
    assert model.trainer == trainer

    # a fit afterwards counts only its own micro-batches (the search ran with the callbacks swapped out)
    trainer.fit(model)
    assert callback.stats.windows == 32
    assert callback.stats.total_micro_batches == 64
