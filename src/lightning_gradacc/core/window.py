"""Window: one accumulation window, its lifecycle, and what its micro-batches recorded, declared once.

A window is the run of micro-batches between two optimizer steps. It moves through explicit states, and
an action that does not fit the state raises instead of mixing two windows' gradients::

    EMPTY ──record──> IN_GRAD                  (the sum lives in .grad)
    EMPTY ──record──> IN_BUFFERS ──flush──> FLUSHED   (buffers, then .grad for the last backward)
    EMPTY ──flush───> FLUSHED                  (K=1 under DDP: nothing buffered yet)
    any open state ──close──> CLOSED           (finalized or discarded; a new Window follows)

**The window's quantities are declared once**, in :data:`QUANTITIES` (as torchmetrics' ``add_state``): each
with how the ranks combine it and whether it carries the gradient scale. The tally that records them
(:class:`WindowTally`: no kernel, no sync per micro-batch for host numbers), the totals summed at the
boundary, the all-reduce packet (:data:`SUMMED`), the step's one host copy (:class:`Measurement`) and a saved
window's keys (:meth:`WindowTally.saved`, :meth:`WindowTally.restore`) are all derived from that table, so a
new quantity cannot be forgotten in one of them. Invalid item counts are recorded too (with weight 0), so
that the error is raised at the boundary on every rank together, never on one rank alone.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch
from torch import Tensor

from .scalars import Scalar, as_scalar


@dataclass(frozen=True)
class Quantity:
    """One total of a window.

    Attributes:
        name: Its name in the totals, the packet, the host copy and a saved window.
        over_ranks: ``"sum"``: each rank's part is summed over the ranks at the boundary (and in a saved
            window, restored on the first rank alone); ``"agreed"``: already the same on every rank.
        scaled: Whether it carries the gradient scale (a saved window's value is rescaled when it loads).
    """

    name: str
    over_ranks: Literal["sum", "agreed"] = "sum"
    scaled: bool = False


QUANTITIES = (
    Quantity("items"),  # items (samples, tokens) of the window's micro-batches
    Quantity("weights"),  # the weights their losses were multiplied by (scaling="weighted")
    Quantity("loss_sum", scaled=True),  # their losses, item-weighted, as back-propagated
    Quantity("loss_weight"),  # the losses' weights
    Quantity("bad_items"),  # invalid item counts, raised at the boundary on every rank
    Quantity("micro_clips"),  # micro-batches clipped by clip_mode="micro_batch"
    Quantity("dropped", "agreed"),  # micro-batches dropped by overflow="skip_micro_batch" (on every rank)
)
NAMES = tuple(quantity.name for quantity in QUANTITIES)
SUMMED = tuple(quantity.name for quantity in QUANTITIES if quantity.over_ranks == "sum")  # the packet
LOSS = ("loss_sum", "loss_weight")  # summed from the recorded losses only when they are needed

Totals = dict[str, Any]  # a total by quantity name: a host number, a device scalar, or None (not summed)


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


@dataclass(frozen=True)
class InvalidCount:
    """Where an item count given as a tensor came from, to name it if its value turns out invalid."""

    flag: Tensor  # device bool: the value was negative or not finite
    value: Tensor
    label: str


def _sum(first: Tensor, losses: list[Tensor]) -> Tensor:
    """Sum scalar losses in one stack and one reduction (in float32 at least: fp16 sums overflow)."""
    if all(t.dim() == 0 and t.dtype == first.dtype and t.device == first.device for t in losses):
        wide = first.dtype if first.dtype in (torch.float32, torch.float64) else torch.float32
        return torch.sum(torch.stack(losses), dtype=wide)
    return torch.stack([t.reshape(()).to(torch.float64) for t in losses]).sum()


class WindowTally:
    """What the open window's micro-batches recorded: every quantity of :data:`QUANTITIES`.

    Each quantity has a host part (Python numbers, added without a kernel) and device scalars waiting to be
    summed at the boundary. The losses are kept with their weights and summed only when needed.

    Args:
        device: Where the totals are built.
        dtype: Dtype of the totals (float64, or float32 where float64 is unsupported).

    Example:
        >>> tally = WindowTally(torch.device("cpu"), torch.float64)
        >>> tally.record(4.0, torch.tensor(1.0))
        >>> tally.record(torch.tensor(2), torch.tensor(4.0))
        >>> totals = tally.totals()
        >>> float(totals["items"]), float(totals["loss_sum"] / totals["loss_weight"])
        (6.0, 2.0)
    """

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self.host: dict[str, float] = dict.fromkeys(NAMES, 0.0)
        self.pending: dict[str, list[Tensor]] = {}  # by quantity, made at its first device scalar
        self.losses: list[Tensor] = []
        self.loss_weights: list[float | Tensor] = []
        self.problems: list[str] = []  # invalid counts found on the host: messages
        self.checks: list[InvalidCount] = []  # counts given as tensors: checked at the boundary
        self.on_device = False  # a quantity or a check waits on the device (else every total is a number)

    def add(self, name: str, value: Scalar) -> None:
        """Add ``value`` to quantity ``name`` (a device scalar waits for the boundary; no kernel here)."""
        if isinstance(value, Tensor):
            self.pending.setdefault(name, []).append(value)
            self.on_device = True
        else:
            self.host[name] += value

    def note(self, problem: str | None, check: InvalidCount | None) -> None:
        """Keep a count's known problem, or its device check, for the boundary to raise (on every rank)."""
        if problem is not None:
            self.problems.append(problem)
        if check is not None:
            self.checks.append(check)
            self.on_device = True

    def record(
        self,
        items: float | Tensor | None,
        loss: Tensor | float | None,
        keep: Tensor | None = None,
        weight: float | Tensor | None = None,
    ) -> None:
        """Record one micro-batch; ``keep`` (a device bool) masks a dropped micro-batch out of every total.

        ``weight`` is the factor its loss was multiplied by (``scaling="weighted"``). Without ``keep`` and
        tensors this launches no kernel.
        """
        if keep is None and weight is None and type(items) is float and isinstance(loss, Tensor):
            # the common case (a host count, a loss tensor): the branches below, short
            self.host["items"] += items
            self.losses.append(loss.detach() if loss.requires_grad else loss)
            self.loss_weights.append(items)
            return
        loss_weight: float | Tensor = 1.0 if items is None else items
        if keep is not None:  # a dropped micro-batch's loss is often nan: select, don't multiply
            loss_weight = torch.where(keep, self._scalar(loss_weight), 0.0)
            if items is not None:
                items = loss_weight
            if weight is not None:
                weight = torch.where(keep, self._scalar(weight), 0.0)
            if loss is not None:
                loss = torch.where(keep, self._scalar(loss), 0.0)
        if items is not None:
            self.add("items", items)
        if weight is not None:
            self.add("weights", weight)
        if isinstance(loss, Tensor):
            self.losses.append(loss.detach())
            self.loss_weights.append(loss_weight)
        elif loss is not None:
            if isinstance(loss_weight, Tensor):
                self.losses.append(self._scalar(loss))
                self.loss_weights.append(loss_weight)
            elif loss_weight:
                self.host["loss_sum"] += float(loss) * loss_weight
                self.host["loss_weight"] += loss_weight

    def _scalar(self, value: Tensor | float) -> Tensor:
        return as_scalar(value, self.device, self.dtype)

    def _vector(self, scalars: list[Tensor]) -> Tensor:
        """Stack scalars into one vector of the totals' dtype: one stack and one cast when they agree."""
        first = scalars[0]
        if all(t.dtype == first.dtype and t.device == first.device and t.dim() == 0 for t in scalars):
            return torch.stack(scalars).to(device=self.device, dtype=self.dtype, non_blocking=True)
        return torch.stack([self._scalar(t) for t in scalars])

    def _total(self, scalars: list[Tensor], host: float) -> Scalar:
        """``host`` plus the sum of ``scalars`` (two kernels, three if ``host`` is not 0)."""
        if not scalars:
            return host
        total = self._vector(scalars).sum()
        return total + host if host else total

    def totals(self, *, with_loss: bool = True) -> Totals:
        """Every quantity summed: a few kernels when tensors were recorded, none otherwise.

        ``with_loss=False`` leaves the loss totals ``None`` (see :meth:`loss_totals`, callable later).
        """
        totals: Totals = {
            name: self._total(self.pending.get(name, []), self.host[name])
            for name in NAMES
            if name not in LOSS and name != "bad_items"
        }
        totals["bad_items"] = self._total(
            [*self.pending.get("bad_items", ()), *(check.flag for check in self.checks)],
            self.host["bad_items"] + len(self.problems),
        )
        totals.update(zip(LOSS, self.loss_totals() if with_loss else (None, None), strict=True))
        return totals

    def loss_totals(self) -> tuple[Scalar, Scalar]:
        """The item-weighted sum of the recorded losses and the sum of their weights."""
        loss_sum: Scalar = self.host["loss_sum"]
        loss_weight: Scalar = self.host["loss_weight"]
        # A micro-batch with 0 items has no loss (a mean over nothing is nan): it weighs nothing here either.
        host_only = all(not isinstance(w, Tensor) for w in self.loss_weights)
        pairs = list(zip(self.losses, self.loss_weights, strict=True))
        if host_only:
            pairs = [(loss, w) for loss, w in pairs if w != 0]
        if pairs:
            if host_only and len({float(w) for _, w in pairs}) == 1:
                # the common case, one micro-batch size: one stack, one sum, one multiply
                weight = float(pairs[0][1])
                loss_sum = _sum(pairs[0][0], [loss for loss, _ in pairs]) * weight
                loss_weight = weight * len(pairs) + self.host["loss_weight"]
            elif host_only:  # a scalar list: no host-to-device copy
                losses = self._vector([loss for loss, _ in pairs])
                host_weights = [float(w) for _, w in pairs]
                loss_sum = torch.stack(torch._foreach_mul(list(losses.unbind()), host_weights)).sum()
                loss_weight = float(sum(host_weights)) + self.host["loss_weight"]
            else:
                losses = self._vector([loss for loss, _ in pairs])
                weight_vector = torch.stack([self._scalar(w) for _, w in pairs])
                loss_sum = torch.where(weight_vector > 0, losses * weight_vector, 0.0).sum()
                loss_weight = weight_vector.sum() + self.host["loss_weight"]
            if self.host["loss_sum"]:
                loss_sum = loss_sum + self.host["loss_sum"]
        return loss_sum, loss_weight

    def invalid_counts(self) -> list[str]:
        """Describe every invalid count of the window (syncs: for the error path only)."""
        found = list(self.problems)
        for check in self.checks:
            if bool(check.flag):
                found.append(f"{check.label} is {check.value.item()!r}")
        return found

    def saved(self, summed: Callable[[Tensor], Tensor]) -> dict[str, float]:
        """Every quantity as a number for a checkpoint, the summed ones summed over ranks by ``summed``."""
        totals = self.totals()
        over_ranks = summed(torch.stack([self._scalar(totals[name]) for name in SUMMED])).tolist()
        agreed = {name: float(totals[name]) for name in NAMES if name not in SUMMED}
        return {**dict(zip(SUMMED, over_ranks, strict=True)), **agreed}

    def restore(self, saved: Mapping[str, Any], *, rescale: float, primary: bool) -> None:
        """Take a saved window's quantities (the summed ones on the ``primary`` rank only).

        ``rescale`` turns the values that carry the gradient scale into the current scale's units.
        """
        for quantity in QUANTITIES:
            if quantity.over_ranks == "agreed" or primary:
                value = float(saved.get(quantity.name) or 0.0)
                self.host[quantity.name] = value * rescale if quantity.scaled else value


Vector = Tensor | list[float]  # a device vector, or its values on the host


class Packet:
    """Named numbers of several owners summed over the ranks in one all-reduce, and given back by owner.

    Each owner adds its numbers under its names (the window its :data:`SUMMED` quantities, a K policy its
    riders, the noise scale its totals as one vector); :meth:`reduce` stacks them once, sums them in one call
    and hands each owner back its part, in the order of its names. Nothing is addressed by offset outside.

    Example:
        >>> packet = Packet()
        >>> packet.scalars("window", ("items",), [torch.tensor(3.0)])
        >>> packet.vector("noise", ("a", "b"), torch.tensor([1.0, 2.0]))
        >>> parts = packet.reduce(lambda t: t * 2)
        >>> parts["window"].tolist(), parts["noise"].tolist(), packet.names["noise"]
        ([6.0], [2.0, 4.0], ('a', 'b'))
    """

    def __init__(self) -> None:
        self._scalar_names: dict[str, tuple[str, ...]] = {}
        self._vector_names: dict[str, tuple[str, ...]] = {}
        self._scalars: list[Tensor] = []
        self._vectors: list[Tensor] = []

    @property
    def names(self) -> dict[str, tuple[str, ...]]:
        """Each owner's names, in the packet's order (the scalars' owners first)."""
        return {**self._scalar_names, **self._vector_names}

    def scalars(self, owner: str, names: tuple[str, ...], values: list[Tensor]) -> None:
        """Add ``owner``'s device scalars (stacked with every other owner's scalars: one stack in all)."""
        assert owner not in self.names and len(names) == len(values), owner
        self._scalar_names[owner] = names
        self._scalars.extend(values)

    def vector(self, owner: str, names: tuple[str, ...], values: Tensor) -> None:
        """Add ``owner``'s numbers as one device vector (after the scalars)."""
        assert owner not in self.names and len(names) == values.numel(), owner
        self._vector_names[owner] = names
        self._vectors.append(values)

    def reduce(self, all_reduce: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
        """Sum everything over the ranks in one call; each owner's part, a vector in its names' order."""
        pieces = ([torch.stack(self._scalars)] if self._scalars else []) + self._vectors
        reduced = all_reduce(pieces[0] if len(pieces) == 1 else torch.cat(pieces))
        parts: dict[str, Tensor] = {}
        at = 0
        for owner, names in self.names.items():
            parts[owner] = reduced[at : at + len(names)]
            at += len(names)
        return parts


@dataclass(slots=True)
class Measurement:
    """What the boundary measured, over every rank: the window's totals and its norms.

    Attributes:
        totals: The window's :data:`QUANTITIES` by name (the loss totals ``None`` when computed on read).
        tensor_norms: Each summed gradient's norm, for a decision on the host (``None`` on the device).
        tensor_largest: Each one's largest element (``clip_value``), likewise.
        noise: The noise scale's window totals (``noise_scale=True``).
        l2_norm: The window's L2 norm when clipping uses another (``noise_scale=True``).
        riders: Numbers a caller asked to have summed over ranks with the window's totals (see
            ``GradAccumulator.ride``).

    Example:
        >>> measured = Measurement({"items": torch.tensor(8.0), "weights": 1.0}, torch.tensor([3.0, 4.0]))
        >>> host = measured.to_host(lambda *values: [v.tolist() for v in values])
        >>> host["items"], host.tensor_norms
        (8.0, [3.0, 4.0])
    """

    totals: Totals
    tensor_norms: Vector | None = None
    tensor_largest: Vector | None = None
    noise: Vector | None = None
    l2_norm: Scalar | None = None
    riders: Vector | None = None

    def __getitem__(self, name: str) -> Any:
        """A total by quantity name."""
        return self.totals[name]

    def to_host(self, sync: Callable[..., list[Any]]) -> Measurement:
        """Replace every device value by its copy from ``sync``, in place, and return ``self``.

        ``sync`` copies all of them at once (e.g. ``RunStatistics.sync``, in which the pending statistics come
        along): one host sync for the whole step.
        """
        totals = [name for name, value in self.totals.items() if isinstance(value, Tensor)]
        others = [name for name in _NORMS if isinstance(getattr(self, name), Tensor)]
        if totals or others:
            copied = sync(*(self.totals[name] for name in totals), *(getattr(self, name) for name in others))
            self.totals.update(zip(totals, copied[: len(totals)], strict=True))
            for name, value in zip(others, copied[len(totals) :], strict=True):
                setattr(self, name, value)
        return self


_NORMS = tuple(field.name for field in fields(Measurement) if field.name != "totals")


def mean_loss(loss_sum: Scalar, loss_weight: Scalar, gradient_scale: Scalar) -> Scalar:
    """``loss_sum / loss_weight / gradient_scale`` with as few kernels as its operands allow (nan: no loss).

    Example:
        >>> mean_loss(6.0, 3.0, 0.5)
        4.0
    """
    if isinstance(loss_weight, Tensor) or isinstance(gradient_scale, Tensor):
        return loss_sum / (loss_weight * gradient_scale)
    if not loss_weight:
        return math.nan
    return loss_sum * (1.0 / (loss_weight * gradient_scale))


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
