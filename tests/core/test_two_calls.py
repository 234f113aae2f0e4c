"""A micro-batch as two calls: ``begin_micro_batch`` before its backward, ``end_micro_batch`` after it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gradacc import GradAccumulator
from lightning_gradacc.core import WindowState


def _data(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator)) for _ in range(n)
    ]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 1)


def test_two_calls_around_a_backward_equal_the_big_batch() -> None:
    """Oracle: two windows of 3 micro-batches (unequal sizes, "weighted"), each one SGD step on the
    concatenated batch in plain PyTorch."""
    data = [(x[: 2 + i % 3], y[: 2 + i % 3]) for i, (x, y) in enumerate(_data())]
    net, reference = _net(), _net()
    accumulator = GradAccumulator(net.named_parameters(), 3, scaling="weighted")
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in data:
        loss = nn.functional.mse_loss(net(x), y)
        accumulator.begin_micro_batch(loss, items=len(x)).backward()
        accumulator.end_micro_batch()
        accumulator.step(optimizer)
    big_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for start in (0, 3):
        x = torch.cat([x for x, _ in data[start : start + 3]])
        y = torch.cat([y for _, y in data[start : start + 3]])
        nn.functional.mse_loss(reference(x), y).backward()
        big_optimizer.step()
        big_optimizer.zero_grad()
    for mine, theirs in zip(net.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-7)


def test_in_place_weighs_the_loss_itself_and_records_it_unweighted() -> None:
    net = _net()
    accumulator = GradAccumulator(net.parameters(), 2, scaling="weighted")
    (x, y), (x2, y2) = _data(2)
    first = nn.functional.mse_loss(net(x), y)
    accumulator.begin_micro_batch(first, items=4).backward()
    accumulator.end_micro_batch()
    loss = nn.functional.mse_loss(net(x2[:2]), y2[:2])
    unweighted = float(loss)
    returned = accumulator.begin_micro_batch(loss, items=2, in_place=True)
    assert returned is loss and float(loss) == pytest.approx(unweighted / 2)  # weight 2 / reference 4
    returned.backward()
    accumulator.end_micro_batch()
    accumulator.finalize(read_statistics=True)
    expected = (4 * float(first) + 2 * unweighted) / 6  # the window loss is item-weighted, unweighted losses
    assert accumulator.window_loss == pytest.approx(expected, rel=1e-6)


def test_the_calls_must_pair() -> None:
    net = _net()
    accumulator = GradAccumulator(net.parameters(), 2)
    with pytest.raises(RuntimeError, match="`end_micro_batch` was called without `begin_micro_batch`"):
        accumulator.end_micro_batch()
    x, y = _data(1)[0]
    accumulator.begin_micro_batch(nn.functional.mse_loss(net(x), y))
    with pytest.raises(RuntimeError, match="`begin_micro_batch` was called twice"):
        accumulator.begin_micro_batch(nn.functional.mse_loss(net(x), y))
    accumulator.reset()  # a discarded window forgets the micro-batch begun
    accumulator.begin_micro_batch(nn.functional.mse_loss(net(x), y)).backward()
    accumulator.end_micro_batch()
    assert accumulator.window.micro_batches == 1


def _two_rank_accumulator(net: nn.Module, **kwargs: object) -> GradAccumulator:
    """Rank 0 of two, whose other rank adds nothing (an all-reduce that returns its input)."""
    return GradAccumulator(
        net.parameters(), 3, world_size=2, all_reduce=lambda t: t, accumulation_dtype="float64", **kwargs
    )


@pytest.mark.parametrize("last", [None, True])
def test_the_last_micro_batch_under_data_parallelism_writes_the_buffers_into_grad_first(
    last: bool | None,
) -> None:
    """DDP's all-reduce of the window's last backward then carries the whole window: before that backward
    `.grad` already holds the buffered sum. `last=None` means the K-th micro-batch; a shorter last window
    says `last=True`."""
    net = _net()
    accumulator = _two_rank_accumulator(net)
    data = _data(3)[: 3 if last is None else 2]
    for index, (x, y) in enumerate(data):
        is_last = index == len(data) - 1
        loss = nn.functional.mse_loss(net(x), y)
        weighted = accumulator.begin_micro_batch(loss, last=last if is_last else None)
        state = accumulator.window.state
        assert state is (
            WindowState.FLUSHED if is_last else WindowState.IN_BUFFERS if index else WindowState.EMPTY
        )
        assert (net.weight.grad is not None) == is_last  # the buffered sum, in .grad before the backward
        weighted.backward()
        accumulator.end_micro_batch()


def test_the_per_micro_batch_checks_keep_the_last_micro_batch_in_the_buffers() -> None:
    """With `clip_mode="micro_batch"` each micro-batch, the last too, is clipped on its own: no flush
    before its backward (data parallelism then uses `reduce_gradients`)."""
    net = _net()
    accumulator = _two_rank_accumulator(net, clip_mode="micro_batch", max_grad_norm=0.1)
    for x, y in _data(3):
        accumulator.begin_micro_batch(nn.functional.mse_loss(net(x), y)).backward()
        accumulator.end_micro_batch()
        assert accumulator.window.state is WindowState.IN_BUFFERS


def test_under_a_grad_scaler_the_last_micro_batch_leaves_the_window_in_grad() -> None:
    """The scaler unscales and checks `.grad`: after the window's last micro-batch its sum is there."""
    net = _net()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    accumulator = GradAccumulator(net.parameters(), 2, grad_scaler=scaler, accumulation_dtype="float64")
    for index, (x, y) in enumerate(_data(2)):
        accumulator.backward(nn.functional.mse_loss(net(x), y))
        expected = WindowState.FLUSHED if index == 1 else WindowState.IN_BUFFERS
        assert accumulator.window.state is expected
