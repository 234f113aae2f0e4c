"""WindowTally: what a window's micro-batches recorded, reduced to totals only at the boundary.

Recording a micro-batch appends to lists (no kernel launch, no sync); the boundary stacks them into
totals with a handful of kernels, once per window. Invalid item counts are recorded too (with weight 0), so
that the error can be raised at the boundary on every rank together, never on one rank alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .scalars import as_scalar


@dataclass
class WindowTotals:
    """Totals of a window as device scalars (or Python numbers where nothing was a tensor)."""

    items: Tensor | float
    weights: Tensor | float  # sum of the weights the losses were multiplied by (scaling="weighted")
    loss_sum: Tensor | float
    loss_weight: Tensor | float
    bad_items: Tensor | float  # number of invalid item counts

    def values(self) -> tuple[Tensor | float, ...]:
        """The totals in field order (``dataclasses.astuple`` would deep-copy every tensor)."""
        return (self.items, self.weights, self.loss_sum, self.loss_weight, self.bad_items)


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
    """Per-micro-batch item counts, loss weights and losses of the open window.

    Args:
        device: Where the totals are built.
        dtype: Dtype of the totals (float64, or float32 where float64 is unsupported).

    Example:
        >>> tally = WindowTally(torch.device("cpu"), torch.float64)
        >>> tally.add(4.0, torch.tensor(1.0))
        >>> tally.add(torch.tensor(2), torch.tensor(4.0))
        >>> totals = tally.totals()
        >>> float(totals.items), float(totals.loss_sum / totals.loss_weight)
        (6.0, 2.0)
    """

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self.clear()

    def clear(self) -> None:
        """Forget the window."""
        self.host_items = 0.0
        self.host_weights = 0.0
        self.host_loss_sum = 0.0
        self.host_loss_weight = 0.0
        self.item_tensors: list[Tensor] = []
        self.weight_tensors: list[Tensor] = []
        self.losses: list[Tensor] = []
        self.loss_weights: list[float | Tensor] = []
        self.problems: list[str] = []  # invalid counts found on the host: messages
        self.checks: list[InvalidCount] = []  # counts given as tensors: checked at the boundary
        self.host_bad = 0.0  # invalid counts restored from a saved window

    def note(self, problem: str | None, check: InvalidCount | None) -> None:
        """Keep a count's known problem, or its device check, for the boundary to raise (on every rank)."""
        if problem is not None:
            self.problems.append(problem)
        if check is not None:
            self.checks.append(check)

    def add(
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
            self.host_items += items
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
        if isinstance(items, Tensor):
            self.item_tensors.append(items)
        elif items is not None:
            self.host_items += items
        if isinstance(weight, Tensor):
            self.weight_tensors.append(weight)
        elif weight is not None:
            self.host_weights += weight
        if isinstance(loss, Tensor):
            self.losses.append(loss.detach())
            self.loss_weights.append(loss_weight)
        elif loss is not None:
            if isinstance(loss_weight, Tensor):
                self.losses.append(self._scalar(loss))
                self.loss_weights.append(loss_weight)
            elif loss_weight:
                self.host_loss_sum += float(loss) * loss_weight
                self.host_loss_weight += loss_weight

    def _scalar(self, value: Tensor | float) -> Tensor:
        return as_scalar(value, self.device, self.dtype)

    def _vector(self, scalars: list[Tensor]) -> Tensor:
        """Stack scalars into one vector of the totals' dtype: one stack and one cast when they agree."""
        first = scalars[0]
        if all(t.dtype == first.dtype and t.device == first.device and t.dim() == 0 for t in scalars):
            return torch.stack(scalars).to(device=self.device, dtype=self.dtype, non_blocking=True)
        return torch.stack([self._scalar(t) for t in scalars])

    def _total(self, scalars: list[Tensor], host: float) -> Tensor | float:
        """``host`` plus the sum of ``scalars`` (two kernels, three if ``host`` is not 0)."""
        if not scalars:
            return host
        total = self._vector(scalars).sum()
        return total + host if host else total

    def totals(self, *, with_loss: bool = True) -> WindowTotals:
        """Sum the window: a few kernels when tensors were recorded, none otherwise.

        ``with_loss=False`` leaves the loss totals at 0 (see :meth:`loss_totals`, callable later).
        """
        items = self._total(self.item_tensors, self.host_items)
        weights = self._total(self.weight_tensors, self.host_weights)
        bad_items = self._total(
            [check.flag for check in self.checks], float(len(self.problems)) + self.host_bad
        )
        loss_sum, loss_weight = self.loss_totals() if with_loss else (0.0, 0.0)
        return WindowTotals(items, weights, loss_sum, loss_weight, bad_items)

    def loss_totals(self) -> tuple[Tensor | float, Tensor | float]:
        """The item-weighted sum of the recorded losses and the sum of their weights."""
        loss_sum: Tensor | float = self.host_loss_sum
        loss_weight: Tensor | float = self.host_loss_weight
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
                loss_weight = weight * len(pairs) + self.host_loss_weight
            elif host_only:  # a scalar list: no host-to-device copy
                losses = self._vector([loss for loss, _ in pairs])
                host_weights = [float(w) for _, w in pairs]
                loss_sum = torch.stack(torch._foreach_mul(list(losses.unbind()), host_weights)).sum()
                loss_weight = float(sum(host_weights)) + self.host_loss_weight
            else:
                losses = self._vector([loss for loss, _ in pairs])
                weight_vector = torch.stack([self._scalar(w) for _, w in pairs])
                loss_sum = torch.where(weight_vector > 0, losses * weight_vector, 0.0).sum()
                loss_weight = weight_vector.sum() + self.host_loss_weight
            if self.host_loss_sum:
                loss_sum = loss_sum + self.host_loss_sum
        return loss_sum, loss_weight

    def invalid_counts(self) -> list[str]:
        """Describe every invalid count of the window (syncs: for the error path only)."""
        found = list(self.problems)
        for check in self.checks:
            if bool(check.flag):
                found.append(f"{check.label} is {check.value.item()!r}")
        return found
