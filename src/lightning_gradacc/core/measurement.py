"""Measurement: what the boundary measured, declared by name once; the step's one host copy.

Every value the step needs is gathered here, as a device scalar or vector where it was computed on the
device. When a decision needs the host (``overflow="skip"``: should the optimizer step?),
:meth:`Measurement.to_host` copies every device value in one sync, in which the ledger's pending statistics
come along; otherwise the values stay on the device and nothing syncs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from torch import Tensor

from .scalars import Scalar

Vector = Tensor | list[float]  # a device vector, or its values on the host


@dataclass(slots=True)
class Measurement:
    """One window's measurements, over every rank (filled in as the boundary measures).

    Attributes:
        items: Items of the window's micro-batches.
        weights: Sum of the weights their losses were multiplied by (``scaling="weighted"``).
        bad_items: Number of invalid item counts.
        dropped: Micro-batches dropped by ``overflow="skip_micro_batch"``.
        micro_clips: Micro-batches clipped by ``clip_mode="micro_batch"``.
        loss_sum: The item-weighted sum of the window's losses, when computed now (``None``: on read).
        loss_weight: The sum of their weights, likewise.
        tensor_norms: Each summed gradient's norm, for a decision on the host (``None`` on the device).
        tensor_largest: Each one's largest element (``clip_value``), likewise.
        noise: The noise scale's window totals (``noise_scale=True``).
        l2_norm: The window's L2 norm when clipping uses another (``noise_scale=True``).

    Example:
        >>> import torch
        >>> measured = Measurement(items=torch.tensor(8.0), weights=1.0, bad_items=0.0, dropped=0.0,
        ...                        micro_clips=0.0, tensor_norms=torch.tensor([3.0, 4.0]))
        >>> host = measured.to_host(lambda *values: [v.tolist() for v in values])
        >>> host.items, host.tensor_norms
        (8.0, [3.0, 4.0])
    """

    items: Scalar
    weights: Scalar
    bad_items: Scalar
    dropped: Scalar
    micro_clips: Scalar
    loss_sum: Scalar | None = None
    loss_weight: Scalar | None = None
    tensor_norms: Vector | None = None
    tensor_largest: Vector | None = None
    noise: Vector | None = None
    l2_norm: Scalar | None = None

    def to_host(self, sync: Callable[..., list[Any]]) -> Measurement:
        """Replace every device value by its copy from ``sync``, in place, and return ``self``.

        ``sync`` copies all of them at once (e.g. ``Ledger.sync``, in which the pending statistics come
        along): one host sync for the whole step.
        """
        on_device = [name for name in _NAMES if isinstance(getattr(self, name), Tensor)]
        if on_device:
            copied = sync(*(getattr(self, name) for name in on_device))
            for name, value in zip(on_device, copied, strict=True):
                setattr(self, name, value)
        return self


_NAMES = tuple(field.name for field in fields(Measurement))


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
