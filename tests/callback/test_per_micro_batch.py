"""The per-micro-batch modes act on every micro-batch of a window, its last one included, on every path.

``clip_mode="micro_batch"`` clips each micro-batch's own gradient and ``overflow="skip_micro_batch"`` drops
only the micro-batch whose gradient is not finite. Under a GradScaler and under DDP the window's sum used
to go back into ``.grad`` before its last backward, so that last micro-batch escaped both. The oracle clips
(or leaves out) every micro-batch of every rank on its own, in plain PyTorch, and steps on their mean.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h
from tests.helpers import ddp_trainer

WORLD = 2


reference = h.regression_reference


def per_micro_batch_reference(
    data: TensorDataset,
    window_list: list[list[int]],
    *,
    world: int = 1,
    max_grad_norm: float | None = None,
    clip_last: bool = True,
    drop: Sequence[int] = (),
    fp16_autocast: bool = False,
    scaling: str = "mean",
    batch_size: int = 4,
    lr: float = 0.1,
) -> torch.nn.Module:
    """One SGD step per window on the mean of its micro-batch gradients, each taken on its own.

    Micro-batch ``i`` of rank ``r`` holds rows ``r, r + world, ...`` ``[i * batch_size, (i + 1) *
    batch_size)`` (``DistributedSampler(shuffle=False)``). With ``max_grad_norm`` each one's gradient is
    clipped to it (not the window's last when ``clip_last`` is false: the old, wrong behaviour); micro-batch
    indices in ``drop`` are left out on every rank. ``scaling="sum"`` steps on their sum.
    """
    net = h.regression_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    x, y = data.tensors
    rows_of_rank = [torch.arange(rank, len(data), world) for rank in range(world)]
    for window in window_list:
        kept = [i for i in window if i not in drop]
        total = [torch.zeros_like(p) for p in net.parameters()]
        for i in kept:
            for rows in (rows[i * batch_size : (i + 1) * batch_size] for rows in rows_of_rank):
                net.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16, enabled=fp16_autocast):
                    loss = h.mse(net, x[rows], y[rows])
                loss.backward()
                if max_grad_norm is not None and (clip_last or i != window[-1]):
                    torch.nn.utils.clip_grad_norm_(net.parameters(), max_grad_norm)
                for sum_, param in zip(total, net.parameters(), strict=True):
                    sum_ += param.grad
        for sum_, param in zip(total, net.parameters(), strict=True):
            param.grad = sum_ if scaling == "sum" else sum_ / (len(kept) * world)
        optimizer.step()
    return net


@pytest.mark.parametrize("bad", [[0], [3], [5], [9], [4, 6]])
def test_skip_micro_batch_steps_with_the_rest_of_the_window(bad: list[int]) -> None:
    callback = GradientAccumulationCallback(
        4, overflow="skip_micro_batch", accumulation_dtype="float64", scaling="weighted"
    )
    module = h.RegressionModule(h.regression_data(40), nan_at=bad)
    h.trainer(callbacks=[callback]).fit(module)
    windows = [[b for b in window if b not in bad] for window in h.windows(10, 4)]
    assert h.max_abs_diff(module.net, reference(windows)) < 1e-6
    stats = callback.stats
    assert (stats.dropped_micro_batches, stats.non_finite_windows, stats.skipped_steps) == (len(bad), 0, 0)
    assert stats.windows == stats.steps_taken == 3
    # the last window has micro-batches 8 and 9 of 4 samples; a dropped one does not count
    assert stats.items_last_step == 4 * len(windows[-1])


def test_skip_micro_batch_mean_divides_by_the_micro_batches_kept() -> None:
    callback = GradientAccumulationCallback(4, overflow="skip_micro_batch", accumulation_dtype="float64")
    module = h.RegressionModule(h.regression_data(40), nan_at=[1])
    h.trainer(callbacks=[callback]).fit(module)
    assert h.max_abs_diff(module.net, reference([[0, 2, 3], [4, 5, 6, 7], [8, 9]])) < 1e-6


def test_a_window_without_any_finite_micro_batch_is_skipped() -> None:
    callback = GradientAccumulationCallback(2, overflow="skip_micro_batch", accumulation_dtype="float64")
    module = h.RegressionModule(h.regression_data(40), nan_at=[2, 3])
    with pytest.warns(UserWarning, match="skipped"):
        h.trainer(callbacks=[callback]).fit(module)
    stats = callback.stats
    assert (stats.dropped_micro_batches, stats.non_finite_windows, stats.skipped_steps) == (2, 0, 1)
    windows = h.windows(10, 2)
    assert h.max_abs_diff(module.net, reference(windows, skip_windows=[1])) < 1e-6


def test_micro_batch_clipping_clips_each_micro_batch_before_adding() -> None:
    callback = GradientAccumulationCallback(
        4, accumulation_dtype="float64", clip_mode="micro_batch", max_grad_norm=0.3
    )
    module = h.RegressionModule(h.regression_data(40))
    h.trainer(callbacks=[callback]).fit(module)
    # plain PyTorch: each micro-batch's gradient clipped with torch's clip_grad_norm_, then the mean
    expected = h.regression_net()
    optimizer = torch.optim.SGD(expected.parameters(), lr=0.1)
    x, y = h.regression_data(40).tensors
    for window in h.windows(10, 4):
        total = [torch.zeros_like(p) for p in expected.parameters()]
        for b in window:
            expected.zero_grad()
            h.mse(expected, x[b * 4 : b * 4 + 4], y[b * 4 : b * 4 + 4]).backward()
            torch.nn.utils.clip_grad_norm_(expected.parameters(), 0.3)
            for t, p in zip(total, expected.parameters(), strict=True):
                t += p.grad
        for t, p in zip(total, expected.parameters(), strict=True):
            p.grad = t / len(window)
        optimizer.step()
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert callback.stats.clipped_steps > 0


def test_skip_micro_batch_is_refused_under_a_grad_scaler() -> None:
    callback = GradientAccumulationCallback(4, overflow="skip_micro_batch", accumulation_dtype="float64")
    with pytest.raises(RuntimeError, match="cannot be used with a GradScaler"):
        h.trainer(callbacks=[callback], plugins=[h.amp_plugin()]).fit(
            h.RegressionModule(h.regression_data(8))
        )


# --------------------------------------- the window's last micro-batch, under a GradScaler and under DDP


def test_clip_per_micro_batch_under_16_mixed_clips_the_last_micro_batch_too() -> None:
    data = h.regression_data(40)  # 10 micro-batches of 4, K=4: windows 4, 4, 2
    module = h.RegressionModule(data)
    callback = GradientAccumulationCallback(
        4, clip_mode="micro_batch", max_grad_norm=0.3, accumulation_dtype="float32"
    )
    h.trainer(callbacks=[callback], plugins=[h.amp_plugin()]).fit(module)
    windows = h.windows(10, 4)
    expected = per_micro_batch_reference(data, windows, max_grad_norm=0.3, fp16_autocast=True)
    assert h.max_abs_diff(module.net, expected) < 1e-6
    last_unclipped = per_micro_batch_reference(
        data, windows, max_grad_norm=0.3, fp16_autocast=True, clip_last=False
    )
    assert h.max_abs_diff(expected, last_unclipped) > 1e-3  # the last micro-batches really clip
    assert callback.stats.clipped_steps == 3


def test_clip_per_micro_batch_with_sum_scaling_does_not_clip_the_sum_again() -> None:
    """ "sum" adds the clipped micro-batch gradients: their sum may exceed `max_grad_norm` and stays so (the
    window's gradient used to be clipped once more: 5.9e-2 off)."""
    data = h.regression_data(40)
    module = h.RegressionModule(data)
    callback = GradientAccumulationCallback(
        4, scaling="sum", clip_mode="micro_batch", max_grad_norm=0.3, accumulation_dtype="float64"
    )
    h.trainer(callbacks=[callback]).fit(module)
    expected = per_micro_batch_reference(data, h.windows(10, 4), max_grad_norm=0.3, scaling="sum")
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert callback.stats.last_grad_norm > 0.3  # the sum's norm, not clipped


@pytest.mark.slow
def test_ddp_clip_per_micro_batch_under_16_mixed_clips_every_micro_batch_of_every_rank() -> None:
    data = h.regression_data(40)  # 5 micro-batches of 4 per rank; K=2: windows 2, 2, 1
    module = h.RegressionModule(data)
    callback = GradientAccumulationCallback(
        2, clip_mode="micro_batch", max_grad_norm=0.3, accumulation_dtype="float64"
    )
    trainer = ddp_trainer(callback, plugins=[h.amp_plugin()])
    trainer.fit(module)
    windows = h.windows(5, 2)
    expected = per_micro_batch_reference(data, windows, world=WORLD, max_grad_norm=0.3, fp16_autocast=True)
    assert h.max_abs_diff(module.net, expected) < 1e-6
    last_unclipped = per_micro_batch_reference(
        data, windows, world=WORLD, max_grad_norm=0.3, fp16_autocast=True, clip_last=False
    )
    assert h.max_abs_diff(expected, last_unclipped) > 1e-3
    assert float(trainer.callback_metrics["grad_accum/skipped_steps"]) == 0


class SecondBranchOnRankOne(h.RegressionModule):
    """`a(x)` on every rank, plus `b(x)` on rank 1 only: `b` has a gradient on one rank and not the other in
    every window."""

    def __init__(self, data: TensorDataset) -> None:
        super().__init__(data)
        torch.manual_seed(1)
        self.a, self.b = torch.nn.Linear(5, 1), torch.nn.Linear(5, 1)

    def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.a(x) + (self.b(x) if self.global_rank == 1 else 0.0)
        return torch.nn.functional.mse_loss(out, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([*self.a.parameters(), *self.b.parameters()], lr=0.1)


@pytest.mark.slow
def test_ddp_per_micro_batch_averages_a_parameter_that_only_one_rank_used() -> None:
    """Under the per-micro-batch modes the core averages the buffers over the ranks itself: which parameters
    take part must be decided over all ranks (`b` holds a gradient on rank 1 only, and is averaged with rank
    0's zeros, as DDP would). Oracle: plain PyTorch, each rank's micro-batch gradients summed, divided by
    the micro-batches of all ranks."""
    data = h.regression_data(40)  # 5 micro-batches of 4 per rank; K=2: windows 2, 2, 1
    module = SecondBranchOnRankOne(data)
    # one mode (`skip_micro_batch` takes the same path: `reduce_gradients`)
    callback = GradientAccumulationCallback(
        2, accumulation_dtype="float64", clip_mode="micro_batch", max_grad_norm=100.0
    )
    ddp_trainer(callback).fit(module)
    torch.manual_seed(1)
    a, b = torch.nn.Linear(5, 1), torch.nn.Linear(5, 1)
    b_before = b.weight.detach().clone()
    optimizer = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    x, y = data.tensors
    rows_of_rank = [torch.arange(rank, len(data), WORLD) for rank in range(WORLD)]
    for window in h.windows(5, 2):
        optimizer.zero_grad()
        for i in window:
            for rank, rows in enumerate(rows_of_rank):
                part = rows[i * 4 : (i + 1) * 4]
                out = a(x[part]) + (b(x[part]) if rank == 1 else 0.0)
                (torch.nn.functional.mse_loss(out, y[part]) / (len(window) * WORLD)).backward()
        optimizer.step()
    assert h.max_abs_diff(module.a, a) < 1e-6
    assert h.max_abs_diff(module.b, b) < 1e-6
    assert float((module.b.weight.detach() - b_before).abs().max()) > 1e-3  # `b` really moved (rank 1's half)
