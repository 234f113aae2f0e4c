"""Gradient accumulation with Lightning Fabric: the core's ``GradAccumulator`` in a Fabric loop.

    python examples/fabric_accumulation.py                       # one process
    python examples/fabric_accumulation.py --devices 2           # 2 CPU processes (DDP, gloo)
    python examples/fabric_accumulation.py --precision 16-mixed  # a GradScaler through Fabric's precision

Per micro-batch: the accumulator weighs the loss (``begin_micro_batch``), ``fabric.backward`` runs the
backward (and scales the loss under ``16-mixed``), and the accumulator records it (``end_micro_batch``); every
backward but the window's last runs under ``fabric.no_backward_sync``, so DDP all-reduces once per window. At
the window's end ``end_window`` normalizes by the micro-batches (or items) the window really had, checks for
non-finite gradients and clips, after Fabric's GradScaler unscaled; then the optimizer steps through Fabric
(the GradScaler skips a non-finite step). A fused optimizer (``fused=True``) takes the decision on the device,
with no host read. ``fabric.save`` inside a window keeps the window (``window_state_dict``, summed over the
ranks), and ``fabric.load`` resumes it exactly.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from lightning_gradacc import GradAccumulator


def data(samples: int = 96) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 5, generator=generator)
    noise = 0.1 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(x, x @ torch.randn(5, 1, generator=generator) + noise)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))


def train(
    fabric: L.Fabric,
    *,
    k: int = 4,
    epochs: int = 2,
    batch_size: int = 4,
    fused: bool = False,
    save_at: int | None = None,
    checkpoint: Path | None = None,
    resume: Path | None = None,
    comm_hook: Any = None,
) -> tuple[nn.Module, GradAccumulator]:
    """Train ``net()`` on ``data()`` with windows of ``k`` micro-batches (the epoch's last may be shorter).

    ``save_at``: save a checkpoint to ``checkpoint`` after that global micro-batch (and stop); ``resume``:
    continue from one; ``comm_hook``: a DDP communication hook for the model (the tests count all-reduces).
    Under DDP rank r reads rows r, r + W, ... in order (one big batch per window).
    """
    dataset = data()
    sampler = DistributedSampler(dataset, fabric.world_size, fabric.global_rank, shuffle=False)
    loader = fabric.setup_dataloaders(
        DataLoader(dataset, batch_size=batch_size, sampler=sampler), use_distributed_sampler=False
    )
    model = net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused)
    model, optimizer = fabric.setup(model, optimizer)
    if comm_hook is not None:
        model._forward_module.register_comm_hook(None, comm_hook)  # Fabric's DistributedDataParallel
    scaler = getattr(fabric.strategy.precision, "scaler", None)  # Fabric's GradScaler under "16-mixed"
    accumulator = GradAccumulator(model.named_parameters(), k, max_grad_norm=1.0, grad_scaler=scaler)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "seen": 0}
    if resume is not None:
        remainder = fabric.load(resume, state)
        accumulator.load_state_dict(remainder["accumulator"])
        if remainder["window"] is not None:  # the open window: rank 0 takes the sum, the others start at 0
            accumulator.load_window_state_dict(remainder["window"], primary=fabric.global_rank == 0)
    seen = 0
    for _ in range(epochs):
        batches = len(loader)
        for index, (x, y) in enumerate(loader):
            seen += 1
            if seen <= state["seen"]:  # consumed before the checkpoint
                continue
            last = accumulator.window.micro_batches + 1 == k or index == batches - 1
            with fabric.no_backward_sync(model, enabled=not last):  # DDP reduces at the window's end only
                loss = nn.functional.mse_loss(model(x), y)
                fabric.backward(accumulator.begin_micro_batch(loss, len(x), last=last, amp_scaled=False))
                accumulator.end_micro_batch()
            if last:
                # Fabric's GradScaler unscales here; normalize, check, clip; a fused step is armed
                stepped = accumulator.end_window(optimizer.optimizer)
                if stepped or scaler is not None:  # the GradScaler decides and updates its scale itself
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if seen == save_at and checkpoint is not None:
                window = accumulator.window_state_dict()  # a collective under DDP: every rank calls it
                fabric.save(
                    checkpoint,
                    {**state, "seen": seen, "accumulator": accumulator.state_dict(), "window": window},
                )
                return model, accumulator
    return model, accumulator


def fabric_for(devices: int = 1, precision: str = "32-true") -> L.Fabric:
    """A CPU Fabric; ``"16-mixed"`` with a GradScaler (Fabric itself falls back to bf16 on a CPU)."""
    plugins: Any = None
    if precision == "16-mixed":
        plugins = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**8))
        precision = None  # type: ignore[assignment]  # the plugin says it
    strategy = "ddp_spawn" if devices > 1 else "auto"
    return L.Fabric(
        accelerator="cpu", devices=devices, strategy=strategy, precision=precision, plugins=plugins
    )  # type: ignore[arg-type]


def run(fabric: L.Fabric) -> None:
    _, accumulator = train(fabric)
    stats = accumulator.stats
    fabric.print(
        f"windows {stats.windows}, steps {stats.steps_taken}, last grad norm {stats.last_grad_norm:.4f}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--precision", default="32-true", choices=("32-true", "16-mixed", "bf16-mixed"))
    args = parser.parse_args(argv)
    fabric_for(args.devices, args.precision).launch(run)


if __name__ == "__main__":
    main()
