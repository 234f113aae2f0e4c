"""Sharded gradients: local shards and their norms.

Two kinds: ``DTensor`` (FSDP2's ``fully_shard``) and flat slices (FSDP1's
``FullyShardedDataParallel(use_orig_params=True)``).
The boundary works on each rank's local shard in place; only the norms need the other ranks: each
tensor's norm is combined over the ranks that hold its shards with one all-reduce of a vector (the sum of
p-th powers, or the maximum for ``inf``), never by gathering gradients. A tensor replicated on its mesh is
complete on every rank and is left as it is. Under FSDP1 a rank may hold none of a parameter: its slot in
the vector is then 0, so that every rank's vector lines up.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .torch_internals import fsdp1_layouts
from .torch_internals import fsdp2_held_back as held_back


@functools.cache  # asked for every window and every buffered micro-batch
def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed support
        return None
    return DTensor


def local_shards(tensors: Sequence[Tensor | None]) -> tuple[list[Tensor | None], list[Any]]:
    """Each tensor's local shard (the tensor itself when it is not a ``DTensor``) and its shard group.

    Returns:
        The local tensors (aliases: in-place work on them changes the ``DTensor``) and, per tensor, the
        process group its shards are spread over (``None``: not sharded).

    Raises:
        NotImplementedError: a tensor sharded over more than one mesh dimension.

    Example:
        >>> local_shards([torch.ones(2), None])
        ([tensor([1., 1.]), None], [None, None])
    """
    dtensor = _dtensor_type()
    if dtensor is None or not any(isinstance(t, dtensor) for t in tensors):
        return list(tensors), [None] * len(tensors)
    local: list[Tensor | None] = []
    groups: list[Any] = []
    for tensor in tensors:
        if tensor is None or not isinstance(tensor, dtensor):
            local.append(tensor)
            groups.append(None)
            continue
        shard: Any = tensor  # a DTensor
        sharded = [dim for dim, placement in enumerate(shard.placements) if placement.is_shard()]
        if len(sharded) > 1:
            raise NotImplementedError(
                f"A gradient sharded over {len(sharded)} mesh dimensions ({shard.placements}) is not"
                " supported; shard each parameter over one mesh dimension (FSDP, or HSDP's shard dimension)."
            )
        local.append(shard.to_local())
        groups.append(shard.device_mesh.get_group(sharded[0]) if sharded else None)
    return local, groups


def combine_shard_norms(norms: list[Tensor], groups: Sequence[Any], norm_type: float) -> list[Tensor]:
    """Turn each sharded tensor's local norm into its whole norm: one all-reduce per shard group.

    Computed in float64, so that p-th powers of large float32 norms cannot overflow. A ``nan`` or ``inf``
    on one rank makes the norm non-finite on every rank.
    """
    import torch.distributed as dist

    by_group: dict[Any, list[int]] = {}
    for index, group in enumerate(groups):
        if group is not None:
            by_group.setdefault(group, []).append(index)
    combined = list(norms)
    for group, indices in by_group.items():
        vector = torch.stack([norms[i].to(torch.float64) for i in indices])
        if norm_type == math.inf:
            dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=group)
        else:
            vector = vector.pow(norm_type)
            dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=group)
            vector = vector.pow(1.0 / norm_type)
        for position, index in enumerate(indices):
            combined[index] = vector[position].to(norms[index].dtype)
    return combined


def as_sharded_like(param: Tensor, local: Tensor) -> Tensor:
    """``local`` as the gradient of ``param``: a ``DTensor`` shaped and placed as ``param`` when it is one.

    Accumulation buffers hold local shards; the gradient written back must be the parameter's kind.

    Example:
        >>> as_sharded_like(torch.zeros(2), torch.ones(2))
        tensor([1., 1.])
    """
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(param, dtensor):
        return local
    sharded: Any = param
    return dtensor.from_local(  # type: ignore[attr-defined,no-any-return]
        local,
        sharded.device_mesh,
        sharded.placements,
        run_check=False,
        shape=sharded.size(),  # uneven shards: the global shape cannot be inferred from one rank's
        stride=sharded.stride(),
    )


def distribute_like(param: Tensor, whole: Tensor) -> Tensor:
    """This rank's shard of ``whole`` as a ``DTensor`` placed as ``param``.

    No communication: every rank holds ``whole`` (loaded from the same checkpoint).
    """
    from torch.distributed.tensor import distribute_tensor

    sharded: Any = param
    return distribute_tensor(whole, sharded.device_mesh, sharded.placements, src_data_rank=None)


@dataclass(frozen=True)
class FlatShard:
    """The part of one parameter an FSDP1 rank holds: a flat slice of the whole, in place of the parameter.

    Under ``FullyShardedDataParallel(use_orig_params=True)`` a parameter is a 1-D view of the elements
    ``start`` to ``start + numel`` of the flattened whole, and so is its ``.grad`` after a synced backward.
    ``numel`` may be 0: the rank holds none of it (its ``.grad`` is then ``None``).

    Attributes:
        group: The process group the parameter's elements are spread over (FSDP's shard group: the
            ranks of one replica under ``HYBRID_SHARD``).
        shape: The whole parameter's shape.
        start: The first element held here, in the flattened whole.
        numel: How many elements are held here.
    """

    group: Any
    shape: torch.Size
    start: int
    numel: int

    def whole(self, local: Tensor | None, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The whole tensor, from every rank's slice: one all-reduce over :attr:`group` (a collective).

        Each element is held by exactly one rank of the group, so the sum adds zeros only: exact.
        """
        import torch.distributed as dist

        whole = torch.zeros(self.shape.numel(), dtype=dtype, device=device)
        if local is not None and self.numel:
            whole[self.start : self.start + self.numel] = local.reshape(-1)
        dist.all_reduce(whole, group=self.group)
        return whole.view(self.shape)

    def local(self, whole: Tensor) -> Tensor:
        """This rank's slice of ``whole`` (a copy), shaped like the parameter.

        Example:
            >>> FlatShard(None, torch.Size([2, 3]), start=2, numel=3).local(torch.arange(6).view(2, 3))
            tensor([2, 3, 4])
        """
        return whole.reshape(-1)[self.start : self.start + self.numel].clone()


def flat_shards(module: torch.nn.Module) -> dict[int, FlatShard | None]:
    """Where each parameter flattened by FSDP1 inside ``module`` lies, by the parameter's ``id``.

    ``None`` for a parameter FSDP1 does not shard (``NO_SHARD``: its gradient is whole on every rank). The
    flat-parameter metadata is FSDP1's private state (``torch_internals.fsdp1_layouts``).

    Raises:
        ValueError: a module wrapped with ``use_orig_params=False``.
    """
    return {
        id(layout.param): FlatShard(layout.process_group, layout.shape, layout.start, layout.numel)
        if layout.sharded
        else None
        for layout in fsdp1_layouts(module)
    }


def fsdp2_modules(module: torch.nn.Module) -> list[Any]:
    """The modules sharded with FSDP2's ``fully_shard`` (each sets its own gradient sync).

    Example:
        >>> fsdp2_modules(torch.nn.Linear(2, 2))
        []
    """
    try:
        from torch.distributed.fsdp import FSDPModule  # public from torch 2.6 (2.9 is the oldest supported)
    except ImportError:  # a build without distributed support
        return []
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def fsdp2_held_back(module: torch.nn.Module) -> set[int]:
    """The sharded parameters (by ``id``) whose window gradient FSDP2 holds back inside ``module``.

    See :func:`~lightning_gradacc.core.torch_internals.fsdp2_held_back` (FSDP2's private state, read only).

    Example:
        >>> fsdp2_held_back(torch.nn.Linear(2, 2))
        set()
    """
    return held_back(fsdp2_modules(module))
