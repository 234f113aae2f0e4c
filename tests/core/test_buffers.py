"""Accumulation buffers wider than the parameters: their size, refusals, warnings and mean over ranks.

Also bf16 parameters with fp32 buffers on CUDA (skipped without a GPU).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_gradacc import GradAccumulator, GradientAccumulationCallback
from tests import helpers as h
from tests.helpers import cuda_only
from tests.syncs import SyncCounter


def test_reduce_gradients_averages_the_buffers_over_the_ranks_at_the_window_end() -> None:
    """A second rank whose window sums to zero, simulated by an all-reduce that adds nothing: the window's
    mean over the two ranks is half this rank's, and a parameter no rank has a gradient for stays without
    one."""
    nets = [nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    nets[0][0].requires_grad_(False)
    nets[1][0].requires_grad_(False)
    alone = GradAccumulator(nets[0].parameters(), 2, accumulation_dtype="float64")
    reduced = GradAccumulator(
        nets[1].parameters(),
        2,
        accumulation_dtype="float64",
        world_size=2,
        all_reduce=lambda tensor: tensor,
        reduce_gradients=True,
    )
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    for net, accumulator in zip(nets, (alone, reduced), strict=True):
        for rows in (x[:2], x[2:]):
            accumulator.backward(net(rows).pow(2).mean(), items=len(rows))
        assert accumulator.finalize()
    for mine, theirs in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        assert (mine.grad is None) == (theirs.grad is None)
        if mine.grad is not None:
            assert torch.equal(mine.grad / 2, theirs.grad)
    assert nets[1][0].weight.grad is None
    with pytest.raises(ValueError, match=r"`reduce_gradients=True` .* needs `accumulation_dtype`"):
        GradAccumulator(nets[0].parameters(), 2, world_size=2, all_reduce=lambda t: t, reduce_gradients=True)


def test_buffer_bytes_are_the_exact_size_of_the_buffers() -> None:
    net = nn.Linear(10, 3).to(torch.bfloat16)
    accumulator = GradAccumulator(net.parameters(), 2, accumulation_dtype="float32")
    assert accumulator.stats.buffer_bytes == 0  # allocated lazily, at the first micro-batch
    accumulator.backward(net(torch.randn(4, 10, dtype=torch.bfloat16)).float().pow(2).mean())
    assert accumulator.stats.buffer_bytes == 4 * (10 * 3 + 3)
    assert all(p.grad is None for p in net.parameters())  # .grad is released after every micro-batch
    accumulator.backward(net(torch.randn(4, 10, dtype=torch.bfloat16)).float().pow(2).mean())
    assert accumulator.finalize()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in net.parameters())


def test_buffers_on_float32_parameters_warn_that_they_change_nothing() -> None:
    with pytest.warns(UserWarning, match="changes nothing: the parameters are already torch.float32"):
        GradAccumulator(nn.Linear(2, 1).parameters(), accumulation_dtype="float32")


def test_buffer_dtype_narrower_than_a_parameter_is_refused_before_training() -> None:
    match = r"`accumulation_dtype=torch.float16` is narrower than parameter `0.weight` \(torch.float32\)"
    with pytest.raises(ValueError, match=match):
        GradAccumulator(h.regression_net().named_parameters(), accumulation_dtype="float16")
    module = h.RegressionModule(h.regression_data(8))
    with pytest.raises(ValueError, match=match.replace("`0.weight`", "`net.0.weight`")):
        h.trainer(callbacks=[GradientAccumulationCallback(2, accumulation_dtype="float16")]).fit(module)
    assert module.micro_batches_seen == 0


@cuda_only
def test_bf16_buffers_on_cuda() -> None:
    net = torch.nn.Linear(64, 8).cuda().to(torch.bfloat16)
    accumulator = GradAccumulator(net.parameters(), 256, accumulation_dtype="float32")
    generator = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(256):
        x = torch.randn(2, 64, device="cuda", generator=generator, dtype=torch.bfloat16)
        accumulator.backward(net(x).float().pow(2).mean(), items=2)
    assert accumulator.finalize()
    assert accumulator.stats.buffer_bytes == 4 * (64 * 8 + 8)
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in net.parameters())


def test_skip_micro_batch_does_not_sync_while_accumulating() -> None:
    net = h.regression_net()
    accumulator = GradAccumulator(
        net.parameters(), 4, overflow="skip_micro_batch", accumulation_dtype="float64"
    )
    x, y = h.regression_data(16).tensors
    counter = SyncCounter()
    with counter.patched():
        for index in range(4):
            loss = h.mse(net, x[index * 4 : index * 4 + 4], y[index * 4 : index * 4 + 4])
            with counter.counting():
                accumulator.backward(loss * (float("nan") if index == 1 else 1.0), items=torch.tensor(4))
        assert counter.calls == []
        with counter.counting():
            assert accumulator.finalize()
        assert counter.calls == ["tolist"]
    assert (accumulator.stats.dropped_micro_batches, accumulator.stats.non_finite_windows) == (1, 0)


def test_a_window_s_buffers_are_released_as_its_gradients_are_written() -> None:
    """The buffers live while their window does: none is alive once `.grad` holds the window's sum, so the
    buffers and the final gradients are never both whole in memory (and the step runs beside neither)."""
    import weakref

    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).to(torch.bfloat16)
    accumulator = GradAccumulator(net.parameters(), 2, accumulation_dtype="float32")
    for _ in range(2):
        accumulator.backward(net(torch.randn(3, 4, dtype=torch.bfloat16)).float().square().mean(), items=3)
    buffers = [weakref.ref(b) for b in accumulator._buffers.window() if b is not None]  # type: ignore[union-attr]
    assert len(buffers) == 4
    assert accumulator.finalize()
    assert all(ref() is None for ref in buffers)
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in net.parameters())
    assert accumulator.stats.buffer_bytes == 4 * sum(p.numel() for p in net.parameters())  # per window


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/clear_refs")
def test_a_narrower_gradient_is_added_on_a_cpu_without_a_whole_cast_copy() -> None:
    """torch's CPU `add_` casts a bf16 input to fp32 as a copy of the whole tensor (64 MiB here): added in
    chunks, the peak rises by a chunk's cast only, and the sum is the same element by element."""
    from lightning_gradacc.core.buffers import add_widening_

    def peak_rise(add: Callable[[torch.Tensor, torch.Tensor], None]) -> float:
        buffer, grad = torch.zeros(2**24), torch.full((2**24,), 0.5, dtype=torch.bfloat16)
        Path("/proc/self/clear_refs").write_text("5")  # reset this process's resident-set peak
        before = _resident_peak()
        add(buffer, grad)
        rise = (_resident_peak() - before) / 2**20
        assert bool((buffer == 0.5).all())
        return rise

    assert peak_rise(lambda b, g: b.add_(g)) > 48  # the control: the whole cast copy, 64 MiB
    assert peak_rise(add_widening_) < 8


def _resident_peak() -> int:
    import re

    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024  # type: ignore[union-attr]


def test_writing_the_window_into_grad_releases_each_buffer_at_once() -> None:
    """Each buffer is released as its gradient is written, before the next window (not only when it opens):
    right after `write_to_grads` no buffer is alive, and a buffer of the parameter's dtype is the gradient."""
    import weakref

    from lightning_gradacc.core.buffers import GradBuffers

    wide = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    same = nn.Parameter(torch.zeros(2, dtype=torch.float32))
    buffers = GradBuffers([("wide", wide), ("same", same)], torch.float32)
    wide.grad, same.grad = torch.ones(3, dtype=torch.bfloat16), torch.ones(2)
    buffers.absorb()
    held = [weakref.ref(b) for b in buffers.window() if b is not None]
    same_buffer = buffers.window()[1]
    buffers.write_to_grads()
    assert same.grad is same_buffer  # no copy where the dtypes agree
    del same_buffer
    same.grad = None
    assert [ref() is None for ref in held] == [True, True]
    assert wide.grad is not None and wide.grad.dtype == torch.bfloat16 and buffers.nbytes == 3 * 4 + 2 * 4
