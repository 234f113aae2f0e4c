"""How the ranks of one fit reduce a window's gradients, and in which backward.

FSDP reduces in its own backward hooks: every micro-batch, or only in the window's last backward
(:class:`~lightning_gradacc.sharded_sync.ShardedSync`, ``sharded_reduction``). DDP all-reduces in the
window's last backward, after the core flushed the accumulation buffers into ``.grad``, so that one
all-reduce carries the whole window. With a per-micro-batch mode (``clip_mode="micro_batch"``,
``overflow="skip_micro_batch"``) no backward syncs through DDP, so that each micro-batch's own gradient is
checked and clipped; the core all-reduces the buffers at the window's end instead.

Accumulation buffers may take each gradient inside the backward (the core's ``accumulate_in_backward``),
except under DDP with ``find_unused_parameters=True`` or ``static_graph=True``: DDP's reducer then marks a
parameter as used in a ``no_sync()`` backward only if its ``.grad`` holds a gradient after its
``AccumulateGrad``, and a parameter never marked, used in no backward of the window but an earlier one,
would be left out of the synchronized backward's all-reduce (its flushed sum not averaged over the ranks).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from . import lightning_internals as internals
from .sharded_sync import ShardedSync


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
        >>> reduction.fsdp.defers, reduction.core_reduces
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
        self.fsdp = ShardedSync(torch.nn.Module() if model is None else model, reduction=reduction)
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
    def core_reduces(self) -> bool:
        """Whether the core all-reduces the window's buffers at its end (DDP's own sync is off)."""
        return self.ddp_without_sync is not None

    def start(self) -> None:
        """Turn DDP's gradient sync off for the fit where the core reduces: ``no_sync()`` for every pass."""
        if self.ddp_without_sync is not None:
            internals.set_ddp_backward_sync(self.ddp_without_sync, False)

    def after_step(self) -> None:
        """Have DDP sync its buffers at the next forward, as after a pass that synced."""
        if self.ddp_without_sync is not None:
            internals.sync_ddp_buffers_at_next_forward(self.ddp_without_sync)

    def end(self, *, discard: bool) -> None:
        """DDP's and FSDP's own behaviour again, after a fit; ``discard`` drops what FSDP holds unsynced."""
        ddp, self.ddp_without_sync = self.ddp_without_sync, None
        if ddp is not None:
            internals.set_ddp_backward_sync(ddp, True)
        self.fsdp.restore(discard=discard)
