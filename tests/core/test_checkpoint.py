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
    with pytest.raises(ValueError, match="has format version 2; this version of lightning_gradacc reads 3"):
        restored.load_window_state_dict({**old, "version": 2})
    with pytest.raises(ValueError, match=r"is missing \['loss_scale', 'amp_scale'\]"):
        restored.load_window_state_dict(old)
    assert restored_net.weight.grad is None and restored.window.empty
    restored.load_window_state_dict(state)
    assert torch.equal(restored_net.weight.grad, net.weight.grad)
