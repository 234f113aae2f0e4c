"""``lightning_internals``: what the callback computes in Lightning's place agrees with Lightning's answer."""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl

from lightning_gradacc import GradientAccumulationCallback
from lightning_gradacc import lightning_internals as internals
from tests import helpers as h


class CompareLogging(pl.Callback):
    """Asks both answers to "are step metrics logged now?" in the hooks where the callback asks."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.stop_at = stop_at
        self.answers: list[tuple[bool, bool]] = []

    def _compare(self, trainer: pl.Trainer) -> None:
        self.answers.append(
            (internals.logs_this_step(trainer), bool(trainer._logger_connector.should_update_logs))
        )

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self._compare(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        self._compare(trainer)
        if self.stop_at is not None and trainer.global_step >= self.stop_at:
            trainer.should_stop = True
            self._compare(trainer)


@pytest.mark.parametrize(("every", "stop_at"), [(3, None), (1, None), (0, None), (50, 2)])
def test_logs_this_step_agrees_with_lightning(every: int, stop_at: int | None) -> None:
    compare = CompareLogging(stop_at)
    callbacks = [GradientAccumulationCallback(2), compare]
    trainer = h.trainer(
        callbacks=callbacks, logger=h.MetricsRecorder(), log_every_n_steps=every, max_epochs=2
    )
    trainer.fit(h.RegressionModule(h.regression_data(40)))
    assert len(compare.answers) >= 5
    assert all(ours == lightning for ours, lightning in compare.answers), compare.answers
    assert any(ours for ours, _ in compare.answers) == (every != 0)
