"""Ported from Lightning-AI/pytorch-lightning:
tests/tests_pytorch/trainer/properties/test_estimated_stepping_batches.py.

``Trainer.estimated_stepping_batches`` divides by ``trainer.accumulate_grad_batches``. The usual reader is
``configure_optimizers`` (e.g. ``OneCycleLR(total_steps=...)``), which runs after the callbacks' ``setup``:
by then K must be the callback's, also when it is derived from ``target_batch_size``.
"""

from __future__ import annotations

import pytest
import torch
from pytorch_lightning import Trainer
from pytorch_lightning.demos.boring_classes import BoringModel

from lightning_gradacc import GradientAccumulationCallback


class OneCycleModel(BoringModel):
    """Reads the estimate where models do, and fails loudly (OneCycleLR) if more steps than estimated run."""

    def configure_optimizers(self):
        self.estimated = self.trainer.estimated_stepping_batches
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=self.estimated)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# Original: test_num_stepping_batches_accumulate_gradients
@pytest.mark.parametrize(
    ("accumulation", "expected_steps"),
    [
        ({"accumulation_steps": 2}, 32),
        ({"accumulation_steps": 3}, 22),
        ({"target_batch_size": 2}, 32),  # BoringModel's micro-batches hold 1 sample
        ({"target_batch_size": 3}, 22),
    ],
)
def test_num_stepping_batches_accumulate_gradients(tmp_path, accumulation, expected_steps):
    """Test the total stepping batches when accumulation grad batches is configured."""
    callback = GradientAccumulationCallback(**accumulation)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        max_epochs=1,
        limit_val_batches=0,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = OneCycleModel()
    trainer.fit(model)
    assert model.estimated == expected_steps
    assert trainer.estimated_stepping_batches == expected_steps
    assert trainer.global_step == expected_steps
    assert callback.stats.windows == expected_steps
