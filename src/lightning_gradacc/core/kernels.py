"""Fused passes over lists of gradients, grouped by (device, dtype).

The boundary of a window needs the total norm (which also reveals ``nan``/``inf``), one in-place multiply
(normalization and norm clipping folded into one factor) and optionally a clamp. Each is one
``torch._foreach_*`` call per (device, dtype) group; scalars stay on the device, so nothing here syncs
with the host. The ``foreach`` argument keeps the contract of ``torch.nn.utils.clip_grad_norm_``:
``None`` uses the fused kernels where the device and tensor type support them and falls back to a
per-tensor loop elsewhere, ``True`` raises where they are unsupported, ``False`` always loops. Every
in-place pass runs under ``torch.no_grad()``. Gradients are dense (the accumulator rejects sparse ones).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from .torch_internals import device_has_foreach

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


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` widened to float32 (fp16/bf16 squares and factors would overflow or round).

    Example:
        >>> at_least_float32(torch.bfloat16), at_least_float32(torch.float64)
        (torch.float32, torch.float64)
    """
    if dtype is torch.float32 or dtype is torch.float64:  # no dispatcher call on the hot path
        return dtype
    return torch.promote_types(dtype, torch.float32)


def use_foreach(foreach: bool | None, device: torch.device, tensors: Sequence[Tensor]) -> bool:
    """Whether to use the fused kernels for ``tensors`` on ``device``, as ``torch.nn.utils`` decides.

    Raises:
        RuntimeError: ``foreach=True`` on a device without foreach kernels.

    Example:
        >>> use_foreach(None, torch.device("cpu"), [torch.zeros(1)])
        True
    """
    if foreach is None:  # as torch's _has_foreach_support, with the device's answer cached
        return device_has_foreach(device.type) and all(type(t) is Tensor for t in tensors)
    if foreach and not device_has_foreach(device.type):
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return foreach


def tensor_norms(
    tensors: Tensors, norm_type: float, *, device: torch.device, foreach: bool | None = None
) -> list[Tensor]:
    """The ``norm_type``-norm of each tensor (in group order), as scalars on ``device``.

    Computed in float32 at least (fp16/bf16 squares cannot overflow), float64 for float64 tensors.

    Example:
        >>> tensor_norms([torch.tensor([3.0, 4.0]), torch.tensor([1.0])], 2.0, device=torch.device("cpu"))
        [tensor(5.), tensor(1.)]
    """
    norms: list[Tensor] = []
    for (group_device, group_dtype), group in _grouped(tensors).items():
        if not group:
            continue
        norm_dtype = at_least_float32(group_dtype)
        empty = [i for i, t in enumerate(group) if t.numel() == 0]
        if empty:  # a rank's empty shard (FSDP): norm 0, which the inf-norm kernels refuse to compute
            full = [t for t in group if t.numel()]
            filled = tensor_norms(
                {(group_device, group_dtype): full}, norm_type, device=device, foreach=foreach
            )
            zero = torch.zeros((), dtype=norm_dtype, device=device)
            found_iter = iter(filled)
            norms.extend(zero if i in empty else next(found_iter) for i in range(len(group)))
            continue
        if use_foreach(foreach, group_device, group):
            found: Sequence[Tensor] = torch._foreach_norm(group, norm_type, dtype=norm_dtype)
        else:
            found = [torch.linalg.vector_norm(t, norm_type, dtype=norm_dtype) for t in group]
        if group_device != device:
            found = [n.to(device, non_blocking=True) for n in found]
        norms.extend(found)
    return norms


def combine_norms(norms: Sequence[Tensor], norm_type: float, *, device: torch.device) -> Tensor:
    """The norm of all tensors together from their own norms (float64 if any norm is float64).

    Any ``nan`` or ``inf`` element makes the result non-finite, so one pass answers both "how large" and
    "is it finite".

    Example:
        >>> combine_norms([torch.tensor(3.0), torch.tensor(4.0)], 2.0, device=torch.device("cpu"))
        tensor(5.)
    """
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    if len({n.dtype for n in norms}) > 1:  # float32 and float64 groups: stack in float64
        norms = [n.to(torch.float64) for n in norms]
    total: Tensor = torch.linalg.vector_norm(torch.stack(list(norms)), norm_type)
    return total


def total_norm(
    tensors: Tensors, norm_type: float, *, device: torch.device, foreach: bool | None = None
) -> Tensor:
    """Return the ``norm_type``-norm of all tensors together as a scalar on ``device``.

    Example:
        >>> total_norm([torch.tensor([3.0]), torch.tensor([4.0])], 2.0, device=torch.device("cpu"))
        tensor(5.)
    """
    norms = tensor_norms(tensors, norm_type, device=device, foreach=foreach)
    return combine_norms(norms, norm_type, device=device)


def scale_(
    tensors: Tensors,
    factor: float | Tensor | Sequence[Tensor] | Sequence[float],
    *,
    foreach: bool | None = None,
) -> None:
    """Multiply every tensor in place by ``factor``: a number, a scalar tensor, or one per tensor.

    Example:
        >>> grads = [torch.ones(2)]
        >>> scale_(grads, torch.tensor(0.5))
        >>> grads[0]
        tensor([0.5000, 0.5000])
    """
    if isinstance(factor, (int, float)) and factor == 1.0:
        return
    if not isinstance(factor, (int, float, Tensor)) and not isinstance(tensors, Mapping):
        # one factor per tensor of a flat list: group the factors with their tensors
        paired: dict[GroupKey, list[tuple[Tensor, Tensor | float]]] = defaultdict(list)
        for tensor, one in zip(tensors, factor, strict=True):
            paired[(tensor.device, tensor.dtype)].append((tensor, one))  # type: ignore[arg-type]
        tensors = {key: [t for t, _ in pairs] for key, pairs in paired.items()}
        factor = [one for pairs in paired.values() for _, one in pairs]  # type: ignore[assignment]
    with _no_grad():
        _scale(tensors, factor, foreach)


def _no_grad() -> contextlib.AbstractContextManager[None]:
    """``torch.no_grad()`` where grad mode is on (in-place work on leaves), else nothing to enter."""
    return torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext()


def _scale(
    tensors: Tensors, factor: float | Tensor | Sequence[Tensor] | Sequence[float], foreach: bool | None
) -> None:
    offset = 0
    for (group_device, group_dtype), group in _grouped(tensors).items():
        if not group:
            continue
        wide = at_least_float32(group_dtype)  # the group's precision: no promotion per tensor
        # On CPU the foreach kernels take a scalar tensor up to 3x faster than a Python number (200 tensors
        # of 4K: 124 vs 382 us); on a GPU a Python number is a kernel argument, with no tensor to make.
        on_cpu = group_device.type == "cpu"
        local: list[Tensor] | list[float] | float | Tensor
        if isinstance(factor, (int, float)):
            local = torch.full((), factor, dtype=wide) if on_cpu else factor
        elif isinstance(factor, Tensor):
            local = factor.to(group_device, wide, non_blocking=True)
        else:
            mine = factor[offset : offset + len(group)]
            offset += len(group)
            if all(isinstance(f, (int, float)) for f in mine):  # host numbers
                numbers = [float(f) for f in mine]
                local = list(torch.tensor(numbers, dtype=wide).unbind()) if on_cpu else numbers
            else:
                local = [
                    f.to(group_device, wide, non_blocking=True)
                    if isinstance(f, Tensor)
                    else torch.tensor(f, dtype=wide, device=group_device)
                    for f in mine
                ]
        if use_foreach(foreach, group_device, group):
            torch._foreach_mul_(group, local)
        else:
            for index, tensor in enumerate(group):
                tensor.mul_(local[index] if isinstance(local, list) else local)


def clamp_(tensors: Tensors, bound: float, *, foreach: bool | None = None) -> None:
    """Clamp every element of every tensor to ``[-bound, bound]`` in place.

    Example:
        >>> grads = [torch.tensor([-3.0, 0.5, 3.0])]
        >>> clamp_(grads, 1.0)
        >>> grads[0]
        tensor([-1.0000,  0.5000,  1.0000])
    """
    with _no_grad():
        for (group_device, _), group in _grouped(tensors).items():
            if not group:
                continue
            if use_foreach(foreach, group_device, group):
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


__all__ = [
    "clamp_",
    "combine_norms",
    "group_by_device_and_dtype",
    "non_finite_names",
    "scale_",
    "tensor_norms",
    "total_norm",
    "use_foreach",
]
