"""``piece_size`` on two CPU processes (ddp_spawn, gloo): pieces and out-of-memory errors on one rank only."""

from __future__ import annotations

import pytest

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
    assert float(metrics["grad_accum/oom_retries"]) == 0
