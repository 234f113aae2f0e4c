"""RunStatistics, the run's statistics in one part: the ledger of per-window statistics against a fold
written out, the lifetime counters and their saved form, the process's memory peak, and the snapshot."""

from __future__ import annotations

import math
import random
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_gradacc import GradAccumulator, GradientAccumulationCallback
from lightning_gradacc.core import statistics as ledger_module
from lightning_gradacc.core.statistics import COUNTERS, NAMES, STATISTICS, UNMEASURED, Ledger, RunStatistics
from tests import helpers as h
from tests.helpers import F32, F64, INF, linear_accumulator, linear_backward

CPU = torch.device("cpu")


def test_a_reevaluated_window_replaces_its_statistics_without_counting_again() -> None:
    statistics = RunStatistics(CPU, F64)
    statistics.record_micro_batch(reevaluation=False)
    statistics.close_window({"last_grad_norm": 2.0, "clipped_steps": True}, micro_batches=1)
    statistics.record_micro_batch(reevaluation=True)
    statistics.close_window(
        {"last_grad_norm": 3.0, "clipped_steps": True}, micro_batches=1, reevaluation=True
    )
    stats = statistics.snapshot(accumulation_steps=1)
    assert (stats.windows, stats.total_micro_batches, stats.clipped_steps) == (1, 1, 1)
    assert stats.last_grad_norm == 3.0


def test_an_empty_window_is_counted_and_has_no_loss() -> None:
    statistics = RunStatistics(CPU, F64)
    statistics.close_empty_window()
    stats = statistics.snapshot(accumulation_steps=4)
    assert (stats.windows, stats.empty_windows, stats.micro_batches_last_step) == (1, 1, 0)
    assert math.isnan(statistics.window_loss)


def test_the_saved_form_round_trips_and_a_bad_one_changes_nothing() -> None:
    statistics = RunStatistics(CPU, F64)
    statistics.record_micro_batch(reevaluation=False)
    statistics.close_window({"skipped_steps": torch.tensor(True), "window_loss": 0.5}, micro_batches=1)
    saved = statistics.state_dict()
    restored = RunStatistics(CPU, F64)
    restored.load_state_dict(saved)
    assert restored.snapshot(accumulation_steps=1) == statistics.snapshot(accumulation_steps=1)
    with pytest.raises(ValueError, match="missing"):  # the format version is the accumulator's to check
        restored.load_state_dict({"windows": 1})
    assert restored.windows == 1


def _oracle_fold(state: dict, window: dict, count: bool) -> None:
    folds = {s.name: s.fold for s in STATISTICS}
    values = {k: float(v) for k, v in window.items()}
    if "last_grad_norm" in values:
        values["max_grad_norm_seen"] = values["last_grad_norm"]
    for name, value in values.items():
        fold = folds[name]
        if fold == "sum":
            if count:
                state[name] += value
        elif fold == "max":
            if math.isfinite(value) and value > state[name]:
                state[name] = value
        else:
            state[name] = value


def _assert_ledger(values: dict, oracle: dict) -> None:
    assert set(values) == set(oracle)
    for name, want in oracle.items():
        got = values[name]
        assert (math.isnan(got) and math.isnan(want)) or got == want, (name, got, want)


@pytest.mark.parametrize("seed", range(4))
def test_ledger_folds_host_and_device_values_in_any_order(seed: int) -> None:
    rng = random.Random(seed)
    ledger = Ledger(F64)
    oracle = dict.fromkeys(NAMES, 0.0) | dict.fromkeys(UNMEASURED, math.nan)  # nan: nothing measured yet
    _assert_ledger(ledger.values(), oracle)
    for _ in range(40):
        window: dict = {}
        for statistic in STATISTICS:
            if statistic.name == "max_grad_norm_seen" or rng.random() < 0.2:
                continue
            if statistic.fold == "sum":
                value = float(rng.randint(0, 2))
            else:
                value = rng.choice([rng.uniform(0, 10), rng.uniform(0, 10), math.nan, INF])
            on_device = rng.random() < 0.5
            window[statistic.name] = torch.tensor(value, dtype=rng.choice([F32, F64])) if on_device else value
        count = rng.random() < 0.8
        ledger.fold(window, count=count)
        _oracle_fold(oracle, {k: float(v) for k, v in window.items()}, count)
        if rng.random() < 0.2:
            _assert_ledger(ledger.values(), oracle)
            assert ledger.fresh
    _assert_ledger(ledger.values(), oracle)
    _assert_ledger(ledger.state_dict(), oracle)


def test_ledger_last_follows_fold_order_across_host_and_device() -> None:
    ledger = Ledger(F64)
    ledger.fold({"last_grad_norm": torch.tensor(5.0), "skipped_steps": torch.tensor(1.0)})
    assert not ledger.fresh
    ledger.fold({"last_grad_norm": 3.0, "skipped_steps": 1.0})  # host values after a pending device row
    ledger.fold({"items_last_step": torch.tensor(7.0)})
    values = ledger.values()
    assert values["last_grad_norm"] == 3.0 and values["max_grad_norm_seen"] == 5.0
    assert values["skipped_steps"] == 2.0 and values["items_last_step"] == 7.0
    assert ledger.fresh


def test_ledger_non_finite_norm_is_last_but_not_max() -> None:
    for value in (math.nan, INF, torch.tensor(math.nan), torch.tensor(INF)):
        ledger = Ledger(F64)
        ledger.fold({"last_grad_norm": 2.0})
        ledger.fold({"last_grad_norm": value})
        values = ledger.values()
        assert not math.isfinite(values["last_grad_norm"])
        assert values["max_grad_norm_seen"] == 2.0
    ledger = Ledger(F64)
    ledger.fold({"last_grad_norm": torch.tensor(math.nan)})
    assert ledger.values()["max_grad_norm_seen"] == 0.0


def test_ledger_count_false_leaves_counters() -> None:
    for device in (False, True):
        ledger = Ledger(F64)

        def value(v: float, _device: bool = device):
            return torch.tensor(v, dtype=F64) if _device else v

        ledger.fold({name: value(1.0) for name in COUNTERS} | {"last_grad_norm": value(1.0)})
        ledger.fold(
            {name: value(5.0) for name in COUNTERS}
            | {"last_grad_norm": value(4.0), "items_last_step": value(9.0), "window_loss": value(0.5)},
            count=False,
        )
        values = ledger.values()
        assert all(values[name] == 1.0 for name in COUNTERS)
        assert values["last_grad_norm"] == 4.0 and values["max_grad_norm_seen"] == 4.0
        assert values["items_last_step"] == 9.0 and values["window_loss"] == 0.5


def test_ledger_syncs_every_max_pending_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ledger_module, "MAX_PENDING", 3)
    syncs = []
    original = Ledger.sync

    def counting_sync(self, *extra):
        syncs.append(len(self._pending))
        return original(self, *extra)

    monkeypatch.setattr(Ledger, "sync", counting_sync)
    ledger = Ledger(F64)
    for index in range(7):
        ledger.fold({"clipped_steps": torch.tensor(1.0), "last_grad_norm": torch.tensor(float(index))})
        assert ledger.fresh == ((index + 1) % 3 == 0), index
    assert syncs == [3, 3]
    values = ledger.values()
    assert values["clipped_steps"] == 7.0 and values["last_grad_norm"] == 6.0
    assert values["max_grad_norm_seen"] == 6.0


def test_ledger_sync_returns_extra_values_and_folds() -> None:
    ledger = Ledger(F64)
    assert ledger.sync(torch.tensor(2.5)) == [2.5]
    ledger.fold({"skipped_steps": torch.tensor(1.0)})
    assert ledger.sync(torch.tensor(1.5), torch.tensor(3, dtype=torch.int64)) == [1.5, 3.0]
    assert ledger.fresh and ledger.values()["skipped_steps"] == 1.0


def test_ledger_load_state_dict_takes_known_names_and_starts_the_others_afresh() -> None:
    ledger = Ledger(F64)
    ledger.fold({"dropped_micro_batches": torch.tensor(4.0)})  # pending: dropped by the load
    ledger.load_state_dict(
        {
            "non_finite_windows": 3,
            "clipped_steps": 2,
            "skipped_steps": 1,
            "other": 5.0,
            "last_grad_norm": 1.5,
            "max_grad_norm_seen": 2.5,
        }
    )
    values = ledger.values()
    assert values["non_finite_windows"] == 3.0 and values["clipped_steps"] == 2.0
    assert values["skipped_steps"] == 1.0 and values["dropped_micro_batches"] == 0.0
    assert values["empty_windows"] == 0.0 and math.isnan(values["window_loss"])
    assert values["last_grad_norm"] == 1.5 and values["max_grad_norm_seen"] == 2.5
    assert set(values) == set(NAMES)
    ledger.load_state_dict(dict(values, window_loss=0.25))
    assert ledger.values() == dict(values, window_loss=0.25)


def test_ledger_deferred_last_values_are_computed_once_when_read() -> None:
    calls: list[str] = []

    def deferred(name: str, value):
        def compute():
            calls.append(name)
            return value

        return compute

    ledger = Ledger(F64)
    ledger.fold({"window_loss": deferred("first", 1.0), "skipped_steps": 1.0})
    ledger.fold({"window_loss": deferred("second", torch.tensor(2.0)), "skipped_steps": torch.tensor(1.0)})
    assert calls == []  # superseded before any read: "first" is never computed
    assert ledger.values(deferred=False)["skipped_steps"] == 2.0 and calls == []
    assert ledger.values()["window_loss"] == 2.0 and calls == ["second"]
    assert ledger.values()["window_loss"] == 2.0 and calls == ["second"]  # once
    # a deferred value after a pending device value of the same statistic wins, and vice versa
    ledger.fold({"window_loss": torch.tensor(3.0)})
    ledger.fold({"window_loss": deferred("third", 4.0)})
    assert ledger.values()["window_loss"] == 4.0
    ledger.fold({"window_loss": deferred("fourth", 5.0)})
    ledger.fold({"window_loss": torch.tensor(6.0)})
    assert ledger.values()["window_loss"] == 6.0 and "fourth" not in calls
    ledger.fold({"window_loss": deferred("fifth", 7.0)})
    ledger.load_state_dict({"window_loss": 0.5})
    assert ledger.values()["window_loss"] == 0.5 and "fifth" not in calls


def test_a_held_count_check_raises_at_the_next_sync_after_folding() -> None:
    ledger = Ledger(torch.float64)
    ledger.fold({"skipped_steps": torch.tensor(1.0)})
    ledger.hold_check(torch.tensor(0.0), lambda count: f"{count} bad")
    assert not ledger.fresh
    assert ledger.values()["skipped_steps"] == 1.0  # nothing held was bad
    ledger.fold({"skipped_steps": torch.tensor(1.0)})
    ledger.hold_check(torch.tensor(2.0), lambda count: f"{count} bad (first)")
    ledger.hold_check(torch.tensor(1.0), lambda count: f"{count} bad (second)")
    with pytest.raises(ValueError, match=r"^3 bad \(first\)$"):
        ledger.values()
    assert ledger.fresh and ledger.values()["skipped_steps"] == 2.0  # folded before it raised


def _process_peak() -> int:
    """The kernel's resident-set peak of this process (what a user, `ru_maxrss` or a monitor reads)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")
def test_the_memory_peak_is_read_and_never_reset_for_the_whole_process() -> None:
    """A 128 MiB peak made before the accumulator exists is still the process's peak after a fit with the
    callback logging every step (it used to reset it: a user's own reading fell by the difference)."""
    big = torch.ones(128 * 2**20 // 4)  # touched, then freed
    big.add_(1.0)
    del big
    peak = _process_peak()
    accumulator = GradAccumulator(nn.Linear(3, 1).parameters(), 1)
    assert accumulator.stats.peak_memory_bytes >= peak
    module = h.RegressionModule(h.regression_data(40))
    callback = GradientAccumulationCallback(2)
    h.trainer(callbacks=[callback], logger=h.MetricsRecorder(), log_every_n_steps=1).fit(module)
    assert _process_peak() >= peak
    assert callback.stats.peak_memory_bytes >= peak


def test_stats_of_a_run_with_skipped_and_empty_windows() -> None:
    model, accumulator = linear_accumulator(max_grad_norm=1e-3)
    linear_backward(model, accumulator)
    linear_backward(model, accumulator)
    assert accumulator.finalize()  # stepped and clipped
    linear_backward(model, accumulator, scale=math.nan)
    linear_backward(model, accumulator)
    assert not accumulator.finalize()  # not finite: skipped
    assert model.weight.grad is None
    assert not accumulator.finalize()  # empty
    linear_backward(model, accumulator)
    stats = accumulator.stats
    assert (stats.windows, stats.skipped_steps, stats.empty_windows, stats.non_finite_windows) == (3, 1, 1, 1)
    assert stats.steps_taken == 1 == stats.windows - stats.skipped_steps - stats.empty_windows
    assert stats.clipped_steps == 1 and stats.open_window_micro_batches == 1
    assert accumulator.window.micro_batches == 1
    assert stats.as_dict()["steps_taken"] == 1
