"""The window driver: one interface for whatever keeps a fit's window, the core's or an engine's.

Every fit has one window driver, which the callback's parts drive without asking which one runs: the core
accumulator (:class:`~lightning_gradacc.core.GradAccumulator`: gradients in ``.grad`` or buffers) or an
engine's window (:class:`~lightning_gradacc.engine_window.EngineWindow`: DeepSpeed keeps the gradients and
is told where windows end). Both implement :class:`WindowDriver` (a test holds each to it, signature by
signature). What a driver cannot show is the statistics it declares :attr:`~WindowDriver.absent`, from the
one declaration of every statistic (``AccumulationStats``, ``engine=False``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from .core import AccumulationStats
from .core.pieces import MicroBatchPieces


class OpenWindow(Protocol):
    """The open window, as the parts read it."""

    @property
    def empty(self) -> bool:
        """Whether no micro-batch has been recorded."""

    @property
    def micro_batches(self) -> int:
        """Micro-batches recorded."""


@runtime_checkable
class WindowDriver(Protocol):
    """What the parts of a fit ask of its window driver."""

    device_step: Any  # a step decided on the device (the core's, with a fused optimizer), else None

    @property
    def accumulation_steps(self) -> int:
        """K of the open window (the plan writes it)."""

    @accumulation_steps.setter
    def accumulation_steps(self, value: int) -> None: ...

    @property
    def loss_scale(self) -> float:
        """What every loss was multiplied by before its backward (1 / Lightning's K; the plan writes it)."""

    @loss_scale.setter
    def loss_scale(self, value: float) -> None: ...

    @property
    def window(self) -> OpenWindow:
        """The open window."""

    @property
    def uses_last(self) -> bool:
        """Whether a micro-batch must be told that it ends the window."""

    @property
    def absent(self) -> frozenset[str]:
        """Statistics it cannot show (not logged)."""

    @property
    def saves_open_window(self) -> bool:
        """Whether a checkpoint holds its open window (an engine's checkpoint holds no gradient)."""

    @property
    def stats(self) -> AccumulationStats:
        """A snapshot of its statistics."""

    def begin_micro_batch(
        self,
        loss: Tensor,
        items: Any = None,
        *,
        last: bool | None = None,
        label: str | None = None,
        error: str | None = None,
        in_place: bool = False,
        amp_scaled: bool = True,
    ) -> Tensor:
        """Weigh a micro-batch's loss before its backward; return what to back-propagate."""

    def begin_pieces(
        self,
        loss: Tensor,
        items: Any = None,
        *,
        share: float | Tensor = 1.0,
        hold_in_grad: bool = False,
        last: bool | None = None,
        label: str | None = None,
        error: str | None = None,
        in_place: bool = False,
    ) -> MicroBatchPieces:
        """Begin a micro-batch that runs as pieces; return their handle."""

    def end_micro_batch(self, *, reevaluation: bool = False) -> None:
        """The micro-batch's backward ran: record it."""

    def end_window(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        unscale: bool = True,
        on_device: bool | None = None,
        fold_multiplier: bool = True,
        reevaluation: bool = False,
        read_statistics: bool = False,
    ) -> bool:
        """Close the window before the optimizer steps; whether it steps."""

    def reset(self, *, set_grads_to_none: bool = True) -> None:
        """Abandon the open window."""

    def statistic(self, name: str) -> float:
        """One statistic by name."""

    def ride(self, values: Mapping[str, float]) -> None:
        """Values summed over the ranks in the next window's end."""

    @property
    def ridden(self) -> dict[str, float]:
        """What :meth:`ride` carried, summed over the ranks."""

    def track(self, parameters: Any) -> None:
        """Follow a changed set of parameters."""

    def remove_hooks(self) -> None:
        """Remove whatever hooks it placed (it is replaced, or training ended)."""

    def state_dict(self) -> dict[str, Any]:
        """Its counters as plain numbers."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Counters of an earlier fit."""

    def window_state_dict(self) -> dict[str, Any] | None:
        """The open window, or ``None``."""

    def load_window_state_dict(self, state: Mapping[str, Any], *, primary: bool = True) -> None:
        """Re-open a saved window."""


__all__ = ["OpenWindow", "WindowDriver"]
