"""The one K authority through ``Trainer.fit``: every transition of a window keeps K, the loss scale, the
learning-rate factor and Lightning's ``accumulate_grad_batches`` in step.

Oracles: plain PyTorch, one optimizer step per window on all of the window's data as one batch, the windows
(and their K, for the learning-rate factor) computed from the schedule by ``helpers.keyed_windows``.
"""

from __future__ import annotations

import math
import signal
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_gradacc import GradientAccumulationCallback, estimated_stepping_batches
from tests import helpers as h

# torchdata 0.11 calls torch.set_vital, deprecated in recent torch; nothing to act on here.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

BATCHES = 10  # micro-batches of 4 samples per epoch
EPOCHS = 2
POWERS = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}


class Stateful(h.RegressionModule):
    """The regression module reading its data with torchdata's ``StatefulDataLoader`` (resumes mid-epoch)."""

    def train_dataloader(self) -> DataLoader[Any]:
        return StatefulDataLoader(self.data, batch_size=self.batch_size)


def keyed_reference(
    schedule: dict[int, int], unit: str, lr_scaling: str, optimizer: str = "sgd", **kwargs: Any
) -> torch.nn.Module:
    """The big batch of every window the schedule implies, with lr x (K / K_first) ** p."""
    keyed = h.keyed_windows(schedule, BATCHES, epochs=EPOCHS, unit=unit)
    first_k = keyed[0][1]
    factors = [(k / first_k) ** POWERS[lr_scaling] for _, k in keyed]
    return h.regression_reference(
        [window for window, _ in keyed], optimizer=optimizer, lr_factors=factors, **kwargs
    )


@pytest.fixture
def sigint_restored() -> Iterator[None]:
    """Lightning ignores SIGINT after it caught a KeyboardInterrupt; give pytest its handler back."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


# ---------------------------------------------------------------- a resume inside a window of a schedule

# Fused SGD with momentum divides by 1/m in its step where the reference multiplies by m: the uninterrupted
# run is 1.2e-6 from the reference (measured), the others 6e-8 (SGD) and 1.8e-7 (Adam).
TOLERANCE = {"sgd": 1e-6, "adam": 1e-6, "sgd_fused": 2e-6}
RESUMES = [
    # by steps: [0,1] [2,3] [4,5,6] [7,8,9] | [0,1,2] ...; saved after batch 5, inside the first 3-window
    ({0: 2, 2: 3}, "steps", "sqrt", "sgd", 5),
    # by items (4 per batch): [0] [1] [2] [3,4] [5,6,7] [8,9] | ...; saved inside the first window of K=2
    ({0: 1, 12: 2, 20: 3}, "items", "linear", "sgd_fused", 3),
    ({0: 1, 12: 2, 20: 3}, "items", "linear", "sgd_fused", 6),
    ({0: 2, 2: 3}, "steps", "none", "adam", 5),
]


@pytest.mark.parametrize(("schedule", "unit", "lr_scaling", "optimizer", "at"), RESUMES, ids=str)
def test_a_resume_inside_a_window_of_a_keyed_schedule_runs_it_with_its_own_k(
    tmp_path: Path, schedule: dict[int, int], unit: str, lr_scaling: str, optimizer: str, at: int
) -> None:
    """The restored window steps with its own K (and learning-rate factor), and is logged with them."""
    path = tmp_path / "mid.ckpt"

    def callback() -> GradientAccumulationCallback:
        return GradientAccumulationCallback(schedule, schedule_unit=unit, lr_scaling=lr_scaling)

    def module() -> Stateful:
        return Stateful(h.regression_data(40), optimizer=optimizer)

    h.preempt(module(), [callback()], at, path, max_epochs=EPOCHS)
    resumed, recorder, resumed_callback = module(), h.MetricsRecorder(), callback()
    h.trainer(callbacks=[resumed_callback], max_epochs=EPOCHS, logger=recorder, log_every_n_steps=1).fit(
        resumed, ckpt_path=path
    )
    expected = keyed_reference(schedule, unit, lr_scaling, optimizer)
    assert h.max_abs_diff(resumed.net, expected) < TOLERANCE[optimizer]
    keyed = h.keyed_windows(schedule, BATCHES, epochs=EPOCHS, unit=unit)
    open_window = next(i for i, (w, _) in enumerate(keyed) if w[0] <= at < w[-1])  # at < 10: epoch 0
    logged_k = [int(k) for _, k in recorder.series("grad_accum/accumulation_steps")]
    assert logged_k == [k for _, k in keyed[open_window:]]
    if lr_scaling != "none":
        first_k = keyed[0][1]
        factors = [factor for _, factor in recorder.series("grad_accum/lr_factor")]
        assert factors == [(k / first_k) ** POWERS[lr_scaling] for _, k in keyed[open_window:]]


@pytest.mark.slow
def test_a_resume_inside_a_window_of_a_keyed_schedule_on_two_ddp_ranks(tmp_path: Path) -> None:
    """As on one device, with the window summed over the ranks in the checkpoint and restored on rank 0
    (with the noise scale's totals of the window, summed likewise: its estimate goes on); weighted by items
    and clipped. Only rank 0 writes the checkpoint: it stores the window summed over ranks, the others
    restart at 0."""
    data = h.regression_data(80)  # 10 micro-batches of 4 per rank: micro-batch i is rows [8i, 8i + 8)
    schedule = {0: 2, 2: 3}

    def callback() -> GradientAccumulationCallback:
        return GradientAccumulationCallback(
            schedule,
            schedule_unit="steps",
            lr_scaling="sqrt",
            noise_scale=True,
            scaling="weighted",
            max_grad_norm=0.5,
        )

    path = tmp_path / "mid.ckpt"
    with pytest.raises(Exception, match="Preempted"):
        h.ddp_trainer(callback(), h.SaveAndStop(5, path), max_epochs=EPOCHS).fit(
            h.RegressionModule(data, resumable=True)
        )
    resumed = h.RegressionModule(data, resumable=True)
    trainer = h.ddp_trainer(callback(), max_epochs=EPOCHS)
    trainer.fit(resumed, ckpt_path=path)
    keyed = h.keyed_windows(schedule, BATCHES, epochs=EPOCHS)
    expected = h.big_batch_reference(
        h.regression_net(),
        data,
        8,
        [window for window, _ in keyed],
        h.mse,
        lr_factors=[(k / 2) ** 0.5 for _, k in keyed],
        max_grad_norm=0.5,
    )
    assert h.max_abs_diff(resumed.net, expected) < 1e-6
    assert float(trainer.callback_metrics["grad_accum/windows"]) == len(keyed)
    assert math.isfinite(float(trainer.callback_metrics["grad_accum/noise_scale"]))


# ----------------------------------------------------------- a second fit after a fit interrupted inside one


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()], ids=["exception", "interrupt"])
def test_a_second_fit_after_a_fit_interrupted_inside_a_window_starts_a_window_of_its_own(
    error: BaseException, sigint_restored: None
) -> None:
    """`{0: 2, 2: 3}` by steps, interrupted after micro-batch 5 (inside the first 3-window, two steps taken):
    the next fit on a fresh model opens a window of K=3 at its first batch (windows [0-2] [3-5] [6-8] [9]),
    as the schedule says after two steps; the aborted window is not merged into it."""
    callback = GradientAccumulationCallback({0: 2, 2: 3}, schedule_unit="steps")
    raised = SystemExit if isinstance(error, KeyboardInterrupt) else type(error)  # Lightning: sys.exit(1)
    with pytest.raises(raised):
        h.trainer(callbacks=[callback, h.RaiseAfter(5, error)]).fit(h.RegressionModule(h.regression_data(40)))
    module, recorder = h.RegressionModule(h.regression_data(40)), h.MetricsRecorder()
    trainer = h.trainer(callbacks=[callback], logger=recorder, log_every_n_steps=1)
    trainer.fit(module)
    assert h.max_abs_diff(module.net, h.regression_reference([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]])) < 1e-6
    assert [int(k) for _, k in recorder.series("grad_accum/accumulation_steps")] == [3, 3, 3, 3]
    assert [int(n) for _, n in recorder.series("grad_accum/micro_batches_last_step")] == [3, 3, 3, 1]
    assert trainer.accumulate_grad_batches == 1  # the user's value, given back at the end of the fit


# ------------------------------------------------------------ optimizer steps of an items-keyed schedule


class OneCycle(h.RegressionModule):
    """A `OneCycleLR` over `estimated_stepping_batches(trainer)` steps: it raises if it is stepped more."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        self.total = estimated_stepping_batches(self.trainer)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=self.total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=4)  # Lightning adds its DistributedSampler under DDP

    def on_train_end(self) -> None:  # read in the launching process under ddp_spawn
        self.trainer.callback_metrics["estimated"] = torch.tensor(float(self.total))
        self.trainer.callback_metrics["stepped"] = torch.tensor(float(self.trainer.global_step))


@pytest.mark.parametrize("limit", [9, 0.9, 1.0], ids=["int", "fraction", "whole_epoch"])
@pytest.mark.parametrize("schedule", [{0: 1, 35: 3}, {0: 4, 35: 1}, {0: 1, 38: 5, 40: 3}], ids=str)
def test_the_steps_of_an_items_keyed_schedule_when_the_last_batch_that_runs_is_full(
    schedule: dict[int, int], limit: float
) -> None:
    """38 samples in batches of 4 (the dataset's last batch holds 2), `limit_train_batches` 9: the last batch
    that runs holds 4 (a whole epoch: 2). The estimate equals the steps taken, so a OneCycleLR built from it
    completes. `{0: 1, 38: 5, 40: 3}` takes 17 steps with the 38 items of a whole epoch (18 if its last batch
    counted 4, 40 items), 16 with the 36 of 9 batches (15 if the last of them counted as the dataset's 2)."""
    module = OneCycle(h.regression_data(38))
    callback = GradientAccumulationCallback(schedule, schedule_unit="items")
    trainer = h.trainer(callbacks=[callback], max_epochs=3, limit_train_batches=limit)
    trainer.fit(module)
    assert module.total == trainer.global_step


@pytest.mark.slow
def test_the_steps_of_an_items_keyed_schedule_with_the_ddp_sampler_padding_each_rank() -> None:
    """37 samples over 2 ranks: Lightning's DistributedSampler pads each rank to 19 (batches of 4, 4, 4, 4, 3
    per rank; 8, 8, 8, 8, 6 over the ranks): 38 items an epoch, for which `{0: 1, 38: 5, 40: 3}` takes 8
    steps (10 counting the 37 samples, 9 counting whole batches, 40 items)."""
    callback = GradientAccumulationCallback({0: 1, 38: 5, 40: 3}, schedule_unit="items")
    trainer = h.ddp_trainer(callback, max_epochs=3, use_distributed_sampler=True)
    trainer.fit(OneCycle(h.regression_data(37)))
    assert float(trainer.callback_metrics["estimated"]) == float(trainer.callback_metrics["stepped"])


def test_the_noise_scale_warning_reads_the_plan_not_the_trainer(tmp_path: Path) -> None:
    """`{0: 1, 2: 4}` by steps with the noise scale: a resume inside a window of K=4 does not warn that K=1
    measures nothing (the Trainer's K when the accumulator is built), and its windows are measured."""
    path = tmp_path / "mid.ckpt"

    def callback() -> GradientAccumulationCallback:
        return GradientAccumulationCallback({0: 1, 2: 4}, schedule_unit="steps", noise_scale=True)

    h.preempt(Stateful(h.regression_data(40)), [callback()], 3, path, max_epochs=EPOCHS)
    resumed_callback = callback()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h.trainer(callbacks=[resumed_callback], max_epochs=EPOCHS).fit(
            Stateful(h.regression_data(40)), ckpt_path=path
        )
    assert not [w for w in caught if "no estimate is made" in str(w.message)]
    assert resumed_callback.stats.noise_scale == resumed_callback.stats.noise_scale  # measured: not nan
    with pytest.warns(UserWarning, match="no estimate is made"):
        h.trainer(callbacks=[GradientAccumulationCallback(1, noise_scale=True)]).fit(
            h.RegressionModule(h.regression_data(8))
        )


def test_k_is_written_by_the_window_plan_alone() -> None:
    """No other module of the Lightning shell assigns Lightning's K, the core's K or its loss scale."""
    import ast

    shell = Path(__file__).resolve().parents[2] / "src" / "lightning_gradacc"
    k_names = {"accumulate_grad_batches", "accumulation_steps", "loss_scale"}
    writers: dict[str, int] = {}
    for path in sorted(shell.rglob("*.py")):
        if "core" in path.relative_to(shell).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in k_names:
                    writers[path.name] = writers.get(path.name, 0) + 1
    assert set(writers) == {"window_plan.py"}, writers


# ----------------------------------------------------- every policy through every transition of a window

POLICIES: dict[str, dict[str, Any]] = {
    "fixed": {"accumulation_steps": 3},
    "epochs": {"accumulation_steps": {0: 2, 1: 3}},
    "target": {"target_batch_size": 12},  # micro-batches of 4: K=3
    "target_per_stage": {"target_batch_size": {0: 8, 2: 12}, "schedule_unit": "steps"},  # K=2, then 3
    "steps": {"accumulation_steps": {0: 2, 2: 3}, "schedule_unit": "steps"},
    "items": {"accumulation_steps": {0: 1, 12: 2, 20: 3}, "schedule_unit": "items"},
}


def policy_windows(
    name: str, epochs: int, *, skipped: int | None = None, steps: int = 0, items: float = 0.0
) -> list[tuple[list[int], int]]:
    """The windows (micro-batch indices per epoch) each policy implies, with their K.

    ``skipped``: a batch whose `training_step` returns None in every epoch (it holds no items); ``steps`` and
    ``items``: where a schedule keyed by them stands when the first window opens.
    """
    if name in ("fixed", "target"):
        return [(window, 3) for window in h.windows(BATCHES, 3, epochs=epochs)]
    if name == "epochs":
        return [
            (w, 2 if e == 0 else 3) for e in range(epochs) for w in h.windows(BATCHES, 2 if e == 0 else 3)
        ]
    schedule, unit = ({0: 2, 2: 3}, "steps") if name != "items" else ({0: 1, 12: 2, 20: 3}, "items")
    return h.keyed_windows(
        schedule,
        BATCHES,
        epochs=epochs,
        unit=unit,
        items=lambda b: 0.0 if b == skipped else 4.0,
        steps=steps,
        consumed=items,
    )


def first_transition(name: str) -> int:
    """The first micro-batch of the first window whose K differs from the one before (of the second window
    where K never changes): a save after it is inside a window right after a transition."""
    keyed = policy_windows(name, EPOCHS)
    index = next((i for i in range(1, len(keyed)) if keyed[i][1] != keyed[i - 1][1]), 1)
    return sum(len(window) for window, _ in keyed[:index])


class SkipsBatchFive(Stateful):
    """`training_step` returns None for batch 5 of every epoch; validation every 3 batches if asked."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx == 5 else loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val", h.mse(self.net, *batch))

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(h.regression_data(8), batch_size=4)


def _reference(windows: list[tuple[list[int], int]]) -> torch.nn.Module:
    return h.regression_reference([window for window, _ in windows])


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_resumes_inside_the_first_window_after_a_transition(tmp_path: Path, policy: str) -> None:
    at = first_transition(policy)
    path = tmp_path / "mid.ckpt"
    h.preempt(Stateful(h.regression_data(40)), [GradientAccumulationCallback(**POLICIES[policy])], at, path)
    resumed = Stateful(h.regression_data(40))
    h.trainer(callbacks=[GradientAccumulationCallback(**POLICIES[policy])], max_epochs=EPOCHS).fit(
        resumed, ckpt_path=path
    )
    assert h.max_abs_diff(resumed.net, _reference(policy_windows(policy, EPOCHS))) < 1e-6


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_starts_the_fit_after_an_interrupted_one_with_a_window_of_its_own(policy: str) -> None:
    """Interrupted inside the first window after a transition, then a fit on a fresh model with the same
    callback: a policy keyed by steps or items goes on from the windows the first fit closed."""
    at = first_transition(policy)
    callback = GradientAccumulationCallback(**POLICIES[policy])
    with pytest.raises(RuntimeError, match="boom"):
        h.trainer(callbacks=[callback, h.RaiseAfter(at, RuntimeError("boom"))], max_epochs=EPOCHS).fit(
            h.RegressionModule(h.regression_data(40))
        )
    module = h.RegressionModule(h.regression_data(40))
    h.trainer(callbacks=[callback]).fit(module)
    if POLICIES[policy].get("schedule_unit") in ("steps", "items"):  # the count goes on
        closed = [window for window, _ in policy_windows(policy, 1) if window[-1] < at]
        expected = policy_windows(policy, 1, steps=len(closed), items=4.0 * sum(map(len, closed)))
    else:
        expected = policy_windows(policy, 1)
    assert h.max_abs_diff(module.net, _reference(expected)) < 1e-6


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_with_validation_inside_windows_and_a_none_step(policy: str) -> None:
    module = SkipsBatchFive(h.regression_data(40))
    callback = GradientAccumulationCallback(**POLICIES[policy])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`training_step` returned `None`")
        h.trainer(callbacks=[callback], max_epochs=EPOCHS, val_check_interval=3, limit_val_batches=1).fit(
            module
        )
    windows = [([b for b in window if b != 5], k) for window, k in policy_windows(policy, EPOCHS, skipped=5)]
    assert h.max_abs_diff(module.net, _reference(windows)) < 1e-6


class OneCycleStateful(Stateful):
    """A `OneCycleLR` built in `configure_optimizers` from `estimated_stepping_batches(trainer)` (or from
    Lightning's own estimate), over a `StatefulDataLoader`."""

    def __init__(self, ours: bool) -> None:
        super().__init__(h.regression_data(40))
        self.ours = ours

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        total = (
            estimated_stepping_batches(self.trainer) if self.ours else self.trainer.estimated_stepping_batches
        )
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=int(total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize("ours", [True, False], ids=["estimated_stepping_batches", "lightning_estimate"])
def test_a_step_estimate_in_configure_optimizers_keeps_the_dataloader_s_position_on_resume(
    tmp_path: Path, ours: bool
) -> None:
    """Lightning builds the train dataloader for its estimate before a checkpoint's loop state is restored
    and never loads the loader's saved position then (Lightning #20550): the resumed run reads the epoch
    from its start. The package's estimate lets the fit build it again after the restore."""
    whole = OneCycleStateful(ours)
    h.trainer(callbacks=[GradientAccumulationCallback({0: 2, 1: 3})], max_epochs=EPOCHS).fit(whole)
    path = tmp_path / "mid.ckpt"
    h.preempt(OneCycleStateful(ours), [GradientAccumulationCallback({0: 2, 1: 3})], 5, path)
    resumed = OneCycleStateful(ours)
    h.trainer(callbacks=[GradientAccumulationCallback({0: 2, 1: 3})], max_epochs=EPOCHS).fit(
        resumed, ckpt_path=path
    )
    difference = h.max_abs_diff(resumed.net, whole.net)
    assert difference < 1e-7 if ours else difference > 1e-3


class LogsItsLoss(Stateful):
    """Logs its own loss at every step, as a module does with ``self.log``."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        self.log("module_loss", loss)
        return loss


AUTO_POLICY = {"accumulation_steps": "auto", "auto": {"patience": 1, "max_k": 4, "powers_of_two": False}}


@pytest.mark.parametrize("policy", [*POLICIES, "auto"])
def test_the_logged_step_axis_of_a_run_resumed_from_a_window_end_is_the_uninterrupted_run_s(
    tmp_path: Path, policy: str
) -> None:
    """Saved at the end of the first window after a transition (a window-end checkpoint), resumed: every
    value logged after it, the callback's statistics and the module's own ``self.log``, lands on the step
    the uninterrupted run logged it at (one step early, for policies that drive Lightning window by window,
    when Lightning's restarted loop was given another K than the saved window ran with)."""
    arguments = AUTO_POLICY if policy == "auto" else POLICIES[policy]
    whole, windows, recorder = LogsItsLoss(h.regression_data(40)), h.SteppedWindows(), h.MetricsRecorder()
    options = {"max_epochs": EPOCHS, "log_every_n_steps": 1}
    h.trainer(callbacks=[GradientAccumulationCallback(**arguments), windows], logger=recorder, **options).fit(
        whole
    )
    sizes = [len(window) for window in windows.windows]
    ends = [sum(sizes[: i + 1]) - 1 for i in range(len(sizes))]  # each window's last micro-batch
    # the first window after a transition (the second window where K never changes), not at an epoch's end
    change = next(
        (i for i in range(1, len(sizes)) if sizes[i] != sizes[i - 1] and ends[i] % BATCHES != BATCHES - 1), 1
    )
    at = ends[change]
    path = tmp_path / "window_end.ckpt"
    h.preempt(LogsItsLoss(h.regression_data(40)), [GradientAccumulationCallback(**arguments)], at, path)
    resumed, resumed_recorder = LogsItsLoss(h.regression_data(40)), h.MetricsRecorder()
    h.trainer(callbacks=[GradientAccumulationCallback(**arguments)], logger=resumed_recorder, **options).fit(
        resumed, ckpt_path=path
    )
    for key in ("module_loss", "grad_accum/accumulation_steps", "grad_accum/window_loss"):
        after = resumed_recorder.series(key)
        assert after, key
        assert after == [(s, v) for s, v in recorder.series(key) if s >= after[0][0]], key
        assert after[0][0] == change + 1, key  # the first step after the save
