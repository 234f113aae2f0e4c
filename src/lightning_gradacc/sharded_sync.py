"""When FSDP reduces the gradients of a window: every micro-batch (Lightning's way) or only at its end.

Lightning's ``FSDPStrategy`` and ``ModelParallelStrategy`` reduce-scatter every micro-batch's gradient:
their ``block_backward_sync`` only knows DDP's ``no_sync``. ``sharded_reduction="window_end"`` turns the
sync off for all but the window's last backward instead: FSDP2's ``set_requires_gradient_sync`` on each
``fully_shard`` module, FSDP1's ``no_sync()`` on each root ``FullyShardedDataParallel``. The unsharded
gradients are then kept inside FSDP across the window (memory), and one reduce-scatter carries all of it.
``"replicas_at_window_end"`` (FSDP2 on an HSDP mesh) still reduce-scatters every micro-batch inside each
replica (memory stays sharded) and defers only the all-reduce across replicas
(``set_requires_all_reduce``), which is the slow one between nodes.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .core.shards import fsdp2_modules


def fsdp1_roots(module: torch.nn.Module) -> list[Any]:
    """The outermost ``FullyShardedDataParallel`` (FSDP1) modules in ``module``: where ``no_sync()`` goes.

    Example:
        >>> fsdp1_roots(torch.nn.Linear(2, 2))
        []
    """
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return []
    roots: list[Any] = []

    def visit(node: torch.nn.Module) -> None:
        if isinstance(node, FullyShardedDataParallel):
            roots.append(node)
            return
        for child in node.children():
            visit(child)

    visit(module)
    return roots


def drop_unsynced_fsdp2(module: Any) -> None:
    """Forget the gradients an FSDP2 module held back while its sync or all-reduce was off (private state).

    Unsharded while the sync was off; reduce-scattered but not all-reduced across replicas (HSDP).
    """
    group: Any = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
    if getattr(group, "_partial_reduce_output", None) is not None:
        group._partial_reduce_output = None
    for fsdp_param in getattr(group, "fsdp_params", []):
        if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
            fsdp_param.unsharded_accumulated_grad = None
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if unsharded is not None:
            unsharded.grad = None


REDUCTIONS = ("every_micro_batch", "window_end", "replicas_at_window_end")


def check_reduction(reduction: Any) -> str:
    """The callback's ``sharded_reduction`` argument, if it is one of :data:`REDUCTIONS`.

    Example:
        >>> check_reduction("window_end")
        'window_end'
    """
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"Expected argument `sharded_reduction` to be one of {list(REDUCTIONS)}, but got {reduction!r}."
        )
    return str(reduction)


def is_replicated(module: Any) -> bool:
    """Whether an FSDP2 module shards over an HSDP mesh (a replicate and a shard dimension)."""
    meshes = [getattr(param, "device_mesh", None) for param in module.parameters()]
    return any(mesh is not None and mesh.ndim > 1 for mesh in meshes)


class ShardedSync:
    """Which backward of a window lets FSDP (1 or 2) reduce its gradients.

    Args:
        module: The model as the strategy wrapped it (``trainer.model``).
        reduction: One of :data:`REDUCTIONS` (``"every_micro_batch"``: every backward, as Lightning does).

    Raises:
        ValueError: ``"replicas_at_window_end"`` with FSDP1, which cannot defer the all-reduce alone.

    Example:
        >>> sync = ShardedSync(torch.nn.Linear(2, 2), reduction="window_end")
        >>> sync.defers, sync.fsdp1, sync.sharded
        (False, False, False)
    """

    def __init__(self, module: torch.nn.Module, *, reduction: str = "every_micro_batch") -> None:
        self._fsdp2 = fsdp2_modules(module)
        self._fsdp1 = fsdp1_roots(module)
        self.sharded = bool(self._fsdp2 or self._fsdp1)  # FSDP reduces every micro-batch's gradient itself
        self._all_reduce_only = reduction == "replicas_at_window_end"
        if self._all_reduce_only and self._fsdp1:
            raise ValueError(
                "`sharded_reduction='replicas_at_window_end'` needs FSDP2 (`fully_shard` on an HSDP mesh):"
                " FSDP1 (`FSDPStrategy`) cannot defer the all-reduce across replicas alone. Use"
                " `sharded_reduction='window_end'` (`no_sync()`), or `ModelParallelStrategy` with"
                " `fully_shard`."
            )
        if self._all_reduce_only:
            self._fsdp2 = [m for m in self._fsdp2 if is_replicated(m)]
        self.defers = reduction != "every_micro_batch" and bool(self._fsdp2 or self._fsdp1)
        self._held: list[contextlib.AbstractContextManager[Any]] = []  # FSDP1 `no_sync()` entered

    @property
    def fsdp1(self) -> bool:
        """Whether the model is wrapped by FSDP1 (``FullyShardedDataParallel``)."""
        return bool(self._fsdp1)

    def before_backward(self, last: bool) -> None:
        """Let the coming backward reduce only if it is the window's ``last``."""
        if not self.defers:
            return
        self._set_fsdp2(last)
        if not last:
            for root in self._fsdp1:
                context = root.no_sync()
                context.__enter__()
                self._held.append(context)

    def _set_fsdp2(self, reduce: bool) -> None:
        """Switch what the mode defers on every FSDP2 module: the whole sync, or the all-reduce only."""
        for module in self._fsdp2:
            if self._all_reduce_only:
                module.set_requires_all_reduce(reduce, recurse=False)
            else:
                module.set_requires_gradient_sync(reduce, recurse=False)

    def after_backward(self) -> None:
        """Leave FSDP1's ``no_sync()``: only the backward itself runs inside it."""
        while self._held:
            self._held.pop().__exit__(None, None, None)

    def drop_unsynced(self) -> None:
        """Forget what FSDP2 holds unsynced for an abandoned window.

        FSDP1 needs nothing: it frees its unsynced flat gradient by itself before the next forward once
        every original parameter's ``.grad`` is ``None`` (``_reset_flat_param_grad_info_if_needed``), which
        a discarded window and ``zero_grad`` make so.
        """
        if not self.defers:
            return
        for module in self._fsdp2:
            drop_unsynced_fsdp2(module)

    def restore(self, *, discard: bool) -> None:
        """FSDP's own behaviour again (sync on), after ``fit``; ``discard`` drops what is held unsynced."""
        self.after_backward()
        if not self.defers:
            return
        self._set_fsdp2(True)
        if discard:
            self.drop_unsynced()
