"""Accumulation buffers wider than the parameters: averaged over the ranks at the window's end."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gradacc import GradAccumulator


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
