"""Ported from Lightning-AI/pytorch-lightning:
tests/tests_pytorch/trainer/optimization/test_backward_calls.py.

``accumulate_grad_batches=2`` is replaced by ``GradientAccumulationCallback(2)``: the callback adds no
backward pass of its own (one per micro-batch). LBFGS re-evaluates its closure, which recomputes only the
last micro-batch, so the callback accepts it with K=1 only and refuses K=2 (Lightning's test counts the
backward calls of that combination instead).
"""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
from pytorch_lightning import Trainer
from pytorch_lightning.demos.boring_classes import BoringModel

from lightning_gradacc import GradientAccumulationCallback

QUIET = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)


# Original: test_backward_count_with_grad_accumulation
@patch("torch.Tensor.backward")
def test_backward_count_with_grad_accumulation(torch_backward):
    """Test that backward is called the correct number of times when accumulating gradients."""
    model = BoringModel()
    trainer = Trainer(
        max_epochs=1,
        limit_train_batches=6,
        limit_val_batches=0,
        callbacks=[GradientAccumulationCallback(2)],
        **QUIET,
    )
    trainer.fit(model)
    assert torch_backward.call_count == 6

    torch_backward.reset_mock()

    trainer = Trainer(max_steps=6, limit_val_batches=0, callbacks=[GradientAccumulationCallback(2)], **QUIET)
    trainer.fit(model)
    assert torch_backward.call_count == 12


# Original: test_backward_count_with_closure
@patch("torch.Tensor.backward")
def test_backward_count_with_closure(torch_backward, tmp_path):
    """Using a closure (e.g. with LBFGS) should lead to no extra backward calls."""

    class TestModel(BoringModel):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.1)

    model = TestModel()
    trainer = Trainer(max_steps=5, limit_val_batches=0, callbacks=[GradientAccumulationCallback(1)], **QUIET)
    trainer.fit(model)
    assert torch_backward.call_count == 5

    torch_backward.reset_mock()

    trainer = Trainer(max_steps=5, limit_val_batches=0, callbacks=[GradientAccumulationCallback(2)], **QUIET)
    with pytest.raises(RuntimeError, match="LBFGS"):
        trainer.fit(model)
    assert torch_backward.call_count == 0
