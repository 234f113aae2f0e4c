"""Two CPU processes (ddp_spawn, gloo) equal one process holding both ranks' data as one big batch."""

from __future__ import annotations

import pytest

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h

pytestmark = pytest.mark.slow
WORLD = 2


def ddp_trainer(callback: GradientAccumulationCallback) -> object:
    return h.trainer(
        strategy="ddp_spawn",
        devices=WORLD,
        callbacks=[callback],
        logger=h.MetricsRecorder(),
        log_every_n_steps=1,
        use_distributed_sampler=False,  # the modules shard in dataset order (see helpers.ordered_loader)
    )


def test_ddp_mean_with_partial_window_matches_single_process_big_batch() -> None:
    data = h.regression_data(40)  # 5 micro-batches of 4 per rank; K=2: windows 2, 2, 1
    module = h.RegressionModule(data)
    trainer = ddp_trainer(GradientAccumulationCallback(2, max_grad_norm=0.5))
    trainer.fit(module)
    # DistributedSampler interleaves ranks: micro-batch i of both ranks together is rows [8i, 8i+8)
    expected = h.big_batch_reference(
        h.regression_net(), data, 4 * WORLD, h.windows(5, 2), h.mse, max_grad_norm=0.5
    )
    assert h.max_abs_diff(module.net, expected) < 1e-6
    metrics = trainer.callback_metrics
    assert float(metrics["grad_accum/items_per_step"]) == 8  # 1 micro-batch x 4 items x 2 ranks
    assert float(metrics["grad_accum/optimizer_steps"]) == 3


def test_ddp_weighted_uneven_tokens_per_rank_matches_single_process_big_batch() -> None:
    data = h.token_data(24)  # 6 micro-batches of 2 sequences per rank; K=4: windows 4, 2
    module = h.TokenModule(data)
    callback = GradientAccumulationCallback(4, scaling="weighted", item_count_fn=h.count_tokens)
    trainer = ddp_trainer(callback)
    trainer.fit(module)
    expected = h.big_batch_reference(h.token_net(), data, 2 * WORLD, h.windows(6, 4), h.token_loss, lr=0.5)
    assert h.max_abs_diff(module.net, expected) < 1e-6
    tokens_last_window = int((data.tensors[1][16:] != h.IGNORE_INDEX).sum())
    assert float(trainer.callback_metrics["grad_accum/items_per_step"]) == tokens_last_window
    # the per-rank token counts really are uneven in these windows
    per_rank = [int((data.tensors[1][rank::WORLD] != h.IGNORE_INDEX).sum()) for rank in range(WORLD)]
    assert per_rank[0] != per_rank[1]
