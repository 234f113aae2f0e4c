"""The window's end where the core keeps it: the driver closes the window, the optimizer steps (or not).

Lightning calls ``on_before_optimizer_step`` once per window: the core turns the window's sum into the big
batch's gradient (normalized, checked, clipped) and says whether to step. Under a GradScaler Lightning
neither unscales nor steps when the window's last batch returned ``None``: the part steps it itself. A step
skipped for a non-finite gradient is warned of; Lightning's own clipping, which runs after this hook, is
paused until the batch ends (it would crash on a skipped step's empty gradients, or clip twice).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from .. import lightning_internals as internals
from ..compatibility import grads_read_before_step
from .base import Fit, FitPart

if TYPE_CHECKING:
    from .window import WindowPart


class CoreStep(FitPart):
    """Closes each window on the core's driver and steps it (see the module).

    Args:
        fit: The fit.
        window: The fit's window part (its parameter groups and plan).
        callback: The accumulation callback (``grads_read_before_step`` looks past it).
        log_stats: Whether statistics are logged (read in the step's one sync when they are).
    """

    def __init__(self, fit: Fit, *, window: WindowPart, callback: Any, log_stats: bool) -> None:
        super().__init__(fit)
        self.window, self.callback, self.log_stats = window, callback, log_stats
        self.grads_read_before_step = True  # by a hook after the callback's: set at train start
        self._paused_clipping: internals.PausedClipping | None = None  # Lightning's, until the batch ends

    @override
    def train_start(self) -> None:
        fit = self.fit
        self.grads_read_before_step = grads_read_before_step(
            fit.api, fit.trainer, fit.pl_module, self.callback
        )

    @override
    def window_end(self, optimizer: torch.optim.Optimizer) -> None:
        fit, current, scaler, trainer = self.fit, self.fit.batch, self.fit.scaler, self.fit.trainer
        driver = fit.driver
        assert driver is not None
        # a group the module's (or a later callback's) `on_after_backward` added is stepped too
        self.window.groups.follow(trainer, fit.pl_module, driver)
        if not current.backward_ran and not driver.window.empty:
            fit.verify("window_end")
        # Under a GradScaler, Lightning neither unscales nor steps when the batch that ends a window returned
        # None: the window's earlier micro-batches would be dropped. The part steps it itself.
        steps_itself = (
            scaler is not None
            and not current.backward_ran
            and not driver.window.empty
            and not current.finalized
        )
        # The scaler unscales here where Lightning did not: a window stepped here, and a fused optimizer
        # (Lightning leaves the AMP scale in for it, which the norm and clipping must not see; the scaler's
        # step then only skips on its `found_inf`). Logged at this batch's end: the statistics then come
        # along in the step's one sync.
        stepped = driver.end_window(
            optimizer,
            unscale=steps_itself or (current.backward_ran and not internals.lightning_unscales(optimizer)),
            fold_multiplier=not self.grads_read_before_step,
            reevaluation=current.finalized,
            read_statistics=self.log_stats and internals.logs_this_step(trainer),
        )
        fit.stepped_on_device = fit.stepped_on_device or driver.device_step is not None
        if not current.finalized:  # items: the window's, over ranks (read if the policy counts them)
            self.window.plan.window_closed(driver)
        current.finalized = True
        if steps_itself:
            assert scaler is not None
            if stepped:  # Lightning's clipping (and the module's hook), before the step it would miss
                internals.clip_as_lightning(trainer, fit.pl_module, optimizer)
            scaler.step(optimizer)
            scaler.update()
        elif stepped:
            return
        if not stepped:  # `skipped_steps` syncs, on this rare path only
            fit.skips.update(driver.stats.skipped_steps, trainer.global_step, fit.warn)
        # Lightning clips after this hook (`gradient_clip_val`, or `configure_gradient_clipping`): by value
        # it crashes on a list with no gradient at all, and a window stepped here was clipped before its
        # step. Both go through the precision plugin, paused until the batch ends.
        paused = self._paused_clipping
        if paused is None or paused.plugin is not trainer.precision_plugin:
            self._paused_clipping = internals.pause_clipping(trainer.precision_plugin)

    @override
    def batch_end(self, outputs: Any) -> None:
        if self.fit.batch.finalized:
            self._resume_clipping()

    @override
    def exception(self) -> None:
        self._resume_clipping()

    def _resume_clipping(self) -> None:
        paused, self._paused_clipping = self._paused_clipping, None
        if paused is not None:
            paused.resume()
