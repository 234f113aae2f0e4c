"""Ported from Lightning-AI/pytorch-lightning: tests/tests_pytorch/loggers/test_tensorboard.py.

Only ``test_tensorboard_with_accumulated_gradients`` (accumulation with ``log_every_n_steps``): step metrics
are logged once per optimizer step, every ``log_every_n_steps`` steps; the callback's ``grad_accum/``
statistics must be logged at exactly those steps as well.
"""

from __future__ import annotations

from unittest import mock

from pytorch_lightning import Trainer
from pytorch_lightning.demos.boring_classes import BoringModel
from pytorch_lightning.loggers import TensorBoardLogger

from lightning_gradacc import GradientAccumulationCallback


# Original: test_tensorboard_with_accumulated_gradients
@mock.patch("pytorch_lightning.loggers.TensorBoardLogger.log_metrics")
def test_tensorboard_with_accumulated_gradients(mock_log_metrics, tmp_path):
    """Tests to ensure that tensorboard log properly when accumulated_gradients > 1."""

    class TestModel(BoringModel):
        def __init__(self):
            super().__init__()
            self.indexes = []

        def training_step(self, *args):
            self.log("foo", 1, on_step=True, on_epoch=True)
            if (
                not self.trainer.fit_loop._should_accumulate()
                and self.trainer._logger_connector.should_update_logs
            ):
                self.indexes.append(self.trainer.global_step)
            return super().training_step(*args)

    model = TestModel()
    logger_0 = TensorBoardLogger(tmp_path, default_hp_metric=False)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        limit_train_batches=12,
        limit_val_batches=0,
        max_epochs=3,
        callbacks=[GradientAccumulationCallback(2)],
        logger=[logger_0],
        log_every_n_steps=3,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)

    calls = [m[2] for m in mock_log_metrics.mock_calls]
    count_epochs = [c["step"] for c in calls if "foo_epoch" in c["metrics"]]
    assert count_epochs == [5, 11, 17]

    assert model.indexes == [2, 5, 8, 11, 14, 17]  # 6 steps per epoch, logged every 3rd step
    count_steps = [c["step"] for c in calls if "foo_step" in c["metrics"]]
    assert count_steps == model.indexes

    stats_steps = [c["step"] for c in calls if "grad_accum/windows" in c["metrics"]]
    assert stats_steps == model.indexes
    # the statistic logged at step s counts s + 1 optimizer steps
    assert [c["metrics"]["grad_accum/windows"] for c in calls if "grad_accum/windows" in c["metrics"]] == [
        s + 1 for s in model.indexes
    ]
