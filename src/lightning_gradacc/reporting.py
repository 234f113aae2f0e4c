"""What the callback reports: the scalars it logs at each optimizer step, and warnings of skipped steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .core import AccumulationStats, GradAccumulator

# Statistics logged under "grad_accum/" with their own names (all but the open window's micro-batches).
NOISE_STATISTICS = ("noise_scale", "grad_sq_norm_estimate", "trace_sigma_estimate")  # with noise_scale=True
LOGGED_STATISTICS = tuple(
    name
    for name in (*AccumulationStats.__dataclass_fields__, "steps_taken")
    if name != "open_window_micro_batches" and name not in NOISE_STATISTICS
)


def step_metrics(accumulator: GradAccumulator | None, *, noise_scale: bool) -> dict[str, float]:
    """The logged scalars: ``LOGGED_STATISTICS`` (and ``NOISE_STATISTICS``) and ``window_loss``.

    Args:
        accumulator: The accumulator of the fit (``None``: nothing to log yet).
        noise_scale: Whether the noise scale is estimated.

    Example:
        >>> import torch
        >>> metrics = step_metrics(GradAccumulator([torch.zeros(1, requires_grad=True)]), noise_scale=False)
        >>> metrics["grad_accum/windows"], "grad_accum/noise_scale" in metrics
        (0.0, False)
    """
    if accumulator is None:
        return {}
    stats = accumulator.stats.as_dict()
    names = LOGGED_STATISTICS + (NOISE_STATISTICS if noise_scale else ())
    logged = {f"grad_accum/{name}": float(stats[name]) for name in names}
    logged["grad_accum/window_loss"] = accumulator.window_loss
    return logged


class SkipWarnings:
    """Warns of steps skipped for non-finite gradients, rate-limited: at the 1st, 2nd, 4th, 8th, ... skip.

    Attributes:
        seen: The skipped steps counted at the last look (set when an accumulator takes over its counters).

    Example:
        >>> skips = SkipWarnings()
        >>> for skipped in (1, 2, 3, 4):
        ...     skips.update(skipped, global_step=10 * skipped, warn=lambda message: print(message[:38]))
        Non-finite gradient at global step 10:
        Non-finite gradient at global step 20:
        Non-finite gradient at global step 40:
    """

    def __init__(self) -> None:
        self.seen = 0
        self._warned = 0  # the skips counted at the last warning

    def update(
        self, skipped: int, global_step: int, warn: Callable[[str], Any], *, late: bool = False
    ) -> None:
        """Look at the run's ``skipped`` steps after a step that was skipped; warn if it is time to.

        ``late``: the count was read after steps decided on the device, so the skips happened by
        ``global_step``, not at it.
        """
        if skipped > self.seen and (skipped >= 2 * self._warned or skipped == 1):
            self._warned = max(skipped, 1)
            where = (
                f"by global step {global_step} (a fused optimizer skipped it on the device)"
                if late
                else f"at global step {global_step}"
            )
            warn(
                f"Non-finite gradient {where}: the optimizer step was skipped"
                f" ({skipped} skipped so far). Parameters and optimizer state are unchanged; `global_step`"
                " and step-interval LR schedulers still advance."
            )
        self.seen = skipped
