"""Ported from Lightning-AI/pytorch-lightning: tests/tests_pytorch/loops/test_training_loop.py.

``on_train_batch_start`` returning ``-1`` (or ``trainer.should_stop``) ends the epoch in the middle of a
window: Lightning runs no optimizer step for it and zeroes the gradients at the next window. Exact
behaviour asserted here: that open window is discarded, and the next epoch's first window holds only its
own micro-batches. A plain-PyTorch loop is the oracle.
"""

from __future__ import annotations

import copy

import pytest
import torch
from pytorch_lightning import Callback, Trainer
from pytorch_lightning.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader

from lightning_gradacc import GradientAccumulationCallback
from tests.helpers import max_abs_diff, windows
from tests.lightning_port.reference import boring_reference

K = 3
QUIET = dict(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, logger=False)
DATA = torch.randn(10, 32, generator=torch.Generator().manual_seed(13))


class FixedDataModel(BoringModel):
    def train_dataloader(self):
        return DataLoader(DATA, batch_size=1)


def plain_reference(layer, batches_run: int, epochs: int, k: int = K, discard_open_window: bool = True):
    """Each epoch runs micro-batches [0, batches_run); a trailing window shorter than K is stepped only if
    the epoch really ended there (``discard_open_window=False``)."""
    run = [w for w in windows(batches_run, k) if len(w) == k or not discard_open_window]
    return boring_reference(layer, DATA, [run] * epochs)


class WindowSizes(Callback):
    """Records the micro-batches of each optimizer step's window, as the callback counted them."""

    def __init__(self, accumulation: GradientAccumulationCallback) -> None:
        self.accumulation = accumulation
        self.sizes: list[int] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        if self.accumulation.stats.windows > len(self.sizes):
            self.sizes.append(self.accumulation.stats.micro_batches_last_step)


# Original: test_on_train_batch_start_return_minus_one
@pytest.mark.parametrize(("max_epochs", "batch_idx_"), [(2, 5), (3, 8), (4, 12)])
def test_on_train_batch_start_return_minus_one(max_epochs, batch_idx_, tmp_path):
    class CurrentModel(FixedDataModel):
        def on_train_batch_start(self, batch, batch_idx):
            if batch_idx == batch_idx_:
                return -1
            return None

    model = CurrentModel()
    initial = copy.deepcopy(model.layer)
    callback = GradientAccumulationCallback(K)
    sizes = WindowSizes(callback)
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=max_epochs,
        limit_train_batches=10,
        limit_val_batches=0,
        enable_checkpointing=False,
        callbacks=[callback, sizes],
        **QUIET,
    )
    trainer.fit(model)
    if batch_idx_ > trainer.num_training_batches - 1:
        assert trainer.fit_loop.batch_idx == trainer.num_training_batches - 1
        steps_per_epoch = -(-trainer.num_training_batches // K)  # the last, partial window steps too
        assert trainer.global_step == steps_per_epoch * max_epochs
        expected = plain_reference(initial, 10, max_epochs, discard_open_window=False)
        assert sizes.sizes == [3, 3, 3, 1] * max_epochs
    else:
        assert trainer.fit_loop.batch_idx == batch_idx_
        # only the full windows before batch `batch_idx_` step; the open one is dropped
        assert trainer.global_step == (batch_idx_ // K) * max_epochs
        expected = plain_reference(initial, batch_idx_, max_epochs)
        assert sizes.sizes == [K] * trainer.global_step  # no window carries micro-batches of the last epoch

    assert trainer.is_last_batch
    assert callback.stats.windows == trainer.global_step
    assert max_abs_diff(model.layer, expected) < 1e-6


# Original: test_lr_updated_on_train_batch_start_returns_minus_one
@pytest.mark.parametrize(("max_epochs", "batch_idx_"), [(2, 5), (3, 8)])
def test_lr_updated_on_train_batch_start_returns_minus_one(tmp_path, max_epochs, batch_idx_):
    class TestModel(FixedDataModel):
        def on_train_batch_start(self, batch, batch_idx):
            if batch_idx == batch_idx_:
                return -1
            return super().on_train_batch_start(batch, batch_idx)

    model = TestModel()
    init_lr = 0.1
    trainer = Trainer(
        default_root_dir=tmp_path,
        limit_train_batches=10,
        limit_val_batches=0,
        max_epochs=max_epochs,
        enable_checkpointing=False,
        callbacks=[GradientAccumulationCallback(K)],
        **QUIET,
    )
    trainer.fit(model)

    adjusted_lr = [pg["lr"] for pg in trainer.optimizers[0].param_groups]

    assert len(trainer.lr_scheduler_configs) == 1
    assert all(a == adjusted_lr[0] for a in adjusted_lr)
    assert init_lr * 0.1**max_epochs == adjusted_lr[0]


# Original: test_should_stop_mid_epoch
def test_should_stop_mid_epoch(tmp_path):
    class TestModel(FixedDataModel):
        def __init__(self):
            super().__init__()
            self.validation_called_at = None

        def training_step(self, batch, batch_idx):
            if batch_idx == 4:
                self.trainer.should_stop = True
            return super().training_step(batch, batch_idx)

        def validation_step(self, *args):
            self.validation_called_at = (self.trainer.current_epoch, self.trainer.global_step)
            return super().validation_step(*args)

    model = TestModel()
    initial = copy.deepcopy(model.layer)
    callback = GradientAccumulationCallback(2)
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=1,
        limit_train_batches=10,
        limit_val_batches=1,
        enable_checkpointing=False,
        callbacks=[callback],
        **QUIET,
    )
    with pytest.warns(UserWarning, match="Training ended inside a window"):
        trainer.fit(model)

    # even though we stopped mid epoch, the fit loop finished normally and the current epoch was increased
    assert trainer.current_epoch == 1
    # micro-batches 0..4 ran: windows [0, 1] and [2, 3] stepped; [4] was open when training stopped
    assert trainer.global_step == 2
    assert model.validation_called_at == (0, 2)
    assert callback.stats.windows == 2
    assert callback.stats.open_window_micro_batches == 0  # the open window was discarded
    assert max_abs_diff(model.layer, plain_reference(initial, 5, 1, k=2)) < 1e-6
