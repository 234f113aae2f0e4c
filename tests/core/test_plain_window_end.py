"""The window's end in its plain form is the general one: the same gradients and statistics, bit for bit.

``WindowEnd.close_plain`` ends a default window with the least Python (one host read); everything it does
not take goes through ``WindowEnd.close``. Two accumulators over the same model and data, one held to the
general path, must agree on every window: normalized, clipped, non-finite (skipped or raised), weighted
with no items, K windows and short ones, and on the statistics.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

from lightning_gradacc import GradAccumulator, GradientOverflowError


def run(
    plain: bool, settings: dict[str, Any], *, items: list[int], nan_at: set[int]
) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    accumulator = GradAccumulator(model.named_parameters(), 3, **settings)
    accumulator._end.plain = accumulator._end.plain and plain
    data = torch.Generator().manual_seed(1)
    for index, count in enumerate(items):
        x, y = torch.randn(5, 6, generator=data), torch.randn(5, 3, generator=data)
        loss = nn.functional.mse_loss(model(x), y) * (float("nan") if index in nan_at else 1.0)
        accumulator.backward(loss, items=count)
        accumulator.step(optimizer, force=index == len(items) - 1, on_device=False)
    return model, accumulator.stats


CASES = {
    "mean": {},
    "sum": {"scaling": "sum"},
    "clipped": {"max_grad_norm": 0.05},
    "weighted": {"scaling": "weighted"},
    "float64-overflow-ignored-not": {"overflow": "skip", "max_grad_norm": 1e9},
}


@pytest.mark.parametrize("settings", list(CASES.values()), ids=list(CASES))
def test_the_plain_end_is_the_general_one(settings: dict[str, Any]) -> None:
    items = [5, 3, 0, 4, 4, 4, 0, 0, 0, 2, 7]  # window 2 (6-8) holds no items: empty under "weighted"
    nan_at = {4}  # window 1 is not finite: skipped
    plain_model, plain_stats = run(True, settings, items=items, nan_at=nan_at)
    general_model, general_stats = run(False, settings, items=items, nan_at=nan_at)
    for a, b in zip(plain_model.parameters(), general_model.parameters(), strict=True):
        assert torch.equal(a, b)
    memory = {"peak_memory_bytes": 0}  # the process's peak, read anew at each snapshot
    expected = pytest.approx(general_stats.as_dict() | memory, nan_ok=True, rel=0)
    assert plain_stats.as_dict() | memory == expected
    assert plain_stats.skipped_steps == 1 and plain_stats.non_finite_windows == 1
    if settings.get("scaling") == "weighted":
        assert plain_stats.empty_windows == 1


def test_the_plain_end_takes_the_default_window_and_raises_as_the_general_one() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    accumulator = GradAccumulator(model.named_parameters(), 1)
    assert accumulator._end.plain
    calls: list[Any] = []
    general = accumulator._end.close
    accumulator._end.close = lambda *a, **k: calls.append(a) or general(*a, **k)  # type: ignore[method-assign]
    accumulator.backward(model(torch.ones(2, 3)).sum(), items=2)
    assert accumulator.finalize() and calls == []  # the plain form: the general path never ran
    copied = copy.deepcopy(model)
    raising = GradAccumulator(copied.named_parameters(), 1, overflow="raise")
    raising.backward(copied(torch.ones(2, 3)).sum() * math.nan, items=2)
    with pytest.raises(GradientOverflowError, match="step 0"):
        raising.finalize()
