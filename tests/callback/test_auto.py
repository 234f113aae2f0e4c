"""``accumulation_steps="auto"``: K chosen window by window from the measured noise scale.

Oracles:

- replay: the windows an "auto" run stepped, read from the Trainer after every batch, replayed in plain
  PyTorch as fixed windows (one optimizer step on each window's samples as one batch) give the same
  parameters: on one device, on 2 DDP ranks with the goodput rule and an injected clock (both ranks decide
  the same), with token-weighted windows, across a resume inside a window, a second fit and an interrupted
  one (FSDP2: ``tests/distributed/test_model_parallel.py``);
- controller: on the noise-scale tests' fixed problem, whose exact B_noise ``torch.func`` computes, every
  target is the rule applied to the exact value, within the estimator's spread.

The rule itself (bounds, powers of two, hysteresis, goodput's timings, the saved state) is checked on the
policy alone, with hand-computed numbers.
"""

from __future__ import annotations

import datetime
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_gradacc import GradAccumulator, GradientAccumulationCallback, estimated_stepping_batches
from lightning_gradacc.k_policies import TIMINGS, AutoK, AutoSettings, WindowFacts
from tests import helpers as h

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

SAMPLES = 80  # regression samples: 20 micro-batches of 4 per epoch on one device
EPOCHS = 6
AUTO = {"patience": 1, "max_k": 8, "powers_of_two": False}  # K follows the rule closely: many transitions


# ---------------------------------------------------------------------------------------- the rule


def facts(
    noise_scale: float, *, b: float = 32.0, k: int = 2, world: int = 1, ridden: Any = None
) -> WindowFacts:
    """A full window of ``k`` micro-batches of ``b`` items on each of ``world`` ranks."""
    return WindowFacts(1, 0.0, k, k, world, b * k * world, noise_scale, dict(ridden or {}))


def decided(settings: AutoSettings, *windows: WindowFacts, world: int = 1) -> AutoK:
    policy = AutoK(settings).for_fit(1, world_size=world)
    assert isinstance(policy, AutoK)
    for window in windows:
        policy.window_closed(window)
    return policy


@pytest.mark.parametrize(
    ("options", "noise_scale", "world", "expected"),
    [
        ({}, 300.0, 1, 8),  # 300 / 32 = 9.4: the largest power of two within it
        ({"powers_of_two": False}, 300.0, 1, 9),
        ({"powers_of_two": False}, 300.0, 2, 4),  # b W = 64: 4.7
        ({"budget": 0.5, "powers_of_two": False}, 300.0, 1, 4),  # 4.7
        ({}, 10.0, 1, 2),  # below 1: the smallest K one rank can estimate with
        ({}, 10.0, 2, 1),  # two ranks estimate at K=1
        ({}, 1e6, 1, 64),  # max_k
        ({"min_k": 4, "powers_of_two": False}, 40.0, 1, 4),
    ],
)
def test_the_budget_rule(options: dict[str, Any], noise_scale: float, world: int, expected: int) -> None:
    policy = decided(
        AutoSettings(patience=1, decrease=True, **options), facts(noise_scale, world=world), world=world
    )
    assert policy.k == expected == policy.metrics()["auto_target_k"]


@pytest.mark.parametrize(("powers_of_two", "expected"), [(True, 16), (False, 22)])
def test_the_goodput_rule_from_the_times_summed_over_ranks(powers_of_two: bool, expected: int) -> None:
    """Two ranks timed 20 accumulating micro-batches (25 s: 1.25 s each) and 2 stepping ones (2 x 13.25 s:
    12 s more each); K* = sqrt(12 x 200 / (1.25 x 2 x 2)) = 21.9 = 2^4.45: nearer 16 than 32 in log scale."""
    settings = AutoSettings(rule="goodput", patience=1, powers_of_two=powers_of_two)
    policy = decided(
        settings,
        facts(200.0, b=2.0, world=2, ridden=dict(zip(TIMINGS, (25.0, 20.0, 26.5, 2.0), strict=True))),
        world=2,
    )
    metrics = policy.metrics()
    assert metrics["auto_t_micro"] == 1.25 and metrics["auto_t_step"] == 12.0
    assert policy.k == expected
    assert decided(settings, facts(200.0, b=2.0, world=2), world=2).k == 2  # no times yet: no target


def test_a_target_must_hold_for_patience_windows_and_k_does_not_fall_by_default() -> None:
    policy = decided(AutoSettings(patience=3), facts(300.0), facts(300.0))
    assert policy.k == 2 and policy.metrics()["auto_target_k"] == 8
    policy.window_closed(facts(math.nan))  # a window without an estimate breaks the run
    policy.window_closed(facts(300.0))
    policy.window_closed(facts(150.0))  # larger than K, if not the same target: the run goes on
    assert policy.k == 2
    policy.window_closed(facts(600.0))
    assert policy.k == 16  # the last target
    for _ in range(3):
        policy.window_closed(facts(64.0))  # asks for 2
    assert policy.k == 16 and policy.metrics()["auto_target_k"] == 2
    assert policy.trajectory == [(0, 0.0, 2), (1, 0.0, 16)]


def test_with_decrease_k_falls_and_never_below_what_one_rank_can_estimate_with() -> None:
    policy = decided(AutoSettings(patience=1, decrease=True), facts(600.0), facts(1.0))
    assert policy.k == 2


def test_the_controller_s_saved_state_decides_the_rest_as_the_uninterrupted_one() -> None:
    """Saved after any window (a new target pending or not, timings averaged), loaded into the controller
    of a new fit: the K and the logged values of every later window are the uninterrupted controller's."""
    settings = AutoSettings(rule="goodput", patience=2, powers_of_two=False)
    windows = [
        facts(
            50.0 * (i % 5 + 1), b=4.0, ridden=dict(zip(TIMINGS, (3.0 * (i + 1), 3.0, 20.0, 1.0), strict=True))
        )
        for i in range(12)
    ]
    whole = decided(settings)
    trace = []
    for window in windows:
        whole.window_closed(window)
        trace.append((whole.k, whole.metrics(), whole.trajectory[-1]))
    assert len({k for k, _, _ in trace}) > 2
    pending = 0
    for split in range(1, len(windows)):
        first = decided(settings, *windows[:split])
        pending += first.pending is not None
        restored = AutoK(settings).for_fit(1)
        restored.load_state_dict(first.state_dict())
        rest = []
        for window in windows[split:]:
            restored.window_closed(window)
            rest.append((restored.k, restored.metrics(), restored.trajectory[-1]))
        assert rest == trace[split:], split
    assert pending > 0  # some saves held a target not yet taken


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ({"accumulation_steps": "auto", "target_batch_size": 64}, "leave `target_batch_size` \\(64\\)"),
        ({"accumulation_steps": 4, "auto": AutoSettings()}, "Argument `auto` .* `accumulation_steps` is 4"),
        ({"accumulation_steps": "Auto"}, "a positive int, a schedule dict, 'auto' or None, but got 'Auto'"),
    ],
)
def test_auto_arguments_that_do_not_go_together(arguments: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        GradientAccumulationCallback(**arguments)


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"budget": 0}, "`auto.budget` to be a number > 0, but got 0"),
        ({"budget": True}, "`auto.budget` to be a number > 0, but got True"),
        ({"rule": "fastest"}, "auto.rule"),
        ({"min_k": 8, "max_k": 4}, r"`auto.min_k` <= `auto.start_k` <= `auto.max_k`, but got 8, None, 4"),
        ({"patience": 0}, "auto.patience"),
        ({"powers_of_two": "yes"}, "`auto.powers_of_two` to be True or False"),
        ({"clock": 3.0}, "`auto.clock` to be callable"),
    ],
)
def test_bad_auto_settings_name_the_field(settings: dict[str, Any], error: str) -> None:
    with pytest.raises((ValueError, TypeError), match=error):
        AutoSettings(**settings)


def test_one_rank_refuses_bounds_that_would_leave_k_at_1_before_training() -> None:
    module = h.RegressionModule()
    callback = GradientAccumulationCallback("auto", auto=AutoSettings(start_k=1))
    with pytest.raises(ValueError, match=r"auto.start_k=1.*one micro-batch gives no noise-scale estimate"):
        h.fit(module, callback)
    assert h.max_abs_diff(module.net, h.regression_net()) == 0


class OneCycle(h.RegressionModule):
    def __init__(self, most: bool) -> None:
        super().__init__(h.regression_data(SAMPLES))
        self.most = most

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        total = estimated_stepping_batches(self.trainer, most=self.most)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=int(total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_step_counts_are_unknown_before_an_auto_run_and_the_most_it_can_take_is_offered() -> None:
    with pytest.raises(
        ValueError, match=r"chooses K while training.*`estimated_stepping_batches\(trainer, most=True\)`"
    ):
        h.fit(OneCycle(most=False), GradientAccumulationCallback("auto"))
    module = OneCycle(most=True)
    trainer = h.fit(module, GradientAccumulationCallback("auto", auto=AutoSettings(**AUTO)), max_epochs=2)
    assert trainer.lr_scheduler_configs[0].scheduler.total_steps == 20  # 2 epochs of 20 batches at K=2


# ------------------------------------------------------------------------------- through Trainer.fit


def auto_callback(**auto: Any) -> GradientAccumulationCallback:
    return GradientAccumulationCallback("auto", auto=AutoSettings(**{**AUTO, **auto}))


def test_the_windows_of_an_auto_run_replay_as_fixed_windows() -> None:
    """K grows from 2 as the regression converges (|G| falls, B_noise rises); every window is one step on
    its samples as one batch. Each step logs its K, the rule's target and the estimate; the summary shows
    the trajectory."""
    module = h.RegressionModule(h.regression_data(SAMPLES), lr=0.05)
    recorder, windows, callback = h.MetricsRecorder(), h.SteppedWindows(), auto_callback()
    h.fit(module, callback, windows, max_epochs=EPOCHS, logger=recorder, log_every_n_steps=1)
    sizes = [len(window) for window in windows.windows]
    assert sizes[0] == 2 and len(set(sizes) - {max(sizes)} - {2}) >= 1 and max(sizes) >= 4
    expected = h.big_batch_reference(h.regression_net(), module.data, 4, windows.windows, h.mse, lr=0.05)
    assert h.max_abs_diff(module.net, expected) < 1e-6
    logged_k = [int(k) for _, k in recorder.series("grad_accum/accumulation_steps")]
    assert len(logged_k) == len(sizes)
    for window, k in zip(windows.windows, logged_k, strict=True):  # an epoch's last window may be shorter
        assert k == len(window) or (window[-1] == SAMPLES // 4 - 1 and k > len(window))
    targets = recorder.series("grad_accum/auto_target_k")
    estimates = recorder.series("grad_accum/auto_noise_scale")
    assert len(targets) == len(estimates) == len(sizes)
    trajectory = callback.plan.run.trajectory
    summary = callback.summary()
    assert "auto (budget): K=2 at step 0 (0 items)" in summary and f"K={trajectory[-1][2]} at step" in summary
    assert "gradient noise scale" in summary


def test_a_token_weighted_auto_run_replays_as_fixed_windows() -> None:
    """Items are the real tokens (``count_tokens``): the rule reads the tokens per micro-batch, and every
    window is the mean over all of its tokens."""
    data = h.token_data(96, seed=3)
    module = h.TokenModule(data)
    windows = h.SteppedWindows()
    callback = GradientAccumulationCallback(
        "auto", scaling="weighted", item_count_fn=h.count_tokens, auto=AutoSettings(budget=0.5, **AUTO)
    )
    h.fit(module, callback, windows, max_epochs=4)
    sizes = {len(window) for window in windows.windows}
    assert len(sizes) >= 3, sizes
    expected = h.big_batch_reference(h.token_net(), data, 2, windows.windows, h.token_loss, lr=0.5)
    assert h.max_abs_diff(module.net, expected) < 1e-6


FAKE_NOW = [0.0]  # the injected clock's time, advanced by the module (per process)


class FakeClock:
    def __call__(self) -> float:
        return FAKE_NOW[0]


class Timed(h.RegressionModule):
    """By the fake clock a micro-batch takes 1 s on rank 0 and 1.5 s on rank 1; a step 12 s more."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        FAKE_NOW[0] += 1.0 + 0.5 * self.global_rank
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        FAKE_NOW[0] += 12.0


@pytest.mark.slow
def test_two_ddp_ranks_decide_the_same_goodput_k_from_their_summed_times(tmp_path: Path) -> None:
    """t_micro = 1.25 s (both ranks), t_step = 12 s; K* = sqrt(12 B / (1.25 x 8)) for micro-batches of 4
    on 2 ranks. The windows replay as one big batch of both ranks' samples."""
    callback = auto_callback(rule="goodput", clock=FakeClock())
    # ranks that decided differently would wait on each other's collectives: fail in 60 s, not gloo's 30 min
    strategy = h.SpawnStrategy(timeout=datetime.timedelta(seconds=60))
    trainer = h.ddp_trainer(callback, h.SteppedWindows(tmp_path), max_epochs=EPOCHS, strategy=strategy)
    module = Timed(h.regression_data(2 * SAMPLES), lr=0.05)
    trainer.fit(module)
    (windows, trajectory, estimates), (other, other_trajectory, _) = (
        torch.load(tmp_path / f"windows-{rank}.pt") for rank in range(2)
    )
    assert windows == other and trajectory == other_trajectory
    assert trajectory[0][2] == 2 and len(trajectory) >= 3, trajectory  # K=2 (timing), then 2 changes
    expected = h.big_batch_reference(
        h.regression_net(), h.regression_data(2 * SAMPLES), 8, windows, h.mse, lr=0.05
    )
    assert h.max_abs_diff(module.net, expected) < 1e-6  # ddp_spawn brings rank 0's weights back
    # the estimates the rule read: those of one process holding both ranks' micro-batches in its window
    # (rank r's micro-batch b: rows r, r + 2, ... of rows [8b, 8b + 8))
    net = h.regression_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    x, y = h.regression_data(2 * SAMPLES).tensors
    for window, found in zip(windows, estimates, strict=True):
        accumulator = GradAccumulator(net.named_parameters(), 2 * len(window), noise_scale=True)
        for rank in range(2):
            for b in window:
                rows = slice(8 * b + rank, 8 * b + 8, 2)
                accumulator.backward(h.mse(net, x[rows], y[rows]), items=4)
        accumulator.step(optimizer)
        accumulator.remove_hooks()
        wanted = (accumulator.stats.grad_sq_norm_estimate, accumulator.stats.trace_sigma_estimate)
        assert found == pytest.approx(wanted, rel=1e-4, abs=1e-9), (found, wanted)


def test_goodput_refuses_to_start_where_it_cannot_time_an_accumulating_micro_batch() -> None:
    with pytest.raises(ValueError, match=r"at K=1 every micro-batch steps"):
        AutoK(AutoSettings(rule="goodput", start_k=1)).for_fit(1, world_size=2)
    assert AutoK(AutoSettings(rule="goodput")).for_fit(1, world_size=2).k_at(0, 0, 0.0) == 2
    assert AutoK(AutoSettings()).for_fit(1, world_size=2).k_at(0, 0, 0.0) == 1


# ---------------------------------------------------------------------------------- the controller

CONTROLLER_BATCHES = 500  # x4 micro-batches of 1 sample: about 270 windows


def test_every_target_is_the_rule_applied_to_an_estimate_near_the_exact_noise_scale() -> None:
    """A fixed model (learning rate 0) on the noise-scale tests' data, micro-batches of 1 sample: the exact
    B_noise is 7.84 samples (``torch.func``), so the rule (budget 1) asks for K = 7. K follows every target
    (patience 1, falling too, no rounding to powers of two); every target is the rule applied to the
    estimate it was decided from, and every such estimate lies within 4 of the estimator's standard
    deviations of the exact B_noise (the deviation itself under 20% of it, the mean within 10%)."""
    true_g, true_trace = h.noise_truth()
    exact = true_trace / true_g
    settings = AutoSettings(patience=1, decrease=True, powers_of_two=False, max_k=64)
    recorder = h.MetricsRecorder()
    trainer = h.trainer(
        callbacks=[GradientAccumulationCallback("auto", auto=settings)],
        use_distributed_sampler=False,
        logger=recorder,
        log_every_n_steps=1,
    )
    trainer.fit(h.FixedModel([1], windows=CONTROLLER_BATCHES))
    targets = [v for _, v in recorder.series("grad_accum/auto_target_k")]
    estimates = [v for _, v in recorder.series("grad_accum/auto_noise_scale")]
    ks = [int(v) for _, v in recorder.series("grad_accum/accumulation_steps")]
    assert ks[0] == 2 and len(targets) > 250
    for target, k_next in zip(targets, ks[1:], strict=False):  # each window's K is the last target
        assert k_next == (target if math.isfinite(target) else k_next)
    settled = torch.tensor(estimates[20:])  # after the averages' warm-up
    spread = float(settled.std())
    assert spread < 0.2 * exact and abs(float(settled.mean()) - exact) < 0.1 * exact, (settled.mean(), spread)
    assert all(abs(estimate - exact) < 4 * spread for estimate in estimates[20:])
    for target, estimate in zip(targets[20:], estimates[20:], strict=True):
        assert target == min(max(math.floor(estimate), 2), 64)  # 1 item per micro-batch, 1 rank
    counts = {k: targets[20:].count(k) for k in set(targets[20:])}
    assert max(counts, key=counts.__getitem__) in (math.floor(exact), math.floor(exact) + 1), counts


# ------------------------------------------------------------------- resume, second fit, interrupted fit


class StatefulTimed(Timed):
    """:class:`Timed` reading its data with ``StatefulDataLoader`` (it resumes mid-epoch)."""

    def train_dataloader(self) -> DataLoader[Any]:
        return StatefulDataLoader(self.data, batch_size=self.batch_size)


DECISIONS = ["accumulation_steps", "auto_target_k", "auto_noise_scale", "auto_t_micro", "auto_t_step"]


def decisions(recorder: h.MetricsRecorder, since: int = 0) -> dict[str, list[tuple[int, float]]]:
    return {
        name: [(s, v) for s, v in recorder.series(f"grad_accum/{name}") if s >= since] for name in DECISIONS
    }


@pytest.mark.parametrize("rule", ["budget", "goodput"])
def test_a_resume_inside_a_window_goes_on_as_the_uninterrupted_run_decisions_included(
    tmp_path: Path, rule: str
) -> None:
    """Saved inside the first window after K's first change, with a new target pending (patience 2)."""

    def callback() -> GradientAccumulationCallback:
        return auto_callback(rule=rule, patience=2, clock=FakeClock())

    whole, windows, recorder = (
        StatefulTimed(h.regression_data(SAMPLES), lr=0.05),
        h.SteppedWindows(),
        h.MetricsRecorder(),
    )
    h.trainer(callbacks=[callback(), windows], max_epochs=EPOCHS, logger=recorder, log_every_n_steps=1).fit(
        whole
    )
    sizes = [len(window) for window in windows.windows]
    change = next(i for i in range(1, len(sizes)) if sizes[i] > sizes[i - 1] and sizes[i] > 2)
    at = sum(sizes[:change]) + 1  # the second micro-batch of that window
    path = tmp_path / "mid.ckpt"
    h.preempt(StatefulTimed(h.regression_data(SAMPLES), lr=0.05), [callback()], at, path, max_epochs=EPOCHS)
    resumed, resumed_recorder = StatefulTimed(h.regression_data(SAMPLES), lr=0.05), h.MetricsRecorder()
    trainer = h.trainer(
        callbacks=[callback()], max_epochs=EPOCHS, logger=resumed_recorder, log_every_n_steps=1
    )
    trainer.fit(resumed, ckpt_path=path)
    assert h.max_abs_diff(resumed.net, whole.net) < 1e-6
    after = decisions(resumed_recorder)
    assert after["auto_target_k"] and after == decisions(recorder, since=after["auto_target_k"][0][0])
    assert len(set(sizes)) >= 3


def test_a_second_fit_goes_on_from_the_k_the_interrupted_first_one_reached() -> None:
    """The first fit is interrupted inside a window (its micro-batches are discarded); a second fit of the
    same module with the same callback starts a window of its own at the K the first one reached, and every
    stepped window of both replays as one big batch."""
    module, windows, callback = (
        h.RegressionModule(h.regression_data(SAMPLES), lr=0.05),
        h.SteppedWindows(),
        auto_callback(),
    )
    with pytest.raises(RuntimeError, match="boom"):
        h.trainer(
            callbacks=[callback, windows, h.RaiseAfter(101, RuntimeError("boom"))], max_epochs=EPOCHS
        ).fit(module)
    reached, first_fit = callback.plan.run.k, len(windows.windows)
    assert reached > 2 and windows._open  # interrupted inside a window, after K changed
    h.trainer(callbacks=[callback, windows], max_epochs=2).fit(module)
    assert len(windows.windows[first_fit]) == reached
    assert callback.plan.run.trajectory[: len(callback.plan.run.trajectory)][0] == (0, 0.0, 2)
    expected = h.big_batch_reference(h.regression_net(), module.data, 4, windows.windows, h.mse, lr=0.05)
    assert h.max_abs_diff(module.net, expected) < 1e-6


def test_k_never_exceeds_max_k_when_the_rule_asks_for_more() -> None:
    """A budget 50 times the noise scale asks for far more than ``max_k=5`` (not a power of two): every
    window holds at most 5 micro-batches, K reaches 5, and the windows replay as one big batch each."""
    module = h.RegressionModule(h.regression_data(SAMPLES), lr=0.05)
    recorder, windows = h.MetricsRecorder(), h.SteppedWindows()
    callback = auto_callback(budget=50.0, max_k=5)
    h.fit(module, callback, windows, max_epochs=2, logger=recorder, log_every_n_steps=1)
    sizes = [len(window) for window in windows.windows]
    assert max(sizes) == 5 and sizes.count(5) >= 4, sizes
    assert max(k for _, k in recorder.series("grad_accum/auto_target_k")) == 5
    expected = h.big_batch_reference(h.regression_net(), module.data, 4, windows.windows, h.mse, lr=0.05)
    assert h.max_abs_diff(module.net, expected) < 1e-6


class SkipsWindow(h.RegressionModule):
    """`training_step` returns None for batches 2 and 3: the whole second window (K=2) is empty."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx in (2, 3) else loss


@pytest.mark.filterwarnings("ignore:`training_step` returned `None`")
def test_an_empty_window_decides_nothing_and_logs_no_estimate() -> None:
    """A window whose every step returned None measured no items and no noise: K stays where the window
    before it put it (an empty window read as 1 item per micro-batch jumped to ``max_k``), and its logged
    estimates are nan, not the last window's."""
    module = SkipsWindow(h.regression_data(SAMPLES), lr=0.05)
    recorder, windows = h.MetricsRecorder(), h.SteppedWindows()
    callback = auto_callback(max_k=8)
    h.fit(module, callback, windows, max_epochs=1, logger=recorder, log_every_n_steps=1)
    sizes = [len(window) for window in windows.windows]
    assert sizes[:3] == [2, 2, 2], sizes  # the first window's estimate keeps K at 2 (budget 1.0)
    logged = {name: [v for _, v in recorder.series(f"grad_accum/{name}")] for name in DECISIONS}
    estimates = {
        name: [v for _, v in recorder.series(f"grad_accum/{name}")]
        for name in ("grad_sq_norm_estimate", "trace_sigma_estimate", "window_loss")
    }
    assert math.isnan(logged["auto_target_k"][1]) and not math.isnan(logged["auto_target_k"][0])
    for name, values in estimates.items():
        assert math.isnan(values[1]) and not math.isnan(values[0]) and not math.isnan(values[2]), name
    kept = [[b for b in window if b not in (2, 3)] for window in windows.windows]
    expected = h.big_batch_reference(
        h.regression_net(), module.data, 4, [w for w in kept if w], h.mse, lr=0.05
    )
    assert h.max_abs_diff(module.net, expected) < 1e-6


class VaryingTimed(StatefulTimed):
    """By the fake clock every micro-batch and every step costs its own time, a function of where training
    stands (the global batch index, the step): the same in a resumed run, whatever its process saw before."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        FAKE_NOW[0] += 0.5 + 0.25 * (self.trainer.fit_loop.total_batch_idx * 7 % 5)
        return h.RegressionModule.training_step(self, batch, batch_idx)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        FAKE_NOW[0] += 8.0 + 3.0 * (self.trainer.global_step % 3)


def test_goodput_resumes_at_every_position_of_a_window_as_the_uninterrupted_run(tmp_path: Path) -> None:
    """Costs that vary per micro-batch: resumed after each micro-batch of a window of 3 or more after K
    changed, and after the window before it (window-end checkpoints), every later decision (K, target,
    estimate, t_micro, t_step) and the parameters are the uninterrupted run's. Before, the open window's
    timing sums and the batch in flight were lost at the save: other timings, another K, other parameters."""

    def callback() -> GradientAccumulationCallback:
        return auto_callback(rule="goodput", patience=2, clock=FakeClock())

    epochs = 3
    whole, windows = VaryingTimed(h.regression_data(SAMPLES), lr=0.05), h.SteppedWindows()
    recorder = h.MetricsRecorder()
    trainer = h.trainer(
        callbacks=[callback(), windows], max_epochs=epochs, logger=recorder, log_every_n_steps=1
    )
    trainer.fit(whole)
    sizes = [len(window) for window in windows.windows]
    change = next(i for i in range(1, len(sizes)) if sizes[i] > sizes[i - 1] and sizes[i] > 2)
    first = sum(sizes[:change])  # the window's first micro-batch (global index)
    # the window before ends there: a window-end checkpoint (not at an epoch's last batch: torchdata's loader
    # saved there yields nothing in the next epoch, with or without this callback)
    positions = [first - 1, *range(first, first + sizes[change])]
    for at in positions:
        path = tmp_path / f"at{at}.ckpt"
        h.preempt(
            VaryingTimed(h.regression_data(SAMPLES), lr=0.05), [callback()], at, path, max_epochs=epochs
        )
        resumed, resumed_recorder = VaryingTimed(h.regression_data(SAMPLES), lr=0.05), h.MetricsRecorder()
        h.trainer(
            callbacks=[callback()], max_epochs=epochs, logger=resumed_recorder, log_every_n_steps=1
        ).fit(resumed, ckpt_path=path)
        after = decisions(resumed_recorder)
        assert after["auto_t_micro"], at
        expected = decisions(recorder, since=after["auto_t_micro"][0][0])
        # the noise scale's estimate may differ in its last bits (torch 2.9 sums in another order after a
        # restore); every decision and timing is the same number
        noise, expected_noise = after.pop("auto_noise_scale"), expected.pop("auto_noise_scale")
        assert after == expected, at
        assert [s for s, _ in noise] == [s for s, _ in expected_noise], at
        assert [v for _, v in noise] == pytest.approx([v for _, v in expected_noise], rel=1e-12), at
        assert h.max_abs_diff(resumed.net, whole.net) < 1e-6, at


def test_a_format_3_state_with_the_timings_as_a_list_loads_as_the_new_form() -> None:
    """Format 3 saved goodput's open-window timings as a list in `TIMINGS` order: still read."""
    policy = decided(AutoSettings(rule="goodput", patience=1))
    ticks = iter([0.0, 1.5, 4.0])
    policy.clock = lambda: next(ticks, 4.0)  # type: ignore[method-assign]  # then still at 4 s (the save)
    for _ in range(3):
        policy.batch_started()
    state = policy.state_dict()
    assert state["timed"]["accumulating_seconds"] == 4.0 and state["timed"]["accumulating_batches"] == 2.0
    old = {**state, "timed": [state["timed"][name] for name in TIMINGS]}
    restored = [AutoK(AutoSettings(rule="goodput", patience=1)).for_fit(1) for _ in range(2)]
    for saved, into in zip((state, old), restored, strict=True):
        into.load_state_dict(saved)
    assert restored[0].state_dict()["timed"] == restored[1].state_dict()["timed"] == state["timed"]
