"""The gradient noise scale through ``Trainer.fit``, against the truth; measuring it never changes training.

A fixed model (learning rate 0: the parameters never move) on a finite data set sampled with replacement:
its per-sample gradients, computed exactly with ``torch.func``, give the true |G|² (the squared norm of
their mean) and tr(Σ) (their summed variance). The per-step estimates of a real ``Trainer.fit``, averaged
over many windows, must match them within 4 standard errors of that average, which itself is at most a
few percent of the truth: with K micro-batches on one process, and with micro-batches of unequal sizes
weighted by their items or averaged. (Under DDP and FSDP2 the estimates equal those of one process holding
every rank's micro-batches: ``tests/callback/test_auto.py``, ``tests/distributed/test_model_parallel.py``.)

Also what the callback refuses and warns about, the averages across a checkpoint, a parameter group added at
an epoch start, and Lightning's own callbacks combined with it (the same parameters, bit for bit).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BackboneFinetuning
from torch import nn
from torch.utils.data import DataLoader

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h
from tests.helpers import FixedModel, noise_truth

K = 4
WINDOWS = 1000  # the averages' standard errors: 1.7-3.0% of the truth (asserted < 3.5%)


class Estimates(pl.Callback):
    """Reads the per-step estimates after every optimizer step (a sync each: a test only)."""

    def __init__(self, out: Path | None = None) -> None:
        self.out = out
        self.rows: list[tuple[float, float, float]] = []
        self.steps = 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.steps:
            return
        self.steps = trainer.global_step
        stats = next(c for c in trainer.callbacks if isinstance(c, GradientAccumulationCallback)).stats  # type: ignore[attr-defined]
        self.rows.append((stats.grad_sq_norm_estimate, stats.trace_sigma_estimate, stats.noise_scale))

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.out is not None and trainer.global_rank == 0:
            torch.save(self.rows, self.out)


def fit(sizes: list[int], windows: int, scaling: str = "mean", **trainer_options: Any) -> Estimates:
    estimates = Estimates(trainer_options.pop("out", None))
    callback = GradientAccumulationCallback(K, scaling=scaling, noise_scale=True)  # type: ignore[arg-type]
    trainer = h.trainer(callbacks=[callback, estimates], use_distributed_sampler=False, **trainer_options)
    trainer.fit(FixedModel(sizes, windows))
    return estimates


def check_against_truth(rows: list[tuple[float, float, float]], windows: int) -> None:
    true_g, true_trace = noise_truth()
    estimates = torch.tensor([row[:2] for row in rows], dtype=torch.float64)
    assert len(estimates) == windows and bool(torch.isfinite(estimates).all())
    mean = estimates.mean(dim=0)
    standard_error = estimates.std(dim=0) / math.sqrt(windows)
    for got, error, want in zip(mean.tolist(), standard_error.tolist(), (true_g, true_trace), strict=True):
        assert error < 0.035 * want  # the average is precise enough to test anything
        assert abs(got - want) < 4 * error, (got, want, error)
    noise_scale = rows[-1][2]  # smoothed over ~20 steps: a trend, checked loosely
    assert 0.3 * true_trace / true_g < noise_scale < 3 * true_trace / true_g


def test_the_truth_is_not_trivial() -> None:
    """The data set's noise scale is of the order of the windows' batch sizes (4 to 32 items)."""
    true_g, true_trace = noise_truth()
    assert 2 < true_trace / true_g < 50


@pytest.mark.slow
def test_estimates_match_the_truth_with_k_micro_batches() -> None:
    check_against_truth(fit([4], windows=WINDOWS).rows, WINDOWS)


@pytest.mark.slow
def test_estimates_match_the_truth_with_unequal_weighted_micro_batches() -> None:
    check_against_truth(fit([2, 3, 7], windows=WINDOWS, scaling="weighted").rows, WINDOWS)


@pytest.mark.slow
def test_estimates_match_the_truth_with_unequal_micro_batches_averaged() -> None:
    """``"mean"`` over unequal micro-batches: the window's weights are 1/n, not the items'."""
    # micro-batches of 2 items count as much as those of 7: a noisier estimate, twice the windows
    check_against_truth(fit([2, 3, 7], windows=2 * WINDOWS).rows, 2 * WINDOWS)


# -------------------------------------------------------------------------- refused, warned about, saved


def test_noise_scale_refuses_what_breaks_its_assumptions() -> None:
    with pytest.raises(
        ValueError, match="`noise_scale=True` cannot be combined with `overflow='skip_micro_batch'`"
    ):
        GradientAccumulationCallback(
            4, noise_scale=True, overflow="skip_micro_batch", accumulation_dtype="float32"
        )
    with pytest.raises(ValueError, match=r"`noise_scale_decay` to be a number in \[0, 1\), but got 1.0"):
        GradientAccumulationCallback(4, noise_scale=True, noise_scale_decay=1.0)
    with pytest.raises(TypeError, match="`noise_scale` to be True or False, but got 'yes'"):
        GradientAccumulationCallback(4, noise_scale="yes")  # type: ignore[arg-type]


def test_one_micro_batch_per_window_warns_that_nothing_is_estimated() -> None:
    callback = GradientAccumulationCallback(1, noise_scale=True)
    trainer = h.trainer(callbacks=[callback])
    with pytest.warns(UserWarning, match="`noise_scale=True` needs at least 2 micro-batches per window"):
        trainer.fit(h.RegressionModule(h.regression_data(8)))
    assert math.isnan(callback.stats.noise_scale)


def test_the_averages_survive_a_checkpoint(tmp_path: Path) -> None:
    """Two epochs in one fit, or one fit of one epoch resumed for the second: the same averages (without
    them restored the resumed run starts its averages afresh and ends elsewhere)."""

    def run(epochs: int, ckpt_path: Path | None = None) -> GradientAccumulationCallback:
        callback = GradientAccumulationCallback(K, noise_scale=True)
        trainer = h.trainer(callbacks=[callback], max_epochs=epochs, use_distributed_sampler=False)
        trainer.fit(FixedModel([4], windows=10), ckpt_path=ckpt_path)
        if ckpt_path is None and epochs == 1:
            trainer.save_checkpoint(tmp_path / "epoch.ckpt")
        return callback

    uninterrupted = run(2).stats
    first = run(1).stats
    resumed = run(2, tmp_path / "epoch.ckpt").stats
    assert math.isfinite(uninterrupted.noise_scale)
    assert resumed.noise_scale == pytest.approx(uninterrupted.noise_scale, rel=1e-12)
    assert first.noise_scale != pytest.approx(uninterrupted.noise_scale, rel=1e-3)


# ------------------------------------------------------------- combined with the rest of Lightning


def _combined_module(namespace: str) -> Any:
    """Regression with a backbone (finetuning), validation (mid-window), a logged metric (early stopping)
    and a `training_step` that returns None for one batch."""
    base = h.REGRESSION_MODULES[namespace]

    class Combined(base):  # type: ignore[valid-type,misc]
        def __init__(self) -> None:
            super().__init__(h.regression_data(48))
            self.backbone = self.net[0]

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss)
            return None if batch_idx == 5 else loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

        def val_dataloader(self) -> DataLoader:
            return DataLoader(h.regression_data(8), batch_size=4)

    return Combined()


@pytest.mark.parametrize("namespace", ["pytorch_lightning", "lightning.pytorch"])
@pytest.mark.parametrize("combination", ["finetuning", "swa", "ema", "early_stop_checkpoint", "bf16"])
def test_measuring_does_not_change_training(namespace: str, combination: str, tmp_path: Path) -> None:
    """With Lightning's callbacks, a `None` step, validation inside windows and bf16-mixed: the parameters
    after `fit` are the same, bit for bit, with and without the noise scale, and it measures."""
    package = h.PACKAGES[namespace]
    callbacks = package.callbacks

    def run(noise_scale: bool) -> tuple[Any, Any]:
        extra: list[Any] = {
            "finetuning": lambda: [callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=1)],
            "swa": lambda: [callbacks.StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)],
            "ema": lambda: [callbacks.EMAWeightAveraging()],
            "early_stop_checkpoint": lambda: [
                callbacks.EarlyStopping(monitor="val_loss", patience=5),
                callbacks.ModelCheckpoint(dirpath=tmp_path / str(noise_scale), every_n_train_steps=2),
            ],
            "bf16": lambda: [],
        }[combination]()
        accumulation = h.accumulation_callback(namespace, 4, noise_scale=noise_scale)
        trainer = h.trainer(
            namespace,
            callbacks=[accumulation, *extra],
            max_epochs=3,
            val_check_interval=3,  # inside windows of 4
            precision="bf16-mixed" if combination == "bf16" else "32-true",
            deterministic=False,
            enable_checkpointing=combination == "early_stop_checkpoint",
        )
        module = _combined_module(namespace)
        trainer.fit(module)
        return [p.detach().clone() for p in module.net.parameters()], accumulation.stats

    plain, _ = run(False)
    measured, stats = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, measured, strict=True))
    assert math.isfinite(stats.grad_sq_norm_estimate) or math.isfinite(stats.noise_scale)


# ------------------------------------------------------------- a parameter group added at an epoch start


class Backbone(h.RegressionModule):
    """Learning rate 0: the model is fixed, so every window's estimate depends only on its data."""

    def __init__(self) -> None:
        super().__init__(h.regression_data(32), lr=0.0)
        self.backbone = self.net[0]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.0)


def _estimates_by_window(finetuning: bool) -> list[tuple[float, float]]:
    rows: list[tuple[float, float]] = []

    class Read(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if (args[-1] + 1) % 4 == 0:  # batch_idx: a window's last micro-batch
                stats = callback.stats
                rows.append((stats.grad_sq_norm_estimate, stats.trace_sigma_estimate))

    callback = GradientAccumulationCallback(4, noise_scale=True)
    extra = [BackboneFinetuning(unfreeze_backbone_at_epoch=1)] if finetuning else []
    h.trainer(callbacks=[callback, *extra, Read()], max_epochs=2).fit(Backbone())
    return rows


def test_a_group_added_at_an_epoch_start_is_measured_from_the_window_s_first_micro_batch() -> None:
    """``BackboneFinetuning`` adds the backbone's group in ``on_train_epoch_start``: the first window of
    epoch 1 measures the whole model from its first micro-batch, as a run that never froze it does."""
    finetuned = _estimates_by_window(finetuning=True)
    never_frozen = _estimates_by_window(finetuning=False)
    assert len(finetuned) == len(never_frozen) == 4
    assert finetuned[0] != pytest.approx(never_frozen[0], rel=1e-3)  # epoch 0: the backbone is frozen
    for window in (2, 3):
        assert finetuned[window] == pytest.approx(never_frozen[window], rel=1e-9)
