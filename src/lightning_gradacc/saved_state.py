"""The callback's checkpoint entry: the accumulator's lifetime counters and its open window, if any.

A loaded entry waits here until the accumulator of the next fit is built (``on_train_start``); without one,
the counters of the previous fit carry over, so that they survive a second ``fit()`` as a resume.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .core import GradAccumulator
from .core.checkpoint import FORMAT_VERSION


class SavedState:
    """Saves the callback's state and holds a loaded one until :meth:`restore` hands it to an accumulator.

    Attributes:
        counters: The accumulator's state loaded from a checkpoint, not restored yet.
        window: The open window loaded from a checkpoint, not restored yet.

    Example:
        >>> entry = SavedState.save(None, mid_batch=False, warn=print)
        >>> entry["accumulator"], entry["window"]
        (None, None)
    """

    def __init__(self) -> None:
        self.counters: dict[str, Any] | None = None
        self.window: dict[str, Any] | None = None

    @staticmethod
    def save(
        accumulator: GradAccumulator | None, *, mid_batch: bool, warn: Callable[[str], Any]
    ) -> dict[str, Any]:
        """The entry: counters and the open window (tensors and numbers: ``weights_only=True`` loads it).

        Under DDP this sums the open window over ranks (every rank takes part, as in every Lightning save).

        Args:
            accumulator: The accumulator of the current fit, or ``None``.
            mid_batch: Whether a micro-batch was recorded in a batch that has not ended.
            warn: Warns once (on rank zero) that such a save cannot resume exactly.
        """
        window = accumulator.window_state_dict() if accumulator is not None else None
        if window is not None and mid_batch:
            warn(
                "This checkpoint is taken after a micro-batch's backward but before its batch ended (an"
                " exception in a later hook of the batch, saved by `OnExceptionCheckpoint`?): the saved"
                " window holds that micro-batch, while Lightning restarts the batch's index when it resumes,"
                " so a resume from it is not exact. Checkpoints taken at a batch's end resume exactly."
            )
        return {
            "version": FORMAT_VERSION,
            "accumulator": accumulator.state_dict() if accumulator is not None else None,
            "window": window,
        }

    def load(self, state_dict: dict[str, Any]) -> None:
        """Keep a checkpoint's entry for the next accumulator; refuse another format version."""
        if state_dict.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"Cannot load `GradientAccumulationCallback` state of version {state_dict.get('version')!r};"
                f" this version reads {FORMAT_VERSION}."
            )
        self.counters = state_dict.get("accumulator")
        self.window = state_dict.get("window")

    def restore(
        self, accumulator: GradAccumulator, previous: GradAccumulator | None, *, primary: bool
    ) -> None:
        """Load the counters (a checkpoint's, else the previous fit's) and a saved window into a new one.

        The window is re-opened on the ``primary`` rank only (the others start from zero), and is taken even
        if it fails to load; the counters stay until they load.
        """
        counters = self.counters
        if counters is None and previous is not None:
            counters = previous.state_dict()
        if counters is not None:
            accumulator.load_state_dict(counters)
        window, self.window = self.window, None
        if window is not None:
            accumulator.load_window_state_dict(window, primary=primary)
        self.counters = None
