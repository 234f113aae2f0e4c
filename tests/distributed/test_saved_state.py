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


def _flags_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    errors = []
    try:
        for differing in (
            {"loss": [1.0, float("nan")][rank]},
            {"pending": [None, 3][rank]},
            {"a": 1, "b": 2},
        ):
            if rank == 1 and "a" in differing:
                differing = {"a": 1}  # a field the other rank lacks
            try:
                agree_over_ranks(differing, {"*": "agreed"}, torch.device("cpu"))
                errors.append("")
            except RuntimeError as raised:
                errors.append(str(raised))
        if rank == 0:
            torch.save(errors, out)
    finally:
        dist.destroy_process_group()


def test_a_nan_a_none_or_a_missing_field_on_one_rank_is_named_not_hidden(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = str(tmp_path / "flags.pt")
    mp.start_processes(_flags_worker, args=(port, out), nprocs=2, start_method="spawn")
    nan, none, missing = torch.load(out, weights_only=True)
    assert "`loss` is saved as agreed" in nan and "None, nan or a number" in nan
    assert "`pending` is saved as agreed" in none
    assert "The ranks save different fields (1 to 2 numbers" in missing


def test_goodput_timings_are_each_rank_s_own_and_a_checkpoint_at_every_step_saves(tmp_path: Path) -> None:
    """``"auto"``'s goodput rule times each rank's micro-batches: those are local, the rest agreed."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    from lightning_gradacc import AutoSettings, GradientAccumulationCallback
    from tests import helpers as h

    callback = GradientAccumulationCallback("auto", auto=AutoSettings(rule="goodput"))
    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    trainer = h.ddp_trainer(callback, saves, logger=False, max_steps=3, enable_checkpointing=True)
    trainer.fit(h.RegressionModule(h.regression_data(80)))
    assert len(list(tmp_path.glob("*.ckpt"))) == 3
