"""What every micro-batch's gradient carries: its item weight, and the loss and AMP scale (GradientScale).

A back-propagated loss is ``loss * weight * loss_scale * amp_scale``. The item weight is a micro-batch's item
count over a reference (:class:`ItemWeighting`, the one rule: :meth:`ItemCount.weigh_loss`); the loss scale
is the factor the caller multiplied it by (Lightning's ``1 / K``; 1 in a plain loop); the AMP scale is a
GradScaler's, read from it as a device tensor (``get_scale()`` would sync with the host; it is read as a
number only for a checkpoint). The boundary divides them out once per window (:class:`GradientScale`).

Item weighting: a micro-batch's item count, checked without a sync, and the one rule for its weight.

Under ``scaling="weighted"`` every micro-batch's loss (a mean over its items) is multiplied by
``w = items / reference`` before ``backward``, and the boundary divides the window's sum by ``sum w``: the
result is the mean over every item of the window. The reference keeps the weighted gradients at a mean's
magnitude (raw counts overflow fp16): the first micro-batch's count (its mean over ranks) for the first
window, then the mean count per micro-batch of the window before; constant inside a window and the same on
every rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .scalars import Scalar, as_scalar
from .settings import check_item_count
from .torch_internals import scaler_scale, scaler_scales_lazily
from .window import InvalidCount
from .world import World


@dataclass(frozen=True)
class ItemCount:
    """One micro-batch's item count, checked, and the factor its loss is multiplied by before ``backward``.

    Made by :meth:`ItemWeighting.weigh`; an invalid count has weight 0 and is reported at the boundary.
    """

    items: float | Tensor | None
    weight: float | Tensor
    problem: str | None = None
    check: InvalidCount | None = None

    def weigh_loss(self, loss: Tensor, *, in_place: bool = False) -> Tensor:
        """``loss * weight``: the one place the weighting rule is applied (``in_place`` for Lightning's loss).

        Example:
            >>> ItemCount(4.0, 0.5).weigh_loss(torch.tensor(2.0))
            tensor(1.)
        """
        weight = self.weight
        if not isinstance(weight, Tensor) and weight == 1.0:
            return loss
        if isinstance(weight, Tensor):
            weight = weight.to(loss.device, non_blocking=True)
        return loss.mul_(weight) if in_place else loss * weight


def missing_count(label: str) -> str:
    """Why a missing item count cannot be weighed (``scaling="weighted"`` needs every one)."""
    return f"{label} is missing: `scaling='weighted'` needs the item count of every micro-batch"


class ItemWeighting:
    """Checks item counts and weighs them against the reference count.

    Args:
        weighted: Whether losses are weighted (``scaling="weighted"``); otherwise every weight is 1.
        world: The ranks the first reference count is averaged over.
        device: Where a count given as a tensor is weighed.
        dtype: The dtype it is weighed in.

    Example:
        >>> weighting = ItemWeighting(True, World(1), device=torch.device("cpu"), dtype=torch.float64)
        >>> weighting.weigh(8, label="a").weight, weighting.weigh(4, label="b").weight
        (1.0, 0.5)
    """

    def __init__(self, weighted: bool, world: World, *, device: torch.device, dtype: torch.dtype) -> None:
        self.weighted = weighted
        self._world = world
        self._device, self._dtype = device, dtype
        self.reference_count: float | Tensor | None = None
        self._plain: ItemCount | None = None  # the last count of the unweighted fast path

    def weigh(
        self, items: Any, *, label: str, loss_dtype: torch.dtype | None = None, error: str | None = None
    ) -> ItemCount:
        """Check ``items`` (never raising, never syncing) and compute the loss's weight.

        An invalid count (negative, not finite, not a number, missing under ``"weighted"``) gets weight 0
        and is raised by the window's boundary, after the window's counts were summed over ranks, so that
        every rank raises together. Under data parallelism the first call for ``"weighted"`` all-reduces the
        count once (every rank must make it, as Lightning does). A micro-batch with 0 items contributes
        nothing if its loss's gradient is finite (a masked mean must divide by ``mask.sum().clamp(min=1)``:
        its ``nan`` would make the window non-finite).

        Args:
            items: Samples or tokens in the micro-batch: a number >= 0 or a real scalar tensor; ``None``
                when unknown (allowed except for ``"weighted"``).
            label: How an error names this count, e.g. "the item count of batch 7".
            loss_dtype: The loss's dtype: a weight for a fp16/bf16 loss is rounded to it first, so that the
                boundary divides by exactly the weights that were applied.
            error: A problem the caller found already (e.g. the count could not be inferred).
        """
        weighted = self.weighted
        if type(items) is int and items >= 0 and error is None and not weighted:  # the common case, quickly
            plain = self._plain  # the last such count, reused: an ItemCount is immutable
            if plain is None or plain.items != items:
                plain = self._plain = ItemCount(float(items), 1.0)
            return plain
        value: float | Tensor | None = None
        problem = error
        check: InvalidCount | None = None
        if problem is None and items is None and weighted:
            problem = missing_count(label)
        elif problem is None and items is not None:
            try:
                value = check_item_count(items, label)
            except (TypeError, ValueError) as exc:
                problem = str(exc)
        if isinstance(value, Tensor):
            valid = (value >= 0) & (value < math.inf)  # nan fails both
            check = InvalidCount(~valid, value, label)
            if weighted:
                value = torch.where(valid, self._scalar(value), 0.0)
        if problem is not None:
            value = 0.0
        if not weighted:
            return ItemCount(value, 1.0, problem, check)
        assert value is not None
        weight = value / self._reference(value)
        if loss_dtype is not None and loss_dtype.is_floating_point and loss_dtype.itemsize < 4:
            weight = (
                weight.to(loss_dtype)
                if isinstance(weight, Tensor)
                else float(torch.tensor(weight, dtype=loss_dtype))  # a CPU op: no device sync
            )
        return ItemCount(value, weight, problem, check)

    def _reference(self, first: float | Tensor) -> float | Tensor:
        """The reference count for the open window (at least 1); the first call all-reduces once."""
        if self.reference_count is None:
            world_size, all_reduce = self._world.resolve()
            if all_reduce is not None:  # one small collective, once
                total = all_reduce(self._scalar(first).clone().reshape(1)).reshape(())
                self.reference_count = (total / world_size).clamp(min=1.0)
            elif isinstance(first, Tensor):
                self.reference_count = self._scalar(first).clamp(min=1.0)
            else:
                self.reference_count = max(float(first), 1.0)
        return self.reference_count

    def state_dict(self) -> dict[str, float | None]:
        """The reference count (syncs if it is a device scalar: checkpoint time only)."""
        reference = self.reference_count
        return {"reference_count": float(reference) if reference is not None else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the reference count a saved window was weighted against (``"weighted"`` only)."""
        if self.weighted:
            reference = state.get("reference_count", 1.0)
            self.reference_count = float(reference) if reference is not None else None

    def _scalar(self, value: Scalar) -> Tensor:
        return as_scalar(value, self._device, self._dtype)

    def rebase(self, items: Scalar, micro_batches: int) -> None:
        """Make the window's mean count per micro-batch the next window's reference.

        No collective: ``items`` is already summed over ranks and ``micro_batches`` counts every rank's. A
        window without items keeps the reference.
        """
        if not self.weighted or self.reference_count is None:
            return
        mean = items / micro_batches
        if isinstance(mean, Tensor):
            previous = self._scalar(self.reference_count)
            self.reference_count = torch.where(mean > 0, mean.clamp(min=1.0), previous)
        elif mean > 0:
            self.reference_count = max(mean, 1.0)


# -------------------------------------------------------------------------------- the gradient scale


class GradientScale:
    """The loss scale (a host number) and the GradScaler's scale (read from it, never stored).

    Args:
        grad_scaler: An enabled ``torch.amp.GradScaler``, or ``None``.
        loss_scale: The initial loss scale.

    Example:
        >>> scale = GradientScale(None, loss_scale=0.25)
        >>> scale.value(), scale.state_dict()
        (0.25, {'loss_scale': 0.25, 'amp_scale': 1.0})
    """

    def __init__(self, grad_scaler: Any = None, *, loss_scale: float = 1.0) -> None:
        self.scaler = grad_scaler
        self.loss_scale = self.checked(loss_scale)

    @staticmethod
    def checked(value: Any) -> float:
        """``value`` as a loss scale: a finite number > 0, else ``ValueError``."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"Expected `loss_scale` to be a finite number > 0, but got {value!r}.")
        return float(value)

    def amp(self) -> Tensor | None:
        """The GradScaler's scale as a device tensor (``None`` without a scaler); never syncs."""
        if self.scaler is None:
            return None
        scale = scaler_scale(self.scaler)
        if scale is None and scaler_scales_lazily(self.scaler):  # torch's `scale()`, not called yet
            raise RuntimeError(
                "The GradScaler has not scaled a loss yet, but gradients were recorded: under a"
                " `grad_scaler` every micro-batch's loss must be scaled by it before backward"
                " (`scaler.scale(loss).backward()`, or `accumulator.backward(loss)`, which does)."
            )
        if not isinstance(scale, Tensor):
            raise RuntimeError(
                f"The GradScaler ({type(self.scaler).__name__}) keeps no tensor `_scale`, which the"
                " accumulator reads (without a host sync) to undo the loss scale in its statistics and"
                " clipping. Use `torch.amp.GradScaler`."
            )
        return scale

    def value(self) -> Scalar:
        """Loss scale times AMP scale: a number without a scaler, a device scalar with one."""
        amp = self.amp()
        return self.loss_scale * amp if amp is not None else self.loss_scale

    def amp_value(self) -> float:
        """The GradScaler's scale as a number (syncs: for checkpoints only).

        Before its first ``scale()`` call the scaler has no ``_scale`` tensor yet; ``get_scale()`` gives the
        scale it will start from.
        """
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def state_dict(self) -> dict[str, float]:
        """Both scales as numbers, saved with an open window whose sums carry them (syncs)."""
        return {"loss_scale": self.loss_scale, "amp_scale": self.amp_value()}

    def rescale_from(self, saved: dict[str, Any]) -> float:
        """The factor turning sums saved under ``saved`` (a :meth:`state_dict`) into sums under these scales.

        Example:
            >>> GradientScale(None, loss_scale=0.5).rescale_from({"loss_scale": 0.25, "amp_scale": 1.0})
            2.0
        """
        return self.loss_scale * self.amp_value() / (float(saved["loss_scale"]) * float(saved["amp_scale"]))
