"""Schedules keyed by optimizer steps or items: every window equals the big batch of its own micro-batches.

The reference takes windows of exactly the lengths the schedule implies (a window's K is the schedule's value
at the count reached when it opens; an epoch's end closes a window), one SGD step each on all of the window's
data as one batch.
"""

from __future__ import annotations

import pytest
import torch

from lightning_gradacc import GradientAccumulationCallback
from lightning_gradacc.window_plan import window_lightning_k
from tests import helpers as h

BATCHES = 10  # 40 samples in micro-batches of 4


def schedule_windows(
    schedule: dict[int, int], *, epochs: int = 1, unit: str = "steps", items_per_batch: int = 4
) -> list[list[int]]:
    """Windows of batch indices (of the whole data, epoch after epoch) as the schedule implies."""
    keyed = h.keyed_windows(schedule, BATCHES, epochs=epochs, unit=unit, items=lambda b: items_per_batch)
    return [window for window, _ in keyed]


def fit(callback: GradientAccumulationCallback, epochs: int = 1) -> tuple[h.RegressionModule, object]:
    module = h.RegressionModule(h.regression_data(40))
    trainer = h.trainer(callbacks=[callback], max_epochs=epochs)
    trainer.fit(module)
    return module, trainer


@pytest.mark.parametrize(
    "schedule",
    [
        {0: 1, 1: 3},  # 1 | 3 3 3: a transition after the first step
        {0: 2, 2: 3},  # 2 2 | 3 3: mid-epoch, not at a multiple
        {0: 4, 1: 3, 2: 2},  # 4 | 3 | 2 2 2 - 1: decreasing, the last window partial
        {0: 3, 1: 4, 3: 1},  # 3 | 4 | 3 (partial) ; increasing then down to 1
        {0: 1, 3: 7},  # 1 1 1 | 7: a window longer than what is left (the epoch's end closes it)
    ],
    ids=str,
)
def test_a_step_keyed_schedule_equals_the_big_batch_of_each_window(schedule: dict[int, int]) -> None:
    callback = GradientAccumulationCallback(schedule, schedule_unit="steps")
    module, trainer = fit(callback, epochs=2)
    expected = schedule_windows(schedule, epochs=2)
    assert trainer.global_step == len(expected)  # type: ignore[attr-defined]
    assert h.max_abs_diff(module.net, h.regression_reference(expected)) < 1e-6


@pytest.mark.parametrize("position", range(1, BATCHES))
def test_a_transition_at_every_position_of_an_epoch(position: int) -> None:
    """K=1 for the first `position` steps, then 3: the change lands at every batch index once."""
    schedule = {0: 1, position: 3}
    module, _ = fit(GradientAccumulationCallback(schedule, schedule_unit="steps"))
    assert h.max_abs_diff(module.net, h.regression_reference(schedule_windows(schedule))) < 1e-6


def test_an_item_keyed_schedule_follows_the_items_consumed() -> None:
    """Thresholds in samples (written as YAML would, "12"): K=1 until 12 samples, 2 until 20, then 3."""
    schedule = {0: 1, "12": 2, 20: 3}
    module, _ = fit(GradientAccumulationCallback(schedule, schedule_unit="items"))
    expected = schedule_windows({0: 1, 12: 2, 20: 3}, unit="items")
    assert [len(w) for w in expected] == [1, 1, 1, 2, 3, 2]  # 4 samples each: 4 8 12 | 20 | 32
    assert h.max_abs_diff(module.net, h.regression_reference(expected)) < 1e-6


def test_the_naive_per_batch_setter_fails_the_same_oracle() -> None:
    """Negative control: setting `trainer.accumulate_grad_batches` from `global_step` at each batch start
    (Lightning PR #21583's approach) leaves Lightning's zero/step decisions on the old modulo."""
    import pytorch_lightning as pl

    schedule = {0: 2, 2: 3}

    class NaiveSetter(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
            step = trainer.global_step
            trainer.accumulate_grad_batches = [v for t, v in sorted(schedule.items()) if t <= step][-1]

    module = h.RegressionModule(h.regression_data(40))
    h.trainer(callbacks=[NaiveSetter()], max_epochs=2).fit(module)
    error = h.max_abs_diff(module.net, h.regression_reference(schedule_windows(schedule, epochs=2)))
    assert error > 1e-2


def test_lightning_is_driven_to_every_wanted_decision() -> None:
    """For every window start and length, Lightning's own tests (zero: n % K == 0, step: ready % K == 0)
    step at the window's last batch and neither step nor zero inside it; K is a power of two wherever one
    divides the window's end."""
    for first in range(1, 1500):
        for length in range(1, 13):
            k = window_lightning_k(first, length)
            end = first + length - 1
            assert end % k == 0  # steps at the window's last batch
            assert all(ready % k for ready in range(first, end))  # no step inside
            assert all(n % k for n in range(first, end))  # no zeroing inside (batch n = ready - 1)
            powers = [p for p in (1 << j for j in range(12)) if p >= length and end % p == 0]
            assert k == min(powers) if powers else k >= length


def test_a_resume_inside_the_first_window_after_a_transition_is_exact(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Saved after batch 5 (inside the first 3-window after two 2-windows), resumed: the same parameters as
    the uninterrupted fit."""
    schedule = {0: 2, 2: 3}
    whole = h.RegressionModule(h.regression_data(40), resumable=True)
    h.trainer(callbacks=[GradientAccumulationCallback(schedule, schedule_unit="steps")], max_epochs=2).fit(
        whole
    )
    stopped = h.RegressionModule(h.regression_data(40), resumable=True)
    h.preempt(
        stopped, [GradientAccumulationCallback(schedule, schedule_unit="steps")], 5, tmp_path / "mid.ckpt"
    )
    resumed = h.RegressionModule(h.regression_data(40), resumable=True)
    callback = GradientAccumulationCallback(schedule, schedule_unit="steps")
    h.trainer(callbacks=[callback], max_epochs=2).fit(resumed, ckpt_path=str(tmp_path / "mid.ckpt"))
    assert h.max_abs_diff(resumed.net, whole.net) < 1e-7


def test_schedule_unit_needs_a_schedule_and_keys_are_checked() -> None:
    with pytest.raises(ValueError, match=r"schedule_unit='steps'.*keys a schedule"):
        GradientAccumulationCallback(4, schedule_unit="steps")
    with pytest.raises(ValueError, match="schedule_unit"):
        GradientAccumulationCallback({0: 1}, schedule_unit="tokens")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="whole numbers >= 0"):
        GradientAccumulationCallback({"1.5k5": 2}, schedule_unit="items")


@pytest.mark.parametrize(
    ("schedule", "unit", "samples"),
    [
        ({0: 2, 2: 3}, "steps", 40),
        ({0: 1, 3: 4}, "steps", 38),
        ({0: 1, 12: 2, 20: 3}, "items", 40),
        ({0: 1, 8: 3}, "items", 38),
    ],
    ids=str,
)
def test_estimated_stepping_batches_counts_the_steps_of_the_schedule(
    schedule: dict[int, int], unit: str, samples: int
) -> None:
    """A `OneCycleLR` built from it completes exactly: the scheduler's total equals the steps taken."""
    import torch

    from lightning_gradacc import estimated_stepping_batches

    class OneCycle(h.RegressionModule):
        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            self.total = estimated_stepping_batches(self.trainer)
            scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=self.total)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    module = OneCycle(h.regression_data(samples))
    trainer = h.trainer(callbacks=[GradientAccumulationCallback(schedule, schedule_unit=unit)], max_epochs=2)
    trainer.fit(module)
    assert module.total == trainer.global_step


def test_a_token_keyed_schedule_cannot_be_counted_before_training() -> None:
    """Tokens are known only once the data is read: asked in `configure_optimizers`, the count refuses."""
    import torch

    from lightning_gradacc import estimated_stepping_batches
    from lightning_gradacc.counters import count_tokens

    class AsksForTheCount(h.TokenModule):
        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            estimated_stepping_batches(self.trainer)
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callback = GradientAccumulationCallback(
        {0: 1, "1k": 2}, schedule_unit="items", scaling="weighted", item_count_fn=count_tokens
    )
    with pytest.raises(ValueError, match="cannot be counted before training"):
        h.trainer(callbacks=[callback]).fit(AsksForTheCount(h.token_data()))


def test_each_step_says_its_k_and_the_items_consumed_so_far() -> None:
    schedule = {0: 1, 12: 2, 20: 3}
    callback = GradientAccumulationCallback(schedule, schedule_unit="items")
    fit(callback)
    assert callback.items_consumed == 40  # every sample of the epoch, in closed windows
    assert callback.stats.accumulation_steps == 3 and callback.stats.items_last_step == 8  # [8, 9]: partial


@pytest.mark.parametrize(("mode", "power"), [("sqrt", 0.5), ("linear", 1.0)])
def test_lr_scaling_multiplies_each_step_by_the_window_k_and_leaves_the_scheduler_alone(
    mode: str, power: float
) -> None:
    """Oracle: the reference steps each window with lr x (K / K_first) ** p; a StepLR's own value is
    unchanged at the end (the factor exists only during the step)."""
    import torch

    schedule = {0: 1, 2: 4}
    factors: list[float] = []

    class WithStepLR(h.RegressionModule):
        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            self.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler, "interval": "step"}}

    module = WithStepLR(h.regression_data(40))
    callback = GradientAccumulationCallback(schedule, schedule_unit="steps", lr_scaling=mode)
    trainer = h.trainer(callbacks=[callback])
    trainer.fit(module)
    windows = schedule_windows(schedule)  # 1 1 | 4 4 | 0
    assert [len(w) for w in windows] == [1, 1, 4, 4]
    # the reference: StepLR halves every 2 steps; each window's lr times (K / 1) ** p
    reference = h.regression_net()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    tensors = h.regression_data(40).tensors
    for index, window in enumerate(windows):
        factor = (len(window) if index < 3 else 4) ** power
        factors.append(factor)
        rows = torch.cat([torch.arange(4 * b, 4 * b + 4) for b in window])
        optimizer.zero_grad()
        h.mse(reference, *(t[rows] for t in tensors)).backward()
        for group in optimizer.param_groups:
            group["lr"] = 0.1 * 0.5 ** (index // 2) * factor
        optimizer.step()
    assert h.max_abs_diff(module.net, reference) < 1e-6
    assert module.scheduler.get_last_lr() == [0.1 * 0.5**2]  # the scheduler never saw the factor
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.1 * 0.5**2
    assert callback.metrics()["grad_accum/lr_factor"] == factors[-1]


def test_lr_scaling_is_checked() -> None:
    with pytest.raises(ValueError, match="lr_scaling"):
        GradientAccumulationCallback({0: 1, 2: 4}, schedule_unit="steps", lr_scaling="square")  # type: ignore[arg-type]


def test_a_linear_ramp_is_a_schedule_and_bad_ramps_are_refused() -> None:
    from lightning_gradacc import linear_ramp

    ramp = linear_ramp(1, 3, 16, start=4)  # samples: K=1 until 12, 2 until 20, then 3
    assert ramp == {0: 1, 12: 2, 20: 3}
    module, _ = fit(GradientAccumulationCallback(ramp, schedule_unit="items"))
    assert h.max_abs_diff(module.net, h.regression_reference(schedule_windows(ramp, unit="items"))) < 1e-6
    with pytest.raises(ValueError, match="whole number of `increment`"):
        linear_ramp(1, 4, 100, increment=2)


def test_a_linear_ramp_with_an_increment_reaches_its_last_k() -> None:
    """Megatron's ``--rampup-batch-size 2 2 ...`` form: K 2, 4, 6 by steps, the windows those Ks imply."""
    from lightning_gradacc import linear_ramp

    ramp = linear_ramp(2, 6, 4, increment=2)
    module, _ = fit(GradientAccumulationCallback(ramp, schedule_unit="steps"), epochs=2)
    written_out = {0: 2, 2: 4, 4: 6}  # K=2 for steps 0-1, 4 for steps 2-3, 6 from step 4 (the 2nd epoch)
    reference = h.regression_reference(schedule_windows(written_out, epochs=2))
    assert h.max_abs_diff(module.net, reference) < 1e-6


def test_an_lr_schedule_indexed_by_the_items_consumed() -> None:
    """The documented LambdaLR: a linear warmup over the first 16 samples, read from `items_consumed`."""
    import torch

    schedule = {0: 1, 8: 2}
    callback = GradientAccumulationCallback(schedule, schedule_unit="items")
    seen: list[float] = []

    class TokenWarmup(h.RegressionModule):
        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)

            def lr_at(step: int) -> float:
                seen.append(callback.items_consumed or 0)
                return min(1.0, (callback.items_consumed or 0) / 16)

            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    module = TokenWarmup(h.regression_data(40))
    h.trainer(callbacks=[callback]).fit(module)
    assert seen == [
        0,
        4,
        8,
        16,
        24,
        32,
        40,
    ]  # at construction, then after each window: 1, 1, 2, 2, 2, 2 batches
    assert module.trainer.optimizers[0].param_groups[0]["lr"] == 0.1


def test_a_driven_schedule_is_refused_under_16_true() -> None:
    """Lightning would divide fp16 losses by a per-batch K of up to an epoch's batches (underflow)."""
    callback = GradientAccumulationCallback({0: 1, 2: 3}, schedule_unit="steps")
    with pytest.raises(RuntimeError, match="16-true"):
        h.trainer(callbacks=[callback], precision="16-true").fit(h.RegressionModule(h.regression_data(40)))


def test_the_summary_shows_the_stages_reached() -> None:
    callback = GradientAccumulationCallback({0: 1, 12: 2, 20: 3, "1k": 8}, schedule_unit="items")
    fit(callback)
    row = next(line for line in callback.summary().splitlines() if line.startswith("schedule"))
    assert row.endswith("by items: 3 of 4 stages reached (K=3 now); 6 steps, 40 items consumed")


def test_a_target_batch_size_per_stage_derives_each_stage_k(recwarn: pytest.WarningsRecorder) -> None:
    """Micro-batches of 4 samples: 4 items per step for 2 steps, then 12 (K=3), then 10 -> K=3 (rounded up,
    with a warning naming the stage)."""
    callback = GradientAccumulationCallback(target_batch_size={0: 4, 2: 12, 4: 10}, schedule_unit="steps")
    module, _ = fit(callback, epochs=2)
    assert callback.plan.run is not None and callback.plan.run.resolved.schedule == {0: 1, 2: 3, 4: 3}  # type: ignore[attr-defined]
    expected = schedule_windows({0: 1, 2: 3}, epochs=2)
    assert h.max_abs_diff(module.net, h.regression_reference(expected)) < 1e-6
    assert any("10 -> K=3" in str(w.message) for w in recwarn)
    with pytest.raises(ValueError, match="per stage"):
        GradientAccumulationCallback(target_batch_size={0: 4, 2: 12})


@pytest.mark.parametrize("scaling", ["mean", "sum", "weighted"])
def test_a_skipped_window_and_clipping_inside_a_schedule(scaling: str) -> None:
    """A nan in micro-batch 4 (the first window after the transition, batches 4-6) skips that window only;
    every other window is clipped to 0.05 as one big batch would be, with Adam (a skip leaves its state)."""
    schedule = {0: 2, 2: 3}
    callback = GradientAccumulationCallback(
        schedule, schedule_unit="steps", scaling=scaling, max_grad_norm=0.05
    )
    module = h.RegressionModule(h.regression_data(40), optimizer="adam", lr=0.01, nan_at=[4])
    with pytest.warns(UserWarning, match="skipped"):
        h.trainer(callbacks=[callback]).fit(module)
    windows = schedule_windows(schedule)  # [0,1] [2,3] [4,5,6] [7,8,9]
    expected = h.regression_reference(
        windows,
        optimizer="adam",
        lr=0.01,
        skip_windows=[2],
        max_grad_norm=0.05,
        sum_of_means=scaling == "sum",
    )
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert (callback.stats.skipped_steps, callback.stats.windows) == (1, 4)


@pytest.mark.parametrize("buffers", [False, True])
def test_a_schedule_under_16_mixed_with_an_overflow(buffers: bool) -> None:
    """The GradScaler sees each window whole (with buffers: flushed after the window's last micro-batch, which
    Lightning's K for the window marks), skips the window holding the nan and backs off its scale."""
    plugin = h.amp_plugin()
    kwargs = {"accumulation_dtype": "float64"} if buffers else {}
    callback = GradientAccumulationCallback({0: 2, 2: 3}, schedule_unit="steps", **kwargs)
    module = h.RegressionModule(h.regression_data(40), nan_at=[5])
    h.trainer(callbacks=[callback], plugins=[plugin]).fit(module)
    windows = schedule_windows({0: 2, 2: 3})  # [0,1] [2,3] [4,5,6] [7,8,9]: the nan is in window 2
    expected = h.regression_reference(windows, skip_windows=[2], fp16_autocast=True)
    assert h.max_abs_diff(module.net, expected) < 2e-4  # fp16 autocast: micro- vs big-batch rounding
    assert (callback.stats.non_finite_windows, callback.stats.skipped_steps) == (1, 1)
    assert plugin.scaler.get_scale() == 2.0**7


class _ValidatesMidWindow:
    """Validation every 3 batches (inside windows) and `training_step` returning None at batch 5."""

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return None if batch_idx == 5 else super().training_step(batch, batch_idx)  # type: ignore[misc]

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.log("val", h.mse(self.net, *batch))

    def val_dataloader(self):  # type: ignore[no-untyped-def]
        return torch.utils.data.DataLoader(h.regression_data(8), batch_size=4)


@pytest.mark.parametrize("optimizer", ["sgd", "sgd_fused"])  # fused: each step decided on the device
@pytest.mark.parametrize("namespace", ["pytorch_lightning", "lightning.pytorch"])
def test_a_schedule_with_mid_window_validation_and_a_none_step_in_both_namespaces(
    namespace: str, optimizer: str
) -> None:
    """The window holding batch 5 is the big batch of its other micro-batches; validation inside windows
    changes nothing; the same in both Lightning namespaces."""
    base = h.RegressionModule if namespace == "pytorch_lightning" else h.LitRegressionModule
    module = type("Module", (_ValidatesMidWindow, base), {})(h.regression_data(40), optimizer=optimizer)
    schedule = {0: 2, 2: 3}
    callback = h.accumulation_callback(namespace, schedule, schedule_unit="steps", max_grad_norm=0.5)
    h.trainer(namespace, callbacks=[callback], val_check_interval=3, limit_val_batches=1).fit(module)
    windows = [[b for b in w if b != 5] for w in schedule_windows(schedule)]  # [0,1] [2,3] [4,6] [7,8,9]
    expected = h.regression_reference(windows, optimizer=optimizer, max_grad_norm=0.5)
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert callback.stats.clipped_steps > 0


def test_a_second_fit_on_the_same_trainer_goes_on_with_the_schedule() -> None:
    """The per-window K written into the Trainer is the callback's own: a second `fit` accepts it (it is not
    taken for a user's `accumulate_grad_batches`) and goes on counting steps."""
    schedule = {0: 2, 2: 3}
    callback = GradientAccumulationCallback(schedule, schedule_unit="steps")
    module = h.RegressionModule(h.regression_data(40))
    trainer = h.trainer(callbacks=[callback], max_epochs=1)
    trainer.fit(module)
    trainer.fit_loop.max_epochs = 2
    trainer.fit(module)
    assert h.max_abs_diff(module.net, h.regression_reference(schedule_windows(schedule, epochs=2))) < 1e-6


@pytest.mark.parametrize(("mode", "power"), [("sqrt", 0.5), ("linear", 1.0)])
def test_lr_scaling_is_relative_to_the_schedules_first_k(mode: str, power: float) -> None:
    """A schedule that starts at K=2, `{0: 2, 2: 4}`: windows 2 2 | 4 2 (the last cut by the epoch's end,
    whose factor is the schedule's K). The factor is (K / 2) ** p: 1 for the first windows, 2 ** p after.
    Oracle: one SGD step per window on its big batch with that learning rate; the logged factor."""
    import torch

    schedule = {0: 2, 2: 4}
    callback = GradientAccumulationCallback(schedule, schedule_unit="steps", lr_scaling=mode)
    module, _ = fit(callback)
    windows = schedule_windows(schedule)
    assert [len(w) for w in windows] == [2, 2, 4, 2]
    reference = h.regression_net()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    tensors = h.regression_data(40).tensors
    for index, window in enumerate(windows):
        rows = torch.cat([torch.arange(4 * b, 4 * b + 4) for b in window])
        optimizer.zero_grad()
        h.mse(reference, *(t[rows] for t in tensors)).backward()
        optimizer.param_groups[0]["lr"] = 0.1 * (1.0 if index < 2 else 2.0**power)
        optimizer.step()
    assert h.max_abs_diff(module.net, reference) < 1e-6
    assert callback.metrics()["grad_accum/lr_factor"] == 2.0**power
