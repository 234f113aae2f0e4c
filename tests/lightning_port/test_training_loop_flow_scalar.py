"""Ported from Lightning-AI/pytorch-lightning: tests/tests_pytorch/loops/test_training_loop_flow_scalar.py.

``training_step`` may return ``None`` (or the dataloader may yield ``None``) for some micro-batches: those
add nothing to the window. Exact behaviour asserted here: each window's gradient is the mean over the
micro-batches that returned a loss, and a window in which none did leaves the parameters unchanged (no
optimizer step, no error). A plain-PyTorch loop is the oracle.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from pytorch_lightning import Trainer
from pytorch_lightning.demos.boring_classes import BoringModel
from pytorch_lightning.loops.optimization.automatic import Closure
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_collate

from lightning_gradacc import GradientAccumulationCallback
from tests.helpers import max_abs_diff, windows
from tests.lightning_port.reference import boring_reference

QUIET = dict(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, logger=False)
DATA = torch.randn(8, 32, generator=torch.Generator().manual_seed(11))


class FixedDataModel(BoringModel):
    def train_dataloader(self):
        return DataLoader(DATA, batch_size=2)


def plain_reference(layer, num_batches, k, epochs, has_loss, batch_size=2, gamma=0.1):
    """``has_loss(batch_idx)`` says which micro-batches contribute to their window."""
    run = [[b for b in window if has_loss(b)] for window in windows(num_batches, k)]
    return boring_reference(layer, DATA, [run] * epochs, batch_size=batch_size, gamma=gamma)


# Original: test__training_step__flow_scalar (a scalar tensor rather than a dict; oracle added)
def test__training_step__flow_scalar(tmp_path):
    class TestModel(FixedDataModel):
        def training_step(self, batch, batch_idx):
            self.training_step_called = True
            return self.step(batch)

    model = TestModel()
    initial = copy.deepcopy(model.layer)
    trainer = Trainer(
        default_root_dir=tmp_path,
        limit_train_batches=3,
        limit_val_batches=2,
        max_epochs=2,
        log_every_n_steps=1,
        callbacks=[GradientAccumulationCallback(2)],
        **QUIET,
    )
    trainer.fit(model)
    assert model.training_step_called
    assert max_abs_diff(model.layer, plain_reference(initial, 3, 2, 2, lambda b: True)) < 1e-6


# Original: test_train_step_no_return
# (Its second half, with manual optimization, is not ported: the callback refuses manual optimization.)
@pytest.mark.parametrize("k", [1, 2])
def test_train_step_no_return(tmp_path, k):
    class TestModel(BoringModel):
        def training_step(self, batch):
            self.training_step_called = True
            loss = self.step(batch[0])
            self.log("a", loss, on_step=True, on_epoch=True)

        def validation_step(self, batch, batch_idx):
            self.validation_step_called = True

    model = TestModel()
    initial = copy.deepcopy(model.layer)
    trainer = Trainer(
        default_root_dir=tmp_path, fast_dev_run=2, callbacks=[GradientAccumulationCallback(k)], **QUIET
    )

    Closure.warning_cache.clear()

    with pytest.warns(UserWarning, match=r"training_step` returned `None"):
        trainer.fit(model)

    assert model.training_step_called
    assert model.validation_step_called
    # no micro-batch had a loss: nothing to step with
    assert max_abs_diff(model.layer, initial) == 0


# Original: test_training_step_no_return_when_even
# (The manual `automatic_optimization.run` calls after fit are not ported: they test Lightning's output
# format outside a fit, not accumulation.)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_training_step_no_return_when_even(tmp_path, k):
    class TestModel(FixedDataModel):
        def training_step(self, batch, batch_idx):
            self.training_step_called = True
            loss = self.step(batch)
            self.log("a", loss, on_step=True, on_epoch=True)
            return loss if batch_idx % 2 else None

    model = TestModel()
    initial = copy.deepcopy(model.layer)
    trainer = Trainer(
        default_root_dir=tmp_path,
        limit_train_batches=4,
        limit_val_batches=1,
        max_epochs=4,
        enable_checkpointing=False,
        callbacks=[GradientAccumulationCallback(k)],
        **QUIET,
    )

    Closure.warning_cache.clear()

    with pytest.warns(UserWarning, match=r".*training_step` returned `None.*"):
        trainer.fit(model)

    expected = plain_reference(initial, 4, k, 4, lambda b: b % 2 == 1)
    assert max_abs_diff(model.layer, expected) < 1e-6


# Original: test_training_step_none_batches
# Lightning zeroes the gradients in the closure of a window's first batch; when that batch is None no
# closure runs, so the built-in accumulation adds the window to the previous window's stale gradient. The
# exact behaviour asserted here: each window starts from zero. (K=3 is left out: its windows would close
# on a None batch, where Lightning runs no optimizer step at all.)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_training_step_none_batches(tmp_path, k):
    class TestModel(BoringModel):
        def __init__(self):
            super().__init__()
            self.counter = 0

        def collate_none_when_even(self, batch):
            result = None if self.counter % 2 == 0 else default_collate(batch)
            self.counter += 1
            return result

        def train_dataloader(self):
            return DataLoader(DATA, batch_size=2, collate_fn=self.collate_none_when_even)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if batch_idx % 2 == 0:
                assert outputs is None
            else:
                assert outputs

    model = TestModel()
    initial = copy.deepcopy(model.layer)
    trainer = Trainer(
        default_root_dir=tmp_path,
        limit_val_batches=1,
        max_epochs=4,
        enable_checkpointing=False,
        callbacks=[GradientAccumulationCallback(k)],
        **QUIET,
    )

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    assert any("train_dataloader yielded None" in str(w.message) for w in caught)

    expected = plain_reference(initial, 4, k, 4, lambda b: b % 2 == 1)
    assert max_abs_diff(model.layer, expected) < 1e-6
