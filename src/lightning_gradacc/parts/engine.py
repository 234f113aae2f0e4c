"""The window's end where an engine keeps it (DeepSpeed): the engine is told where windows end.

Lightning calls ``on_before_optimizer_step`` at every micro-batch under a strategy that accumulates itself;
the engine steps at the end of the window it was told of before the micro-batch's forward (its boundary).
After the step the engine's own gradient norm and its fp16 overflows are read, once per window.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from .. import lightning_internals as internals
from ..engine_window import EngineWindow
from .base import Fit, FitPart


def engine_window(fit: Fit) -> EngineWindow:
    """The fit's driver where an engine accumulates: its window (the engine's own calls)."""
    driver = fit.driver
    assert isinstance(driver, EngineWindow), "an engine's fit drives an `EngineWindow`"
    return driver


class EngineSteps(FitPart):
    """Tells the engine each window's boundary and counts what it stepped (see the module).

    Args:
        fit: The fit (its driver an :class:`~lightning_gradacc.engine_window.EngineWindow`).
        plan: The one owner of K (told of each window closed).
    """

    def __init__(self, fit: Fit, *, plan: Any) -> None:
        super().__init__(fit)
        self.plan = plan

    @property
    def engine(self) -> EngineWindow:
        """The fit's driver: the engine's window (the engine's own calls: its boundary, its step)."""
        return engine_window(self.fit)

    @override
    def train_start(self) -> None:
        """A resume inside a window: its micro-batches before the save are in no checkpoint of the engine."""
        restored_inside = self.plan.position.batches_in_window
        if restored_inside:
            self.engine.lost(restored_inside)
            self.fit.warn(
                f"Resumed inside a window under {self.fit.layout.name}: the gradients of its first"
                f" {restored_inside} micro-batch(es) are in no checkpoint of the engine, so this window steps"
                " on its remaining micro-batches alone (normalized over them). Checkpoints taken at a"
                " window's end resume exactly."
            )

    @override
    def batch_start(self, batch: Any, batch_idx: int) -> None:
        """Before the forward, of the window this batch is in (after a discard): whether it ends there."""
        self.engine.batch_start()

    @override
    def window_end(self, optimizer: torch.optim.Optimizer) -> None:
        """Called every micro-batch: the window closes where Lightning steps (the engine steps at its end)."""
        current = self.fit.batch
        if not internals.should_accumulate(self.fit.trainer) and not current.finalized:
            self.engine.end_window(optimizer)
            self.plan.window_closed(self.engine)
            current.finalized = True

    @override
    def batch_end(self, outputs: Any) -> None:
        """After the engine's step: its norm and fp16 overflows."""
        if self.fit.batch.finalized:
            engine = self.engine
            engine.after_step()
            self.fit.skips.update(engine.stats.skipped_steps, self.fit.trainer.global_step, self.fit.warn)
