"""``python benchmarks/sharded.py OUT STRATEGY MODE``: a fit with the callback, sharded, on 2 CPU processes.

``STRATEGY``: ``model_parallel`` (``ModelParallelStrategy``, FSDP2 ``fully_shard`` over both ranks),
``hsdp`` (the same on an HSDP mesh of 2 replicas of 1 shard) or ``fsdp`` (``FSDPStrategy``, FSDP1; on CPU
Lightning refuses the class by its exact type and FSDP1 needs ``device_id=cpu``, so a subclass is used and
the module wraps its layers itself). ``MODE``: a ``sharded_reduction``.

Measures, per rank: calls and bytes of gradient reduce-scatters and all-reduces per optimizer step, the
largest gradient memory FSDP holds after a backward (read from FSDP's state: sharded ``.grad``, unsharded
gradients kept inside a window, partial reductions), the process's peak resident memory, and seconds per
optimizer step. Run by ``python -m benchmarks``.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.strategies import FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradacc import GradientAccumulationCallback

K = 4
WIDTH = 1024  # 4 layers of 1024 x 1024: 4.2M parameters, 16.8 MB of fp32 gradients
STEPS = 6


class Wide(pl.LightningModule):
    def __init__(self, strategy: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.strategy = strategy
        self.net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

        if self.strategy == "fsdp":
            wrap: Any = functools.partial(
                FullyShardedDataParallel, device_id=torch.device("cpu"), use_orig_params=True
            )
            for index, layer in enumerate(self.net):
                self.net[index] = wrap(layer)
            self.net = wrap(self.net)
            return
        mesh = self.device_mesh["data_parallel"]
        if self.strategy == "hsdp":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        for layer in self.net:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-6)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(2 * K * STEPS * 8, WIDTH)), batch_size=8)


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy``; only the type differs, which the CPU refusal checks exactly."""


def _bytes(tensor: Any) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return int(local.numel() * local.element_size())


def held_gradient_bytes(model: nn.Module) -> int:
    """The gradient memory FSDP holds now (private state, read for measuring only)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    held = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group: Any = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
            if group is None:
                continue
            held += _bytes(getattr(group, "_partial_reduce_output", None))
            for fsdp_param in group.fsdp_params:
                held += _bytes(fsdp_param.sharded_param.grad)
                held += _bytes(getattr(fsdp_param, "unsharded_accumulated_grad", None))
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                held += _bytes(unsharded.grad if unsharded is not None else None)
        elif isinstance(module, FullyShardedDataParallel) and module._handle is not None:
            flat: Any = module._handle.flat_param
            held += _bytes(flat.grad) + _bytes(getattr(flat, "_saved_grad_shard", None))
    return held


class Probe(pl.Callback):
    """Seconds per step (after a warm-up step) and the largest gradient memory held after a backward."""

    def __init__(self) -> None:
        self.peak_held = 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 1 and not hasattr(self, "start"):
            self.start = time.perf_counter()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert trainer.model is not None
        self.peak_held = max(self.peak_held, held_gradient_bytes(trainer.model))

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.seconds_per_step = (time.perf_counter() - self.start) / (trainer.global_step - 1)


def count(name: str, tally: list[int]) -> None:
    """Count the calls of ``dist.NAME`` and the bytes of its input (the tensor reduced)."""
    original = getattr(dist, name, None)
    if original is None:
        return

    def counting(*args: Any, **kwargs: Any) -> Any:
        if name.startswith("reduce_scatter"):
            tensor = args[1] if len(args) > 1 else kwargs["input"]
        else:
            tensor = args[0] if args else kwargs["tensor"]
        tally[0] += tensor.numel() * tensor.element_size()
        tally[1] += 1
        return original(*args, **kwargs)

    setattr(dist, name, counting)


def peak_resident_bytes() -> int:
    """This process's peak resident memory since it started its program.

    ``ru_maxrss`` survives ``exec`` on Linux: a rank started from a large parent (the benchmark run) would
    report the parent's peak. ``VmHWM`` belongs to the process's own address space, which ``exec`` replaces.
    """
    try:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(out: Path, strategy_name: str, mode: str) -> None:
    scattered, reduced = [0, 0], [0, 0]  # bytes, calls
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):  # FSDP2, FSDP1
        count(name, scattered)
    count("all_reduce", reduced)
    probe = Probe()
    strategy: Any = (
        CPUFSDPStrategy()
        if strategy_name == "fsdp"
        else ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    )
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[GradientAccumulationCallback(K, sharded_reduction=mode), probe],  # type: ignore[arg-type]
    )
    trainer.fit(Wide(strategy_name))
    steps = trainer.global_step
    result = {
        "reduce_scatters_per_step": scattered[1] / steps,
        "scattered_bytes_per_step": scattered[0] / steps,
        "all_reduces_per_step": reduced[1] / steps,
        "all_reduced_bytes_per_step": reduced[0] / steps,
        "peak_held_gradient_bytes": probe.peak_held,
        "peak_rss": peak_resident_bytes(),
        "seconds_per_step": probe.seconds_per_step,
    }
    (out / f"{strategy_name}-{mode}-{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
    # Every rank meets, the process group goes, and the process ends without the interpreter's teardown:
    # a gloo worker thread may still need the GIL there, which aborts the process (see tests/helpers.py,
    # `exit_together`).
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
