"""Models, data and the eight ways of training them that the benchmarks compare."""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradacc import GradAccumulator, GradientAccumulationCallback

MODES = ("builtin", "callback", "schedule", "weighted", "buffers", "noise", "noise4", "plain", "plain+core")
MODE_TITLES = {
    "builtin": "Lightning `accumulate_grad_batches`",
    "callback": "callback (default)",
    "schedule": 'callback `{0: K}` by `schedule_unit="steps"` (driven per batch)',
    "weighted": 'callback `scaling="weighted"`',
    "buffers": 'callback `accumulation_dtype="float32"`',
    "buffers_after": 'callback `accumulation_dtype="float32"`, buffers filled after the backward',
    "noise": "callback `noise_scale=True`",
    "noise4": "callback `noise_scale=True, noise_scale_every=4`",
    "plain": "plain PyTorch loop",
    "plain+core": "plain loop + `GradAccumulator`",
}


@dataclass(frozen=True)
class Size:
    """A model and micro-batch size."""

    name: str
    widths: tuple[int, ...]
    batch: int

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(self.widths[:-1], self.widths[1:], strict=True)):
            layers.append(nn.Linear(a, b))
            if i < len(self.widths) - 2:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)

    def data(self, micro_batches: int) -> TensorDataset:
        generator = torch.Generator().manual_seed(0)
        n = micro_batches * self.batch
        return TensorDataset(
            torch.randn(n, self.widths[0], generator=generator),
            torch.randn(n, self.widths[-1], generator=generator),
        )


SIZES = {
    "small": Size("small (0.1M parameters)", (64, 256, 256, 10), 32),
    "big": Size("big (25M parameters)", (1024, 4096, 4096, 1024), 8),
}
QUICK_SIZES = {"small": Size("tiny", (8, 16, 4), 4)}
# trained with precision="bf16-true" by the gradient-memory benchmark (SGD without momentum: no state)
BF16_SIZES = {"bf16": Size("bf16 (33.6M parameters)", (2048, 4096, 4096, 2048), 8)}
QUICK_BF16_SIZES = {"bf16": Size("tiny bf16", (8, 16, 4), 4)}


OPTIMIZERS = {
    "SGD": lambda params: torch.optim.SGD(params, lr=1e-4, momentum=0.9),
    "SGD without momentum": lambda params: torch.optim.SGD(params, lr=1e-4),  # no state (memory runs)
    "Adam": lambda params: torch.optim.Adam(params, lr=1e-4),
    "SGD (fused)": lambda params: torch.optim.SGD(params, lr=1e-4, momentum=0.9, fused=True),
    "Adam (fused)": lambda params: torch.optim.Adam(params, lr=1e-4, fused=True),
    "AdamW (fused)": lambda params: torch.optim.AdamW(params, lr=1e-4, fused=True),
}


class BenchModule(pl.LightningModule):
    def __init__(self, size: Size, data: TensorDataset, optimizer: str = "SGD") -> None:
        super().__init__()
        self.net = size.model()
        self.data, self.batch = data, size.batch
        self.optimizer = optimizer

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return OPTIMIZERS[self.optimizer](self.parameters())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class MicroBatchTimer(pl.Callback):
    """Wall time per micro-batch after ``skip`` warm-up micro-batches (whole windows)."""

    def __init__(self, skip: int, device: str) -> None:
        self.skip, self.device = skip, device
        self.start = self.end = 0.0
        self.count = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.skip:
            synchronize(self.device)
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        self.count += 1
        self.end = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        synchronize(self.device)
        self.end = time.perf_counter()

    @property
    def per_micro_batch(self) -> float:
        return (self.end - self.start) / (self.count - self.skip)


def accumulation_callbacks(mode: str, k: int) -> list[pl.Callback]:
    if mode == "builtin":
        return []
    kwargs: dict[str, Any] = {
        "weighted": {"scaling": "weighted"},
        "buffers": {"accumulation_dtype": "float32"},
        "buffers_after": {"accumulation_dtype": "float32"},
        "noise": {"noise_scale": True},
        "noise4": {"noise_scale": True, "noise_scale_every": 4},
    }.get(mode, {})
    if mode == "schedule":  # the same windows as K, through the per-batch driving of a step-keyed schedule
        return [GradientAccumulationCallback({0: k}, schedule_unit="steps")]
    callback = GradientAccumulationCallback(k, **kwargs)
    if mode == "buffers_after":  # the path kept where hooks cannot take gradients inside the backward
        callback._accumulate_in_backward = False
    return [callback]


def quiet() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning_fabric").setLevel(logging.ERROR)


def lightning_run(
    mode: str,
    size: Size,
    k: int,
    windows: int,
    device: str,
    extra: list[pl.Callback] | None = None,
    precision: str = "32-true",
) -> tuple[float, BenchModule]:
    """Seconds per micro-batch of ``Trainer.fit`` over ``windows + 1`` windows (the first is warm-up).

    ``precision="bf16-true"`` trains bf16 parameters with plain SGD (no optimizer state).
    """
    quiet()
    micro_batches = k * (windows + 1)
    bf16 = precision == "bf16-true"
    module = BenchModule(size, size.data(micro_batches), "SGD without momentum" if bf16 else "SGD")
    timer = MicroBatchTimer(skip=k, device=device)
    trainer = pl.Trainer(
        accelerator=device,
        devices=1,
        max_epochs=1,
        accumulate_grad_batches=k if mode == "builtin" else 1,
        callbacks=[*(extra or []), *accumulation_callbacks(mode, k), timer],  # probes see hooks first
        precision=precision,  # type: ignore[arg-type]
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module)
    return timer.per_micro_batch, module


def plain_run(mode: str, size: Size, k: int, windows: int, device: str) -> float:
    """Seconds per micro-batch of a plain PyTorch loop, with or without ``GradAccumulator``."""
    model = size.model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    x_all, y_all = (t.to(device) for t in size.data(k * (windows + 1)).tensors)
    accumulator = GradAccumulator(model.parameters(), k) if mode == "plain+core" else None
    start = 0.0
    for index in range(k * (windows + 1)):
        if index == k:
            synchronize(device)
            start = time.perf_counter()
        rows = slice(index * size.batch, (index + 1) * size.batch)
        loss = nn.functional.mse_loss(model(x_all[rows]), y_all[rows])
        if accumulator is not None:
            accumulator.backward(loss, items=size.batch)
            accumulator.step(optimizer)
        else:
            (loss / k).backward()
            if (index + 1) % k == 0:
                optimizer.step()
                optimizer.zero_grad()
    synchronize(device)
    return (time.perf_counter() - start) / (k * windows)


def seconds_per_micro_batch(mode: str, size: Size, k: int, windows: int, device: str) -> float:
    if mode.startswith("plain"):
        return plain_run(mode, size, k, windows, device)
    return lightning_run(mode, size, k, windows, device)[0]
