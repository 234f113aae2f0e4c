"""The callback's statistics: logged once per optimizer step with exact values, and read without a logger.

As often as asked (``log_every_n_steps``, ``log_stats``), as a frozen snapshot of plain numbers, and in
``callback_metrics`` without a logger.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl

from lightning_gradacc import AccumulationStats, GradientAccumulationCallback
from lightning_gradacc.callback import LOGGED_STATISTICS
from tests import helpers as h

BATCH = 4


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


@pytest.mark.parametrize(
    "kwargs",
    [
        {"piece_size": "auto", "lr_scaling": "sqrt"},
        {"accumulation_steps": "auto"},
        {"noise_scale": True, "piece_size": 2},
    ],
    ids=["pieces-lr", "auto-k", "noise"],
)
def test_stats_hold_every_value_the_fit_logged(kwargs: dict[str, Any]) -> None:
    """What ``callback.stats`` returns is what was logged: the parts' values (pieces, the learning-rate
    factor, "auto"'s) and the window loss too, read after a real fit (not from the declaration)."""
    module = h.RegressionModule(h.regression_data(40))
    callback = GradientAccumulationCallback(**{"accumulation_steps": 2, **kwargs})
    trainer = h.fit(module, callback, max_epochs=2)
    logged = {k.removeprefix("grad_accum/"): float(v) for k, v in trainer.callback_metrics.items()}
    stats = callback.stats.as_dict()
    assert logged.keys() <= stats.keys()
    del logged["peak_memory_bytes"]  # the process's peak: read anew at each read
    assert {name: stats[name] for name in logged} == pytest.approx(logged, nan_ok=True)
    assert math.isfinite(stats["window_loss"]) and stats["window_loss"] > 0
    assert ("piece_size" in logged) == ("piece_size" in kwargs)


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


def test_stats_before_fit() -> None:
    assert GradientAccumulationCallback(3).stats == AccumulationStats(accumulation_steps=3)
    assert isinstance(GradientAccumulationCallback(), pl.Callback)


def test_statistics_reach_callback_metrics_without_a_logger() -> None:
    trainer = h.trainer(callbacks=[GradientAccumulationCallback(4)], log_every_n_steps=1)  # logger=False
    trainer.fit(h.RegressionModule(h.regression_data(40)))
    metrics = trainer.callback_metrics
    assert float(metrics["grad_accum/windows"]) == 3
    assert float(metrics["grad_accum/items_last_step"]) == 8  # the partial window: 2 micro-batches of 4


def test_statistics_share_the_step_of_the_modules_own_logs_and_can_be_monitored(tmp_path: Path) -> None:
    """Handed to the loggers directly (as Lightning's LearningRateMonitor), at the step of `self.log`'s."""

    class LogsItsLoss(h.RegressionModule):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss, on_step=True, on_epoch=False)
            return loss

    recorder = h.MetricsRecorder()
    checkpoint = pl.callbacks.ModelCheckpoint(tmp_path, monitor="grad_accum/last_grad_norm", mode="min")
    trainer = h.trainer(
        callbacks=[GradientAccumulationCallback(4), checkpoint],
        logger=recorder,
        log_every_n_steps=1,
        enable_checkpointing=True,
    )
    trainer.fit(LogsItsLoss(h.regression_data(40)))
    assert (
        h.series_steps(recorder, "grad_accum/windows") == h.series_steps(recorder, "train_loss") == [0, 1, 2]
    )
    assert checkpoint.best_model_score is not None  # `callback_metrics` hold the statistics
    assert float(trainer.logged_metrics["grad_accum/windows"]) == 3
