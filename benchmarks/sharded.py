"""``python benchmarks/sharded.py OUT MODE``: a fit under ``ModelParallelStrategy`` (FSDP2), 2 CPU processes.

Measures, per rank, what the two ``sharded_reduction`` modes cost: bytes reduce-scattered per optimizer
step, the process's peak resident memory, and seconds per optimizer step. Run by ``python -m benchmarks``.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradacc import GradientAccumulationCallback

K = 4
WIDTH = 1024  # 4 layers of 1024 x 1024: 4.2M parameters, 16.8 MB of fp32 gradients
STEPS = 6


class Wide(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-6)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(2 * K * STEPS * 8, WIDTH)), batch_size=8)


class Timer(pl.Callback):
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 1 and not hasattr(self, "start"):  # the first step is warm-up
            self.start = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.seconds_per_step = (time.perf_counter() - self.start) / (trainer.global_step - 1)


def main(out: Path, mode: str) -> None:
    sent = [0, 0]  # bytes, calls
    original = dist.reduce_scatter_single if hasattr(dist, "reduce_scatter_single") else None

    def counting(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent[0] += input.numel() * input.element_size()
        sent[1] += 1
        assert original is not None
        return original(output, input, *args, **kwargs)

    if original is not None:
        dist.reduce_scatter_single = counting  # type: ignore[assignment]
    timer = Timer()
    trainer = pl.Trainer(
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[GradientAccumulationCallback(K, sharded_reduction=mode), timer],
    )
    trainer.fit(Wide())
    result = {
        "bytes_per_step": sent[0] / trainer.global_step,
        "reduce_scatters_per_step": sent[1] / trainer.global_step,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "seconds_per_step": timer.seconds_per_step,
    }
    (out / f"{mode}-{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
