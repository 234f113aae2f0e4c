"""TrackedParameters: the parameters an accumulator works on, their names and how they are laid out.

A parameter's gradient is a plain tensor, a ``DTensor`` shard (FSDP2), or a flat 1-D slice of the whole
(FSDP1 with ``use_orig_params=True``, where a rank may hold none of it). The norms of the boundary and of
the per-micro-batch checks need each gradient's local tensor, the process group its norm is combined over,
and a slot for every parameter on every rank so that the norm vectors line up in one all-reduce. This
module is the one place that knows those layouts; everything else asks it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.nn.parameter import is_lazy

from .kernels import GroupKey, combine_norms, tensor_norms
from .shards import FlatShard, combine_shard_norms, flat_shards, local_shards
from .torch_internals import is_fsdp_flattened

NamedParameters = Iterable[Tensor] | Iterable[tuple[str, Tensor]]


def named_list(parameters: NamedParameters) -> list[tuple[str, Tensor]]:
    """``parameters`` as ``(name, tensor)`` pairs; unnamed ones are called ``param_<index>``.

    Example:
        >>> [name for name, _ in named_list([torch.zeros(1), torch.zeros(2)])]
        ['param_0', 'param_1']
    """
    named: list[tuple[str, Tensor]] = []
    for index, entry in enumerate(parameters):
        name, param = entry if isinstance(entry, tuple) else (f"param_{index}", entry)
        if not isinstance(param, Tensor):
            raise TypeError(
                f"Expected argument `parameters` to hold tensors, but got {type(param).__name__}."
            )
        named.append((name, param))
    if not named:
        raise ValueError("Expected argument `parameters` to hold at least one parameter.")
    return named


class TrackedParameters:
    """The tracked parameters by name, grouped for fused kernels, with their FSDP layouts.

    Args:
        parameters: Tensors or ``(name, tensor)`` pairs.
        buffer_dtype: The accumulation buffers' dtype (``None``: no buffers); groups the buffers' kernels.
        fsdp_module: The model wrapped by FSDP1 or FSDP2 (see ``GradAccumulator``'s ``fsdp_module``).
        foreach: As in ``torch.nn.utils.clip_grad_norm_``.

    Example:
        >>> weight = torch.nn.Parameter(torch.ones(2))
        >>> tracked = TrackedParameters([("weight", weight)])
        >>> weight.grad = torch.tensor([3.0, 4.0])
        >>> tracked.names, tracked.micro_batch_norm(2.0)
        (['weight'], tensor(5.))
    """

    def __init__(
        self,
        parameters: NamedParameters,
        *,
        buffer_dtype: torch.dtype | None = None,
        fsdp_module: torch.nn.Module | None = None,
        foreach: bool | None = None,
    ) -> None:
        self.buffer_dtype = buffer_dtype
        self.fsdp_module = fsdp_module
        self.foreach = foreach
        self.follow(parameters)

    def follow(self, parameters: NamedParameters) -> None:
        """Track a new set of parameters (in place: every part holding this object sees the new set)."""
        named = named_list(parameters)
        known = flat_shards(self.fsdp_module) if self.fsdp_module is not None else {}
        for name, param in named:
            if is_fsdp_flattened(param) and id(param) not in known:
                raise ValueError(
                    f"Parameter `{name}` was flattened by `FullyShardedDataParallel` (FSDP1): its gradient is"
                    " a slice of the whole on each rank. Pass the wrapped model as `fsdp_module=` so that its"
                    " norms are combined over the ranks."
                )
        self.named = named
        self.device = named[0][1].device
        self.index = {name: index for index, (name, _) in enumerate(named)}
        # parameter indices grouped by (device, dtype): of the gradients, and of the buffers
        self.grad_groups: dict[GroupKey, list[int]] = {}
        self.buffer_groups: dict[GroupKey, list[int]] = {}
        for index, (_, param) in enumerate(named):
            self.grad_groups.setdefault((param.device, param.dtype), []).append(index)
            self.buffer_groups.setdefault((param.device, self.buffer_dtype or param.dtype), []).append(index)
        # FSDP1 only: each parameter's slice (None: not flattened, or not sharded)
        self.flat_shards: list[FlatShard | None] = [known.get(id(param)) for _, param in named]
        self.flat_sharded = any(shard is not None for shard in self.flat_shards)
        # the process group of each sharded parameter (FSDP2 DTensor), else None
        self.shard_groups: list[Any] = local_shards(self.params)[1]
        self.sharded = self.flat_sharded or any(group is not None for group in self.shard_groups)

    @property
    def params(self) -> list[Tensor]:
        """The parameters, in order."""
        return [param for _, param in self.named]

    @property
    def names(self) -> list[str]:
        """Their names, in order."""
        return [name for name, _ in self.named]

    def grads(self) -> list[Tensor | None]:
        """Each parameter's ``.grad``, in order."""
        return [param.grad for _, param in self.named]

    def set_grads_to_none(self) -> None:
        """Drop every gradient (torch optimizers then leave parameters and state unchanged)."""
        for _, param in self.named:
            param.grad = None

    def sharded_names(self) -> set[str]:
        """The names of the parameters sharded by FSDP1 or FSDP2."""
        return {
            name
            for (name, _), piece, group in zip(self.named, self.flat_shards, self.shard_groups, strict=True)
            if piece is not None or group is not None
        }

    def num_parameters(self) -> int:
        """Whole parameters that train, sharded or not (an FSDP1 slice counts its whole)."""
        return sum(
            shard.shape.numel() if shard is not None else param.numel()
            for (_, param), shard in zip(self.named, self.flat_shards, strict=True)
            if param.requires_grad and not is_lazy(param)
        )

    def local_layout(
        self, sources: list[Tensor | None], *, in_buffers: bool
    ) -> tuple[dict[GroupKey, list[Tensor]], list[Any] | None]:
        """``sources`` (one per parameter) as local tensors grouped for kernels, and their process groups.

        Args:
            sources: The gradients (``.grad``), or the buffers' sums (already local shards).
            in_buffers: Whether ``sources`` are the buffers' (grouped by the buffers' dtype).

        Returns:
            The local tensors by (device, dtype), and, in the same order, the process group of each sharded
            one (``None`` if none is sharded).
        """
        if in_buffers:  # buffers hold local shards; the parameters say how they are spread
            local, groups = list(sources), list(self.shard_groups)
        else:
            local, groups = local_shards(sources)
        if self.flat_sharded:  # FSDP1: a rank holding none of a parameter still takes its slot (norm 0)
            for index, shard in enumerate(self.flat_shards):
                if shard is not None:
                    groups[index] = shard.group
                    if local[index] is None:
                        local[index] = self.named[index][1].new_zeros(0)
        layout = self.buffer_groups if in_buffers else self.grad_groups
        grads = {key: [t for i in ids if (t := local[i]) is not None] for key, ids in layout.items()}
        if not any(group is not None for group in groups):
            return grads, None
        return grads, [groups[i] for ids in layout.values() for i in ids if local[i] is not None]

    def tensor_norms(
        self, grads: dict[GroupKey, list[Tensor]], norm_type: float, shard_groups: list[Any] | None
    ) -> list[Tensor]:
        """Each tensor's norm (in group order), combined over its shards when it is sharded."""
        each = tensor_norms(grads, norm_type, device=self.device, foreach=self.foreach)
        return each if shard_groups is None else combine_shard_norms(each, shard_groups, norm_type)

    def micro_batch_norm(self, norm_type: float) -> Tensor:
        """The total norm of ``.grad`` (one micro-batch), combined over shards: a device scalar, no sync."""
        grads, groups = self.local_layout(self.grads(), in_buffers=False)
        return combine_norms(self.tensor_norms(grads, norm_type, groups), norm_type, device=self.device)

    def check_flat_gradients(self) -> None:
        """FSDP1 inside ``no_sync()`` leaves whole, unsynced gradients in ``.grad``: no slice to buffer."""
        for (name, param), shard in zip(self.named, self.flat_shards, strict=True):
            if shard is not None and param.grad is not None and param.grad.shape != param.shape:
                raise RuntimeError(
                    f"The gradient of `{name}` is whole ({tuple(param.grad.shape)}), not this rank's slice"
                    f" ({tuple(param.shape)}): FSDP1 ran this backward inside `no_sync()`. Accumulation"
                    " buffers need the gradient reduced every micro-batch; do not combine"
                    " `accumulation_dtype` with `no_sync()`."
                )
