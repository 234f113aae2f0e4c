"""RunAccounts: lifetime counters and per-window statistics, and their saved form."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_gradacc.core.accounts import RunAccounts

CPU, F64 = torch.device("cpu"), torch.float64


def test_a_reevaluated_window_replaces_its_statistics_without_counting_again() -> None:
    accounts = RunAccounts(CPU, F64)
    accounts.micro_batch_recorded(reevaluation=False)
    accounts.close_window({"last_grad_norm": 2.0, "clipped_steps": True}, micro_batches=1)
    accounts.micro_batch_recorded(reevaluation=True)
    accounts.close_window({"last_grad_norm": 3.0, "clipped_steps": True}, micro_batches=1, reevaluation=True)
    stats = accounts.snapshot(accumulation_steps=1)
    assert (stats.windows, stats.total_micro_batches, stats.clipped_steps) == (1, 1, 1)
    assert stats.last_grad_norm == 3.0


def test_an_empty_window_is_counted_and_has_no_loss() -> None:
    accounts = RunAccounts(CPU, F64)
    accounts.close_empty_window()
    stats = accounts.snapshot(accumulation_steps=4)
    assert (stats.windows, stats.empty_windows, stats.micro_batches_last_step) == (1, 1, 0)
    assert math.isnan(accounts.window_loss)


def test_the_saved_form_round_trips_and_a_bad_one_changes_nothing() -> None:
    accounts = RunAccounts(CPU, F64)
    accounts.micro_batch_recorded(reevaluation=False)
    accounts.close_window({"skipped_steps": torch.tensor(True), "window_loss": 0.5}, micro_batches=1)
    saved = accounts.state_dict()
    restored = RunAccounts(CPU, F64)
    restored.load_state_dict(saved)
    assert restored.snapshot(accumulation_steps=1) == accounts.snapshot(accumulation_steps=1)
    for bad, message in (({**saved, "version": 2}, "version 2"), ({"version": saved["version"]}, "missing")):
        with pytest.raises(ValueError, match=message):
            restored.load_state_dict(bad)
    assert restored.windows == 1
