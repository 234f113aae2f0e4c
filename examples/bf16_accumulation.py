"""How precise is the accumulated gradient with bf16 parameters, with and without fp32 buffers?

Run: ``python examples/bf16_accumulation.py``. For each K, one optimizer step of a ``Trainer`` with
``precision="bf16-true"`` over K micro-batches of a linear model; the gradient the optimizer receives is
compared with the gradient of one big batch computed in float64 from the same bf16 weights and inputs.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradacc import GradientAccumulationCallback


class LinearRegression(pl.LightningModule):
    def __init__(self, data: TensorDataset, batch_size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(data.tensors[0].shape[1], data.tensors[1].shape[1])
        self.data, self.batch_size = data, batch_size

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


class GradientProbe(pl.Callback):
    """Keeps the final gradient the optimizer receives (it runs after the accumulation callback)."""

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        self.gradient = torch.cat([p.grad.detach().double().flatten() for p in pl_module.parameters()])


def relative_error(k: int, accumulation_dtype: str | None, micro_batch: int = 2) -> float:
    """Relative L2 error of the accumulated gradient against a float64 big-batch gradient."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(k * micro_batch, 64, generator=generator)
    y = torch.randn(k * micro_batch, 8, generator=generator)
    module = LinearRegression(TensorDataset(x, y), micro_batch)
    probe = GradientProbe()
    callback = GradientAccumulationCallback(k, accumulation_dtype=accumulation_dtype)
    trainer = pl.Trainer(
        accelerator="cpu",
        precision="bf16-true",
        max_steps=1,
        callbacks=[callback, probe],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module)
    reference = nn.Linear(64, 8).double()
    with torch.no_grad():
        reference.weight.copy_(module.net.weight.double())
        reference.bias.copy_(module.net.bias.double())
    nn.functional.mse_loss(reference(x.bfloat16().double()), y.bfloat16().double()).backward()
    expected = torch.cat([reference.weight.grad.flatten(), reference.bias.grad.flatten()])
    return float((probe.gradient - expected).norm() / expected.norm())


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    print('| K | bf16 `.grad` (built-in behaviour) | `accumulation_dtype="float32"` |')
    print("|---|---|---|")
    for k in (16, 64, 256, 1024):
        print(f"| {k} | {relative_error(k, None):.2%} | {relative_error(k, 'float32'):.2%} |")
    print("\nrelative L2 error of the accumulated gradient against a float64 big-batch gradient")


if __name__ == "__main__":
    main()
