"""Token weighting where an engine accumulates (DeepSpeed): the window's batches counted before its backward.

Under ``scaling="weighted"`` each micro-batch's loss is weighed by its item count over the window's total
over the ranks. The core rescales the window's sum at its end; DeepSpeed keeps no ``.grad`` to rescale, so
the total must be known before the window's first backward. When a window opens, its coming batches are
read ahead from Lightning's data fetcher (and left for Lightning to take next, in order), counted as the
callback counts a batch (``item_count_fn``, else the batch size), and their total is summed over the ranks
in one all-reduce per window (Hugging Face's Trainer counts a step's batches ahead in the same way). Each
micro-batch's count is checked at its own turn against the one it was read ahead with.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from typing_extensions import override

from .. import lightning_internals as internals
from ..core.settings import check_item_count
from ..core.weighting import missing_count
from ..core.world import summed_over_ranks
from ..counters import count_micro_batch
from ..engine_window import EngineWindow
from .base import Fit, FitPart
from .engine import engine_window


class ItemsReadAhead(FitPart):
    """Reads each window's batches ahead and gives the engine's window their counts (see the module).

    Args:
        fit: The fit (its driver an :class:`~lightning_gradacc.engine_window.EngineWindow`).
        item_count_fn: The callback's item counter, or ``None`` (the batch size).
    """

    def __init__(self, fit: Fit, *, item_count_fn: Callable[[Any], Any] | None) -> None:
        super().__init__(fit)
        self.item_count_fn = item_count_fn

    @property
    def engine(self) -> EngineWindow:
        """The fit's driver: the engine's window, told the counts."""
        return engine_window(self.fit)

    @override
    def batch_start(self, batch: Any, batch_idx: int) -> None:
        """A window opening here: read its other batches ahead, count them, and sum over the ranks."""
        engine, fit = self.engine, self.fit
        if engine.expecting:
            return
        ahead = internals.read_ahead(fit.trainer, engine.remaining - 1)
        current = fit.batch
        counts = [self._checked(current.items, current.label, current.error)]
        for offset, later in enumerate(ahead, 1):
            if later is None:  # Lightning skips a None batch: it cuts the window, whose step never comes
                counts.append(0.0)
                continue
            counted = count_micro_batch(
                later, batch_idx + offset, self.item_count_fn, True, fit.api.extract_batch_size
            )
            counts.append(self._checked(counted.items, counted.label, counted.error))
        problem = next((c for c in counts if isinstance(c, str)), None)
        local = math.nan if problem is not None else sum(counts)  # type: ignore[arg-type]
        total = summed_over_ranks(local, engine.device)  # one per window; a bad count's nan reaches all
        if not math.isfinite(total):
            raise RuntimeError(problem or "Another rank's item count in this window is invalid")
        if total == 0 and "empty weighted window" not in fit.once:
            fit.once.add("empty weighted window")
            fit.warn(
                f"The window opening at batch {batch_idx} holds no items on any rank: its gradient is zero,"
                " and DeepSpeed still steps it (momentum and weight decay act on it)."
            )
        engine.expect([float(c) for c in counts], total)

    def _checked(self, items: Any, label: str, error: str | None) -> float | str:
        """A count as a number >= 0, or the problem with it (raised on every rank after the all-reduce)."""
        if error is not None:
            return error
        if items is None:
            return missing_count(label)
        try:  # a tensor of the loader's batch is read on the host (before any transfer) and checked as one
            return float(check_item_count(float(check_item_count(items, label)), label))
        except (TypeError, ValueError) as exc:
            return str(exc)

    @override
    def state_dict(self) -> dict[str, Any]:
        """Nothing saved; a save while batches are held ahead says what a stateful loader saved."""
        held = internals.held_ahead(self.fit.trainer)
        if held and hasattr(self.fit.trainer.train_dataloader, "state_dict"):
            self.fit.warn(
                f"This checkpoint is taken inside a window whose next {held} batch(es) were read ahead"
                " (`scaling='weighted'` under DeepSpeed): a loader that saves the position of what it yielded"
                " (e.g. `StatefulDataLoader`) saved it past them, so a resume would skip them. Save at a"
                " window's end (`ModelCheckpoint(every_n_train_steps=...)`)."
            )
        return {}
