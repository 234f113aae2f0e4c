"""Ported from Lightning-AI/pytorch-lightning: tests/tests_pytorch/loops/test_training_epoch_loop.py.

Only ``test_no_batch_idx_gradient_accumulation``: a ``training_step`` without ``batch_idx`` must still
accumulate.
"""

from __future__ import annotations

from pytorch_lightning import Trainer
from pytorch_lightning.demos.boring_classes import BoringModel

from lightning_gradacc import GradientAccumulationCallback


# Original: test_no_batch_idx_gradient_accumulation
def test_no_batch_idx_gradient_accumulation():
    """Regression test for an issue where excluding the batch_idx from training_step would disable gradient
    accumulation."""

    class MyModel(BoringModel):
        last_batch_idx = -1

        def training_step(self, batch):  # no batch_idx
            return self.step(batch)

        def optimizer_step(self, epoch, batch_idx, *args, **kwargs):
            assert batch_idx in (1, 3)
            self.last_batch_idx = batch_idx
            return super().optimizer_step(epoch, batch_idx, *args, **kwargs)

    callback = GradientAccumulationCallback(2)
    trainer = Trainer(
        accelerator="cpu",
        fast_dev_run=4,
        limit_val_batches=0,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = MyModel()
    trainer.fit(model)
    assert model.last_batch_idx == 3
    assert callback.stats.windows == 2
    assert callback.stats.micro_batches_last_step == 2
