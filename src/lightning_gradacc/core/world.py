"""The data-parallel world: how many ranks share a window, and how a small tensor is summed over them."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .settings import check_positive_int

AllReduce = Callable[[Tensor], Tensor]


def default_world() -> tuple[int, AllReduce | None]:
    """World size and a sum all-reduce from ``torch.distributed`` when a process group is running.

    Example:
        >>> default_world()  # no process group here
        (1, None)
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 1, None
    return dist.get_world_size(), _all_reduce_sum


def summed_over_ranks(value: float | Tensor, device: torch.device | str) -> float:
    """A count summed over the ranks of the running process group (itself without one), read on the host.

    One all-reduce of a float64 scalar on ``device`` (the process group's: a CUDA device under NCCL); a nan
    on any rank reaches every rank, which can then raise together.

    Example:
        >>> summed_over_ranks(torch.tensor(3), "cpu"), summed_over_ranks(2.5, "cpu")  # one process
        (3.0, 2.5)
    """
    _, all_reduce = default_world()
    if all_reduce is None:
        return float(value)
    return float(all_reduce(torch.as_tensor(value, dtype=torch.float64).reshape(()).to(device)))


def _all_reduce_sum(tensor: Tensor) -> Tensor:
    import torch.distributed as dist

    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


class World:
    """The ranks a window is summed over, as configured, resolved when it is needed.

    Args:
        size: Data-parallel ranks; ``None``: taken from ``torch.distributed`` when initialized, else 1.
        all_reduce: Sums a small tensor over ranks in place and returns it; ``None``:
            ``torch.distributed.all_reduce``, which must then be initialized with ``size`` ranks.

    Example:
        >>> World(2, all_reduce=lambda tensor: tensor * 2).resolve()[0]
        2
    """

    def __init__(self, size: int | None = None, all_reduce: AllReduce | None = None) -> None:
        if size is not None:
            check_positive_int("world_size", size)
            if size > 1 and all_reduce is None and default_world()[0] != size:
                raise ValueError(
                    f"Argument `world_size={size}` needs `all_reduce=` (a function that sums a tensor"
                    " over ranks in place) or an initialized `torch.distributed` process group of"
                    f" {size} ranks; without either the window's counts could not be summed over ranks."
                )
        self.size = size
        self.all_reduce = all_reduce

    def resolve(self) -> tuple[int, AllReduce | None]:
        """The world size and the all-reduce to use now (``None`` for a single rank)."""
        if self.size is None:
            return default_world()
        if self.size > 1 and self.all_reduce is None:
            size, all_reduce = default_world()
            if all_reduce is None or size != self.size:
                raise RuntimeError(
                    f"`GradAccumulator(world_size={self.size})` has no `all_reduce` and no"
                    f" `torch.distributed` process group of {self.size} ranks is running (found"
                    f" {size}): the window cannot be summed over ranks."
                )
            return size, all_reduce
        return self.size, self.all_reduce if self.size > 1 else None
