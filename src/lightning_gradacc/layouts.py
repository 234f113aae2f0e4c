"""Layouts: what each Lightning strategy means for the gradients, one object per strategy.

A layout says whether the callback can accumulate under a strategy and what it refuses there, how the
window's gradients are reduced over the ranks (a :class:`~lightning_gradacc.reduction.WindowReduction` for
the wrapped model), and where the core finds them (FSDP's flat slices or ``DTensor`` shards, which the core
then norms, clips and saves per shard group). The callback asks the layout of its Trainer's strategy
(:func:`layout_of`) and nothing else about the strategy, so a new engine is one more :class:`Layout` in
:data:`LAYOUTS`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from . import lightning_internals as internals
from .reduction import WindowReduction

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from .namespaces import LightningNamespace


class Layout:
    """How one family of Lightning strategies lays out the gradients (the base: one process, no sharding).

    Attributes:
        name: For messages.
        strategy: The name of the strategy class in the Trainer's namespace (``LightningNamespace``).
        lightning_clips_by_norm: Whether Lightning's own ``gradient_clip_val`` by norm works here (its
            ``FSDPPrecision`` refuses it).
    """

    name = "single-device"
    strategy = "single_device_strategy"
    lightning_clips_by_norm = True

    def accepts(self, api: LightningNamespace, strategy: Any) -> bool:
        """Whether ``strategy`` (of the Trainer's namespace ``api``) is of this layout."""
        return isinstance(strategy, getattr(api, self.strategy))

    def refuse(self, trainer: pl.Trainer) -> None:
        """Raise ``RuntimeError`` for a configuration of this strategy the callback cannot make exact."""

    def reduction(self, trainer: pl.Trainer, *, reduction: str, per_micro_batch: bool) -> WindowReduction:
        """Which backward of a window reduces its gradients over the ranks, and who reduces them."""
        return WindowReduction(
            trainer.model, reduction=reduction, world_size=trainer.world_size, per_micro_batch=per_micro_batch
        )

    def sharded_model(self, trainer: pl.Trainer, reduction: WindowReduction) -> torch.nn.Module | None:
        """The model FSDP (1 or 2) shards, whose gradients the core finds per shard (``None``: none)."""
        return trainer.model if reduction.sharded else None


class DataParallel(Layout):
    """DDP: whole gradients on every rank, all-reduced in the window's last backward (or by the core)."""

    name = "DDP"
    strategy = "ddp_strategy"


class FullyShardedV1(Layout):
    """Lightning's ``FSDPStrategy`` (FSDP1): flat gradient slices, reduce-scattered by FSDP."""

    name = "FSDP"
    strategy = "fsdp_strategy"
    lightning_clips_by_norm = False

    def refuse(self, trainer: pl.Trainer) -> None:
        """FSDP1 without the original parameters: flat parameters mix many tensors."""
        if not internals.fsdp_uses_orig_params(trainer.strategy):
            raise RuntimeError(
                "`GradientAccumulationCallback` needs `FSDPStrategy(use_orig_params=True)` (Lightning's"
                " default), but `use_orig_params=False` was passed: the optimizer then holds flat parameters"
                " that mix many tensors, which neither per-parameter clipping nor the statistics can tell"
                " apart."
            )


class ModelParallel(Layout):
    """``ModelParallelStrategy`` with ``fully_shard`` (FSDP2, HSDP): ``DTensor`` shards, data-parallel."""

    name = "ModelParallel (FSDP2)"
    strategy = "model_parallel_strategy"

    def refuse(self, trainer: pl.Trainer) -> None:
        """Tensor parallelism: its ranks see the same data, which item counts would count twice."""
        tensor_parallel = internals.tensor_parallel_size(trainer.strategy)
        if tensor_parallel != 1:
            raise RuntimeError(
                f"`GradientAccumulationCallback` supports `ModelParallelStrategy` with data parallelism only"
                f" (FSDP2), but `tensor_parallel_size={tensor_parallel}`: ranks of a tensor-parallel group"
                " see the same data, which item counts summed over every rank would count twice. Use"
                f" `ModelParallelStrategy(data_parallel_size={trainer.world_size}, tensor_parallel_size=1)`."
            )


LAYOUTS: tuple[Layout, ...] = (Layout(), DataParallel(), FullyShardedV1(), ModelParallel())


def layout_of(api: LightningNamespace, trainer: pl.Trainer) -> Layout:
    """The layout of the Trainer's strategy, its own refusals checked.

    Raises:
        RuntimeError: A strategy that accumulates itself (DeepSpeed), one no layout accepts, or a
            configuration its layout refuses.
    """
    strategy = trainer.strategy
    if strategy.handles_gradient_accumulation or "deepspeed" in type(strategy).__name__.lower():
        raise RuntimeError(
            f"`{type(strategy).__name__}` performs gradient accumulation itself (its config's"
            " `gradient_accumulation_steps`). Remove `GradientAccumulationCallback` and configure"
            " accumulation there."
        )
    for layout in LAYOUTS:
        if layout.accepts(api, strategy):
            layout.refuse(trainer)
            return layout
    *others, last = [layout.name for layout in LAYOUTS]
    names = f"{', '.join(others)} and {last}"
    raise RuntimeError(
        f"`GradientAccumulationCallback` supports {names} strategies, but the Trainer uses"
        f" `{type(strategy).__name__}`, whose gradients it cannot normalize and clip yet. Use"
        " `strategy='ddp'` or `strategy='fsdp'`, or `ModelParallelStrategy(data_parallel_size=N,"
        " tensor_parallel_size=1)` with `fully_shard` in `configure_model`, or remove the callback."
    )
