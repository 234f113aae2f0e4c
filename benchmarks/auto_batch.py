"""Time and examples to a target validation loss: ``accumulation_steps="auto"`` against fixed K.

``python -m benchmarks --only auto-batch`` (a section of the report) also writes ``docs/auto-batch.svg``:
the validation loss of every run, and K with the measured noise scale of the "auto" runs, over the
examples trained on.

The task: an MLP classifier on overlapping Gaussian blobs (the demo's data, generated from a seed; 8 classes,
32 features), micro-batches of 16 samples, Adam at one learning rate for every run (no per-K tuning: what a
user who only changes K gets). Each run trains until the validation loss (a fixed held-out set, evaluated
every 512 training samples, outside the timed span) reaches the target, or the example cap. Time is the
wall time of training alone on this machine.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradacc import AutoSettings, GradientAccumulationCallback
from lightning_gradacc.demo.classifier import make_blobs

from .workloads import quiet

MICRO_BATCH = 32
EVAL_EVERY = 2048  # training samples between evaluations
PLOT = Path(__file__).resolve().parents[1] / "docs" / "auto-batch.svg"


@dataclass
class Task:
    """The data, the model's size, the target and the example cap."""

    train: int = 48_000
    val: int = 8_192
    features: int = 32
    classes: int = 8
    hidden: int = 128
    lr: float = 2e-3
    target: float = 0.207  # validation cross-entropy: K=1 at this learning rate levels off near it
    cap: int = 240_000  # training samples at most (5 epochs)
    seeds: tuple[int, ...] = (0, 1, 2)  # of the initialization and the shuffling


QUICK = Task(train=2_048, val=512, hidden=32, target=2.0, cap=4_096, seeds=(0,))

RUNS: dict[str, dict[str, Any]] = {
    "K=1": {"accumulation_steps": 1},
    "K=4": {"accumulation_steps": 4},
    "K=16": {"accumulation_steps": 16},
    "auto (budget)": {"accumulation_steps": "auto"},
    "auto (goodput)": {"accumulation_steps": "auto", "auto": AutoSettings(rule="goodput")},
}


class Classifier(pl.LightningModule):
    def __init__(self, task: Task, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(
            nn.Linear(task.features, task.hidden), nn.ReLU(), nn.Linear(task.hidden, task.classes)
        )
        self.lr = task.lr

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


@dataclass
class Trace:
    """What one run measured: per evaluation (examples, loss), per step (examples, K, noise scale)."""

    losses: list[tuple[int, float]] = field(default_factory=list)
    ks: list[tuple[int, int, float]] = field(default_factory=list)
    reached: tuple[int, int, float] | None = None  # examples, steps, seconds at the target
    total: tuple[int, int, float] = (0, 0, 0.0)  # the same at the end of the run


class ToTarget(pl.Callback):
    """Evaluates every ``EVAL_EVERY`` samples (untimed) and stops the fit at the target loss."""

    def __init__(self, task: Task, val: TensorDataset, callback: GradientAccumulationCallback) -> None:
        self.task, self.val, self.callback = task, val, callback
        self.trace = Trace()
        self.examples = 0
        self.untimed = 0.0
        self.started = 0.0
        self.steps = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        before = self.examples
        self.examples += MICRO_BATCH
        begin = time.perf_counter()
        if trainer.global_step != self.steps:  # a window closed: its K, and the estimate after it
            self.steps = trainer.global_step
            stats = self.callback.stats
            noise = stats.noise_scale if self.callback.settings.noise_scale else math.nan
            self.trace.ks.append((self.examples, stats.accumulation_steps, noise))
        if before // EVAL_EVERY != self.examples // EVAL_EVERY or self.examples >= self.task.cap:
            x, y = self.val.tensors
            with torch.no_grad():
                loss = float(nn.functional.cross_entropy(pl_module.net(x), y))  # type: ignore[operator]
            self.trace.losses.append((self.examples, loss))
            if loss <= self.task.target and self.trace.reached is None:
                seconds = time.perf_counter() - self.started - self.untimed - (time.perf_counter() - begin)
                self.trace.reached = (self.examples, trainer.global_step, seconds)
                trainer.should_stop = True
            if self.examples >= self.task.cap:
                trainer.should_stop = True
        self.untimed += time.perf_counter() - begin
        seconds = time.perf_counter() - self.started - self.untimed
        self.trace.total = (self.examples, trainer.global_step, seconds)


def run(task: Task, name: str, seed: int = 0) -> Trace:
    """One fit of the task with the run's callback arguments (``seed``: initialization and shuffling)."""
    x, y = make_blobs(task.train + task.val, task.features, task.classes, seed=0).tensors
    train = TensorDataset(x[task.val :], y[task.val :])
    val = TensorDataset(x[: task.val], y[: task.val])
    callback = GradientAccumulationCallback(**RUNS[name], log_stats=False)
    probe = ToTarget(task, val, callback)
    quiet()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=-(-task.cap // task.train),
        callbacks=[callback, probe],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    loader = DataLoader(
        train, batch_size=MICRO_BATCH, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )
    trainer.fit(Classifier(task, seed), loader)
    return probe.trace


def auto_batch(quick: bool, plot: Path = PLOT) -> list[str]:
    """The report's section: the median over seeds of each run's cost to the target, and the plot."""
    task = QUICK if quick else Task()
    run(task, "K=1")  # warm-up: the first fit of a process pays for imports and allocations
    traces = {name: [run(task, name, seed) for seed in task.seeds] for name in RUNS}
    lines = [
        f"Target: validation loss {task.target} (cross-entropy, {task.classes} overlapping Gaussian blobs,"
        f" {task.features} features; {task.train:,} training samples, micro-batches of {MICRO_BATCH}, Adam"
        f" lr={task.lr} for every run). Cap: {task.cap:,} samples. Median over {len(task.seeds)} seed(s)"
        " of the initialization and the shuffling (a run that never reaches the target counts as the"
        f" cap); K at the end: seed 0's. Plot (seed 0): `{plot.name}`.\n",
        "| run | samples to target | optimizer steps | time to target | time vs K=1 | reached"
        " | K at the end |",
        "|---|---|---|---|---|---|---|",
    ]
    medians = {name: _median_cost(task, runs) for name, runs in traces.items()}
    base = medians["K=1"][2]
    for name, (examples, steps, seconds, reached) in medians.items():
        first = traces[name][0]
        last_k = first.ks[-1][1] if first.ks else RUNS[name].get("accumulation_steps")
        lines.append(
            f"| {name} | {examples:,.0f} | {steps:,.0f} | {seconds:.1f} s | {seconds / base:.2f}x"
            f" | {reached}/{len(task.seeds)} | {last_k} |"
        )
    plot.write_text(svg({name: runs[0] for name, runs in traces.items()}, task))
    return lines


def _median_cost(task: Task, runs: list[Trace]) -> tuple[float, float, float, int]:
    """Median samples, steps and seconds to the target (a run that missed it: the whole run's)."""
    costs = [trace.reached or trace.total for trace in runs]
    middle = [statistics.median(values) for values in zip(*costs, strict=True)]
    return middle[0], middle[1], middle[2], sum(trace.reached is not None for trace in runs)


# ------------------------------------------------------------------------------------------- the plot

COLORS = {"K=1": "#888888", "K=4": "#1f77b4", "K=16": "#2ca02c", "auto (budget)": "#d62728"}
COLORS["auto (goodput)"] = "#9467bd"


def _polyline(points: list[tuple[float, float]], color: str, dashed: bool = False) -> str:
    coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    dash = ' stroke-dasharray="5,3"' if dashed else ""
    return f'<polyline fill="none" stroke="{color}" stroke-width="1.5"{dash} points="{coords}"/>'


def svg(traces: dict[str, Trace], task: Task) -> str:
    """Two panels over the samples trained on: every run's validation loss; "auto"'s K and noise scale."""
    width, height, left, right, panel = 760, 520, 60, 60, 200
    tops = (30, 290)
    most = max(max((e for e, _ in t.losses), default=1) for t in traces.values())
    losses = [loss for t in traces.values() for _, loss in t.losses]
    # the region around the target matters: the first evaluations' losses are cut off at the top
    low, high = min([*losses, task.target]), min(max(losses), 1.5 * task.target)

    def x_of(examples: float) -> float:
        return left + (width - left - right) * examples / most

    def y_of(value: float, top: int, lo: float, hi: float, log: bool = False) -> float:
        if log:
            value, lo, hi = math.log2(max(value, 1e-9)), math.log2(lo), math.log2(hi)
        return top + panel - panel * (value - lo) / ((hi - lo) or 1.0)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif"'
        ' font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    for top, title in zip(tops, ("validation loss", "auto: K (steps) and noise scale (dashed)"), strict=True):
        parts.append(
            f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{panel}"'
            ' fill="none" stroke="#cccccc"/>'
        )
        parts.append(f'<text x="{left}" y="{top - 6}">{title}</text>')
    target_y = y_of(task.target, tops[0], low, high)
    parts.append(
        f'<line x1="{left}" x2="{width - right}" y1="{target_y:.1f}" y2="{target_y:.1f}"'
        ' stroke="#000000" stroke-dasharray="2,2"/>'
    )
    parts.append(f'<text x="{width - right + 4}" y="{target_y + 4:.1f}">target</text>')
    for value in (low, high):
        parts.append(f'<text x="4" y="{y_of(value, tops[0], low, high) + 4:.1f}">{value:.2f}</text>')
    for row, (name, trace) in enumerate(traces.items()):
        points = [(x_of(e), y_of(min(loss, high), tops[0], low, high)) for e, loss in trace.losses]
        parts.append(_polyline(points, COLORS[name]))
        parts.append(
            f'<text x="{width - right - 120}" y="{tops[0] + 14 + 13 * row}"'
            f' fill="{COLORS[name]}">{name}</text>'
        )
    autos = {name: t for name, t in traces.items() if name.startswith("auto")}
    ks = [k for t in autos.values() for _, k, _ in t.ks] or [1]
    noises = [n for t in autos.values() for _, _, n in t.ks if math.isfinite(n) and n > 0] or [1.0]
    k_hi, n_lo, n_hi = max(max(ks), 2), min(noises), max(max(noises), min(noises) * 2)
    for name, trace in autos.items():
        steps: list[tuple[float, float]] = []
        for e, k, _ in trace.ks:
            y = y_of(k, tops[1], 1, k_hi, log=True)
            if steps:
                steps.append((x_of(e), steps[-1][1]))
            steps.append((x_of(e), y))
        parts.append(_polyline(steps, COLORS[name]))
        noise = [(x_of(e), y_of(n, tops[1], n_lo, n_hi, log=True)) for e, _, n in trace.ks if n > 0]
        parts.append(_polyline(noise, COLORS[name], dashed=True))
    for k in (1, k_hi):
        parts.append(f'<text x="{left - 30}" y="{y_of(k, tops[1], 1, k_hi, log=True) + 4:.1f}">K={k}</text>')
    for value in (n_lo, n_hi):
        y = y_of(value, tops[1], n_lo, n_hi, log=True)
        parts.append(f'<text x="{width - right + 4}" y="{y + 4:.1f}">{value:.0f}</text>')
    for frac in (0.0, 0.5, 1.0):
        x = x_of(most * frac)
        parts.append(f'<text x="{x - 10:.1f}" y="{tops[1] + panel + 16}">{most * frac / 1000:.0f}k</text>')
    parts.append(f'<text x="{width / 2 - 60}" y="{height - 6}">training samples</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
