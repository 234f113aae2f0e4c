"""``piece_size`` on two CPU processes (ddp_spawn, gloo): pieces and out-of-memory errors on one rank only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h
from tests.callback.test_pieces import Cap, OomModule
from tests.helpers import ddp_trainer

pytestmark = pytest.mark.slow
WORLD = 2


def test_only_rank_1_runs_out_of_memory_and_both_ranks_step_the_big_batch() -> None:
    """Rank 1 halves at batch 2 (a forward that opens a window: DDP broadcast the module's buffer in it) and
    at batch 4 (a backward that does not sync); rank 0 never runs out, and takes the agreed size at the
    next batch (one all-reduce per batch)."""
    data = h.regression_data(96)  # 6 batches of 8 per rank; K=2: windows 2, 2, 2
    module = OomModule(
        data,
        batch_size=8,
        ranks=[1],
        forward_cap=Cap(since={2: 5}),
        backward_cap=Cap(at={4: 2}),  # batch 4 opens its window: it runs again
    )
    trainer = ddp_trainer(GradientAccumulationCallback(2, piece_size="auto", max_grad_norm=0.5), logger=False)
    trainer.fit(module)
    # ordered_loader shards in dataset order: micro-batch i of both ranks together is rows [16i, 16i+16)
    expected = h.big_batch_reference(
        h.regression_net(), data, 8 * WORLD, h.windows(6, 2), h.mse, max_grad_norm=0.5
    )
    assert h.max_abs_diff(module.net, expected) < 1e-6
    metrics = trainer.callback_metrics  # rank 0's: it agreed on rank 1's size without running out
    assert float(metrics["grad_accum/piece_size"]) == 2
    assert float(metrics["grad_accum/oom_retries"]) == 2  # rank 1's two recoveries, counted over the ranks


class SaveThenStop(pl.Callback):
    """Saves a checkpoint after global micro-batch ``at`` on every rank (a collective), then stops."""

    def __init__(self, at: int, path: Path) -> None:
        self.at, self.path, self.seen = at, path, 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.seen == self.at:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True
        self.seen += 1


class OomsOverRanks(pl.Callback):
    """Logs the out-of-memory errors the module raised, summed over the ranks."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        total = trainer.strategy.reduce(pl_module.ooms * 1.0, reduce_op="sum")
        trainer.callback_metrics["ooms"] = total


@pytest.mark.filterwarnings("ignore:Training ended inside a window")
@pytest.mark.parametrize("stage", ["backward", "forward"])
def test_a_checkpoint_after_one_rank_ran_out_holds_the_agreed_size_and_resumes_exactly(
    stage: str, tmp_path: Path
) -> None:
    """Only rank 1 runs out, at batch 1 (the middle of a window of 3), and a checkpoint is saved right after
    it: the checkpoint holds the size both ranks agreed on at that batch's end, so the resumed run goes on in
    pieces on both ranks (the window's last batch, whose backward DDP all-reduces, included), never runs
    out again, and ends where the uninterrupted run does."""
    data = h.regression_data(96)  # 6 batches of 8 per rank; K=3: windows 3, 3
    caps = {"forward_cap": Cap(), "backward_cap": Cap(), f"{stage}_cap": Cap(since={1: 4})}

    def module() -> OomModule:
        return OomModule(data, batch_size=8, ranks=[1], resumable=True, **caps)

    def callback() -> GradientAccumulationCallback:
        return GradientAccumulationCallback(3, piece_size="auto", oom_snapshot=True)

    expected = h.big_batch_reference(h.regression_net(), data, 8 * WORLD, h.windows(6, 3), h.mse)
    whole = module()
    uninterrupted = ddp_trainer(callback(), OomsOverRanks(), logger=False)
    uninterrupted.fit(whole)
    assert h.max_abs_diff(whole.net, expected) < 1e-6
    assert float(uninterrupted.callback_metrics["grad_accum/oom_retries"]) == 1  # rank 1's, over ranks
    path = tmp_path / "after_the_error.ckpt"
    ddp_trainer(callback(), SaveThenStop(1, path), logger=False, min_epochs=0).fit(module())
    resumed = module()
    trainer = ddp_trainer(callback(), OomsOverRanks(), logger=False)
    trainer.fit(resumed, ckpt_path=path)
    assert h.max_abs_diff(resumed.net, expected) < 1e-6
    assert float(trainer.callback_metrics["ooms"]) == 0  # the saved size fits: no error after the resume
    assert float(trainer.callback_metrics["grad_accum/piece_size"]) == 4
    assert float(trainer.callback_metrics["grad_accum/oom_retries"]) == 1  # the checkpoint's


def test_a_backward_error_in_a_window_s_last_batch_with_buffers_redoes_it_from_the_snapshot() -> None:
    """fp64 buffers under DDP are written into ``.grad`` before a window's last batch (DDP's all-reduce
    carries them): ``.grad`` then holds the window's earlier batches too, and a backward's error there is
    redone from the snapshot, not by dropping ``.grad``. Rank 1 runs out in batch 0's forward (both ranks
    take pieces of 4 after it), then in the backward of batch 1's first piece (not synced)."""
    data = h.regression_data(64)  # 4 batches of 8 per rank; K=2: windows 2, 2
    module = OomModule(data, batch_size=8, ranks=[1], forward_cap=Cap(at={0: 5}), backward_cap=Cap(at={1: 2}))
    callback = GradientAccumulationCallback(
        2, piece_size="auto", oom_snapshot=True, accumulation_dtype="float64"
    )
    trainer = ddp_trainer(callback, logger=False)
    trainer.fit(module)
    expected = h.big_batch_reference(h.regression_net(), data, 8 * WORLD, h.windows(4, 2), h.mse)
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert float(trainer.callback_metrics["grad_accum/oom_retries"]) == 2


class SaveAfterBackward(pl.Callback):
    """Saves a checkpoint after the backward of global micro-batch ``at`` (inside the batch), then stops."""

    def __init__(self, at: int, path: Path) -> None:
        self.at, self.path, self.seen = at, path, 0

    def on_after_backward(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if self.seen == self.at:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True
        self.seen += 1


@pytest.mark.filterwarnings("ignore:Training ended inside a window")
@pytest.mark.filterwarnings("ignore:This checkpoint is taken after a micro-batch")
def test_a_save_while_the_ranks_views_differ_holds_the_agreed_view(tmp_path: Path) -> None:
    """Inside batch 1 only rank 1 has run out (its size is 4, rank 0's still whole batches) when the save
    comes: the checkpoint holds the smallest size over the ranks, not rank 0's view, and the counters the
    ranks agree on were checked equal on the way."""
    data = h.regression_data(64)
    module = OomModule(data, batch_size=8, ranks=[1], forward_cap=Cap(at={1: 5}), backward_cap=Cap())
    path = tmp_path / "inside_batch_1.ckpt"
    callbacks = [GradientAccumulationCallback(2, piece_size="auto"), SaveAfterBackward(1, path)]
    ddp_trainer(*callbacks, logger=False, min_epochs=0).fit(module)
    saved = torch.load(path, weights_only=True)["callbacks"]
    (state,) = [entry for entry in saved.values() if "pieces" in entry]
    assert state["pieces"]["size"] == 4
