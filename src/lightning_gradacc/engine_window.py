"""Accumulation an engine performs itself (DeepSpeed): the callback only tells it where windows end.

A strategy whose engine keeps the window's gradients (DeepSpeed's ZeRO stages hold no ``.grad`` to rescale)
is driven from outside instead of accumulated by the core: at each micro-batch's start the engine is told
whether it ends the window (its boundary: the reduction and the optimizer step), and each loss is weighed
in place before its backward so that the window's gradient is the big batch's. The engine divides every
loss by its ``gradient_accumulation_steps`` and Lightning by ``accumulate_grad_batches``; the weight undoes
both and applies the scaling mode's normalization, which must be known before the window's first backward.
Under ``scaling="weighted"`` that is the window's item total over the ranks: its batches are read ahead
and counted when it opens (:mod:`~lightning_gradacc.parts.read_ahead`, as Hugging Face's Trainer does),
and each loss is weighed by its own count over that total (:meth:`EngineWindow.expect`).
:class:`EngineWindow` takes the core accumulator's place in the callback and the window plan; what the
engine does not report is absent from the logged statistics (:data:`ABSENT`, and the gradient norm where
the engine computes none), never a made-up zero.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch
from torch import Tensor

from .core import AccumulationStats
from .core.checkpoint import stamp
from .core.pieces import MicroBatchPieces
from .core.settings import AccumulationSettings

# What an engine that accumulates itself cannot show: its clipping, the loss, the buffers (declared once)
ABSENT = frozenset(f.name for f in fields(AccumulationStats) if not f.metadata["engine"])


class Engine(Protocol):
    """What :class:`EngineWindow` asks of the engine (the layout adapts DeepSpeed's to it)."""

    gradient_accumulation_steps: int  # what the engine divides every loss by

    def set_boundary(self, last: bool) -> None:
        """Whether the coming micro-batch ends the window: the engine reduces and steps after it."""

    def drop_gradients(self) -> None:
        """Forget the gradients accumulated so far (a window abandoned)."""

    def skipped_steps(self) -> int:
        """Steps the engine skipped so far (its fp16 loss scaler's overflows)."""

    def grad_norm(self) -> float | None:
        """The gradient norm of its last step, where it computed one."""


@dataclass
class _Open:
    """The open window: micro-batches back-propagated and their items on this rank."""

    micro_batches: int = 0
    items: float = 0.0
    lost: int = 0  # its micro-batches before a resume, whose gradients no checkpoint of the engine holds

    @property
    def empty(self) -> bool:
        return self.micro_batches == 0


class EngineWindow:
    """The accumulator of a fit whose engine accumulates: boundaries, loss weights and the counters.

    Args:
        engine: The engine, adapted (:class:`Engine`).
        settings: The callback's math settings (their scaling mode normalizes the window).
        world_size: Data-parallel ranks (item counts are summed over them).
        device: Where an item count is all-reduced.
        num_parameters: Elements the optimizers step.

    Example:
        >>> class Counting:
        ...     gradient_accumulation_steps = 2
        ...     def set_boundary(self, last): print("boundary", last)
        ...     def drop_gradients(self): pass
        ...     def skipped_steps(self): return 0
        ...     def grad_norm(self): return None
        >>> window = EngineWindow(Counting(), settings=AccumulationSettings(), world_size=1)
        >>> window.accumulation_steps, window.loss_scale = 2, 0.5  # the plan's: K, 1 / Lightning's K
        >>> window.window_length = 2  # the plan's: this window's micro-batches
        >>> window.batch_start()
        boundary False
        >>> loss = torch.tensor(3.0)
        >>> _ = window.begin_micro_batch(loss, 4, in_place=True)
        >>> float(loss)  # x (Lightning's 2 x the engine's 2) / 2 micro-batches
        6.0
    """

    device_step = None  # the engine steps: nothing is decided on the device for it
    uses_last = True
    saves_open_window = False  # the engine's checkpoint holds no accumulated gradient

    def __init__(
        self,
        engine: Engine,
        *,
        settings: AccumulationSettings,
        world_size: int,
        device: torch.device | None = None,
        num_parameters: int = 0,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.world_size = world_size
        self.device = device or torch.device("cpu")
        self._steps = 1  # the window's K (the plan writes it)
        self.window_length = 1  # the open window's micro-batches: K, or an epoch's short tail (the plan's)
        self._scale = 1.0  # what Lightning divided each loss by (the plan writes it)
        self.window = _Open()
        self._counts: dict[str, float] = {
            "windows": 0,
            "total_micro_batches": 0,
            "micro_batches_last_step": 0,
            "items_last_step": 0.0,
            "items_seen": 0.0,
            "items_last_full_step": 0.0,
            "max_grad_norm_seen": 0.0,
            "last_grad_norm": math.nan,
        }
        self._num_parameters = num_parameters
        self._skipped_before = engine.skipped_steps()  # the engine's count when this fit started
        self._skipped_restored = 0  # skips of earlier fits (a checkpoint's or the previous fit's)
        self._ridden: dict[str, float] = {}
        self._items_known = True
        # "weighted": the open window's counts on this rank still to come, read ahead, and its total over
        # the ranks (None: not read ahead)
        self._ahead: deque[float] = deque()
        self._window_items: float | None = None

    @property
    def accumulation_steps(self) -> int:
        """K of the open window, set by the plan (``window_length``: its own micro-batches)."""
        return self._steps

    @accumulation_steps.setter
    def accumulation_steps(self, value: int) -> None:
        self._steps = int(value)

    @property
    def loss_scale(self) -> float:
        """What Lightning divided each loss by (1 / its ``accumulate_grad_batches``), set by the plan."""
        return self._scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self._scale = float(value)

    # ----------------------------------------------------------------------------------- a window

    def batch_start(self) -> None:
        """A micro-batch starts: tell the engine whether it ends the window (before its forward)."""
        self.engine.set_boundary(self.window.micro_batches + 1 >= self._length)

    @property
    def _length(self) -> int:
        """Micro-batches the open window still takes from its start (those lost to a resume excluded)."""
        return self.window_length - self.window.lost

    @property
    def remaining(self) -> int:
        """Micro-batches the open window still takes, the coming one included."""
        return self._length - self.window.micro_batches

    @property
    def expecting(self) -> bool:
        """Whether the open window's counts were read ahead (:meth:`expect`)."""
        return self._window_items is not None

    def expect(self, counts: Sequence[float], total: float) -> None:
        """``scaling="weighted"``: the open window's item counts on this rank, read ahead, and their total.

        Args:
            counts: The counts of the window's coming micro-batches on this rank, in order (the next one's
                first), each a number >= 0.
            total: The window's count summed over the ranks, which every loss is weighed against.

        Example:
            >>> class Engine:
            ...     gradient_accumulation_steps = 1
            ...     def skipped_steps(self): return 0
            >>> weighted = AccumulationSettings(scaling="weighted")
            >>> window = EngineWindow(Engine(), settings=weighted, world_size=1)
            >>> window.window_length = 2
            >>> window.expect([3.0, 1.0], 4.0)
            >>> float(window.begin_micro_batch(torch.tensor(2.0), 3))  # 2 x 3 / 4
            1.5
        """
        self._ahead = deque(counts)
        self._window_items = float(total)

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
        """Weigh ``loss`` (in place or not) so that the engine's sum is the window's big-batch gradient."""
        weighted = self.settings.mode.weighted
        factor = self.settings.mode.factor(
            max(self._length, 1),
            dropped=0.0,
            weights=self._window_items if self._window_items is not None else 0.0,  # "weighted" only
            loss_scale=self.loss_scale / self.engine.gradient_accumulation_steps,
            world_size=self.world_size,
        )
        if weighted:  # the count it was read ahead with: its share of the window's total
            factor = factor * self._read_ahead_count(items, label)
        window = self.window
        if items is None or error is not None:
            self._items_known = False
        else:
            window.items += float(items.sum()) if isinstance(items, Tensor) else float(items)
        return loss.mul_(factor) if in_place else loss * factor

    def _read_ahead_count(self, items: Any, label: str | None) -> float:
        """This micro-batch's count as read ahead, checked against what it counts now (before backward)."""
        if not self._ahead or self._window_items is None:
            raise RuntimeError(
                "A micro-batch began under `scaling='weighted'` beyond the counts its DeepSpeed window was"
                " read ahead with. This is a bug of `GradientAccumulationCallback`; please report it."
            )
        expected = self._ahead.popleft()
        seen = float(items) if isinstance(items, (int, float, Tensor)) else math.nan
        if seen != expected:
            raise RuntimeError(
                f"{label or 'The item count'} is {seen} at its own micro-batch but was {expected} when its"
                " window's batches were read ahead from the loader: under DeepSpeed a weighted window is"
                " weighed by the counts read ahead (before Lightning moves a batch to the device and runs"
                " its batch hooks), so `item_count_fn` must count the loader's batch and the batch the step"
                " sees the same."
            )
        return seen

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
        """Refused: an engine sums its micro-batches itself (``piece_size`` is refused before training)."""
        raise RuntimeError("An engine's window cannot run a batch in pieces (`piece_size`).")

    def end_micro_batch(self, *, reevaluation: bool = False) -> None:
        """The micro-batch's backward ran."""
        if not reevaluation:
            self.window.micro_batches += 1
            self._counts["total_micro_batches"] += 1

    def end_window(
        self,
        optimizer: Any,
        *,
        unscale: bool = True,
        on_device: bool | None = None,
        fold_multiplier: bool = True,
        reevaluation: bool = False,
        read_statistics: bool = False,
    ) -> bool:
        """Close the window before the engine's step: count it (its items summed over the ranks).

        The driver's arguments (:class:`~lightning_gradacc.window_driver.WindowDriver`): the engine steps,
        unscales and reads its statistics itself, so none of them changes what this does.
        """
        window, counts = self.window, self._counts
        items = window.items if self._items_known else math.nan
        if self._window_items is not None:  # read ahead, summed over the ranks already
            items = self._window_items
        elif self.world_size > 1 and torch.distributed.is_initialized():
            total = torch.tensor([items], dtype=torch.float64, device=self.device)
            torch.distributed.all_reduce(total)
            items = float(total[0])
        counts["windows"] += 1
        counts["micro_batches_last_step"] = window.micro_batches
        counts["items_last_step"] = items
        counts["items_seen"] += items
        if window.micro_batches + window.lost >= self._steps:
            counts["items_last_full_step"] = items
        self._open(_Open())
        return True

    def _open(self, window: _Open) -> None:
        """A new window: nothing read ahead for it yet."""
        self.window, self._ahead, self._window_items = window, deque(), None

    def reset(self, *, set_grads_to_none: bool = True) -> None:
        """Abandon the open window: the engine forgets its gradients (an empty one, resumed or not, stays)."""
        if not self.window.empty:
            self.engine.drop_gradients()
        self._open(_Open(lost=self.window.lost) if self.window.empty else _Open())

    def lost(self, micro_batches: int) -> None:
        """A resume inside a window: its first ``micro_batches`` are in no checkpoint of the engine."""
        self._open(_Open(lost=micro_batches))

    def after_step(self) -> None:
        """The engine stepped the window just closed: read its gradient norm (once per step, a host read)."""
        norm = self.engine.grad_norm()
        counts = self._counts
        counts["last_grad_norm"] = math.nan if norm is None else float(norm)
        if norm is not None and math.isfinite(counts["last_grad_norm"]):
            counts["max_grad_norm_seen"] = max(counts["max_grad_norm_seen"], counts["last_grad_norm"])

    # ------------------------------------------------------------------------------------- reading

    @property
    def absent(self) -> frozenset[str]:
        """What is not logged: :data:`ABSENT`, and the norms where the engine reported none."""
        if math.isnan(self._counts["last_grad_norm"]):
            return ABSENT | {"last_grad_norm", "max_grad_norm_seen"}
        return ABSENT

    @property
    def stats(self) -> AccumulationStats:
        """The counters; what the engine does not show stays at its default (see :data:`ABSENT`)."""
        counts = self._counts
        skipped = self._skipped_restored + self.engine.skipped_steps() - self._skipped_before
        return AccumulationStats(
            accumulation_steps=self.accumulation_steps,
            open_window_micro_batches=self.window.micro_batches,
            windows=int(counts["windows"]),
            total_micro_batches=int(counts["total_micro_batches"]),
            skipped_steps=skipped,
            last_grad_norm=counts["last_grad_norm"],
            max_grad_norm_seen=counts["max_grad_norm_seen"],
            items_last_step=counts["items_last_step"],
            items_seen=counts["items_seen"],
            items_last_full_step=counts["items_last_full_step"],
            micro_batches_last_step=int(counts["micro_batches_last_step"]),
            num_parameters=self._num_parameters,
        )

    def statistic(self, name: str) -> float:
        """One statistic by name (the plan reads the items of the window just closed)."""
        return float(self.stats.as_dict()[name])

    @property
    def window_loss(self) -> float:
        """Not shown: the engine's losses are its own (``nan``)."""
        return math.nan

    def ride(self, values: Mapping[str, float]) -> None:
        """Values a policy hands to the window's end (no all-reduce carries them here)."""
        self._ridden = dict(values)

    @property
    def ridden(self) -> dict[str, float]:
        """What :meth:`ride` was given last."""
        return self._ridden

    def track(self, parameters: Any) -> None:
        """The engine follows its own parameters."""

    def remove_hooks(self) -> None:
        """No hooks are placed."""

    # ---------------------------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """The counters by name (the engine's checkpoint holds its own state)."""
        stats = self.stats
        return stamp({"engine": {**self._counts, "skipped_steps": stats.skipped_steps}})

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The counters of an earlier fit (an engine's; a core accumulator's counters are not taken)."""
        saved = state.get("engine")
        if saved is None:
            return
        for name in self._counts:
            if name in saved:
                self._counts[name] = float(saved[name])
        self._skipped_restored = int(saved.get("skipped_steps", 0))

    def window_state_dict(self) -> dict[str, Any] | None:
        """Nothing: the engine's checkpoint holds no accumulated gradients (a resume loses them)."""
        return None

    def load_window_state_dict(self, state: Mapping[str, Any], *, primary: bool = True) -> None:
        """A core accumulator's saved window cannot go into an engine."""
        raise RuntimeError(
            "This checkpoint holds an open accumulation window of a run without DeepSpeed; DeepSpeed keeps"
            " the window's gradients in its engine, which this window cannot be put into. Resume from a"
            " checkpoint taken at a window's end."
        )
