"""Ordinary Lightning paths, each against a plain-PyTorch big-batch oracle (issue 9).

Unfrozen layers, skipped batches, epochs cut short, callback order, ambiguous batches, item counts of any
kind, callback reuse, step-interval schedulers and the smaller hooks a user combines with the callback.
"""

from __future__ import annotations

import collections
import copy
import math
import warnings
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BaseFinetuning, StochasticWeightAveraging
from pytorch_lightning.plugins import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_gradacc import GradientAccumulationCallback, estimated_stepping_batches
from tests import helpers as h

BATCH = 4


reference = h.regression_reference


def fit(module: pl.LightningModule, *callbacks: pl.Callback, **kwargs: Any) -> pl.Trainer:
    trainer = h.trainer(callbacks=list(callbacks), **kwargs)
    trainer.fit(module)
    return trainer


def epoch_windows(num_batches: int, k: int, epochs: int) -> list[list[int]]:
    return h.windows(num_batches, k, epochs=epochs)


# ----------------------------------------------------------------------- 1. what the optimizer steps


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
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)


@pytest.mark.parametrize("accumulation_dtype", [None, "float64"])
def test_base_finetuning_param_group_added_mid_fit_is_tracked(accumulation_dtype: str | None) -> None:
    module = TrainsWhatRequiresGrad(h.regression_data(38), nan_at=[13])  # a non-finite window in epoch 1
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


class AddsAGroupInTrainingStep(h.RegressionModule):
    """`net.0` is frozen and in no optimizer until `training_step` of batch `at` adds it as a group."""

    def __init__(self, at: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.at = at
        self.net[0].requires_grad_(False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net[2].parameters(), lr=self.lr)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if batch_idx == self.at:
            self.net[0].requires_grad_(True)
            self.trainer.optimizers[0].add_param_group({"params": list(self.net[0].parameters())})
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("accumulation_dtype", [None, "float64"])
def test_a_group_added_in_the_last_micro_batch_of_a_window_is_in_that_step(
    accumulation_dtype: str | None,
) -> None:
    module = AddsAGroupInTrainingStep(7, data=h.regression_data(40))  # batch 7 ends window 1
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
                optimizer.add_param_group({"params": list(net[0].parameters())})
            (h.mse(net, x[4 * b : 4 * b + 4], y[4 * b : 4 * b + 4]) / len(window)).backward()
        stepped = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(stepped, 0.3)
        optimizer.step()
    assert h.max_abs_diff(module.net, net) < 1e-6


# --------------------------------------------------------------------- 2. windows never merge


class StopsEpochZeroAt(h.RegressionModule):
    """`on_train_batch_start` returns -1 at batch `stop` of epoch 0 (Lightning ends the epoch there)."""

    def __init__(self, stop: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stop = stop

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if self.current_epoch == 0 and batch_idx == self.stop else None


@pytest.mark.parametrize("accumulation_dtype", [None, "float64"])
def test_window_cut_by_an_early_epoch_end_is_discarded_not_merged(accumulation_dtype: str | None) -> None:
    module = StopsEpochZeroAt(6, data=h.regression_data(40))  # epoch 0 runs batches 0-5: window 4-5 is cut
    callback = GradientAccumulationCallback(4, accumulation_dtype=accumulation_dtype)
    with pytest.warns(UserWarning, match="never reached its optimizer step"):
        fit(module, callback, max_epochs=2)
    expected = reference([[0, 1, 2, 3], *h.windows(10, 4)])
    assert h.max_abs_diff(module.net, expected) < 1e-6


# ------------------------------------------------------------------ 4. weighted in low precision


def many_tokens(batch: Any) -> int:
    return len(batch[0]) * 65_536  # 262,144 "tokens" in a micro-batch of 4


def test_weighted_with_huge_counts_does_not_overflow_fp16() -> None:
    data = h.regression_data(38)
    module = h.RegressionModule(data, lr=0.05)
    callback = GradientAccumulationCallback(4, scaling="weighted", item_count_fn=many_tokens)
    fit(module, callback, precision="16-true", max_epochs=1)
    assert callback.stats.skipped_steps == 0 and callback.stats.non_finite_windows == 0
    assert callback.stats.items_last_step == 6 * 65_536
    # fp16 weights against an fp32 reference from the same (fp16-rounded) start: fp16 rounding only
    start = h.regression_net().half().float()
    expected = h.big_batch_reference(start, data, BATCH, h.windows(10, 4), h.mse, lr=0.05)
    assert h.max_abs_diff(module.net.float(), expected) < 2e-3


# ----------------------------------------------------------------- 5. order of the callbacks


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


# ------------------------------------------------------------------ 6. ambiguous batch sizes

Batch = collections.namedtuple("Batch", ["length", "x", "y"])
Pair = collections.namedtuple("Pair", ["x", "y"])


class NamedTupleModule(h.RegressionModule):
    def __init__(self, with_length: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.with_length = with_length

    def train_dataloader(self) -> DataLoader[Any]:
        def collate(rows: list[tuple[Tensor, Tensor]]) -> Any:
            x, y = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
            return Batch(torch.tensor(len(rows)), x, y) if self.with_length else Pair(x, y)

        return DataLoader(self.data, batch_size=self.batch_size, collate_fn=collate)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return nn.functional.mse_loss(self.net(batch.x), batch.y)


def test_weighted_refuses_an_ambiguous_batch_size_and_asks_for_item_count_fn() -> None:
    module = NamedTupleModule(True, data=h.regression_data(38))
    callback = GradientAccumulationCallback(4, scaling="weighted")
    with pytest.raises(
        ValueError, match=r"batch size of batch 0 is ambiguous: it holds a 0-dim.*item_count_fn"
    ):
        fit(module, callback)
    assert h.max_abs_diff(module.net, h.regression_net()) == 0  # raised before any update


def test_weighted_accepts_a_batch_whose_tensors_agree() -> None:
    module = NamedTupleModule(False, data=h.regression_data(38))
    fit(module, GradientAccumulationCallback(4, scaling="weighted"))
    assert h.max_abs_diff(module.net, reference(h.windows(10, 4), num_samples=38)) < 1e-6


# ------------------------------------------------------------- 7. batches and windows with nothing


class SkipsBatches(h.RegressionModule):
    """`training_step` returns None (Lightning's documented way to skip a batch) at the given batches."""

    def __init__(self, skipped: set[int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.skipped = skipped

    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx in self.skipped else loss


def without(window_list: list[list[int]], skipped: set[int]) -> list[list[int]]:
    return [kept for window in window_list if (kept := [b for b in window if b not in skipped])]


@pytest.mark.parametrize(
    ("k", "skipped", "empty"),
    [
        (1, {3}, 1),  # crashed before: a window of one skipped batch
        (4, {4, 5, 6, 7}, 1),  # a whole window skipped
        (4, {1}, 0),  # inside a window: the mean is over the 3 that ran
        (4, {3, 9}, 0),  # the batch that ends a window: its 3 others still step (Lightning steps them)
    ],
)
def test_training_step_returning_none(k: int, skipped: set[int], empty: int) -> None:
    module = SkipsBatches(skipped, data=h.regression_data(40))
    callback = GradientAccumulationCallback(k, max_grad_norm=0.3)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`training_step` returned `None`")
        fit(module, callback)
    expected = reference(without(h.windows(10, k), skipped), max_grad_norm=0.3)
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert callback.stats.empty_windows == empty
    assert callback.stats.windows == len(h.windows(10, k))


@pytest.mark.parametrize("accumulation_dtype", [None, "float64"])
def test_none_at_the_end_of_a_window_under_a_grad_scaler_still_steps_the_window(
    accumulation_dtype: str | None,
) -> None:
    """Lightning neither unscales nor steps then: the window's 3 micro-batches would be lost."""
    module = SkipsBatches({3}, data=h.regression_data(40))
    callback = GradientAccumulationCallback(4, accumulation_dtype=accumulation_dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`training_step` returned `None`")
        fit(module, callback, plugins=[h.amp_plugin(2.0**10)])
    expected = reference(without(h.windows(10, 4), {3}), fp16_autocast=True)
    assert h.max_abs_diff(module.net, expected) < 2e-4  # fp16 rounding: micro- vs big-batch
    lost = reference(without(h.windows(10, 4), {0, 1, 2, 3}), fp16_autocast=True)
    assert h.max_abs_diff(module.net, lost) > 2e-2  # what Lightning alone does


class BatchNormModule(h.RegressionModule):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


class EpochStartSnapshots(pl.Callback):
    def __init__(self) -> None:
        self.params: dict[int, list[Tensor]] = {}

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.params.setdefault(trainer.current_epoch, [p.detach().clone() for p in pl_module.parameters()])


@pytest.mark.parametrize("first", ["swa", "callback"])
def test_swa_with_batchnorm_works_with_the_callback_before_or_after(first: str) -> None:
    def run(builtin: bool) -> tuple[BatchNormModule, pl.Trainer, EpochStartSnapshots]:
        module = BatchNormModule(data=h.regression_data(32))  # 8 batches, K=4: full windows only
        swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
        snapshots = EpochStartSnapshots()
        callbacks: list[pl.Callback] = (
            [snapshots] if builtin else [snapshots, GradientAccumulationCallback(4)]
        )
        callbacks = [swa, *callbacks] if first == "swa" else [*callbacks, swa]
        options = {"accumulate_grad_batches": 4} if builtin else {}
        return module, fit(module, *callbacks, max_epochs=3, **options), snapshots

    module, trainer, ours = run(builtin=False)
    callback = next(c for c in trainer.callbacks if isinstance(c, GradientAccumulationCallback))
    assert callback.stats.empty_windows == 1  # SWA's BatchNorm epoch: forward passes, no backward
    assert trainer.accumulate_grad_batches == 4
    # With full windows the built-in is exact: its trajectory is the oracle until SWA's BatchNorm epoch.
    builtin, _, theirs = run(builtin=True)
    for epoch in (1, 2):
        pairs = zip(ours.params[epoch], theirs.params[epoch], strict=True)
        assert max(float((a - b).abs().max()) for a, b in pairs) < 1e-6
    # SWA averages the weights at the start of epochs 0, 1 and 2; the result must be that average. The
    # built-in steps once more in the BatchNorm epoch with the last window's stale gradient (0.037 off);
    # the callback closes that empty window without a step.
    average = [
        sum(epoch_params) / 3 for epoch_params in zip(*(ours.params[e] for e in range(3)), strict=True)
    ]
    assert max(float((p - a).abs().max()) for p, a in zip(module.parameters(), average, strict=True)) < 1e-6
    assert h.max_abs_diff(builtin, module) > 1e-3
    assert all(torch.equal(a, b) for a, b in zip(module.buffers(), builtin.buffers(), strict=True))


# ---------------------------------------------------------------------------------- 8. item counts


def tokens_float(batch: Any) -> Tensor:
    return (batch[1] != h.IGNORE_INDEX).float().sum()


def tokens_python_float(batch: Any) -> float:
    return float((batch[1] != h.IGNORE_INDEX).sum())


def tokens_numpy(batch: Any) -> Any:
    return np.int64((batch[1] != h.IGNORE_INDEX).sum().item())


@pytest.mark.parametrize("counter", [tokens_float, tokens_python_float, tokens_numpy, h.count_tokens])
def test_any_kind_of_token_count_matches_one_big_batch(counter: Any) -> None:
    data = h.token_data()
    module = h.TokenModule(data)
    fit(module, GradientAccumulationCallback(4, scaling="weighted", item_count_fn=counter))
    expected = h.big_batch_reference(h.token_net(), data, 2, h.windows(12, 4), h.token_loss, lr=0.5)
    assert h.max_abs_diff(module.net, expected) < 1e-6


def padded(data: Any, rows: list[int]) -> Any:
    inputs, labels = (t.clone() for t in data.tensors)
    labels[rows] = h.IGNORE_INDEX  # e.g. SFT samples whose labels are all masked
    return torch.utils.data.TensorDataset(inputs, labels)


@pytest.mark.parametrize("counter", [h.count_tokens, tokens_python_float])
def test_micro_batches_and_windows_with_zero_items(counter: Any) -> None:
    # micro-batch 1 (rows 2-3) has no token; window 2 (micro-batches 8-11, rows 16-23) has none at all
    data = padded(h.token_data(), [2, 3, *range(16, 24)])
    module = h.TokenModule(data)
    callback = GradientAccumulationCallback(4, scaling="weighted", item_count_fn=counter)
    fit(module, callback)
    # the big batch of window 2 has no token: its loss is nan and the reference takes no step either
    expected = h.big_batch_reference(
        h.token_net(), data, 2, h.windows(12, 4), h.token_loss, lr=0.5, skip_windows=[2]
    )
    assert h.max_abs_diff(module.net, expected) < 1e-6
    stats = callback.stats
    assert (stats.empty_windows, stats.skipped_steps, stats.windows) == (1, 0, 3)
    assert math.isnan(callback.metrics()["grad_accum/window_loss"])  # the empty window has no loss


# --------------------------------------------------------------------------- 9. reusing the callback


def test_an_adopted_k_is_adopted_again_by_the_next_trainer() -> None:
    callback = GradientAccumulationCallback()
    fit(h.RegressionModule(h.regression_data(40)), callback, accumulate_grad_batches=4)
    module = h.RegressionModule(h.regression_data(40))
    fit(module, callback, accumulate_grad_batches=3)
    assert h.max_abs_diff(module.net, reference(h.windows(10, 3))) < 1e-6
    assert callback.plan.fixed is None  # the configuration stays what the user gave


def test_a_target_batch_size_is_resolved_again_for_the_next_fit() -> None:
    callback = GradientAccumulationCallback(target_batch_size=16)
    fit(h.RegressionModule(h.regression_data(40), batch_size=4), callback)
    assert callback.stats.accumulation_steps == 4
    module = h.RegressionModule(h.regression_data(40), batch_size=8)
    fit(module, callback)
    assert callback.stats.accumulation_steps == 2
    expected = h.big_batch_reference(h.regression_net(), h.regression_data(40), 8, h.windows(5, 2), h.mse)
    assert h.max_abs_diff(module.net, expected) < 1e-6


# ------------------------------------------------------------- 11. step-interval LR schedulers


class OneCycleModule(h.RegressionModule):
    def __init__(self, exact: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.exact = exact
        self.estimate: float | None = None

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        self.estimate = (
            estimated_stepping_batches(self.trainer)
            if self.exact
            else self.trainer.estimated_stepping_batches
        )
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=int(self.estimate))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class TinyFirstCount:
    """1 item in the very first micro-batch, 262,144 in every other one (equal in the big batch's rows)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, batch: Any) -> float:
        self.calls += 1
        return 1.0 if self.calls == 1 else 262_144.0


def test_weighted_reference_count_follows_the_counts_from_window_to_window() -> None:
    """Relative to the first count, every weight would be 262,144 and overflow fp16 in every window (3 of 3
    skipped with a fixed reference); the reference follows each window's mean, so only the first overflows."""
    data = h.regression_data(40)
    module = h.RegressionModule(data, lr=0.05)
    callback = GradientAccumulationCallback(4, scaling="weighted", item_count_fn=TinyFirstCount())
    fit(module, callback, precision="16-true")
    assert callback.stats.skipped_steps == 1
    start = h.regression_net().half().float()
    # windows 1 and 2 hold equal counts: their weighted mean is the plain mean of their rows
    expected = h.big_batch_reference(start, data, BATCH, h.windows(10, 4), h.mse, lr=0.05, skip_windows=[0])
    assert h.max_abs_diff(module.net.float(), expected) < 2e-3


def test_onecycle_with_a_decreasing_schedule_gets_the_exact_step_count() -> None:
    module = OneCycleModule(True, data=h.regression_data(40))
    trainer = fit(module, GradientAccumulationCallback({0: 4, 2: 1}), max_epochs=3)
    assert module.estimate == trainer.global_step == 3 + 3 + 10


def test_onecycle_from_lightnings_estimate_with_a_schedule_fails_before_training() -> None:
    module = OneCycleModule(False, data=h.regression_data(40))
    with pytest.raises(RuntimeError, match=r"OneCycleLR\(total_steps=9\).*takes 16 optimizer steps"):
        fit(module, GradientAccumulationCallback({0: 4, 2: 1}), max_epochs=3)
    assert h.max_abs_diff(module.net, h.regression_net()) == 0


def test_target_batch_size_is_resolved_before_configure_optimizers() -> None:
    module = OneCycleModule(False, data=h.regression_data(40))  # Lightning's own estimate
    trainer = fit(module, GradientAccumulationCallback(target_batch_size=16), max_epochs=3)
    assert module.estimate == trainer.global_step == 9  # 30 before: K was resolved after the estimate


class DataInSetup(h.RegressionModule):
    """Builds its data in `setup`, which Lightning calls after the callbacks' `setup`."""

    def __init__(self) -> None:
        super().__init__(data=h.regression_data(40))
        self.data = None  # type: ignore[assignment]

    def setup(self, stage: str) -> None:
        self.data = h.regression_data(40)


def test_target_batch_size_with_data_built_in_module_setup_warns_and_still_trains() -> None:
    module = DataInSetup()
    with pytest.warns(UserWarning, match="could not read the train dataloader in `setup`"):
        fit(module, GradientAccumulationCallback(target_batch_size=16))
    assert h.max_abs_diff(module.net, reference(h.windows(10, 4))) < 1e-6


# ------------------------------------------------------------------------------------ smaller


class OverridesOptimizerStep(h.RegressionModule):
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)


def test_overridden_optimizer_step_warns_as_lightnings_scheduler_does() -> None:
    with pytest.warns(
        UserWarning, match="override `LightningModule.optimizer_step` or `optimizer_zero_grad`"
    ):
        fit(OverridesOptimizerStep(h.regression_data(40)), GradientAccumulationCallback(4))


class LBFGSModule(h.RegressionModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


def test_lbfgs_closure_evaluations_are_not_counted_as_windows() -> None:
    module = LBFGSModule(h.regression_data(40))
    callback = GradientAccumulationCallback(1, max_grad_norm=100.0)
    trainer = fit(module, callback)
    plain = LBFGSModule(h.regression_data(40))
    fit(plain)
    assert h.max_abs_diff(module.net, plain.net) < 1e-6  # K=1: nothing to change
    assert callback.stats.windows == trainer.global_step == 10
    assert callback.stats.total_micro_batches == 10


def test_lbfgs_with_accumulation_is_refused_before_training() -> None:
    with pytest.raises(RuntimeError, match=r"LBFGS.*Use K=1"):
        fit(LBFGSModule(h.regression_data(40)), GradientAccumulationCallback(2))


class FloatScaleScaler(torch.amp.GradScaler):
    """A scaler that keeps its scale as a Python float: the callback cannot read it without a sync."""

    def scale(self, outputs: Any) -> Any:  # type: ignore[override]
        return outputs * 1024.0

    def unscale_(self, optimizer: Any) -> None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.div_(1024.0)

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        return optimizer.step()

    def update(self, new_scale: Any = None) -> None:
        pass


def test_a_grad_scaler_without_a_tensor_scale_is_an_error_not_a_wrong_statistic() -> None:
    plugin = MixedPrecision("16-mixed", "cpu", FloatScaleScaler("cpu"))
    with pytest.raises(RuntimeError, match="keeps no tensor `_scale`"):
        fit(h.RegressionModule(h.regression_data(40)), GradientAccumulationCallback(4), plugins=[plugin])


# ----------------------------------------------------------------- found by combining features


class ClipsByValueItself(h.RegressionModule):
    """The documented override: a hard-coded clip that ignores the Trainer's `gradient_clip_val`."""

    def configure_gradient_clipping(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=0.01, gradient_clip_algorithm="value")


def test_a_skipped_window_with_the_modules_own_clipping_by_value() -> None:
    module = ClipsByValueItself(h.regression_data(40), nan_at=[5])  # window 1 is not finite
    callback = GradientAccumulationCallback(4)
    with pytest.warns(UserWarning, match="optimizer step was skipped"):
        fit(module, callback)  # crashed: torch's clip_grad_value_ on a list with no gradient
    net, x_y = h.regression_net(), h.regression_data(40).tensors
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for index, window in enumerate(h.windows(10, 4)):  # the reference clips by value as the module does
        rows = torch.cat([torch.arange(b * BATCH, (b + 1) * BATCH) for b in window])
        optimizer.zero_grad()
        h.mse(net, *(t[rows] for t in x_y)).backward()
        torch.nn.utils.clip_grad_value_(net.parameters(), 0.01)
        if index != 1:
            optimizer.step()
    assert h.max_abs_diff(module.net, net) < 1e-6


class IteratesItself(h.RegressionModule):
    def training_step(self, dataloader_iter: Any) -> Tensor:  # type: ignore[override]
        (x, y), _, _ = next(dataloader_iter)
        return nn.functional.mse_loss(self.net(x), y)


def test_training_step_with_dataloader_iter_is_refused_when_accumulating() -> None:
    """Lightning zeroes gradients there with a stale batch index: the first micro-batch would be lost."""
    with pytest.raises(RuntimeError, match=r"`training_step\(self, dataloader_iter\)` cannot accumulate"):
        fit(IteratesItself(h.regression_data(40)), GradientAccumulationCallback(4))
    with pytest.raises(RuntimeError, match=r"K=3 adopted from `Trainer\(accumulate_grad_batches=3\)`"):
        fit(IteratesItself(h.regression_data(40)), GradientAccumulationCallback(), accumulate_grad_batches=3)
    module = IteratesItself(h.regression_data(40))
    fit(module, GradientAccumulationCallback(1))
    assert h.max_abs_diff(module.net, reference(h.windows(10, 1))) < 1e-6


def test_batch_size_finder_inside_fit_with_a_target_batch_size() -> None:
    from pytorch_lightning.callbacks import BatchSizeFinder

    data = h.regression_data(64)
    module = h.RegressionModule(data, batch_size=2)
    finder = BatchSizeFinder(mode="power", steps_per_trial=1, init_val=2, max_trials=3)
    with pytest.warns(UserWarning, match="micro-batch size changed after `setup`"):
        trainer = fit(module, GradientAccumulationCallback(target_batch_size=32), finder)
    assert (module.batch_size, trainer.accumulate_grad_batches) == (8, 4)  # 8 x 4 = the target again
    expected = h.big_batch_reference(h.regression_net(), data, 8, h.windows(8, 4), h.mse)
    assert h.max_abs_diff(module.net, expected) < 1e-6


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


def test_a_used_callback_pickles_for_ddp_spawn() -> None:
    import pickle

    callback = GradientAccumulationCallback(2)
    fit(h.RegressionModule(h.regression_data(40)), callback)
    restored = pickle.loads(pickle.dumps(callback))
    assert restored.stats.windows == callback.stats.windows == 5


class ValidatedModule(h.RegressionModule):
    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(h.regression_data(12, seed=1), batch_size=4)


def test_validating_a_mid_window_checkpoint_leaves_the_next_fit_alone(tmp_path: Any) -> None:
    path = tmp_path / "mid.ckpt"
    h.preempt(ValidatedModule(h.regression_data(40)), [GradientAccumulationCallback(4)], 5, path)
    module = ValidatedModule(h.regression_data(40))
    callback = GradientAccumulationCallback(4)
    h.trainer(callbacks=[callback]).validate(module, ckpt_path=path)
    loaded = copy.deepcopy(module.net)
    fit(module, callback)  # a fresh fit from the validated weights: the checkpoint's window is not its
    expected = h.big_batch_reference(loaded, h.regression_data(40), BATCH, h.windows(10, 4), h.mse)
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert (callback.stats.windows, callback.stats.total_micro_batches) == (3, 10)
