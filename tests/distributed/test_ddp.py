"""Two CPU processes (ddp_spawn, gloo) equal one process holding both ranks' data as one big batch."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h
from tests.helpers import ddp_trainer

pytestmark = pytest.mark.slow
WORLD = 2


def test_ddp_mean_with_partial_window_matches_single_process_big_batch() -> None:
    data = h.regression_data(40)  # 5 micro-batches of 4 per rank; K=2: windows 2, 2, 1
    module = h.RegressionModule(data)
    # without a logger: `ddp_spawn` hands `callback_metrics` back (`callback.stats` stays in the workers)
    trainer = ddp_trainer(GradientAccumulationCallback(2, max_grad_norm=0.5), logger=False)
    trainer.fit(module)
    # DistributedSampler interleaves ranks: micro-batch i of both ranks together is rows [8i, 8i+8)
    expected = h.big_batch_reference(
        h.regression_net(), data, 4 * WORLD, h.windows(5, 2), h.mse, max_grad_norm=0.5
    )
    assert h.max_abs_diff(module.net, expected) < 1e-6
    metrics = trainer.callback_metrics
    assert float(metrics["grad_accum/items_last_step"]) == 8  # 1 micro-batch x 4 items x 2 ranks
    assert float(metrics["grad_accum/items_last_full_step"]) == 16  # 2 x 4 x 2 ranks
    assert float(metrics["grad_accum/windows"]) == 3


def counted_fit(make_callbacks: Any, **kwargs: object) -> tuple[pl.Trainer, h.RegressionModule]:
    """Fit with DDP's communication counted by a Python comm hook.

    The hook's futures run Python callbacks on gloo's worker threads (the workers end by
    `h.exit_together`: see there).
    """
    module = h.RegressionModule(h.regression_data(40))
    trainer = ddp_trainer(*make_callbacks(), h.CommCounterLogger(), **kwargs)
    trainer.fit(module)
    return trainer, module


def test_ddp_with_buffers_matches_big_batch_with_one_gradient_all_reduce_per_step() -> None:
    data = h.regression_data(40)
    trainer, module = counted_fit(
        lambda: [GradientAccumulationCallback(2, accumulation_dtype="float64", scaling="weighted")]
    )
    expected = h.big_batch_reference(h.regression_net(), data, 4 * WORLD, h.windows(5, 2), h.mse)
    assert h.max_abs_diff(module.net, expected) < 1e-6
    # the communication of Lightning's own accumulation: one all-reduce of the whole float32 gradient per step
    calls, nbytes = (float(trainer.callback_metrics[k]) for k in ("comm_calls", "comm_bytes"))
    assert calls == 3  # 3 optimizer steps, 1 bucket for this small model
    assert nbytes == 3 * 4 * sum(p.numel() for p in h.regression_net().parameters())


class BranchModule(h.RegressionModule):
    """A parameter used only by the first micro-batch of each window of 2, with a gradient per rank."""

    def __init__(self, data: Any) -> None:
        super().__init__(data)
        self.extra = torch.nn.Parameter(torch.ones(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if batch_idx % 2 == 0:
            loss = loss + (self.extra * batch[0].mean()).pow(2)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_ddp_find_unused_parameters_with_buffers_averages_a_parameter_unused_by_the_last_backward() -> None:
    """With `find_unused_parameters=True` DDP marks a parameter as used in a `no_sync()` backward only when
    its `.grad` holds a gradient: the buffers then take it after the backward, not inside (where `.grad`
    would be gone before DDP looks), so the synchronized backward still averages `extra` over the ranks."""
    data = h.regression_data(32)  # 4 micro-batches of 4 per rank; K=2

    module = BranchModule(data)
    strategy = h.SPAWN["pytorch_lightning"](find_unused_parameters=True)
    callback = GradientAccumulationCallback(2, accumulation_dtype="float64")
    ddp_trainer(callback, strategy=strategy, logger=False).fit(module)
    # the plain loop: per window, the mean of the 4 micro-batch gradients (2 per rank; rank r's micro-batch
    # b holds rows r, r + 2, ... of rows [8b, 8b + 8)), one SGD step
    reference = BranchModule(data)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = data.tensors
    for window in h.windows(4, 2):
        optimizer.zero_grad()
        for rank in range(WORLD):
            for batch_idx in window:
                rows = slice(8 * batch_idx + rank, 8 * batch_idx + 8, WORLD)
                (reference.training_step((x[rows], y[rows]), batch_idx) / (WORLD * len(window))).backward()
        optimizer.step()
    assert float(module.extra) != 1.0
    assert h.max_abs_diff(module, reference) < 1e-6


class BarrierCounter(pl.Callback):
    """Counts `torch.distributed.barrier` calls inside training batches and logs them (read in the parent)."""

    def __init__(self) -> None:
        self.calls = 0
        self.inside = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        original = torch.distributed.barrier

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.calls += self.inside
            return original(*args, **kwargs)

        torch.distributed.barrier = counting  # in the spawned worker only

    def on_train_batch_start(self, *args: Any) -> None:
        self.inside = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.inside = False
        pl_module.log("barriers", float(self.calls), on_step=True, on_epoch=False, batch_size=1)


def test_ddp_skip_micro_batch_drops_one_rank_s_non_finite_micro_batch_on_every_rank_without_a_barrier() -> (
    None
):
    """Rank 0's micro-batch is `nan` at the start of window 1 in epoch 0 (micro-batch 2) and at its end in
    epoch 1 (micro-batch 3): on both ranks only that micro-batch is dropped, and the others step, normalized
    by the items left. The window's counts are all-reduced without Lightning's `strategy.reduce`, which adds
    a barrier."""
    data = h.regression_data(40)  # 5 micro-batches of 4 per rank; K=2: windows 0-1, 2-3, 4
    module = h.RegressionModule(data, nan_at=[2, 8], nan_rank=0)  # global micro-batches 2 and 5 + 3
    callback = GradientAccumulationCallback(
        2, scaling="weighted", overflow="skip_micro_batch", accumulation_dtype="float64"
    )
    trainer = ddp_trainer(callback, BarrierCounter(), max_epochs=2)
    trainer.fit(module)
    windows = [[0, 1], [3], [4], [0, 1], [2], [4]]
    expected = h.big_batch_reference(h.regression_net(), data, 4 * WORLD, windows, h.mse)
    assert h.max_abs_diff(module.net, expected) < 1e-6
    metrics = trainer.callback_metrics
    assert float(metrics["grad_accum/dropped_micro_batches"]) == 2
    assert float(metrics["grad_accum/skipped_steps"]) == float(metrics["grad_accum/non_finite_windows"]) == 0
    assert float(metrics["grad_accum/windows"]) == 6
    assert float(metrics["grad_accum/items_last_step"]) == 8
    assert float(metrics["barriers"]) == 0


SENTINEL = 999.0


def negative_for_the_sentinel(batch: Any) -> float:
    """A data-dependent bad count: only the rank that reads the sentinel row sees it."""
    return -1.0 if bool((batch[1] == SENTINEL).any()) else float(len(batch[1]))


def test_ddp_bad_count_on_one_rank_raises_on_every_rank_without_hanging() -> None:
    x, y = h.regression_data(40).tensors
    y = y.clone()
    y[13] = SENTINEL  # rank 1 reads rows 1, 3, 5, ...: row 13 is in its micro-batch 1 (window 0)
    module = h.RegressionModule(torch.utils.data.TensorDataset(x, y))
    callback = GradientAccumulationCallback(2, scaling="weighted", item_count_fn=negative_for_the_sentinel)
    trainer = ddp_trainer(callback, strategy=DDPStrategy(start_method="spawn", timeout=timedelta(seconds=60)))
    started = time.monotonic()
    with pytest.raises(
        Exception, match=r"item count of batch 1 \(from `item_count_fn`\) to be .* got -1.0|on another rank"
    ):
        trainer.fit(module)
    # ddp_spawn ends the other process as soon as one fails, so a hang would not show here on its own;
    # test_a_bad_count_on_another_rank_raises_on_this_rank_too (tests/core/test_weighting.py) shows the
    # decision is collective.
    assert time.monotonic() - started < 45


def test_ddp_under_16_mixed_matches_the_big_batch_under_the_same_autocast() -> None:
    data = h.regression_data(40)  # 5 micro-batches of 4 per rank; K=2: windows 2, 2, 1
    module = h.RegressionModule(data)
    trainer = ddp_trainer(GradientAccumulationCallback(2, max_grad_norm=0.5), plugins=[h.amp_plugin()])
    trainer.fit(module)
    expected = h.big_batch_reference(
        h.regression_net(), data, 4 * WORLD, h.windows(5, 2), h.mse, max_grad_norm=0.5, fp16_autocast=True
    )
    assert h.max_abs_diff(module.net, expected) < 2e-4  # fp16 rounding: micro- vs big-batch
    assert float(trainer.callback_metrics["grad_accum/skipped_steps"]) == 0


def test_ddp_with_a_fused_optimizer_skips_a_window_non_finite_on_one_rank_on_both() -> None:
    """The decision on the device (no host read): the all-reduced nan skips the fused step on every rank."""
    data = h.regression_data(40)  # 5 micro-batches of 4 per rank; K=2: windows 2, 2, 1
    module = h.RegressionModule(data, optimizer="sgd_fused", nan_at=[1], nan_rank=1)
    trainer = ddp_trainer(GradientAccumulationCallback(2, max_grad_norm=0.5), log_every_n_steps=1)
    trainer.fit(module)
    expected = h.big_batch_reference(
        h.regression_net(),
        data,
        4 * WORLD,
        h.windows(5, 2),
        h.mse,
        optimizer="sgd_fused",
        max_grad_norm=0.5,
        skip_windows=[0],
    )
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert float(trainer.callback_metrics["grad_accum/skipped_steps"]) == 1


def test_ddp_token_weighted_with_a_fused_optimizer_steps_the_big_batch_decided_on_the_device() -> None:
    """The window's factor is computed on the device for a fused step (no host read): token weights over
    both ranks' tokens, as the host path does."""
    data = h.token_data(24)  # 6 micro-batches of 2 sequences per rank; K=2
    callback = GradientAccumulationCallback(2, scaling="weighted", item_count_fn=h.count_tokens)
    module = h.TokenModule(data, optimizer="sgd_fused")
    ddp_trainer(callback, logger=False).fit(module)
    expected = h.big_batch_reference(
        h.token_net(), data, 2 * WORLD, h.windows(6, 2), h.token_loss, lr=0.5, optimizer="sgd_fused"
    )
    assert h.max_abs_diff(module.net, expected) < 1e-6


class EstimateRecorder(h.RegressionModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.estimate = self.trainer.estimated_stepping_batches
        return super().configure_optimizers()

    def on_train_batch_end(self, *args: Any) -> None:
        self.log("estimate", float(self.estimate), on_step=True, on_epoch=False, batch_size=1)


def test_ddp_target_batch_size_resolves_k_over_ranks_before_configure_optimizers() -> None:
    data = h.regression_data(40)
    module = EstimateRecorder(data)
    trainer = ddp_trainer(GradientAccumulationCallback(target_batch_size=16))  # 4 per rank x 2 ranks: K=2
    trainer.fit(module)
    assert (
        h.max_abs_diff(module.net, h.big_batch_reference(h.regression_net(), data, 8, h.windows(5, 2), h.mse))
        < 1e-6
    )
    metrics = trainer.callback_metrics
    assert float(metrics["grad_accum/accumulation_steps"]) == 2
    assert float(metrics["estimate"]) == float(metrics["grad_accum/windows"]) == 3
    assert float(metrics["grad_accum/items_seen"]) == 40  # both ranks' samples, each once


def test_ddp_token_keyed_schedule_matches_the_big_batch_of_each_window() -> None:
    """K grows with the tokens consumed over both ranks (uneven per rank): every window, whatever its K,
    equals one step on all of its tokens."""
    data = h.token_data(24)  # 6 micro-batches of 2 sequences per rank
    schedule = {0: 1, 20: 2, 60: 3}
    callback = GradientAccumulationCallback(
        schedule, schedule_unit="items", scaling="weighted", item_count_fn=h.count_tokens
    )
    module = h.TokenModule(data)
    trainer = ddp_trainer(callback)
    trainer.fit(module)
    # micro-batch i of both ranks together is rows [4i, 4i+4): its tokens decide the next window's K
    tokens = [int((data.tensors[1][4 * i : 4 * i + 4] != h.IGNORE_INDEX).sum()) for i in range(6)]
    windows, start, consumed = [], 0, 0
    while start < 6:
        k = [v for t, v in sorted(schedule.items()) if t <= consumed][-1]
        window = list(range(start, min(start + k, 6)))
        windows.append(window)
        consumed += sum(tokens[i] for i in window)
        start += len(window)
    assert len({len(w) for w in windows}) > 1  # the schedule changes K inside the epoch
    expected = h.big_batch_reference(h.token_net(), data, 2 * WORLD, windows, h.token_loss, lr=0.5)
    assert h.max_abs_diff(module.net, expected) < 1e-6
    last_rows = data.tensors[1][4 * windows[-1][0] :]  # the last window's tokens, over both ranks
    assert float(trainer.callback_metrics["grad_accum/items_last_step"]) == int(
        (last_rows != h.IGNORE_INDEX).sum()
    )
    # the per-rank token counts really are uneven
    per_rank = [int((data.tensors[1][rank::WORLD] != h.IGNORE_INDEX).sum()) for rank in range(WORLD)]
    assert per_rank[0] != per_rank[1]
