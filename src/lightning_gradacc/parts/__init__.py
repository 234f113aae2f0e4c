"""The parts of a fit: each capability of the callback as one part, with one interface (:mod:`.base`).

Every fit has the window (:mod:`.window`: the plan's K, the driver's gradients) and the reporting
(:mod:`.reporting`); its layout adds how a window ends (:mod:`.step` where the core keeps it, :mod:`.engine`
where an engine does, with :mod:`.read_ahead` to weigh its windows by items), and its settings the reduction
(:mod:`.reduction`) and the pieces (:mod:`.pieces`).
:func:`assemble` puts them in their order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..piece_runner import PieceRunner
from .base import HOOKS, Batch, Fit, FitPart, Parts, Share
from .engine import EngineSteps
from .pieces import PiecesPart
from .read_ahead import ItemsReadAhead
from .reduction import ReductionPart
from .reporting import ReportingPart
from .step import CoreStep
from .window import WindowPart


def assemble(
    fit: Fit,
    window: WindowPart,
    *,
    runner: PieceRunner | None,
    item_count_fn: Callable[[Any], Any] | None,
    callback: Any,
    log_stats: bool,
) -> tuple[list[FitPart], ReportingPart]:
    """The parts of a fit in their order, after ``window`` built its reduction and driver; its reporting.

    The window and the reporting are in every fit; the layout adds how a window ends, the reduction is in
    where it acts, the pieces where ``piece_size`` is set. The order is each hook's (``docs/architecture.md``,
    "The parts of a fit"): hooks that close what others opened (``after_backward``, ``exception``,
    ``train_end``) run in reverse.
    """
    assert fit.sync is not None, "the window part builds the reduction first"
    plan = window.plan
    window_end: FitPart = (
        EngineSteps(fit, plan=plan)
        if fit.layout.engine_accumulates
        else CoreStep(fit, window=window, callback=callback, log_stats=log_stats)
    )
    parts: list[FitPart] = [window, window_end]
    if fit.layout.engine_accumulates and window.settings.mode.weighted:  # the engine keeps no `.grad`
        parts.insert(1, ItemsReadAhead(fit, item_count_fn=item_count_fn))
    if ReductionPart.acts(fit.sync):
        parts.append(ReductionPart(fit))
    if runner is not None:
        additive = window.settings.mode.additive  # the pieces' losses add without a share
        parts.append(
            PiecesPart(
                fit, runner=runner, count=item_count_fn, lightning_k=plan.lightning_k, additive=additive
            )
        )
    noise_scale = window.settings.noise_scale
    reporting = ReportingPart(fit, parts=Parts(parts), noise_scale=noise_scale, log_stats=log_stats)
    return [*parts, reporting], reporting


__all__ = ["HOOKS", "Batch", "Fit", "FitPart", "Parts", "Share", "assemble"]
