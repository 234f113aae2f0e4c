"""The gradient noise scale against the truth.

A fixed model (learning rate 0: the parameters never move) on a finite data set sampled with replacement:
its per-sample gradients, computed exactly with ``torch.func``, give the true |G|² (the squared norm of
their mean) and tr(Σ) (their summed variance). The per-step estimates of a real ``Trainer.fit``, averaged
over many windows, must match them within 4 standard errors of that average, which itself is at most a
few percent of the truth: with K micro-batches on one process, with 2 DDP processes, and with micro-batches
of unequal sizes weighted by their items.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, Sampler, TensorDataset

from lightning_gradacc import GradAccumulator, GradientAccumulationCallback
from lightning_gradacc.core.noise import NoiseScale, estimate
from tests import helpers as h

SAMPLES = 256
K = 4
WINDOWS = 1500  # the averages' standard errors: about 2.3% of the truth (asserted < 3%)


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 5, generator=generator)
    y = x @ torch.randn(5, 1, generator=generator) + 0.5 * torch.randn(SAMPLES, 1, generator=generator)
    return TensorDataset(x, y)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(5, 1)


def _loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * (net(x) - y).pow(2).mean()  # a mean over the micro-batch's items


def truth() -> tuple[float, float]:
    """|G|² and tr(Σ) of the per-sample gradients of the whole data set (sampling with replacement)."""
    net = _net()
    x, y = _data().tensors
    params = {name: p.detach() for name, p in net.named_parameters()}

    def one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return 0.5 * (functional_call(net, p, (xi[None],)) - yi[None]).pow(2).sum()

    per_sample = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    flat = torch.cat([g.reshape(SAMPLES, -1) for g in per_sample.values()], dim=1).double()
    mean = flat.mean(dim=0)
    return float(mean @ mean), float((flat - mean).pow(2).sum(dim=1).mean())


class ReplacementBatches(Sampler[list[int]]):
    """Micro-batches of the given sizes (cycled), each drawn with replacement: i.i.d. samples."""

    def __init__(self, sizes: list[int], batches: int, seed: int) -> None:
        self.sizes, self.batches, self.seed = sizes, batches, seed
        self.sampler = self  # Lightning calls `batch_sampler.sampler.set_epoch` at each epoch

    def set_epoch(self, epoch: int) -> None:  # Lightning calls it: other samples in another epoch
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        generator = torch.Generator().manual_seed(self.seed + 1000 * getattr(self, "epoch", 0))
        for index in range(self.batches):
            size = self.sizes[index % len(self.sizes)]
            yield torch.randint(0, SAMPLES, (size,), generator=generator).tolist()

    def __len__(self) -> int:
        return self.batches


class FixedModel(pl.LightningModule):
    def __init__(self, sizes: list[int], windows: int) -> None:
        super().__init__()
        self.net = _net()
        self.sizes, self.windows = sizes, windows

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return _loss(self.net, *batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self) -> DataLoader:
        sampler = ReplacementBatches(self.sizes, K * self.windows, seed=1 + self.global_rank)
        return DataLoader(_data(), batch_sampler=sampler)


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
    true_g, true_trace = truth()
    estimates = torch.tensor([row[:2] for row in rows], dtype=torch.float64)
    assert len(estimates) == windows and bool(torch.isfinite(estimates).all())
    mean = estimates.mean(dim=0)
    standard_error = estimates.std(dim=0) / math.sqrt(windows)
    for got, error, want in zip(mean.tolist(), standard_error.tolist(), (true_g, true_trace), strict=True):
        assert error < 0.03 * want  # the average is precise enough to test anything
        assert abs(got - want) < 4 * error, (got, want, error)
    noise_scale = rows[-1][2]  # smoothed over ~20 steps: a trend, checked loosely
    assert 0.3 * true_trace / true_g < noise_scale < 3 * true_trace / true_g


def test_the_truth_is_not_trivial() -> None:
    """The data set's noise scale is of the order of the windows' batch sizes (4 to 32 items)."""
    true_g, true_trace = truth()
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


@pytest.mark.slow
def test_estimates_match_the_truth_across_two_ddp_processes(tmp_path: Path) -> None:
    out = tmp_path / "rows.pt"
    fit([4], windows=WINDOWS // 3, strategy="ddp_spawn", devices=2, out=out)
    check_against_truth(torch.load(out), WINDOWS // 3)


# ------------------------------------------------------------------------------------------ pieces


def test_the_estimate_of_two_micro_batches_by_hand() -> None:
    """Micro-batches of 1 item with gradients 1 and 3 (mean 2): S = 5, |G_W|² = 4, β_S = 1, β_W = 1/2."""
    assert estimate(10.0, 2.0, 2.0, 4.0, 0.5) == (3.0, 2.0)
    g, t = estimate(torch.tensor(10.0), torch.tensor(2.0), torch.tensor(2.0), torch.tensor(4.0), 0.5)
    assert (float(g), float(t)) == (3.0, 2.0)  # device scalars: the same arithmetic, no sync


@pytest.mark.parametrize("count", [1.0, torch.tensor(1.0)])
def test_a_window_of_one_micro_batch_gives_no_estimate(count: Any) -> None:
    g, t = estimate(4.0 if isinstance(count, float) else torch.tensor(4.0), 1.0, count, 4.0, 1.0)
    assert math.isnan(float(g)) and math.isnan(float(t))


def test_the_averages_skip_windows_without_an_estimate() -> None:
    noise = NoiseScale(0.5, torch.device("cpu"), torch.float64)
    first = noise.update([10.0, 2.0, 2.0, 2.0, 2.0, 0.0], 4.0, items=2.0)
    assert (first.grad_sq_norm, first.trace_sigma, first.noise_scale) == (3.0, 2.0, 2.0 / 3.0)
    nothing = noise.update([4.0, 1.0, 1.0, 1.0, 1.0, 0.0], 4.0, items=1.0)  # one micro-batch
    assert math.isnan(nothing.grad_sq_norm) and nothing.noise_scale == 2.0 / 3.0
    noise.load_state_dict(noise.state_dict())
    assert noise.noise_scale() == 2.0 / 3.0


def test_the_hook_sees_each_micro_batch_and_undoes_its_scales() -> None:
    """The incoming gradient carries the item weight and the loss scale: |g|² comes out unscaled."""
    weight = nn.Parameter(torch.zeros(2))
    accumulator = GradAccumulator([weight], 2, scaling="weighted", noise_scale=True)
    accumulator.loss_scale = 0.25
    for items, gradient in ((2, torch.tensor([1.0, 0.0])), (6, torch.tensor([0.0, 2.0]))):
        loss = (weight * gradient).sum()
        count = accumulator.weigh(items)
        count.weigh_loss(loss * accumulator.loss_scale).backward()
        accumulator.record(count)
    accumulator.finalize()
    stats = accumulator.stats
    # S = (2·1 + 6·4)/8 = 3.25, G_W = (2·g1 + 6·g2)/8 = (0.25, 1.5): |G_W|² = 2.3125; β_S = 2/8, β_W = 1/8
    trace = (3.25 - 2.3125) / (2 / 8 - 1 / 8)
    assert stats.trace_sigma_estimate == pytest.approx(trace, rel=1e-6)
    assert stats.grad_sq_norm_estimate == pytest.approx(2.3125 - trace / 8, rel=1e-6)
    accumulator.remove_hooks()
    (weight * 2).sum().backward()  # no hook left: nothing pending
    assert accumulator._noise is not None and not accumulator._noise._parts


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


def test_measuring_one_window_in_three_hooks_only_those() -> None:
    net = _net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    accumulator = GradAccumulator(net.parameters(), 2, noise_scale=True, noise_scale_every=3)
    x, y = _data().tensors
    measured, hooked = [], []
    for window in range(7):
        noise = accumulator._noise
        assert noise is not None
        hooked.append(noise.watching)
        for index in range(2):
            rows = slice(8 * (2 * window + index), 8 * (2 * window + index + 1))
            accumulator.backward(_loss(net, x[rows], y[rows]), items=8)
        accumulator.step(optimizer)
        measured.append(math.isfinite(accumulator.stats.trace_sigma_estimate))
    assert hooked == measured == [True, False, False, True, False, False, True]
    accumulator.remove_hooks()
    assert not accumulator._noise.watching  # type: ignore[union-attr]


# --------------------------------------------------------------------- what must not bias the estimate


def _plain_estimates(options: dict[str, Any], windows: int = 3, **run: Any) -> list[float]:
    """Per-window |G|² and tr Σ, one after the other, of a plain loop over fixed micro-batches of 8 rows
    (K=2, learning rate 0)."""
    net = _net()
    if run.get("dtype") is not None:
        net = net.to(run["dtype"])
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    accumulator = GradAccumulator(net.named_parameters(), 2, noise_scale=True, **options)
    x, y = _data().tensors
    found = []
    for window in range(windows):
        for index in range(2):
            rows = slice(8 * (2 * window + index), 8 * (2 * window + index + 1))
            if run.get("penalty"):  # a gradient penalty's extra pass (weight 0: the same gradient)
                loss = _loss(net, x[rows], y[rows])
                grads = torch.autograd.grad(loss, list(net.parameters()), create_graph=True)
                loss = loss + 0.0 * sum(g.pow(2).sum() for g in grads)
            else:
                loss = _loss(net, x[rows].to(net.weight.dtype), y[rows].to(net.weight.dtype))
            items = run.get("items", lambda w, i: 8)(window, index)
            accumulator.backward(loss, items=items)
        accumulator.step(optimizer)
        stats = accumulator.stats
        found += [stats.grad_sq_norm_estimate, stats.trace_sigma_estimate]
    accumulator.remove_hooks()
    return found


def test_the_estimate_uses_the_l2_norm_whatever_norm_clips() -> None:
    """|G_W| is the L2 norm of the window's gradient even when `norm_type` (for clipping and the logged
    norm) is 1 or inf; otherwise the estimate is silently wrong."""
    reference = _plain_estimates({})
    for norm_type in (1.0, math.inf):
        for overflow in ("skip", "ignore"):  # the host-decided and the device-decided boundary
            found = _plain_estimates({"norm_type": norm_type, "overflow": overflow})
            assert found == pytest.approx(reference, rel=2e-6)  # fp32 norms: 5e-7 apart (1 or inf: 40%)


def test_the_amp_scale_is_divided_out() -> None:
    """Under a GradScaler every incoming gradient carries its scale (here 1024, a device tensor: the
    recording takes the no-sync tensor path); the estimates are those of the unscaled run."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    found = _plain_estimates({"grad_scaler": scaler})
    assert found == pytest.approx(_plain_estimates({}), rel=1e-6)


def test_another_pass_through_the_hooks_is_not_taken_for_the_micro_batch() -> None:
    """`torch.autograd.grad` on the parameters inside the step (a gradient penalty) fires the hooks too."""
    assert _plain_estimates({}, penalty=True) == pytest.approx(_plain_estimates({}), rel=1e-6)


def test_fp16_gradients_are_measured_in_fp32() -> None:
    weight = nn.Parameter(torch.zeros(1000, dtype=torch.float16))
    noise = NoiseScale(0.9, torch.device("cpu"), torch.float64)
    noise.watch([weight])
    noise.begin_backward()
    (weight * 3000.0).sum().backward()  # a norm of ~94,868: inf in fp16
    assert math.isfinite(float(noise._parts[0])) and float(noise._parts[0]) == pytest.approx(
        94868.3, rel=1e-4
    )
    noise.remove_hooks()


@pytest.mark.parametrize(
    ("why", "items"),
    [
        (
            "a micro-batch of 0 items under 'mean' (its gradient is 0, not a mean)",
            lambda w, i: 0 if w == 1 else 8,
        ),
        ("counts known for some micro-batches only", lambda w, i: None if (w, i) == (1, 1) else 8),
    ],
)
def test_a_window_that_cannot_be_measured_gives_no_estimate(why: str, items: Any) -> None:
    found = _plain_estimates({}, items=items)
    assert all(math.isfinite(v) for v in found[:2] + found[4:]), why
    assert all(math.isnan(v) for v in found[2:4]), why


def test_a_restored_window_gives_no_estimate_and_the_next_one_does() -> None:
    """Micro-batches restored from a checkpoint have no recorded norms: with them in the window's gradient
    but not in its counts the estimate would be biased, so the window is not measured."""
    net = _net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    accumulator = GradAccumulator(net.named_parameters(), 3, noise_scale=True)
    x, y = _data().tensors
    batches = [(x[8 * i : 8 * (i + 1)], y[8 * i : 8 * (i + 1)]) for i in range(6)]
    accumulator.backward(_loss(net, *batches[0]), items=8)
    saved = accumulator.window_state_dict()
    accumulator.remove_hooks()
    resumed = GradAccumulator(net.named_parameters(), 3, noise_scale=True)
    resumed.load_window_state_dict(saved)
    for batch in batches[1:3]:  # two new micro-batches: enough for an estimate, were it not restored
        resumed.backward(_loss(net, *batch), items=8)
    resumed.step(optimizer)
    assert math.isnan(resumed.stats.trace_sigma_estimate)
    for batch in batches[3:]:
        resumed.backward(_loss(net, *batch), items=8)
    resumed.step(optimizer)
    assert math.isfinite(resumed.stats.trace_sigma_estimate)
    resumed.remove_hooks()


def test_a_layer_unfrozen_inside_a_window_makes_it_unmeasured() -> None:
    net = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1))
    net[0].requires_grad_(False)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    accumulator = GradAccumulator(net.named_parameters(), 2, noise_scale=True)
    x, y = _data().tensors
    accumulator.backward(_loss(net, x[:8], y[:8]), items=8)
    net[0].requires_grad_(True)  # its first micro-batch had no hook on the layer
    accumulator.backward(_loss(net, x[8:16], y[8:16]), items=8)
    accumulator.step(optimizer)
    assert math.isnan(accumulator.stats.trace_sigma_estimate)
    for rows in (slice(16, 24), slice(24, 32)):
        accumulator.backward(_loss(net, x[rows], y[rows]), items=8)
    accumulator.step(optimizer)
    assert math.isfinite(accumulator.stats.trace_sigma_estimate)  # hooked from the next window on
    accumulator.remove_hooks()


def test_a_dropped_accumulator_takes_its_hooks_along() -> None:
    import gc

    net = _net()
    accumulator = GradAccumulator(net.parameters(), 2, noise_scale=True)
    assert all(p._backward_hooks for p in net.parameters())
    del accumulator
    gc.collect()
    assert not any(p._backward_hooks for p in net.parameters())


@pytest.mark.parametrize(
    ("noise", "items", "expected"),
    [
        (1000.0, 128.0, "well below the gradient noise scale (1,000 items): a larger batch"),
        (50.0, 128.0, "well above the gradient noise scale (50 items): each step uses more items"),
        (100.0, 128.0, "close to the gradient noise scale (100 items)"),
        (-3.0, 128.0, "no usable estimate yet"),
        (12.5, 0.0, "12.5 micro-batches (no item counts were known"),
    ],
)
def test_the_summary_says_which_side_of_the_noise_scale_the_run_is_on(
    noise: float, items: float, expected: str
) -> None:
    from lightning_gradacc.stats import AccumulationStats
    from lightning_gradacc.summary import format_summary, noise_sentence

    stats = AccumulationStats(items_last_step=items, noise_scale=noise)
    assert expected in (noise_sentence(stats) or "")
    assert expected in format_summary(stats, 0.5, None)
    assert noise_sentence(AccumulationStats()) is None  # not measured: nothing said


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
