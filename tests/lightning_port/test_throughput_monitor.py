"""Ported from Lightning-AI/pytorch-lightning: tests/tests_pytorch/callbacks/test_throughput_monitor.py.

Only ``test_throughput_monitor_fit_gradient_accumulation``: ``ThroughputMonitor`` measures once per
optimizer step (``trainer.fit_loop._should_accumulate()``), which the callback's windows must keep. The
callback's own statistics are not logged (``log_stats=False``) so that the logger sees exactly the
original calls; the partial window at the end of each epoch is a step like any other.
"""

from __future__ import annotations

from unittest import mock
from unittest.mock import Mock, call

import pytest
from pytorch_lightning import Trainer
from pytorch_lightning.callbacks.throughput_monitor import ThroughputMonitor
from pytorch_lightning.demos.boring_classes import BoringModel

from lightning_gradacc import GradientAccumulationCallback


# Original: test_throughput_monitor_fit_gradient_accumulation
@pytest.mark.parametrize("log_every_n_steps", [1, 3])
def test_throughput_monitor_fit_gradient_accumulation(log_every_n_steps, tmp_path):
    logger_mock = Mock()
    logger_mock.save_dir = tmp_path
    monitor = ThroughputMonitor(
        length_fn=lambda x: 3 * 2, batch_size_fn=lambda x: 3, window_size=4, separator="|"
    )
    model = BoringModel()
    model.flops_per_batch = 10
    accumulation = GradientAccumulationCallback(2, log_stats=False)

    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        logger=logger_mock,
        callbacks=[monitor, accumulation],
        limit_train_batches=5,
        limit_val_batches=0,
        max_epochs=2,
        log_every_n_steps=log_every_n_steps,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    timings = [0.0] + [0.5 + i for i in range(1, 11)]
    with (
        mock.patch("pytorch_lightning.callbacks.throughput_monitor.get_available_flops", return_value=100),
        mock.patch("time.perf_counter", side_effect=timings),
    ):
        trainer.fit(model)

    expected = {
        "train|device|batches_per_sec": 1.0,
        "train|device|samples_per_sec": 3.0,
        "train|device|items_per_sec": 6.0,
        "train|device|flops_per_sec": 10.0,
        "train|device|mfu": 0.1,
    }

    all_log_calls = [
        call(
            metrics={
                # The very first batch doesn't have the *_per_sec metrics yet
                **(expected if log_every_n_steps > 1 else {}),
                "train|time": 2.5,
                "train|batches": 2,
                "train|samples": 6,
                "train|lengths": 12,
                "epoch": 0,
            },
            step=0,
        ),
        call(
            metrics={
                **expected,
                "train|time": 4.5,
                "train|batches": 4,
                "train|samples": 12,
                "train|lengths": 24,
                "epoch": 0,
            },
            step=1,
        ),
        call(
            metrics={
                **expected,
                "train|time": 5.5,
                "train|batches": 5,
                "train|samples": 15,
                "train|lengths": 30,
                "epoch": 0,
            },
            step=2,
        ),
        call(
            metrics={
                **expected,
                "train|time": 7.5,
                "train|batches": 7,
                "train|samples": 21,
                "train|lengths": 42,
                "epoch": 1,
            },
            step=3,
        ),
        call(
            metrics={
                **expected,
                "train|time": 9.5,
                "train|batches": 9,
                "train|samples": 27,
                "train|lengths": 54,
                "epoch": 1,
            },
            step=4,
        ),
        call(
            metrics={
                **expected,
                "train|time": 10.5,
                "train|batches": 10,
                "train|samples": 30,
                "train|lengths": 60,
                "epoch": 1,
            },
            step=5,
        ),
    ]
    expected_log_calls = all_log_calls[(log_every_n_steps - 1) :: log_every_n_steps]
    assert logger_mock.log_metrics.mock_calls == expected_log_calls
    assert accumulation.stats.windows == 6
    assert accumulation.stats.micro_batches_last_step == 1
