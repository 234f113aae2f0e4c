"""How the ranks of one fit reduce a window's gradients, and in which backward: all of it in one place.

FSDP reduces in its own backward hooks: every micro-batch (Lightning's way), or only in the window's last
backward (``sharded_reduction``). Lightning's ``FSDPStrategy`` and ``ModelParallelStrategy`` reduce-scatter
every micro-batch's gradient: their ``block_backward_sync`` only knows DDP's ``no_sync``.
``sharded_reduction="window_end"`` turns the sync off for all but the window's last backward instead: FSDP2's
``set_requires_gradient_sync`` on each ``fully_shard`` module, FSDP1's ``no_sync()`` on each root
``FullyShardedDataParallel``. The unsharded gradients are then kept inside FSDP across the window (memory),
and one reduce-scatter carries all of it. ``"replicas_at_window_end"`` (FSDP2 on an HSDP mesh) still
reduce-scatters every micro-batch inside each replica (memory stays sharded) and defers only the all-reduce
across replicas (``set_requires_all_reduce``), which is the slow one between nodes.

DDP all-reduces in the window's last backward, after the core flushed the accumulation buffers into
``.grad``, so that one all-reduce carries the whole window. With a per-micro-batch mode
(``clip_mode="micro_batch"``, ``overflow="skip_micro_batch"``) no backward syncs through DDP, so that each
micro-batch's own gradient is checked and clipped; the core all-reduces the buffers at the window's end
instead.

Accumulation buffers may take each gradient inside the backward (the core's ``accumulate_in_backward``),
except under DDP with ``find_unused_parameters=True`` or ``static_graph=True``: DDP's reducer then marks a
parameter as used in a ``no_sync()`` backward only if its ``.grad`` holds a gradient after its
``AccumulateGrad``, and a parameter never marked, used in no backward of the window but an earlier one,
would be left out of the synchronized backward's all-reduce (its flushed sum not averaged over the ranks).

:class:`WindowReduction` is what the callback holds: every question about reduction goes to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .core.shards import fsdp2_modules
from .core.torch_internals import (
    drop_fsdp2_held_back,
    set_ddp_backward_sync,
    sync_ddp_buffers_at_next_forward,
)


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
        self._reduces = True  # whether the running backward reduces (the window's switch)

    @property
    def fsdp1(self) -> bool:
        """Whether the model is wrapped by FSDP1 (``FullyShardedDataParallel``)."""
        return bool(self._fsdp1)

    def before_backward(self, last: bool) -> None:
        """Let the coming backward reduce only if it is the window's ``last``."""
        if not self.defers:
            return
        self._set_fsdp2(last)
        self._reduces = last
        if not last:
            for root in self._fsdp1:
                context = root.no_sync()
                context.__enter__()
                self._held.append(context)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A backward that must not reduce where the mode defers (a batch's pieces but its last).

        Nested in the window's own switch: FSDP2's sync off for it and back after; FSDP1's ``no_sync()``.
        """
        if not self.defers:
            yield
            return
        self._set_fsdp2(False)
        contexts = [root.no_sync() for root in self._fsdp1]
        for context in contexts:
            context.__enter__()
        try:
            yield
        finally:
            for context in reversed(contexts):
                context.__exit__(None, None, None)
            self._set_fsdp2(self._reduces)

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
            drop_fsdp2_held_back(module)

    def restore(self, *, discard: bool) -> None:
        """FSDP's own behaviour again (sync on), after ``fit``; ``discard`` drops what is held unsynced."""
        self.after_backward()
        if not self.defers:
            return
        self._set_fsdp2(True)
        if discard:
            self.drop_unsynced()


class WindowReduction:
    """Which backward of a window reduces its gradients over the ranks, and who reduces them.

    Args:
        model: The model as the strategy wrapped it (``trainer.model``); ``None``: nothing to reduce.
        reduction: The callback's ``sharded_reduction``.
        world_size: The number of ranks.
        per_micro_batch: Whether each micro-batch's gradient is checked on its own (DDP's sync then stays
            off for the fit).

    Raises:
        ValueError: A ``reduction`` the model's FSDP cannot do (see :class:`ShardedSync`).

    Example:
        >>> reduction = WindowReduction(torch.nn.Linear(2, 2), world_size=1)
        >>> reduction.defers, reduction.core_reduces
        (False, False)
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        *,
        reduction: str = "every_micro_batch",
        world_size: int = 1,
        per_micro_batch: bool = False,
    ) -> None:
        self._fsdp = ShardedSync(torch.nn.Module() if model is None else model, reduction=reduction)
        ddp = model if isinstance(model, DistributedDataParallel) else None
        # the model whose gradient sync is off for the fit
        self.ddp_without_sync = ddp if per_micro_batch and world_size > 1 else None
        # whether buffers may take gradients inside the backward (DDP's unused-parameter marks need `.grad`)
        self.gradients_in_backward = ddp is None or not (
            getattr(ddp, "find_unused_parameters", False) or getattr(ddp, "static_graph", False)
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["ddp_without_sync"] = None  # the model of a fit, not the callback's (ddp_spawn pickles it)
        return state

    @property
    def sharded(self) -> bool:
        """Whether FSDP (1 or 2) shards the model: it reduces every micro-batch's gradient itself."""
        return self._fsdp.sharded

    @property
    def defers(self) -> bool:
        """Whether FSDP reduces only in the window's last backward (a deferring ``sharded_reduction``)."""
        return self._fsdp.defers

    def before_backward(self, last: bool) -> None:
        """A backward starts: a deferring FSDP reduces in it only if it is the window's ``last``."""
        self._fsdp.before_backward(last)

    def after_backward(self) -> None:
        """The backward ended (FSDP1's ``no_sync()`` is left: only the backward runs inside it)."""
        self._fsdp.after_backward()

    def held_back(self) -> contextlib.AbstractContextManager[None]:
        """Around a piece's backward that must not reduce (not the batch's last) where FSDP defers.

        Where the reduction waits for the window's last backward; nothing otherwise (FSDP then reduces each
        piece, which keeps its gradients sharded).
        """
        return self._fsdp.held()

    def drop_unsynced(self) -> None:
        """An abandoned window: forget what FSDP holds unsynced (else the next synced backward adds it in)."""
        self._fsdp.drop_unsynced()

    @property
    def core_reduces(self) -> bool:
        """Whether the core all-reduces the window's buffers at its end (DDP's own sync is off)."""
        return self.ddp_without_sync is not None

    def start(self) -> None:
        """Turn DDP's gradient sync off for the fit where the core reduces: ``no_sync()`` for every pass."""
        if self.ddp_without_sync is not None:
            set_ddp_backward_sync(self.ddp_without_sync, False)

    def after_step(self) -> None:
        """Have DDP sync its buffers at the next forward, as after a pass that synced."""
        if self.ddp_without_sync is not None:
            sync_ddp_buffers_at_next_forward(self.ddp_without_sync)

    def end(self, *, discard: bool) -> None:
        """DDP's and FSDP's own behaviour again, after a fit; ``discard`` drops what FSDP holds unsynced."""
        ddp, self.ddp_without_sync = self.ddp_without_sync, None
        if ddp is not None:
            set_ddp_backward_sync(ddp, True)
        self._fsdp.restore(discard=discard)
