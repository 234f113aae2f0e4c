"""What a fit reports: the statistics logged at each step and at the fit's end, and late skip warnings.

Logged at a batch that ended a window, on Lightning's logging steps, to the loggers and
``trainer.callback_metrics`` (``ddp_spawn`` returns those, ``ModelCheckpoint`` reads them); between them to
``callback_metrics`` only where a callback monitors a ``grad_accum/`` key; and once more when the fit ends
(a short run). Steps a fused optimizer skipped on the device are counted where the statistics are read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from typing_extensions import override

from .. import lightning_internals as internals
from ..reporting import monitors_statistics, step_metrics, with_parts
from .base import Fit, FitPart

if TYPE_CHECKING:
    from .base import Parts


class ReportingPart(FitPart):
    """Logs the fit's statistics and warns of steps skipped on the device (see the module).

    Args:
        fit: The fit.
        parts: The fit's parts (their values are logged with the driver's).
        noise_scale: Whether the noise scale is estimated (its statistics are logged).
        log_stats: Whether anything is logged.
    """

    def __init__(self, fit: Fit, *, parts: Parts, noise_scale: bool, log_stats: bool) -> None:
        super().__init__(fit)
        self.parts, self.noise_scale, self.log_stats = parts, noise_scale, log_stats
        self._monitored = False  # a callback monitors a `grad_accum/` key: read the statistics every step

    @override
    def train_start(self) -> None:
        fit = self.fit
        assert fit.driver is not None
        self._monitored = monitors_statistics(fit.trainer.callbacks)  # type: ignore[attr-defined]
        fit.skips.seen = fit.driver.stats.skipped_steps

    def metrics(self) -> dict[str, float]:
        """The scalars logged under ``grad_accum/`` (:func:`~lightning_gradacc.reporting.step_metrics`)."""
        driver = self.fit.driver
        assert driver is not None
        values = self.parts.statistics()
        stats = with_parts(driver.stats, values)
        return step_metrics(stats, noise_scale=self.noise_scale, parts=values, absent=driver.absent)

    @override
    def batch_end(self, outputs: Any) -> None:
        fit = self.fit
        if not fit.batch.finalized or not self.log_stats:
            return
        trainer = fit.trainer
        if internals.logs_this_step(trainer):
            # to the loggers and `callback_metrics` (`ddp_spawn` returns these, `ModelCheckpoint` reads them)
            logged = self.metrics()
            internals.log_step_metrics(trainer, logged)
            if fit.stepped_on_device and logged:  # skipped on the device: counted here
                skipped = int(logged["grad_accum/skipped_steps"])
                fit.skips.update(skipped, trainer.global_step, fit.warn, late=True)
        elif self._monitored:  # `callback_metrics` at every step for a monitor (0.3 ms)
            internals.log_step_metrics(trainer, self.metrics(), to_loggers=False)

    @override
    def train_end(self) -> None:
        fit = self.fit
        assert fit.driver is not None
        if self.log_stats:  # the last statistics, also where no logging step came (a short run)
            internals.log_step_metrics(fit.trainer, self.metrics(), to_loggers=False)
        if fit.stepped_on_device:  # the last steps' skips, and invalid counts held on the device
            fit.skips.update(fit.driver.stats.skipped_steps, fit.trainer.global_step, fit.warn, late=True)
