"""Saved states: the accumulator's counters and its open window load back exactly, or are refused.

A state of another format version, or with a missing or bad value, is refused before anything changes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_gradacc import GradAccumulator
from lightning_gradacc.core.checkpoint import FORMAT_VERSION
from lightning_gradacc.core.statistics import INTEGERS, AccumulationStats
from tests.helpers import linear_accumulator, linear_backward, run_plain_loop

SAVED_STATE = {
    "version": FORMAT_VERSION,
    "accumulation_steps": 4,
    "windows": 12,
    "total_micro_batches": 45,
    "micro_batches_last_step": 3,
    "peak_memory_bytes": 12345,
    "non_finite_windows": 2.0,
    "dropped_micro_batches": 3.0,
    "skipped_steps": 2.0,
    "clipped_steps": 5.0,
    "empty_windows": 1.0,
    "last_grad_norm": 0.75,
    "max_grad_norm_seen": 3.5,
    "items_last_step": 24.0,
    "window_loss": 0.125,
}


def test_accumulator_loads_its_saved_state_and_counts_on() -> None:
    model, accumulator = linear_accumulator()
    accumulator.load_state_dict(SAVED_STATE)
    assert accumulator.state_dict()["peak_memory_bytes"] == 12345  # restored (re-measured when read)
    stats = accumulator.stats
    assert stats.windows == 12 and stats.total_micro_batches == 45 and stats.micro_batches_last_step == 3
    assert (stats.non_finite_windows, stats.dropped_micro_batches, stats.skipped_steps) == (2, 3, 2)
    assert (stats.clipped_steps, stats.empty_windows, stats.steps_taken) == (5, 1, 12 - 2 - 1)
    assert stats.last_grad_norm == 0.75 and stats.max_grad_norm_seen == 3.5 and stats.items_last_step == 24.0
    assert accumulator.window_loss == 0.125
    assert all(isinstance(getattr(stats, name), int) for name in INTEGERS)
    _, other = linear_accumulator()
    other.load_state_dict(accumulator.state_dict())
    assert _without_peak(other.stats) == _without_peak(stats)
    linear_backward(model, accumulator)
    linear_backward(model, accumulator)
    accumulator.finalize()
    assert accumulator.stats.windows == 13 and accumulator.stats.total_micro_batches == 47


def _without_peak(stats: AccumulationStats) -> AccumulationStats:
    """The statistics but the process's memory peak, which grows on its own (it is read when asked)."""
    return dataclasses.replace(stats, peak_memory_bytes=0)


def test_accumulator_load_state_rejects_bad_states_and_changes_nothing() -> None:
    """Formats 1 and 2 were never released: only the current one loads, and a refusal names the version."""
    model, accumulator = linear_accumulator()
    linear_backward(model, accumulator)
    linear_backward(model, accumulator)
    accumulator.finalize()
    before = accumulator.stats
    for bad in (
        dict(SAVED_STATE, version=FORMAT_VERSION + 1),
        {k: v for k, v in SAVED_STATE.items() if k != "version"},
        {k: v for k, v in SAVED_STATE.items() if k != "windows"},
        dict(SAVED_STATE, version=1),
        dict(SAVED_STATE, version=2),
        dict(SAVED_STATE, version=str(FORMAT_VERSION)),
        {k: v for k, v in SAVED_STATE.items() if k != "skipped_steps"},
    ):
        with pytest.raises(ValueError, match=r"version|missing"):
            accumulator.load_state_dict(bad)
        assert _without_peak(accumulator.stats) == _without_peak(before)


def test_accumulator_load_state_with_a_bad_value_changes_nothing() -> None:
    _, accumulator = linear_accumulator()
    before = accumulator.stats
    for bad in (
        dict(SAVED_STATE, total_micro_batches="x"),
        dict(SAVED_STATE, skipped_steps="x"),
        dict(SAVED_STATE, clipped_steps=None),
    ):
        with pytest.raises((ValueError, TypeError)):
            accumulator.load_state_dict(bad)
        assert _without_peak(accumulator.stats) == _without_peak(before)


def test_state_dict_round_trip_keeps_counters(tmp_path: object) -> None:
    _, accumulator = run_plain_loop({"max_grad_norm": 0.5}, 4, nan_at=(1,))
    path = f"{tmp_path}/state.pt"
    torch.save(accumulator.state_dict(), path)
    restored = GradAccumulator([torch.zeros(1, requires_grad=True)], 4)
    restored.load_state_dict(torch.load(path, weights_only=True))
    # the process's memory peak is read when asked (it grows on its own): not compared
    assert dataclasses.replace(restored.stats, peak_memory_bytes=0) == dataclasses.replace(
        accumulator.stats, num_parameters=1, peak_memory_bytes=0
    )
    with pytest.raises(ValueError, match="version 99"):
        restored.load_state_dict({"version": 99})


def test_a_window_of_an_unreleased_format_is_refused_before_anything_changes() -> None:
    """Formats 1 and 2 (before 0.2, never released) recorded no loss or AMP scale: refused, naming why."""
    net = nn.Linear(2, 1)
    accumulator = GradAccumulator(net.named_parameters(), 2)
    accumulator.loss_scale = 0.5
    net(torch.ones(1, 2)).sum().mul(0.5).backward()
    accumulator.record(1)
    state = accumulator.window_state_dict()
    assert state is not None
    restored_net = nn.Linear(2, 1)
    restored = GradAccumulator(restored_net.named_parameters(), 2)
    restored.loss_scale = 0.5
    old = {key: value for key, value in state.items() if key not in ("loss_scale", "amp_scale")}
    with pytest.raises(
        ValueError, match="has format version 2; this version of lightning_gradacc reads 3 and 4"
    ):
        restored.load_window_state_dict({**old, "version": 2})
    with pytest.raises(ValueError, match=r"is missing \['loss_scale', 'amp_scale'\]"):
        restored.load_window_state_dict(old)
    assert restored_net.weight.grad is None and restored.window.empty
    restored.load_window_state_dict(state)
    assert torch.equal(restored_net.weight.grad, net.weight.grad)


def _noise_window() -> tuple[nn.Linear, GradAccumulator, dict]:
    """A window of 2 of K=3 micro-batches with the noise scale on, saved."""
    torch.manual_seed(0)
    net = nn.Linear(2, 1)
    accumulator = GradAccumulator(net.named_parameters(), 3, noise_scale=True)
    for i in range(2):
        accumulator.backward(net(torch.randn(4, 2) + i).square().mean(), items=4)
    state = accumulator.window_state_dict()
    assert state is not None and isinstance(state["noise"]["totals"], dict)
    return net, accumulator, state


def _finish(net: nn.Linear, accumulator: GradAccumulator) -> tuple[torch.Tensor, float, float]:
    torch.manual_seed(1)
    accumulator.backward(net(torch.randn(4, 2)).square().mean(), items=4)
    assert accumulator.finalize()
    stats = accumulator.stats
    assert net.weight.grad is not None
    return net.weight.grad.clone(), stats.grad_sq_norm_estimate, stats.trace_sigma_estimate


def test_a_format_3_window_with_its_noise_totals_as_a_list_resumes_as_the_new_form() -> None:
    """Format 3 saved the noise scale's window totals as a list in `noise.TOTALS` order: still read."""
    from lightning_gradacc.core.noise import TOTALS

    saved_net, _, state = _noise_window()
    old = {
        **state,
        "version": 3,
        "noise": {**state["noise"], "totals": [state["noise"]["totals"][n] for n in TOTALS]},
    }
    results = []
    for saved in (state, old):
        net = nn.Linear(2, 1)
        net.load_state_dict(saved_net.state_dict())
        restored = GradAccumulator(net.named_parameters(), 3, noise_scale=True)
        restored.load_window_state_dict(saved)
        results.append(_finish(net, restored))
    (new_grad, *new_noise), (old_grad, *old_noise) = results
    assert torch.equal(new_grad, old_grad) and new_noise == old_noise
    assert all(value == value for value in new_noise)  # measured (not nan): the totals went on


@pytest.mark.parametrize(
    "bad",
    [
        lambda n: {**n, "totals": {k: v for k, v in n["totals"].items() if k != "unusable"}},
        lambda n: {**n, "totals": list(n["totals"].values())[:5]},
        lambda n: {k: v for k, v in n.items() if k != "micro_batches"},
    ],
)
def test_a_window_with_unreadable_noise_totals_is_refused_before_anything_changes(bad: object) -> None:
    _, _, state = _noise_window()
    net = nn.Linear(2, 1)
    restored = GradAccumulator(net.named_parameters(), 3, noise_scale=True)
    with pytest.raises(ValueError, match="noise-scale totals that cannot be read"):
        restored.load_window_state_dict({**state, "noise": bad(state["noise"])})  # type: ignore[operator]
    assert net.weight.grad is None and restored.window.empty
