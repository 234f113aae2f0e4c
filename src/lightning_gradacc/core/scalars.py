"""The two value types of the core's math, and how a host number becomes a device scalar.

Every boundary quantity is a :data:`Scalar`: a Python number where it is known on the host, a 0-d device
tensor where reading it would sync. Decisions are :data:`Flag` values in the same way.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

Scalar = float | Tensor
Flag = bool | Tensor  # a host bool when decided on the host, a device bool otherwise


def as_scalar(value: Scalar, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``value`` as a 0-d tensor on ``device`` in ``dtype``; a number is made by a fill kernel (no copy).

    Example:
        >>> as_scalar(2, torch.device("cpu"), torch.float64)
        tensor(2., dtype=torch.float64)
    """
    if isinstance(value, Tensor):
        if value.dtype == dtype and value.device == device and value.dim() == 0:
            return value
        return value.to(device=device, dtype=dtype, non_blocking=True).reshape(())
    return torch.full((), float(value), dtype=dtype, device=device)


def is_finite(value: Scalar) -> Flag:
    """Whether ``value`` is finite: a host bool for a number, a device bool for a tensor (no sync)."""
    return torch.isfinite(value) if isinstance(value, Tensor) else math.isfinite(value)


def both(a: Flag, b: Flag) -> Flag:
    """``a and b`` for host or device flags (a host operand decides without a kernel where it can)."""
    if not isinstance(a, Tensor):
        return b if a else False
    if not isinstance(b, Tensor):
        return a if b else False
    return a & b


def either(a: Flag, b: Flag) -> Flag:
    """``a or b`` for host or device flags (a host operand decides without a kernel where it can)."""
    if not isinstance(a, Tensor):
        return True if a else b
    if not isinstance(b, Tensor):
        return True if b else a
    return a | b


def negate(a: Flag) -> Flag:
    """``not a`` for a host or device flag."""
    return ~a if isinstance(a, Tensor) else not a
