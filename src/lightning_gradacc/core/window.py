"""Window: one accumulation window's lifecycle and its counts.

A window is the run of micro-batches between two optimizer steps. It moves through explicit states, and
an action that does not fit the state raises instead of mixing two windows' gradients::

    EMPTY ──record──> IN_GRAD                  (the sum lives in .grad)
    EMPTY ──record──> IN_BUFFERS ──flush──> FLUSHED   (buffers, then .grad for the last backward)
    EMPTY ──flush───> FLUSHED                  (K=1 under DDP: nothing buffered yet)
    any open state ──close──> CLOSED           (finalized or discarded; a new Window follows)

The window owns what its micro-batches recorded (:class:`~lightning_gradacc.core.tally.WindowTally`),
and the micro-batches dropped or clipped on their own. The loss scale its gradients carry is the
accumulator's :class:`~lightning_gradacc.core.gradient_scale.GradientScale` (it changes only between
windows).
"""

from __future__ import annotations

import enum

import torch
from torch import Tensor

from .scalars import Scalar
from .tally import WindowTally


class WindowState(enum.Enum):
    """Where the window's sum lives."""

    EMPTY = "empty"
    IN_GRAD = "accumulating in .grad"
    IN_BUFFERS = "accumulating in buffers"
    FLUSHED = "flushed into .grad"
    CLOSED = "closed"


# The states as module constants: a lookup on the enum class costs more than the whole check on the hot path.
_EMPTY, _IN_GRAD, _IN_BUFFERS, _FLUSHED, _CLOSED = WindowState


class WindowClosedError(RuntimeError):
    """An action on a window that has already been finalized or discarded."""


class Window:
    """One accumulation window.

    Args:
        buffered: Whether micro-batch gradients move into accumulation buffers.
        device: Device of the window's totals.
        dtype: Dtype of the window's totals.

    Example:
        >>> window = Window(buffered=False, device=torch.device("cpu"), dtype=torch.float64)
        >>> window.record_micro_batch(in_buffers=False)
        >>> window.state, window.micro_batches
        (<WindowState.IN_GRAD: 'accumulating in .grad'>, 1)
        >>> window.close()
        >>> window.record_micro_batch(in_buffers=False)
        Traceback (most recent call last):
        ...
        lightning_gradacc.core.window.WindowClosedError: This accumulation window is closed ...
    """

    def __init__(self, *, buffered: bool, device: torch.device, dtype: torch.dtype) -> None:
        self.buffered = buffered
        self.state = _EMPTY
        self.micro_batches = 0
        self.tally = WindowTally(device, dtype)
        self.dropped: Tensor | None = None  # micro-batches dropped by overflow="skip_micro_batch" (device)
        self.micro_clips: Scalar | None = None  # micro-batches clipped by clip_mode="micro_batch"

    def __repr__(self) -> str:
        return f"Window({self.state.value}, micro_batches={self.micro_batches})"

    @property
    def empty(self) -> bool:
        """Whether no micro-batch has been recorded."""
        return self.micro_batches == 0

    @property
    def sums_in_buffers(self) -> bool:
        """Whether the window's sum is in the buffers (not in ``.grad``)."""
        return self.state is _IN_BUFFERS

    @property
    def new_gradients_to_buffers(self) -> bool:
        """Whether the next micro-batch's ``.grad`` moves into the buffers."""
        if self.state is _CLOSED:
            self._require_open("record a micro-batch")
        return self.buffered and self.state is not _FLUSHED

    def _require_open(self, action: str) -> None:
        if self.state is _CLOSED:
            raise WindowClosedError(
                f"This accumulation window is closed (finalized or discarded); cannot {action}. A new window"
                " opens after `finalize()` or `reset()`."
            )

    def record_micro_batch(self, *, in_buffers: bool) -> None:
        """Count one micro-batch whose gradient was added where the sum lives."""
        state = self.state
        if state is _CLOSED:
            self._require_open("record a micro-batch")
        if state is _EMPTY:
            self.state = _IN_BUFFERS if in_buffers else _IN_GRAD
        elif in_buffers != (state is _IN_BUFFERS):
            raise RuntimeError(
                f"A micro-batch's gradient went to {'the buffers' if in_buffers else '.grad'} while the"
                f" window is {self.state.value}."
            )
        self.micro_batches += 1

    def flush(self) -> bool:
        """Mark the sum as moved into ``.grad``; returns whether the buffers must be written (once)."""
        self._require_open("flush it into .grad")
        if not self.buffered:
            raise RuntimeError("A window without accumulation buffers has nothing to flush.")
        if self.state is _FLUSHED:
            return False
        moved = self.state is _IN_BUFFERS
        self.state = _FLUSHED
        return moved

    def close(self) -> None:
        """End the window (finalized or discarded)."""
        self._require_open("close it")
        self.state = _CLOSED

    def restored(self, *, in_buffers: bool, micro_batches: int) -> None:
        """Take the state of a saved window whose sums were just put in place."""
        self._require_open("restore a saved window into it")
        if not self.empty:
            raise RuntimeError("A saved window can only be restored into an empty window.")
        self.state = _IN_BUFFERS if in_buffers else _IN_GRAD
        self.micro_batches = micro_batches
