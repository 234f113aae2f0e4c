"""The core in a plain PyTorch DDP loop (two CPU processes, gloo): buffers, ``no_sync()`` and two calls.

The loop runs every backward but the window's last under ``no_sync()``; ``backward(..., last=True)`` puts
the buffered window into ``.grad`` first, so that DDP's one all-reduce carries all of it. Oracle: one SGD
step per window on both ranks' micro-batches as one batch, in plain PyTorch.
"""

from __future__ import annotations

import contextlib
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradacc import GradAccumulator
from tests.helpers import exit_together

pytestmark = pytest.mark.slow
WORLD, K, MICRO_BATCHES = 2, 3, 7  # windows of 3, 3 and a last one of 1


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)).double()


def _batch(rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * rank + index)
    return torch.randn(5, 4, generator=generator).double(), torch.randn(5, 1, generator=generator).double()


def _worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    model = DistributedDataParallel(_net())
    accumulator = GradAccumulator(model.module.named_parameters(), K, accumulation_dtype="float64")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    for index in range(MICRO_BATCHES):
        ends_window = (index + 1) % K == 0 or index == MICRO_BATCHES - 1
        x, y = _batch(rank, index)
        with contextlib.nullcontext() if ends_window else model.no_sync():
            accumulator.backward(nn.functional.mse_loss(model(x), y), items=len(x), last=ends_window)
        accumulator.step(optimizer, force=ends_window)
    if rank == 0:
        torch.save({n: p.detach() for n, p in model.module.named_parameters()}, out)
    exit_together()


def _reference() -> dict[str, torch.Tensor]:
    net = _net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.2)
    for start in range(0, MICRO_BATCHES, K):
        indices = range(start, min(start + K, MICRO_BATCHES))
        batches = [_batch(rank, index) for rank in range(WORLD) for index in indices]
        x = torch.cat([x for x, _ in batches])
        y = torch.cat([y for _, y in batches])
        nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach() for n, p in net.named_parameters()}


def test_a_plain_ddp_loop_with_buffers_equals_the_big_batch(tmp_path: pytest.TempPathFactory) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = str(tmp_path / "params.pt")  # type: ignore[operator]
    mp.spawn(_worker, args=(port, out), nprocs=WORLD)
    trained = torch.load(out, weights_only=True)
    for name, expected in _reference().items():
        torch.testing.assert_close(trained[name], expected, rtol=0, atol=1e-12)
