"""A window's states, checked state by state, its loss scale, and its quantities declared once.

On its own and as the accumulator moves from window to window; the loss scale is told only while the window is
empty and divided out at the boundary. The tally's totals, the all-reduce packet, the host copy and a saved
window follow the one declaration of the quantities.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_gradacc.core.accumulator import GradAccumulator
from lightning_gradacc.core.statistics import Ledger
from lightning_gradacc.core.window import (
    NAMES,
    QUANTITIES,
    SUMMED,
    Measurement,
    Window,
    WindowClosedError,
    WindowState,
    WindowTally,
    mean_loss,
)
from tests.helpers import F64, INF, linear_accumulator, linear_backward


def _window(buffered: bool) -> Window:
    return Window(buffered=buffered, device=torch.device("cpu"), dtype=F64)


def test_window_unbuffered_states() -> None:
    window = _window(buffered=False)
    assert window.state is WindowState.EMPTY and window.empty
    assert not window.new_gradients_to_buffers
    window.record_micro_batch(in_buffers=False)
    window.record_micro_batch(in_buffers=False)
    assert window.state is WindowState.IN_GRAD and window.micro_batches == 2 and not window.empty
    assert not window.sums_in_buffers
    with pytest.raises(RuntimeError, match="nothing to flush"):
        window.flush()
    with pytest.raises(RuntimeError, match="went to the buffers"):
        window.record_micro_batch(in_buffers=True)
    assert window.micro_batches == 2
    window.close()
    assert window.state is WindowState.CLOSED
    for action in (
        lambda: window.record_micro_batch(in_buffers=False),
        window.close,
        window.flush,
        lambda: window.restored(in_buffers=False, micro_batches=1),
        lambda: window.new_gradients_to_buffers,
    ):
        with pytest.raises(WindowClosedError, match="closed"):
            action()
    assert window.micro_batches == 2
    assert issubclass(WindowClosedError, RuntimeError)


def test_window_buffered_states() -> None:
    window = _window(buffered=True)
    assert window.new_gradients_to_buffers
    window.record_micro_batch(in_buffers=True)
    assert window.state is WindowState.IN_BUFFERS and window.sums_in_buffers
    with pytest.raises(RuntimeError, match=r"went to \.grad"):
        window.record_micro_batch(in_buffers=False)
    assert window.flush() is True
    assert window.state is WindowState.FLUSHED and not window.sums_in_buffers
    assert window.flush() is False
    assert window.flush() is False
    assert not window.new_gradients_to_buffers
    window.record_micro_batch(in_buffers=False)  # the last backward adds to .grad
    assert window.state is WindowState.FLUSHED and window.micro_batches == 2
    with pytest.raises(RuntimeError):
        window.record_micro_batch(in_buffers=True)


def test_window_empty_flush_and_restore() -> None:
    window = _window(buffered=True)
    assert window.flush() is False  # nothing buffered yet
    assert window.state is WindowState.FLUSHED
    fresh = _window(buffered=True)
    fresh.restored(in_buffers=True, micro_batches=3)
    assert fresh.state is WindowState.IN_BUFFERS and fresh.micro_batches == 3
    with pytest.raises(RuntimeError, match="empty window"):
        fresh.restored(in_buffers=True, micro_batches=1)
    assert fresh.micro_batches == 3
    plain = _window(buffered=False)
    plain.restored(in_buffers=False, micro_batches=2)
    assert plain.state is WindowState.IN_GRAD


@pytest.mark.parametrize("buffered", [False, True])
def test_accumulator_windows_follow_each_other(buffered: bool) -> None:
    model, accumulator = linear_accumulator(accumulation_dtype="float64" if buffered else None)
    first = accumulator.window
    assert first.state is WindowState.EMPTY and accumulator.window is first
    linear_backward(model, accumulator)
    assert first.state is (WindowState.IN_BUFFERS if buffered else WindowState.IN_GRAD)
    if buffered:
        accumulator.flush_to_grad()
        assert first.state is WindowState.FLUSHED
    linear_backward(model, accumulator)
    assert accumulator.finalize()
    second = accumulator.window
    assert second is not first and second.state is WindowState.EMPTY and second.micro_batches == 0
    assert first.state is WindowState.CLOSED
    with pytest.raises(WindowClosedError):
        first.record_micro_batch(in_buffers=False)
    linear_backward(model, accumulator)
    accumulator.reset()
    third = accumulator.window
    assert third is not second and second.state is WindowState.CLOSED and third.state is WindowState.EMPTY
    assert accumulator.finalize() is False  # empty window: no step, a new one again
    assert accumulator.window is not third and third.state is WindowState.CLOSED


# ---------------------------------------------------------------------------------------- the loss scale


def test_loss_scale_told_only_while_the_window_is_empty() -> None:
    model, accumulator = linear_accumulator()
    assert accumulator.loss_scale == 1.0
    accumulator.loss_scale = 0.5
    assert accumulator.loss_scale == 0.5
    linear_backward(model, accumulator, scale=0.5)
    with pytest.raises(RuntimeError, match="loss_scale"):
        accumulator.loss_scale = 0.25
    assert accumulator.loss_scale == 0.5
    accumulator.loss_scale = 0.5  # the same value: fine
    accumulator.finalize()
    assert accumulator.loss_scale == 0.5  # the next window keeps it
    accumulator.loss_scale = 2
    assert accumulator.loss_scale == 2.0 and isinstance(accumulator.loss_scale, float)
    for bad in (0, 0.0, -1, -0.5, math.nan, INF, -INF, True, False, "1", None, torch.tensor(1.0)):
        with pytest.raises(ValueError, match="loss_scale"):
            accumulator.loss_scale = bad
    assert accumulator.loss_scale == 2.0


@pytest.mark.parametrize("scaling", ["mean", "sum"])
def test_loss_scale_is_divided_out(scaling: str) -> None:
    """Losses scaled by 1/K with loss_scale=1/K give the gradient of unscaled losses with loss_scale=1."""
    grads, losses = [], []
    for loss_scale in (1.0, 0.25):
        torch.manual_seed(3)
        model = nn.Linear(3, 2)
        accumulator = GradAccumulator(model.named_parameters(), 4, scaling=scaling)
        accumulator.loss_scale = loss_scale
        for _ in range(4):
            linear_backward(model, accumulator, scale=loss_scale)
        assert accumulator.finalize()
        grads.append([p.grad.clone() for p in model.parameters()])
        losses.append(accumulator.window_loss)
    for got, want in zip(grads[1], grads[0], strict=True):
        assert torch.equal(got, want)  # powers of two: exact
    assert losses[1] == losses[0] and math.isfinite(losses[0])  # the loss statistic is unscaled too


# ------------------------------------------------------------------------------ the declared quantities


def test_every_declared_quantity_is_totalled_saved_and_restored_by_name() -> None:
    tally = WindowTally(torch.device("cpu"), F64)
    tally.record(4.0, torch.tensor(2.0))
    tally.record(torch.tensor(2.0), torch.tensor(5.0), keep=torch.tensor(True), weight=torch.tensor(0.5))
    tally.add("micro_clips", torch.tensor(1.0))
    tally.add("dropped", 1.0)
    tally.note("the count of batch 3 is -1", None)
    totals = tally.totals()
    assert set(totals) == set(NAMES)
    assert {name: float(value) for name, value in totals.items()} == {
        "items": 6.0,
        "weights": 0.5,
        "loss_sum": 4.0 * 2.0 + 2.0 * 5.0,
        "loss_weight": 6.0,
        "bad_items": 1.0,
        "micro_clips": 1.0,
        "dropped": 1.0,
    }
    doubled = tally.saved(lambda tensor: tensor * 2)  # an all-reduce over two equal ranks
    assert set(doubled) == set(NAMES)
    assert all(doubled[name] == 2 * float(totals[name]) for name in SUMMED)
    assert doubled["dropped"] == 1.0  # agreed on every rank: not summed
    restored, other_rank = WindowTally(torch.device("cpu"), F64), WindowTally(torch.device("cpu"), F64)
    restored.restore(doubled, rescale=0.5, primary=True)
    other_rank.restore(doubled, rescale=0.5, primary=False)
    scaled = {q.name for q in QUANTITIES if q.scaled}
    assert restored.host == {n: doubled[n] * (0.5 if n in scaled else 1.0) for n in NAMES}
    assert other_rank.host == {n: (1.0 if n == "dropped" else 0.0) for n in NAMES}


def test_the_host_copy_takes_every_device_value_in_one_call_and_keeps_host_values() -> None:
    calls: list[int] = []

    def sync(*values: torch.Tensor) -> list[object]:
        calls.append(len(values))
        return [v.tolist() for v in values]

    totals = {"items": torch.tensor(12.0), "weights": 3.0, "bad_items": torch.tensor(0.0), "dropped": 0.0}
    measured = Measurement({**totals, "micro_clips": torch.tensor(1.0)}, torch.tensor([3.0, 4.0]))
    host = measured.to_host(sync)
    assert calls == [4]  # one copy of the four device values
    assert [host[name] for name in ("items", "weights", "bad_items", "micro_clips")] == [12.0, 3.0, 0.0, 1.0]
    assert host.tensor_norms == [3.0, 4.0] and host.l2_norm is None
    assert host.to_host(sync) is host and calls == [4]  # nothing left on the device: no copy


def test_the_statistics_copy_the_packet_with_their_pending_values() -> None:
    ledger = Ledger(torch.float64)
    ledger.fold({"last_grad_norm": torch.tensor(2.5, dtype=torch.float64)})
    host = Measurement({"items": torch.tensor(8.0), "weights": 1.0})
    assert host.to_host(ledger.sync)["items"] == 8.0
    assert ledger.values()["last_grad_norm"] == 2.5  # folded in the same copy


def test_the_mean_loss_is_nan_without_a_loss() -> None:
    assert mean_loss(6.0, 3.0, 0.5) == 4.0
    assert mean_loss(0.0, 0.0, 1.0) != mean_loss(0.0, 0.0, 1.0)  # nan
