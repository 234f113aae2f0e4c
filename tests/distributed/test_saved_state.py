"""What a part saves, over two CPU processes (gloo): agreed numbers checked equal, the others reduced."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_gradacc.parts.base import agree_over_ranks

pytestmark = pytest.mark.slow


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        declared = {
            "pieces": {"size": "smallest", "oom_retries": "largest"},
            "plan": "agreed",
            "peak": "local",
        }
        entry = {"pieces": {"size": 8 - 4 * rank, "oom_retries": rank}, "plan": {"steps": 3}, "peak": rank}
        agree_over_ranks(entry, declared, torch.device("cpu"))
        differing = {"plan": {"steps": 3 + rank}}
        try:
            agree_over_ranks(differing, {"plan": "agreed"}, torch.device("cpu"))
            error = ""
        except RuntimeError as raised:
            error = str(raised)
        if rank == 0:
            torch.save({"entry": entry, "error": error}, out)
    finally:
        dist.destroy_process_group()


def test_agreed_fields_are_checked_equal_and_the_others_reduced_over_the_ranks(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = str(tmp_path / "agreed.pt")
    mp.start_processes(_worker, args=(port, out), nprocs=2, start_method="spawn")
    result = torch.load(out, weights_only=True)
    entry = result["entry"]
    assert entry["pieces"] == {"size": 4, "oom_retries": 1}  # smallest, largest over the ranks
    assert entry["plan"] == {"steps": 3} and entry["peak"] == 0  # agreed and equal; local: rank 0's own
    assert "`plan.steps` is saved as agreed over the ranks, but they hold 3.0 to 4.0" in result["error"]
