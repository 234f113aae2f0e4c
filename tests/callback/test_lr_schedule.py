"""A learning-rate schedule indexed by items consumed (``lr_schedule``): the same per item whatever K runs.

Oracle: plain PyTorch, one SGD step per window on the window's samples as one batch, at the learning rate
the schedule gives (written out here from its definition) for the samples of the windows before it; the
windows of a fixed K, of an items-keyed schedule and of an ``"auto"`` run (read from the Trainer).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest

from lightning_gradacc import GradientAccumulationCallback, TokenSchedule
from lightning_gradacc.k_policies import AutoSettings
from lightning_gradacc.lr_schedule import make_schedule
from tests import helpers as h

SAMPLES = 80  # 20 micro-batches of 4 samples per epoch
EPOCHS = 3
TOTAL, WARMUP, FINAL = 160, 24, 0.1  # samples: the decay ends in the third epoch


def expected_factor(samples: float) -> float:
    """Linear warmup over 24 samples, cosine to 0.1 at 160, then 0.1: the definition, written out."""
    if samples < WARMUP:
        return samples / WARMUP
    if samples >= TOTAL:
        return FINAL
    return FINAL + (1 - FINAL) * 0.5 * (1 + math.cos(math.pi * (samples - WARMUP) / (TOTAL - WARMUP)))


def test_the_factor_at_known_points() -> None:
    cosine = TokenSchedule(total="1k", warmup=100, final=0.2)
    assert [cosine.factor(n) for n in (0, 50, 100, 550, 1000, 5000)] == pytest.approx(
        [0.0, 0.5, 1.0, 0.6, 0.2, 0.2]
    )
    linear = TokenSchedule(total=1000, warmup=0, decay="linear")
    assert [linear.factor(n) for n in (0, 250, 1000)] == pytest.approx([1.0, 0.75, 0.0])
    constant = TokenSchedule(total=1000, warmup=100, decay="constant")
    assert [constant.factor(n) for n in (10, 100, 10**6)] == pytest.approx([0.1, 1.0, 1.0])
    assert make_schedule({"total": "2.4B", "warmup": "10M"}) == TokenSchedule(2_400_000_000, 10_000_000)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"total": 100, "warmup": 200}, "`lr_schedule.warmup` \\(200\\) to be at least 0 and at most"),
        ({"total": 0}, "which must be more than 0"),
        ({"total": 100, "decay": "step"}, "lr_schedule.decay"),
        ({"total": 100, "final": 1.5}, "`lr_schedule.final` to be a number in \\[0, 1\\], but got 1.5"),
        ({"total": 100, "decay": "constant", "final": 0.1}, "cannot take effect with `lr_schedule.decay"),
    ],
)
def test_bad_schedules_name_the_field(fields: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        TokenSchedule(**fields)


def test_a_bad_lr_schedule_argument_is_refused_at_construction() -> None:
    with pytest.raises(TypeError, match="`lr_schedule` to be a TokenSchedule, a mapping"):
        GradientAccumulationCallback(4, lr_schedule=0.1)  # type: ignore[arg-type]


POLICIES: dict[str, dict[str, Any]] = {
    "fixed": {"accumulation_steps": 1},
    "items": {"accumulation_steps": {0: 1, 40: 2, 100: 4}, "schedule_unit": "items"},
    "auto": {
        "accumulation_steps": "auto",
        "auto": AutoSettings(budget=4.0, patience=1, max_k=8, powers_of_two=False),
    },
}


@pytest.mark.parametrize("policy", POLICIES)
def test_the_learning_rate_per_sample_is_the_schedule_s_whatever_k_runs(policy: str) -> None:
    """Each step's learning rate is the schedule's at the samples of the windows before it, with windows of
    K=1, of K growing by samples, and of K chosen by "auto": the same function of samples in all three."""
    module, windows, recorder = (
        h.RegressionModule(h.regression_data(SAMPLES), lr=0.2),
        h.SteppedWindows(),
        h.MetricsRecorder(),
    )
    callback = GradientAccumulationCallback(
        **POLICIES[policy], lr_schedule={"total": TOTAL, "warmup": WARMUP, "final": FINAL}
    )
    h.fit(module, callback, windows, max_epochs=EPOCHS, logger=recorder, log_every_n_steps=1)
    before = [4.0 * sum(len(w) for w in windows.windows[:i]) for i in range(len(windows.windows))]
    factors = [expected_factor(samples) for samples in before]
    assert [f for _, f in recorder.series("grad_accum/lr_factor")] == pytest.approx(factors, rel=1e-12)
    assert len({len(w) for w in windows.windows}) >= (1 if policy == "fixed" else 2)
    expected = h.big_batch_reference(
        h.regression_net(), module.data, 4, windows.windows, h.mse, lr=0.2, lr_factors=factors
    )
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert callback.items_consumed == 4.0 * SAMPLES // 4 * EPOCHS


def test_under_a_grad_scaler_each_step_takes_the_factor_of_the_items_before_its_window() -> None:
    """``precision="16-mixed"`` with a real GradScaler: the scaler steps after the callback closed the window,
    so the step's factor must come from the items before that window, not after it (one window ahead)."""
    module, windows, recorder = (
        h.RegressionModule(h.regression_data(SAMPLES), lr=0.2),
        h.SteppedWindows(),
        h.MetricsRecorder(),
    )
    callback = GradientAccumulationCallback(2, lr_schedule={"total": TOTAL, "warmup": WARMUP, "final": FINAL})
    h.fit(
        module,
        callback,
        windows,
        max_epochs=EPOCHS,
        logger=recorder,
        log_every_n_steps=1,
        plugins=[h.amp_plugin()],
    )
    before = [4.0 * sum(len(w) for w in windows.windows[:i]) for i in range(len(windows.windows))]
    factors = [expected_factor(samples) for samples in before]
    assert factors[:3] == [0.0, 8 / 24, 16 / 24]
    assert [f for _, f in recorder.series("grad_accum/lr_factor")] == pytest.approx(factors, rel=1e-12)
    expected = h.big_batch_reference(
        h.regression_net(),
        module.data,
        4,
        windows.windows,
        h.mse,
        lr=0.2,
        lr_factors=factors,
        fp16_autocast=True,
    )
    # fp16 autocast, micro- vs big-batch rounding: 3.8e-4 measured over 30 steps (a window ahead: 0.12)
    assert h.max_abs_diff(module.net, expected) < 5e-4


def test_a_schedule_whose_item_budget_the_run_does_not_match_is_warned_of_at_its_first_window() -> None:
    """240 samples in 3 epochs: a budget of 2,400 would leave the learning rate near its peak at the end
    (warned, with the estimate and the factor reached); 240 is the run's (no warning)."""
    budget = TokenSchedule(total=2400, warmup=24)
    with pytest.warns(
        UserWarning, match=r"spans 2,400 items .* about 240 \(4.0 items per batch .* x 60 batches\)"
    ):
        h.fit(
            h.RegressionModule(h.regression_data(SAMPLES)),
            GradientAccumulationCallback(2, lr_schedule=budget),
            max_epochs=EPOCHS,
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "`lr_schedule` spans")
        schedule = TokenSchedule(total=240, warmup=24)
        h.fit(
            h.RegressionModule(h.regression_data(SAMPLES)),
            GradientAccumulationCallback(2, lr_schedule=schedule),
            max_epochs=EPOCHS,
        )
