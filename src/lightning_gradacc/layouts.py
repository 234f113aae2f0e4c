"""Layouts: what each Lightning strategy means for the gradients, one object per strategy.

A layout says whether the callback can accumulate under a strategy and what it refuses there, how the
window's gradients are reduced over the ranks (a :class:`~lightning_gradacc.reduction.WindowReduction` for
the wrapped model), and where the core finds them (FSDP's flat slices or ``DTensor`` shards, which the core
then norms, clips and saves per shard group). The callback asks the layout of its Trainer's strategy
(:func:`layout_of`) and nothing else about the strategy, so a new engine is one more :class:`Layout` in
:data:`LAYOUTS`. An engine that keeps the window's gradients itself (DeepSpeed) is not accumulated by the core
but driven (:mod:`~lightning_gradacc.engine_window`): its layout says so (``engine_accumulates``), maps the
settings it can take into the engine's configuration at ``setup`` and refuses the others there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import lightning_internals as internals
from .deepspeed_internals import forget_zero_partitions
from .engine_window import EngineWindow
from .fit_accumulator import build_accumulator
from .needs import PROVISIONS
from .reduction import WindowReduction

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from .core.settings import AccumulationSettings
    from .namespaces import LightningNamespace
    from .window_driver import WindowDriver
    from .window_plan import WindowPlan


class Layout:
    """How one family of Lightning strategies lays out the gradients (the base: one process, no sharding).

    Attributes:
        name: For messages.
        strategy: The name of the strategy class in the Trainer's namespace (``LightningNamespace``).
        lightning_clips_by_norm: Whether Lightning's own ``gradient_clip_val`` by norm works here (its
            ``FSDPPrecision`` refuses it).
        engine_accumulates: The strategy's engine keeps the window's gradients: the callback drives it
            (:meth:`driver` is an engine's window) instead of the core accumulating ``.grad``.
        provides: What the strategy provides for the gradients (keys of ``needs.PROVISIONS``): a setting
            that needs something else is refused before training (``needs.refuse_unmet``).
    """

    name = "single-device"
    strategy = "single_device_strategy"
    lightning_clips_by_norm = True
    engine_accumulates = False
    provides: frozenset[str] = frozenset(PROVISIONS)

    def accepts(self, api: LightningNamespace, strategy: Any) -> bool:
        """Whether ``strategy`` (of the Trainer's namespace ``api``) is of this layout."""
        return isinstance(strategy, getattr(api, self.strategy))

    def refuse(self, trainer: pl.Trainer) -> None:
        """Raise ``RuntimeError`` for a configuration of this strategy the callback cannot make exact."""

    def prepare(
        self,
        trainer: pl.Trainer,
        settings: AccumulationSettings,
        *,
        plan: WindowPlan,
        sharded_reduction: str,
        warn: Callable[[str], Any],
        chosen: frozenset[str] = frozenset(),
    ) -> None:
        """At ``setup``, before the strategy's: refuse settings that cannot take effect, map the others.

        ``chosen``: the settings the user set (a default left alone does not warn where it cannot act).
        """

    def driver(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        settings: AccumulationSettings,
        *,
        scaler: Any,
        sync: WindowReduction,
        in_backward: bool,
    ) -> WindowDriver:
        """The window driver of a fit: the core accumulator, over what the Trainer's optimizers step.

        Args:
            trainer: The Trainer, its strategy set up.
            pl_module: The module trained.
            settings: The callback's math settings.
            scaler: The fit's GradScaler, or ``None``.
            sync: How the ranks reduce the window.
            in_backward: Whether buffers may take each gradient inside the backward.
        """
        return build_accumulator(
            trainer,
            pl_module,
            settings=settings,
            grad_scaler=scaler,
            reduction=sync,
            sharded_model=self.sharded_model(trainer, sync),
            in_backward=in_backward,
        )

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
    provides = frozenset(PROVISIONS) - {"unsharded_grad"}  # flat slices of the gradients
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
    provides = frozenset(PROVISIONS) - {"unsharded_grad"}  # `DTensor` shards
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


class _DeepSpeedEngine:
    """DeepSpeed's engine as an :class:`~lightning_gradacc.engine_window.Engine`: the one place of its API."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.gradient_accumulation_steps = int(engine.gradient_accumulation_steps())

    def set_boundary(self, last: bool) -> None:
        self._engine.set_gradient_accumulation_boundary(last)

    def drop_gradients(self) -> None:
        """Forget an abandoned window, between two micro-batches: what its next window must not add to.

        ``zero_grad`` clears ``.grad`` (and ZeRO-1's ``grad_accum``); ZeRO-2's reduced partitions are
        forgotten too (:func:`~lightning_gradacc.deepspeed_internals.forget_zero_partitions`).
        """
        engine = self._engine
        zero_grad = getattr(engine.optimizer, "zero_grad", None)
        if zero_grad is not None:
            zero_grad(set_to_none=True)
        engine.zero_grad()
        forget_zero_partitions(engine.optimizer)

    def skipped_steps(self) -> int:
        return int(self._engine.skipped_steps)

    def grad_norm(self) -> float | None:
        norm = self._engine.get_global_grad_norm()
        return None if norm is None else float(norm)


class DeepSpeed(Layout):
    """Lightning's ``DeepSpeedStrategy``, ZeRO stages 0-3: the engine accumulates, the callback drives it.

    DeepSpeed keeps the window's gradients in its engine (ZeRO-1/2/3 in partitioned buffers, no ``.grad``),
    reduces them at the boundary and steps, clips and skips fp16 overflows itself. The callback tells the
    engine at each micro-batch's start whether it ends the window, and weighs each loss in place so that
    Lightning's and the engine's divisions are undone and the window is normalized as one big batch
    (:mod:`~lightning_gradacc.engine_window`). ``max_grad_norm`` becomes the config's ``gradient_clipping``.
    """

    name = "DeepSpeed (ZeRO 0-3)"
    # the engine keeps, sums, clips and steps the window itself; its optimizer's step takes the LR factor;
    # a weighted window is read ahead and counted before its first backward (`parts.read_ahead`)
    provides: frozenset[str] = frozenset({"torch_step", "window_item_total"})
    strategy = "deepspeed_strategy"
    engine_accumulates = True

    def prepare(
        self,
        trainer: pl.Trainer,
        settings: AccumulationSettings,
        *,
        plan: WindowPlan,
        sharded_reduction: str,
        warn: Callable[[str], Any],
        chosen: frozenset[str] = frozenset(),
    ) -> None:
        """Put ``max_grad_norm`` into the engine's ``gradient_clipping`` (its refusals: :mod:`.needs`)."""
        config: dict[str, Any] = trainer.strategy.config  # type: ignore[attr-defined]
        if settings.max_grad_norm is not None:
            clip = float(settings.max_grad_norm)
            given = config.get("gradient_clipping")
            if trainer.gradient_clip_val or (given not in (None, 0, 0.0, clip)):
                raise RuntimeError(
                    f"`GradientAccumulationCallback(max_grad_norm={clip})` is DeepSpeed's"
                    f" `gradient_clipping`, but `gradient_clip_val={trainer.gradient_clip_val}` or the"
                    f" config's `gradient_clipping={given}` sets another: set one of them."
                )
            config["gradient_clipping"] = clip
        fp16 = str(trainer.precision).startswith("16")
        if "overflow" in chosen and settings.overflow == "skip" and not fp16:
            warn(
                "`overflow='skip'` takes effect under DeepSpeed only with fp16 (its loss scaler skips a step"
                " whose gradients overflow): in this precision DeepSpeed steps whatever the gradients hold."
                " Pass `overflow='ignore'` to say so."
            )

    def reduction(self, trainer: pl.Trainer, *, reduction: str, per_micro_batch: bool) -> WindowReduction:
        """The engine reduces at its boundary: nothing for the callback to switch."""
        return WindowReduction()

    def driver(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        settings: AccumulationSettings,
        *,
        scaler: Any,
        sync: WindowReduction,
        in_backward: bool,
    ) -> WindowDriver:
        """The engine's driver; an epoch of unknown length is refused (its last window's end is needed)."""
        if not math.isfinite(trainer.num_training_batches):
            raise RuntimeError(
                "`GradientAccumulationCallback` under `DeepSpeedStrategy` needs a train dataloader with a"
                " length: DeepSpeed must be told before a window's first backward how many micro-batches it"
                " holds, and an epoch of unknown length could end inside it."
            )
        engine = trainer.model
        return EngineWindow(
            _DeepSpeedEngine(engine),
            settings=settings,
            world_size=trainer.world_size,
            device=trainer.strategy.root_device,
            num_parameters=sum(  # ZeRO-3 partitions the parameters: `ds_numel` is the whole tensor's
                getattr(p, "ds_numel", p.numel())
                for p in trainer.lightning_module.parameters()
                if p.requires_grad
            ),
        )


# DeepSpeed's strategy is a DDP strategy: its layout is asked first
LAYOUTS: tuple[Layout, ...] = (DeepSpeed(), Layout(), DataParallel(), FullyShardedV1(), ModelParallel())


def layout_of(api: LightningNamespace, trainer: pl.Trainer) -> Layout:
    """The layout of the Trainer's strategy, its own refusals checked.

    Raises:
        RuntimeError: A strategy no layout accepts (or one accumulating itself whose engine no layout
            drives), or a configuration its layout refuses.
    """
    strategy = trainer.strategy
    for layout in LAYOUTS:
        if layout.accepts(api, strategy):
            if strategy.handles_gradient_accumulation and not layout.engine_accumulates:
                raise RuntimeError(
                    f"`{type(strategy).__name__}` performs gradient accumulation itself, and the callback"
                    " knows no engine of it to drive. Remove `GradientAccumulationCallback` and configure"
                    " accumulation there."
                )
            layout.refuse(trainer)
            return layout
    *others, last = [layout.name for layout in LAYOUTS]
    names = f"{', '.join(others)} and {last}"
    raise RuntimeError(
        f"`GradientAccumulationCallback` supports {names} strategies, but the Trainer uses"
        f" `{type(strategy).__name__}`, whose gradients it cannot normalize and clip yet. Use"
        " `strategy='ddp'`, `strategy='fsdp'` or `strategy='deepspeed_stage_2'`, or"
        " `ModelParallelStrategy(data_parallel_size=N,"
        " tensor_parallel_size=1)` with `fully_shard` in `configure_model`, or remove the callback."
    )
