"""Logging, compatibility checks, argument validation and host syncs of the callback."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import GradientAccumulationScheduler
from pytorch_lightning.strategies import FSDPStrategy, SingleDeviceStrategy

from lightning_gradacc import AccumulationStats, GradientAccumulationCallback
from lightning_gradacc.callback import LOGGED_STATISTICS, NOISE_STATISTICS
from tests import helpers as h
from tests.syncs import SyncCounter

BATCH = 4


# ------------------------------------------------------------------------------------------ logging


def test_logs_one_point_per_optimizer_step_with_exact_values() -> None:
    recorder = h.MetricsRecorder()
    callback = GradientAccumulationCallback(4, scaling="weighted")
    module = h.RegressionModule(h.regression_data(40))
    h.trainer(callbacks=[callback], logger=recorder, log_every_n_steps=1).fit(module)
    assert h.series_steps(recorder, "grad_accum/items_last_step") == [0, 1, 2]
    assert [v for _, v in recorder.series("grad_accum/items_last_step")] == [16, 16, 8]
    assert [v for _, v in recorder.series("grad_accum/micro_batches_last_step")] == [4, 4, 2]
    assert [v for _, v in recorder.series("grad_accum/accumulation_steps")] == [4, 4, 4]
    losses: list[float] = []
    h.big_batch_reference(
        h.regression_net(), h.regression_data(40), BATCH, h.windows(10, 4), h.mse, losses=losses
    )
    logged = [v for _, v in recorder.series("grad_accum/window_loss")]
    assert logged == pytest.approx(losses, rel=1e-5)  # the mean loss over the whole window
    expected_keys = {f"grad_accum/{name}" for name in LOGGED_STATISTICS} | {"grad_accum/window_loss"}
    assert expected_keys <= set(recorder.records[0][1])
    unlogged = {"open_window_micro_batches", *NOISE_STATISTICS}  # the noise ones with noise_scale=True only
    assert set(LOGGED_STATISTICS) == set(AccumulationStats().as_dict()) - unlogged


def test_respects_log_every_n_steps_and_log_stats() -> None:
    recorder = h.MetricsRecorder()
    module = h.RegressionModule(h.regression_data(80))
    h.trainer(callbacks=[GradientAccumulationCallback(2)], logger=recorder, log_every_n_steps=4).fit(module)
    assert h.series_steps(recorder, "grad_accum/windows") == [3, 7]
    quiet = h.MetricsRecorder()
    h.trainer(
        callbacks=[GradientAccumulationCallback(2, log_stats=False)], logger=quiet, log_every_n_steps=1
    ).fit(h.RegressionModule(h.regression_data(40)))
    assert quiet.series("grad_accum/windows") == []


def test_stats_snapshot_is_frozen_and_plain() -> None:
    callback = GradientAccumulationCallback(4)
    h.trainer(callbacks=[callback]).fit(h.RegressionModule(h.regression_data(40)))
    stats = callback.stats
    with pytest.raises(AttributeError):
        stats.windows = 0  # type: ignore[misc]
    assert all(type(v) in (int, float) for v in stats.as_dict().values())
    assert stats.num_parameters == sum(p.numel() for p in h.regression_net().parameters())
    assert stats.buffer_bytes == 0
    assert stats.peak_memory_bytes > 0
    assert stats.max_grad_norm_seen >= stats.last_grad_norm > 0


# ----------------------------------------------------------------------------------- host syncs


class CountingCallback(GradientAccumulationCallback):
    """Counts sync-forcing tensor calls made inside the callback's hooks."""

    def __init__(self, counter: SyncCounter, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counter = counter
        self.per_batch: list[tuple[bool, int]] = []  # (stepped, syncs) per micro-batch
        self._calls_at_start = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._calls_at_start = len(self.counter.calls)
        with self.counter.counting():
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_before_backward(self, trainer, pl_module, loss):
        with self.counter.counting():
            super().on_before_backward(trainer, pl_module, loss)

    def on_after_backward(self, trainer, pl_module):
        with self.counter.counting():
            super().on_after_backward(trainer, pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        with self.counter.counting():
            super().on_before_optimizer_step(trainer, pl_module, optimizer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with self.counter.counting():
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.per_batch.append((self._batch.finalized, len(self.counter.calls) - self._calls_at_start))


@pytest.mark.parametrize("scaling", ["mean", "weighted"])
def test_no_host_sync_on_accumulating_micro_batches(scaling: str) -> None:
    counter = SyncCounter()
    kwargs = {"item_count_fn": h.count_tokens} if scaling == "weighted" else {}
    callback = CountingCallback(counter, 4, scaling=scaling, max_grad_norm=1.0, **kwargs)
    with counter.patched():
        h.trainer(callbacks=[callback], logger=h.MetricsRecorder(), log_every_n_steps=1).fit(
            h.TokenModule(h.token_data())
        )
    accumulating = [syncs for stepped, syncs in callback.per_batch if not stepped]
    stepping = [syncs for stepped, syncs in callback.per_batch if stepped]
    assert len(accumulating) == 9 and set(accumulating) == {0}
    assert len(stepping) == 3 and set(stepping) == {1}  # the skip decision; logging reuses it


# ------------------------------------------------------------------------------------ compatibility


def test_manual_optimization_points_to_the_core() -> None:
    class Manual(h.RegressionModule):
        def __init__(self) -> None:
            super().__init__(h.regression_data(8))
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            return None

    with pytest.raises(RuntimeError, match=r"automatic optimization only.*GradAccumulator"):
        h.trainer(callbacks=[GradientAccumulationCallback(2)]).fit(Manual())


def test_lightning_scheduler_is_rejected() -> None:
    callbacks = [GradientAccumulationCallback(2), GradientAccumulationScheduler({0: 2})]
    with pytest.raises(RuntimeError, match="Remove the scheduler"):
        h.trainer(callbacks=callbacks).fit(h.RegressionModule(h.regression_data(8)))


def test_two_instances_are_rejected() -> None:
    # Lightning itself refuses two instances passed to the constructor (their state keys collide) ...
    with pytest.raises(
        RuntimeError, match="more than one stateful callback of type `GradientAccumulationCallback`"
    ):
        h.trainer(callbacks=[GradientAccumulationCallback(2), GradientAccumulationCallback(2)])
    # ... and the callback refuses one added later
    trainer = h.trainer(callbacks=[GradientAccumulationCallback(2)])
    trainer.callbacks.append(GradientAccumulationCallback(2))
    with pytest.raises(RuntimeError, match="Two `GradientAccumulationCallback` instances"):
        trainer.fit(h.RegressionModule(h.regression_data(8)))


def test_conflicting_trainer_k_is_rejected_and_equal_k_accepted() -> None:
    with pytest.raises(
        ValueError,
        match=r"accumulate_grad_batches=2\)` and `GradientAccumulationCallback\(accumulation_steps=4\)",
    ):
        h.trainer(accumulate_grad_batches=2, callbacks=[GradientAccumulationCallback(4)]).fit(
            h.RegressionModule(h.regression_data(8))
        )
    trainer = h.trainer(accumulate_grad_batches=4, callbacks=[GradientAccumulationCallback(4)])
    trainer.fit(h.RegressionModule(h.regression_data(32)))
    assert trainer.global_step == 2


def test_deepspeed_like_strategy_is_rejected() -> None:
    class AccumulatingStrategy(SingleDeviceStrategy):
        @property
        def handles_gradient_accumulation(self) -> bool:
            return True

    callback = GradientAccumulationCallback(2)
    trainer = SimpleNamespace(strategy=AccumulatingStrategy(device=torch.device("cpu")), callbacks=[callback])
    with pytest.raises(RuntimeError, match="performs gradient accumulation itself"):
        callback._check_compatibility(trainer, h.RegressionModule(h.regression_data(8)))  # type: ignore[arg-type]


def _third_party_strategy(base: type) -> Any:
    """A strategy of another package (e.g. lightning-hivemind's), built without its dependencies."""
    strategy = type("HivemindStrategy", (base,), {})
    strategy.__abstractmethods__ = frozenset()  # type: ignore[attr-defined]
    return strategy.__new__(strategy)


def test_an_unsupported_strategy_is_rejected() -> None:
    from pytorch_lightning.strategies import Strategy

    callback = GradientAccumulationCallback(2)
    trainer = SimpleNamespace(strategy=_third_party_strategy(Strategy), callbacks=[callback])
    with pytest.raises(
        RuntimeError,
        match=r"supports single-device, DDP, FSDP and ModelParallel \(FSDP2\) strategies.*HivemindStrategy",
    ):
        callback._check_compatibility(trainer, h.RegressionModule(h.regression_data(8)))  # type: ignore[arg-type]


def test_fsdp_is_accepted_with_original_parameters_only() -> None:
    callback = GradientAccumulationCallback(2)
    module = h.RegressionModule(h.regression_data(8))
    trainer = SimpleNamespace(strategy=FSDPStrategy(), callbacks=[callback])
    callback._check_compatibility(trainer, module)  # type: ignore[arg-type]
    trainer = SimpleNamespace(strategy=FSDPStrategy(use_orig_params=False), callbacks=[callback])
    with pytest.raises(RuntimeError, match=r"needs `FSDPStrategy\(use_orig_params=True\)`.*flat parameters"):
        callback._check_compatibility(trainer, module)  # type: ignore[arg-type]


def test_double_clipping_warns() -> None:
    trainer = h.trainer(callbacks=[GradientAccumulationCallback(2, max_grad_norm=1.0)], gradient_clip_val=1.0)
    with pytest.warns(UserWarning, match="clipped twice"):
        trainer.fit(h.RegressionModule(h.regression_data(8)))


@pytest.mark.parametrize("bad", [-3, float("nan"), "many"])
def test_bad_item_count_fn_result_raises_naming_that_batch(bad: Any) -> None:
    calls = iter(range(100))

    def counter(batch: Any) -> Any:
        return bad if next(calls) == 3 else 4

    module = h.RegressionModule(h.regression_data(40))
    callback = GradientAccumulationCallback(2, scaling="weighted", item_count_fn=counter)
    with pytest.raises(ValueError, match=f"item count of batch 3 \\(from `item_count_fn`\\).*{bad}"):
        h.trainer(callbacks=[callback]).fit(module)
    # raised at that window's boundary, before its update: only the window of batches 0 and 1 was stepped
    expected = h.big_batch_reference(h.regression_net(), h.regression_data(40), 4, [[0, 1]], h.mse)
    assert h.max_abs_diff(module.net, expected) < 1e-6


# ----------------------------------------------------------------------------------- bad arguments


def _not_callable() -> None:
    pass


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"accumulation_steps": 0}, ValueError, "`accumulation_steps` to be a positive int, but got 0"),
        ({"accumulation_steps": -2}, ValueError, "`accumulation_steps` to be a positive int, but got -2"),
        ({"accumulation_steps": True}, TypeError, "`accumulation_steps` to be a positive int, but got True"),
        ({"accumulation_steps": 4.0}, TypeError, "`accumulation_steps` to be a positive int, but got 4.0"),
        (
            {"accumulation_steps": {-1: 2}},
            ValueError,
            "epochs .* of `accumulation_steps` to be ints >= 0, but got -1",
        ),
        (
            {"accumulation_steps": {"1": 2}},
            ValueError,
            "epochs .* of `accumulation_steps` to be ints >= 0, but got '1'",
        ),
        (
            {"accumulation_steps": {0: 0}},
            ValueError,
            r"`accumulation_steps\[0\]` to be a positive int, but got 0",
        ),
        ({"accumulation_steps": {}}, ValueError, "`accumulation_steps` to be a non-empty dict"),
        ({"accumulation_steps": 2, "target_batch_size": 64}, ValueError, "only one of `accumulation_steps`"),
        ({"target_batch_size": 0}, ValueError, "`target_batch_size` to be a positive int, but got 0"),
        ({"scaling": "median"}, ValueError, "`scaling` to be one of .* but got 'median'"),
        ({"overflow": "retry"}, ValueError, "`overflow` to be one of .* but got 'retry'"),
        ({"scaling": "weighted", "item_count_fn": 3}, TypeError, "`item_count_fn` to be callable"),
        ({"item_count_fn": len}, ValueError, "`item_count_fn` is only used with `scaling='weighted'`"),
        ({"max_grad_norm": 0}, ValueError, "`max_grad_norm` to be a positive float or None, but got 0"),
        ({"max_grad_norm": -1.0}, ValueError, "`max_grad_norm` to be a positive float or None, but got -1.0"),
        (
            {"max_grad_norm": math.nan},
            ValueError,
            "`max_grad_norm` to be a positive float or None, but got nan",
        ),
        ({"max_grad_norm": "1"}, TypeError, "`max_grad_norm` to be a positive float or None, but got '1'"),
        ({"clip_value": 0.0}, ValueError, "`clip_value` to be a positive float or None, but got 0.0"),
        ({"clip_value": math.nan}, ValueError, "`clip_value` to be a positive float or None, but got nan"),
        ({"norm_type": 0}, ValueError, "`norm_type` to be a float > 0 or inf, but got 0"),
        ({"norm_type": -2.0}, ValueError, "`norm_type` to be a float > 0 or inf, but got -2.0"),
        ({"log_stats": "yes"}, TypeError, "`log_stats` to be a bool, but got 'yes'"),
    ],
)
def test_invalid_arguments_raise_at_construction(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        GradientAccumulationCallback(**kwargs)


def test_target_batch_size_needs_a_fixed_batch_size() -> None:
    class NoBatchSize(h.RegressionModule):
        def train_dataloader(self):
            sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(self.data), 4, False)
            return torch.utils.data.DataLoader(self.data, batch_sampler=_Batches(sampler))

    with pytest.raises(RuntimeError, match="has no fixed `batch_size`"):
        h.trainer(callbacks=[GradientAccumulationCallback(target_batch_size=8)]).fit(
            NoBatchSize(h.regression_data(8))
        )


def test_stats_before_fit() -> None:
    assert GradientAccumulationCallback(3).stats == AccumulationStats(accumulation_steps=3)
    assert isinstance(GradientAccumulationCallback(), pl.Callback)


class _Batches:
    """A sized iterable without a ``batch_size`` (a plain list would be taken for a list of dataloaders)."""

    def __init__(self, batches: Any) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def test_batches_without_an_inferable_size_warn_once_and_still_train() -> None:
    class Opaque(h.RegressionModule):
        def train_dataloader(self):
            # plain lists: nothing Lightning can take a batch size from
            return _Batches([{"x": x.tolist(), "y": y.tolist()} for x, y in super().train_dataloader()])

        def training_step(self, batch, batch_idx):
            return super().training_step((torch.tensor(batch["x"]), torch.tensor(batch["y"])), batch_idx)

    callback = GradientAccumulationCallback(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning, not only the first per code location
        h.trainer(callbacks=[callback]).fit(Opaque(h.regression_data(40)))
    inferred = [w for w in caught if "Could not infer the batch size" in str(w.message)]
    assert len(inferred) == 1 and "batch 0" in str(inferred[0].message)  # 10 batches, one warning
    assert callback.stats.windows == 3
    assert callback.stats.items_last_step == 0


def test_sharded_reduction_is_checked_when_the_callback_is_built() -> None:
    expected = r"one of \['every_micro_batch', 'window_end', 'replicas_at_window_end'\], but got 'never'"
    with pytest.raises(ValueError, match=r"argument `sharded_reduction` to be " + expected):
        GradientAccumulationCallback(2, sharded_reduction="never")  # type: ignore[arg-type]


@pytest.mark.parametrize("reduction", ["window_end", "replicas_at_window_end"])
def test_a_sharded_reduction_without_fsdp_warns_that_it_does_nothing(reduction: str) -> None:
    trainer = h.trainer(callbacks=[GradientAccumulationCallback(2, sharded_reduction=reduction)])  # type: ignore[arg-type]
    expected = r"has no effect: no module is sharded by FSDP \(DDP already reduces once per window\)\.$"
    with pytest.warns(UserWarning, match=rf"`sharded_reduction='{reduction}'` {expected}"):
        trainer.fit(h.RegressionModule(h.regression_data(8)))


def test_statistics_reach_callback_metrics_without_a_logger() -> None:
    trainer = h.trainer(callbacks=[GradientAccumulationCallback(4)], log_every_n_steps=1)  # logger=False
    trainer.fit(h.RegressionModule(h.regression_data(40)))
    metrics = trainer.callback_metrics
    assert float(metrics["grad_accum/windows"]) == 3
    assert float(metrics["grad_accum/items_last_step"]) == 8  # the partial window: 2 micro-batches of 4


def test_the_summary_shows_a_full_step_beside_the_last_partial_one() -> None:
    """Token windows: the last is partial; the summary's effective batch is the last full window's."""
    data = h.token_data(24)  # 12 micro-batches of 2 sequences; K=5: windows 5, 5, 2
    callback = GradientAccumulationCallback(5, scaling="weighted", item_count_fn=h.count_tokens)
    h.trainer(callbacks=[callback]).fit(h.TokenModule(data))
    labels = data.tensors[1]
    full = int((labels[10:20] != h.IGNORE_INDEX).sum())  # window 1: micro-batches 5-9
    last = int((labels[20:] != h.IGNORE_INDEX).sum())
    assert (callback.stats.items_last_full_step, callback.stats.items_last_step) == (full, last)
    row = next(line for line in callback.summary().splitlines() if line.startswith("effective batch"))
    assert row.endswith(f"{full} in the last full step (K micro-batches); {last} in the last step (2 of 5)")


@pytest.mark.parametrize(
    ("noise_scale", "items", "expected"),
    [
        (-3.0, 100.0, "no usable estimate yet (not positive)"),
        (12.5, 0.0, "12.5 micro-batches (averaged over recent steps)"),
        (1234.5, 100.0, "1,234.5 items (averaged over recent steps)"),
    ],
)
def test_the_summary_gives_the_noise_scale_its_unit_or_says_it_has_none(
    noise_scale: float, items: float, expected: str
) -> None:
    from lightning_gradacc.summary import format_summary

    stats = AccumulationStats(noise_scale=noise_scale, items_last_step=items, items_last_full_step=items)
    row = next(line for line in format_summary(stats, 0.5, None).splitlines() if "noise scale" in line)
    assert row.endswith(expected)
