"""Which parameters a step covers: unfrozen or added during the fit, outside the optimizer, or lazy.

Against plain-PyTorch oracles: a layer unfrozen or a parameter group added during the fit (``BaseFinetuning``,
inside ``training_step``), parameters that require grad outside the optimizer, lazy parameters.
"""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BaseFinetuning
from torch import Tensor, nn

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h
from tests.helpers import fit

reference = h.regression_reference


def epoch_windows(num_batches: int, k: int, epochs: int) -> list[list[int]]:
    return h.windows(num_batches, k, epochs=epochs)


class FirstLayerFrozenUntil(h.RegressionModule):
    """`net.0` is frozen in __init__ and unfrozen with `requires_grad_()` at the start of epoch `epoch`.

    The optimizer holds every parameter (the usual fine-tuning recipe), so nothing else changes.
    """

    def __init__(self, epoch: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.unfreeze_epoch = epoch
        self.net[0].requires_grad_(False)

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == self.unfreeze_epoch:
            self.net[0].requires_grad_(True)


def unfreeze_from(first_window: int) -> Any:
    def prepare(net: nn.Module, window: int) -> None:
        net[0].requires_grad_(window >= first_window)

    return prepare


@pytest.mark.parametrize(
    ("options", "num_samples", "reference_options"),
    [
        ({"scaling": "weighted"}, 38, {}),  # 4.0x too large before: Lightning's 1/K times the items
        ({}, 40, {}),  # the partial window keeps Lightning's k/K before
        ({"max_grad_norm": 0.3}, 40, {"max_grad_norm": 0.3}),  # left out of the norm before
    ],
)
def test_layer_unfrozen_during_fit_is_normalized_and_clipped(
    options: dict, num_samples: int, reference_options: dict
) -> None:
    module = FirstLayerFrozenUntil(1, data=h.regression_data(num_samples))  # 10 batches
    fit(module, GradientAccumulationCallback(4, **options), max_epochs=2)
    windows = epoch_windows(10, 4, 2)  # epoch 0: windows 0-2, epoch 1: windows 3-5
    expected = reference(windows, num_samples=num_samples, prepare=unfreeze_from(3), **reference_options)
    assert h.max_abs_diff(module.net, expected) < 1e-6


class UnfreezeFirstLayer(BaseFinetuning):
    """Lightning's finetuning recipe: frozen before training, added as a new parameter group at epoch 1."""

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module.net[0])

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.net[0], optimizer, lr=0.1, initial_denom_lr=1.0)


class TrainsWhatRequiresGrad(h.RegressionModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.SGD(params, lr=self.lr, fused=self.optimizer_name == "sgd_fused" or None)


@pytest.mark.parametrize("optimizer", ["sgd", "sgd_fused"])  # fused: the step decided on the device
@pytest.mark.parametrize("accumulation_dtype", [None, "float64"])
def test_base_finetuning_param_group_added_mid_fit_is_tracked(
    accumulation_dtype: str | None, optimizer: str
) -> None:
    module = TrainsWhatRequiresGrad(h.regression_data(38), nan_at=[13], optimizer=optimizer)  # nan: epoch 1
    callback = GradientAccumulationCallback(
        4, scaling="weighted", max_grad_norm=0.3, accumulation_dtype=accumulation_dtype
    )
    fit(module, UnfreezeFirstLayer(), callback, max_epochs=2)
    assert all(torch.isfinite(p).all() for p in module.parameters())  # the nan never reaches the weights
    windows = epoch_windows(10, 4, 2)  # micro-batch 13 = epoch 1, batch 3: window 3
    expected = reference(
        windows, num_samples=38, prepare=unfreeze_from(3), max_grad_norm=0.3, skip_windows=[3]
    )
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert callback.stats.skipped_steps == 1
    assert callback.stats.num_parameters == sum(p.numel() for p in module.parameters())


class WithTeacher(h.RegressionModule):
    """A teacher that requires grad but is in no optimizer: its gradient must not change the step."""

    def __init__(self, poison: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.teacher = nn.Linear(5, 1)
        self.poison = poison

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        scale = torch.tensor(float("nan")) if self.poison and batch_idx == 5 else 100.0
        return loss + scale * self.teacher(x).pow(2).mean()  # large (or nan) gradients, teacher only


@pytest.mark.parametrize("poison", [False, True])
def test_parameters_outside_the_optimizer_change_neither_norm_nor_skip(poison: bool) -> None:
    module = WithTeacher(poison, data=h.regression_data(40))
    callback = GradientAccumulationCallback(4, max_grad_norm=0.3)
    fit(module, callback)
    assert h.max_abs_diff(module.net, reference(h.windows(10, 4), max_grad_norm=0.3)) < 1e-6
    assert callback.stats.skipped_steps == 0


def join_the_optimizer(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], how: str) -> None:
    """A new group, or the parameters appended in place to the one group's list (its length changes)."""
    if how == "group":
        optimizer.add_param_group({"params": params})
    else:
        optimizer.param_groups[0]["params"].extend(params)


class AddsAGroupInTrainingStep(h.RegressionModule):
    """`net.0` is frozen and in no optimizer until `training_step` of batch `at` adds it (see `join_...`)."""

    def __init__(self, at: int, how: str = "group", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.at, self.how = at, how
        self.net[0].requires_grad_(False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net[2].parameters(), lr=self.lr)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if batch_idx == self.at:
            self.net[0].requires_grad_(True)
            join_the_optimizer(self.trainer.optimizers[0], list(self.net[0].parameters()), self.how)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    ("accumulation_dtype", "how"), [(None, "group"), ("float64", "group"), (None, "extended")]
)
def test_a_group_added_in_the_last_micro_batch_of_a_window_is_in_that_step(
    accumulation_dtype: str | None, how: str
) -> None:
    module = AddsAGroupInTrainingStep(7, how, data=h.regression_data(40))  # batch 7 ends window 1
    fit(module, GradientAccumulationCallback(4, max_grad_norm=0.3, accumulation_dtype=accumulation_dtype))
    # the plain loop: net.0 joins the optimizer (and starts receiving gradients) at micro-batch 7
    net, (x, y) = h.regression_net(), h.regression_data(40).tensors
    net[0].requires_grad_(False)
    optimizer = torch.optim.SGD(net[2].parameters(), lr=0.1)
    for window in h.windows(10, 4):
        optimizer.zero_grad()
        for b in window:
            if b == 7:
                net[0].requires_grad_(True)
                join_the_optimizer(optimizer, list(net[0].parameters()), how)
            (h.mse(net, x[4 * b : 4 * b + 4], y[4 * b : 4 * b + 4]) / len(window)).backward()
        stepped = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(stepped, 0.3)
        optimizer.step()
    assert h.max_abs_diff(module.net, net) < 1e-6


class LazyModule(h.RegressionModule):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.Linear(8, 1))


def test_lazy_parameters_are_tracked_once_materialized() -> None:
    module = LazyModule(data=h.regression_data(40))
    callback = GradientAccumulationCallback(4)
    fit(module, callback)  # crashed in on_train_start: numel() of an uninitialized parameter
    builtin = LazyModule(data=h.regression_data(40))
    fit(builtin, accumulate_grad_batches=4)  # full windows of 4 and one of 2: only the last one differs
    assert callback.stats.num_parameters == sum(p.numel() for p in module.parameters())
    assert 1e-4 < h.max_abs_diff(module.net, builtin.net) < 0.5
