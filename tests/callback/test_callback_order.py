"""Every callback and the module see the final gradient before the optimizer step, in any callback order.

Even a callback that moves itself first in ``setup``; the norms they see are the big batch's.
"""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h
from tests.helpers import fit

BATCH = 4


class GradNormProbe(pl.Callback):
    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))


class ModuleNormProbe(h.RegressionModule):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.norms: list[float] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))


def reference_grad_norms(window_list: list[list[int]]) -> list[float]:
    net = h.regression_net()
    x, y = h.regression_data(40).tensors
    norms = []
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for window in window_list:
        rows = torch.cat([torch.arange(b * BATCH, (b + 1) * BATCH) for b in window])
        optimizer.zero_grad()
        h.mse(net, x[rows], y[rows]).backward()
        norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in net.parameters()]))))
        optimizer.step()
    return norms


class PutsItselfFirst(GradNormProbe):
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        trainer.callbacks = [self, *(c for c in trainer.callbacks if c is not self)]


def test_a_callback_that_moves_itself_first_in_setup_still_sees_the_final_gradient() -> None:
    probe = PutsItselfFirst()
    fit(h.RegressionModule(h.regression_data(40)), GradientAccumulationCallback(4), probe)
    assert probe.norms == pytest.approx(reference_grad_norms(h.windows(10, 4)), rel=1e-5)


def test_every_callback_and_the_module_see_the_final_gradient_whatever_the_order() -> None:
    before, after = GradNormProbe(), GradNormProbe()
    module = ModuleNormProbe(data=h.regression_data(40))
    fit(module, before, GradientAccumulationCallback(4), after)
    expected = reference_grad_norms(h.windows(10, 4))
    for seen in (before.norms, after.norms, module.norms):
        assert seen == pytest.approx(expected, rel=1e-5)
