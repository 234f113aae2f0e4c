"""Fused passes over lists of gradients, grouped by (device, dtype).

The boundary of a window needs the total norm (which also reveals ``nan``/``inf``), one in-place multiply
(normalization and norm clipping folded into one factor) and optionally a clamp. Each is one
``torch._foreach_*`` call per (device, dtype) group; scalars stay on the device, so nothing here syncs
with the host. ``foreach=False`` takes a per-tensor path, as in ``torch.nn.utils.clip_grad_norm_``.
Gradients are dense (the accumulator rejects sparse ones).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

GroupKey = tuple[torch.device, torch.dtype]
# A flat list, or one already grouped by (device, dtype): reading .device and .dtype of hundreds of
# tensors costs more than the kernels themselves, so callers that know the grouping pass it.
Tensors = Sequence[Tensor] | Mapping[GroupKey, list[Tensor]]


def group_by_device_and_dtype(tensors: Sequence[Tensor]) -> dict[GroupKey, list[Tensor]]:
    """Group tensors by ``(device, dtype)``, keeping their order inside each group.

    Example:
        >>> groups = group_by_device_and_dtype([torch.zeros(2), torch.zeros(3, dtype=torch.float64)])
        >>> sorted(str(dtype) for _, dtype in groups)
        ['torch.float32', 'torch.float64']
    """
    groups: dict[GroupKey, list[Tensor]] = defaultdict(list)
    for tensor in tensors:
        groups[(tensor.device, tensor.dtype)].append(tensor)
    return dict(groups)


def _grouped(tensors: Tensors) -> Mapping[GroupKey, list[Tensor]]:
    return tensors if isinstance(tensors, Mapping) else group_by_device_and_dtype(tensors)


def _use_foreach(foreach: bool | None) -> bool:
    # foreach kernels exist for every dense strided tensor on CPU and CUDA; None and True both use them.
    return foreach is not False


def total_norm(
    tensors: Tensors, norm_type: float, *, device: torch.device, foreach: bool | None = None
) -> Tensor:
    """Return the ``norm_type``-norm of all tensors together as a scalar on ``device``.

    Computed in float32 (float64 when some tensor is float64).

    Any ``nan`` or ``inf`` element makes the result non-finite, so one pass answers both "how large" and
    "is it finite".

    Example:
        >>> total_norm([torch.tensor([3.0]), torch.tensor([4.0])], 2.0, device=torch.device("cpu"))
        tensor(5.)
    """
    per_tensor: list[Tensor] = []
    norm_dtypes = set()
    for (group_device, group_dtype), group in _grouped(tensors).items():
        if not group:
            continue
        # at least float32, so that fp16/bf16 squares cannot overflow; float64 stays float64
        norm_dtype = torch.promote_types(group_dtype, torch.float32)
        norm_dtypes.add(norm_dtype)
        if _use_foreach(foreach):
            norms: Sequence[Tensor] = torch._foreach_norm(group, norm_type, dtype=norm_dtype)
        else:
            norms = [torch.linalg.vector_norm(t, norm_type, dtype=norm_dtype) for t in group]
        if group_device != device:
            norms = [n.to(device, non_blocking=True) for n in norms]
        per_tensor.extend(norms)
    if not per_tensor:
        return torch.zeros((), dtype=torch.float32, device=device)
    if len(norm_dtypes) > 1:  # float32 and float64 groups: stack in float64
        per_tensor = [n.to(torch.float64) for n in per_tensor]
    total: Tensor = torch.linalg.vector_norm(torch.stack(per_tensor), norm_type)
    return total


def scale_(tensors: Tensors, factor: float | Tensor, *, foreach: bool | None = None) -> None:
    """Multiply every tensor in place by ``factor`` (a Python number or a scalar tensor on any device).

    Example:
        >>> grads = [torch.ones(2)]
        >>> scale_(grads, torch.tensor(0.5))
        >>> grads[0]
        tensor([0.5000, 0.5000])
    """
    if isinstance(factor, (int, float)) and factor == 1.0:
        return
    for (group_device, group_dtype), group in _grouped(tensors).items():
        if not group:
            continue
        local: float | Tensor = factor
        if isinstance(factor, Tensor):  # in the group's precision (at least float32): no promotion per tensor
            local = factor.to(
                group_device, torch.promote_types(group_dtype, torch.float32), non_blocking=True
            )
        if _use_foreach(foreach):
            torch._foreach_mul_(group, local)
        else:
            for tensor in group:
                tensor.mul_(local)


def clamp_(tensors: Tensors, bound: float, *, foreach: bool | None = None) -> None:
    """Clamp every element of every tensor to ``[-bound, bound]`` in place.

    Example:
        >>> grads = [torch.tensor([-3.0, 0.5, 3.0])]
        >>> clamp_(grads, 1.0)
        >>> grads[0]
        tensor([-1.0000,  0.5000,  1.0000])
    """
    for group in _grouped(tensors).values():
        if not group:
            continue
        if _use_foreach(foreach):
            torch._foreach_clamp_min_(group, -bound)
            torch._foreach_clamp_max_(group, bound)
        else:
            for tensor in group:
                tensor.clamp_(-bound, bound)


def non_finite_names(named_tensors: Sequence[tuple[str, Tensor]], limit: int = 5) -> list[str]:
    """Return the names of up to ``limit`` tensors holding ``nan`` or ``inf`` (syncs; for error paths only).

    Example:
        >>> non_finite_names([("a", torch.ones(1)), ("b", torch.tensor([float("nan")]))])
        ['b']
    """
    names: list[str] = []
    for name, tensor in named_tensors:
        if not bool(torch.isfinite(tensor).all()):
            names.append(name)
            if len(names) == limit:
                break
    return names


__all__ = ["clamp_", "group_by_device_and_dtype", "non_finite_names", "scale_", "total_norm"]
