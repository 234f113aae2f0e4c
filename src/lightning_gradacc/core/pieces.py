"""A micro-batch run as pieces, each with its own backward: the handle that weighs and restarts them.

``GradAccumulator.begin_pieces`` begins such a micro-batch and returns a :class:`MicroBatchPieces` (as a
GradScaler keeps its per-optimizer state apart from its own methods): the first piece's loss is weighed
there, :meth:`MicroBatchPieces.next` weighs each later one, :meth:`MicroBatchPieces.restart` forgets the
pieces run so far (after an out-of-memory error), and :attr:`MicroBatchPieces.alone_in_grad` says whether
``.grad`` holds this micro-batch alone (so that dropping it loses nothing else). ``end_micro_batch``
records the micro-batch once, whatever its pieces. The noise scale measures each piece alone (an
item-weighted set of independent groups keeps its estimate unbiased).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .noise import NoiseScale, NoNoiseScale
from .weighting import GradientScale, ItemCount
from .window import Window


@dataclass(slots=True)
class PendingMicroBatch:
    """A micro-batch between ``begin_micro_batch`` (or ``begin_pieces``) and ``end_micro_batch``."""

    count: ItemCount
    loss: Tensor
    last: bool
    pieces: MicroBatchPieces | None = None  # run in pieces


class MicroBatchPieces:
    """The pending micro-batch's pieces (returned by ``GradAccumulator.begin_pieces``).

    Args:
        pending: The micro-batch begun.
        window: The open window.
        noise: The noise-scale estimator (measures each piece alone).
        scale: The window's gradient scale (loss scale and AMP scale).
        weighted: Whether losses carry item weights (``scaling="weighted"``).
        share: The first piece's part of the micro-batch's items.
        loss: The first piece's loss, weighed.
    """

    def __init__(
        self,
        pending: PendingMicroBatch,
        *,
        window: Window,
        noise: NoiseScale | NoNoiseScale,
        scale: GradientScale,
        weighted: bool,
        share: float | Tensor,
        loss: Tensor,
    ) -> None:
        self._pending, self._window, self._noise, self._scale = pending, window, noise, scale
        self._weighted, self.share, self.loss = weighted, share, loss

    @property
    def alone_in_grad(self) -> bool:
        """Whether ``.grad`` holds this micro-batch's gradient alone: dropping it loses nothing else.

        True when it opens the window, or when the window's earlier micro-batches are in the buffers (not
        yet written into ``.grad``): the micro-batch can then start over after an error.
        """
        window = self._window
        return window.micro_batches == 0 or window.new_gradients_to_buffers

    def next(self, loss: Tensor, share: float | Tensor) -> Tensor:
        """Weigh the next piece's loss in place and return it: back-propagate it.

        Args:
            loss: The piece's mean loss times ``share``, as back-propagated otherwise (times the loss scale
                and the AMP scale).
            share: The piece's part of the micro-batch's items.
        """
        pending = self._pending
        if self._noise.watching:  # the previous piece's norms, measured alone
            self.measured()
        pending.loss = pending.loss + loss.detach()
        self.share = share
        return pending.count.weigh_loss(loss, in_place=True) if self._weighted else loss

    def restart(self) -> None:
        """Forget the pieces run so far (their gradients are the caller's to drop).

        After an out-of-memory error inside one of them, before the micro-batch runs again: its loss and
        noise-scale norms start over; its item count and weight stay.
        """
        pending = self._pending
        pending.loss = torch.zeros_like(pending.loss)
        self._noise.begin_backward()

    def measured(self) -> None:
        """The running piece's backward ended: the noise scale keeps its norms (items, factor) alone."""
        count = self._pending.count
        items: Any = None if count.items is None else count.items * self.share
        weight = count.weight if self._weighted else 1.0
        self._noise.end_piece(items, weight * self._scale.value() * self.share)


__all__ = ["MicroBatchPieces", "PendingMicroBatch"]
