"""The run compatibility checks of the callback: what ``trainer/configuration_validator.py`` is for Lightning.

Each function raises (a configuration the callback cannot accumulate exactly) or warns (one that works, but
not as its author may expect). The callback's hooks call them through one dispatcher, :func:`verify`, by the
phase whose facts they need (:data:`CHECKS`: ``setup`` for the Trainer, the module and the precision, train
start for the wrapped model and the optimizers). None imports Lightning: the classes come from the Trainer's
own namespace (``api``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from . import lightning_internals as internals
from .core.torch_internals import compiled_with_cuda_graphs, dynamo_context_uses_cuda_graphs
from .layouts import layout_of
from .namespaces import CALLBACK_IMPORTS, LightningNamespace, namespace_of
from .needs import refuse_unmet

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from .core.settings import AccumulationSettings
    from .reduction import WindowReduction

SCHEDULER_CONFLICT = (
    "You are using Lightning's `GradientAccumulationScheduler` and `GradientAccumulationCallback`. Remove the"
    " scheduler and pass its schedule as `GradientAccumulationCallback(accumulation_steps={epoch: K})`."
)


def _accumulates(largest_k: int | None) -> bool:
    """Whether a plan whose largest K is ``largest_k`` may accumulate (``None``: a target yet unresolved)."""
    return largest_k is None or largest_k > 1


# ---------------------------------------------------------------------------------------------- setup


def check_namespace(trainer: pl.Trainer, callback_namespace: str) -> None:
    """Refuse a Trainer of the other Lightning namespace, which would not treat the callback as one."""
    trainer_namespace = namespace_of(trainer)
    if trainer_namespace is not None and trainer_namespace != callback_namespace:
        raise RuntimeError(
            f"This `GradientAccumulationCallback` is for `{callback_namespace}`, but the Trainer is a"
            f" `{trainer_namespace}` Trainer: the two are separate class trees, so Lightning would run"
            f" the callback without treating it as one. Use `{CALLBACK_IMPORTS[trainer_namespace]}`."
        )


def check_automatic_optimization(pl_module: pl.LightningModule) -> None:
    """Refuse manual optimization: the callback works through Lightning's automatic loop."""
    if not pl_module.automatic_optimization:
        raise RuntimeError(
            "`GradientAccumulationCallback` works with automatic optimization only. With"
            " `automatic_optimization=False`, use `lightning_gradacc.GradAccumulator` in your"
            " `training_step` (it does the same math) and remove the callback."
        )


def check_strategy(api: LightningNamespace, trainer: pl.Trainer) -> None:
    """Refuse a strategy whose gradients the callback cannot normalize, clip and count (see ``layouts``).

    A strategy that accumulates itself (DeepSpeed), one no layout accepts, and what a layout refuses (FSDP
    without the original parameters, tensor parallelism).
    """
    layout_of(api, trainer)


def check_needs(api: LightningNamespace, trainer: pl.Trainer, callback: Any) -> None:
    """Refuse a setting that needs what the strategy's layout does not provide (:mod:`.needs`)."""
    refuse_unmet(callback, layout_of(api, trainer))


def check_callbacks(
    api: LightningNamespace, callbacks: Sequence[Any], callback: object, callback_type: type
) -> None:
    """Refuse Lightning's ``GradientAccumulationScheduler`` and a second accumulation callback.

    Args:
        api: The Trainer's namespace.
        callbacks: The Trainer's callbacks.
        callback: The callback checking.
        callback_type: The class every accumulation callback derives from (of either namespace).
    """
    for other in callbacks:
        if isinstance(other, api.gradient_accumulation_scheduler) or (
            type(other).__name__ == "GradientAccumulationScheduler"  # e.g. of the other namespace
        ):
            raise RuntimeError(SCHEDULER_CONFLICT)
        if isinstance(other, callback_type) and other is not callback:
            raise RuntimeError(
                "Two `GradientAccumulationCallback` instances were passed to the Trainer. Keep one."
            )


def check_training_step(
    api: LightningNamespace, pl_module: pl.LightningModule, largest_k: int | None, plan: str
) -> None:
    """Refuse ``training_step(dataloader_iter)`` when K may exceed 1: Lightning zeroes inside a window.

    Args:
        api: The Trainer's namespace.
        pl_module: The module trained.
        largest_k: The largest K of the fit (``None``: a target batch size not resolved yet).
        plan: How K is chosen, for the message.
    """
    if _accumulates(largest_k) and api.is_param_in_hook_signature(
        pl_module.training_step, "dataloader_iter", explicit=True
    ):
        raise RuntimeError(
            "`training_step(self, dataloader_iter)` cannot accumulate gradients: Lightning then zeroes"
            " them with a stale batch index, in the middle of a window (its built-in accumulation is"
            " wrong there too). Use a `training_step(self, batch, batch_idx)` or K=1"
            f" ({plan})."
        )


def warn_step_hooks_overridden(
    api: LightningNamespace, pl_module: pl.LightningModule, largest_k: int | None
) -> None:
    """Warn that an overridden ``optimizer_step`` or ``optimizer_zero_grad`` runs once per window."""
    if _accumulates(largest_k) and (
        api.is_overridden("optimizer_step", pl_module) or api.is_overridden("optimizer_zero_grad", pl_module)
    ):
        api.rank_zero_warn(
            "You override `LightningModule.optimizer_step` or `optimizer_zero_grad` and accumulate"
            " gradients: these hooks are called once per optimizer step, not on every batch. The"
            " callback normalizes the gradient in `on_before_optimizer_step`, which"
            " `optimizer.step(closure)` runs; an override that steps without the closure, or zeroes"
            " gradients elsewhere, breaks the window."
        )


def check_gradient_clip_val(
    api: LightningNamespace, trainer: pl.Trainer, settings: AccumulationSettings
) -> None:
    """Refuse ``gradient_clip_val`` by norm under FSDP; warn when it clips on top of the callback."""
    algorithm = trainer.gradient_clip_algorithm
    if (
        trainer.gradient_clip_val
        and not layout_of(api, trainer).lightning_clips_by_norm
        and str(getattr(algorithm, "value", algorithm) or "norm") == "norm"
    ):
        raise RuntimeError(
            f"`Trainer(gradient_clip_val={trainer.gradient_clip_val})` clips by norm, which Lightning's"
            " `FSDPStrategy` refuses at the first step (`FSDPPrecision.clip_grad_by_norm`). Remove it and"
            f" pass `GradientAccumulationCallback(max_grad_norm={trainer.gradient_clip_val})`: it clips"
            " the sharded gradients by their whole norm, once per optimizer step."
        )
    if trainer.gradient_clip_val and (settings.max_grad_norm is not None or settings.clip_value is not None):
        api.rank_zero_warn(
            f"Both `Trainer(gradient_clip_val={trainer.gradient_clip_val})` and the callback's clipping"
            f" (max_grad_norm={settings.max_grad_norm}, clip_value={settings.clip_value}) are"
            " set: the gradient is clipped twice. Remove `gradient_clip_val` from the Trainer."
        )


def check_cuda_graphs(
    trainer: pl.Trainer, pl_module: pl.LightningModule, largest_k: int | None, pieces: bool = False
) -> None:
    """Refuse accumulation on CUDA with a compile that captures CUDA graphs.

    Replaying a graph overwrites the gradients the last one returned (pytorch #169545, #181723), so
    ``.grad`` would not be the window's. On a CPU the same compile captures no graph (inductor skips it
    there) and runs exactly. Checked at ``setup`` and again at train start, after ``configure_model`` (where
    Lightning has a model compiled) on the model as the strategy wrapped it; batches in ``pieces`` run
    several backwards into ``.grad`` per step, as K > 1 does.
    """
    if not (_accumulates(largest_k) or pieces) or trainer.strategy.root_device.type != "cuda":
        return
    model = getattr(trainer, "model", None)
    model = model if isinstance(model, torch.nn.Module) else None
    found = compiled_with_cuda_graphs(pl_module) or (
        None if model is None else compiled_with_cuda_graphs(model)
    )
    context = internals.compiled_module_context(pl_module)
    if found is None and context is not None:
        reason = dynamo_context_uses_cuda_graphs(context)
        found = None if reason is None else f"the LightningModule ({reason})"
    if found is not None:
        raise RuntimeError(
            f"{found} is compiled to capture CUDA graphs, which corrupt accumulated gradients: each replay"
            " overwrites the gradients the previous one returned (pytorch #169545). Accumulating K > 1"
            " micro-batches needs `torch.compile(mode='default')` or `mode='max-autotune-no-cudagraphs'`."
        )


def check_driven_precision(trainer: pl.Trainer, keyed_by_count: bool) -> None:
    """Refuse a schedule keyed by steps or items under ``precision="16-true"``.

    Such a schedule sets a K per window of up to the batches of an epoch (a divisor of the batch count where
    the window ends), and Lightning divides each loss by it: an fp16 loss divided by thousands falls into
    fp16's subnormal range and loses its digits. bf16 keeps fp32's
    range (the division rounds as Lightning's own by a K that is not a power of two does).
    """
    if keyed_by_count and str(trainer.precision) == "16-true":
        raise RuntimeError(
            "A K chosen window by window (a schedule keyed by steps or items, `items_per_step`, 'auto')"
            " cannot be exact under `precision='16-true'`: Lightning divides each fp16 loss by a per-window"
            " K of up to the batches of an epoch, which can underflow fp16. Use `precision='16-mixed'` or"
            " `'bf16-true'`, or a K per epoch."
        )


def check_grad_scaler(api: LightningNamespace, scaler: torch.amp.GradScaler | None, overflow: str) -> None:
    """Under a GradScaler, refuse ``overflow='skip_micro_batch'`` and warn that other policies do nothing."""
    if scaler is not None and overflow == "skip_micro_batch":
        raise RuntimeError(
            "`overflow='skip_micro_batch'` cannot be used with a GradScaler (`precision='16-mixed'`): the"
            " scaler must see every overflow to lower its scale. Use `overflow='skip'` (the scaler skips"
            " the window) or bf16."
        )
    if scaler is not None and overflow != "skip":
        api.rank_zero_warn(
            f"`overflow={overflow!r}` cannot take effect under a GradScaler"
            " (`precision='16-mixed'`): the scaler skips steps with non-finite gradients and lowers its"
            " scale; those overflows are counted in `non_finite_windows` and `skipped_steps`."
        )


# -------------------------------------------------------------------------------------- train start


def check_optimizers(
    trainer: pl.Trainer, largest_k: int | None, plan: str, stepping_batches: Callable[[Any], int | float]
) -> None:
    """Refuse LBFGS when accumulating, and a ``OneCycleLR`` built for fewer steps than the fit takes.

    Args:
        trainer: The Trainer, its optimizers and schedulers configured.
        largest_k: The largest K of the fit.
        plan: How K is chosen, for the messages.
        stepping_batches: The number of optimizer steps of the fit (``trainer -> steps``): the most it can
            take where K is chosen while training.
    """
    if (largest_k or 1) > 1 and any(
        isinstance(optimizer, torch.optim.LBFGS) for optimizer in trainer.optimizers
    ):
        raise RuntimeError(
            "`torch.optim.LBFGS` evaluates its closure several times per step, and each evaluation"
            " recomputes only the last micro-batch, so gradients cannot be accumulated over micro-batches"
            f" ({plan}). Use K=1 with LBFGS."
        )
    if trainer.global_step:  # a resumed scheduler carries the total it was built with
        return
    for config in trainer.lr_scheduler_configs:
        scheduler = config.scheduler
        if config.interval != "step" or not isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR):
            continue
        needed = stepping_batches(trainer)
        if needed != float("inf") and needed // config.frequency > scheduler.total_steps:
            raise RuntimeError(
                f"`OneCycleLR(total_steps={scheduler.total_steps})` would fail at step"
                f" {scheduler.total_steps + 1}: this fit takes up to {int(needed)} optimizer steps with"
                f" {plan}, and `trainer.estimated_stepping_batches` does not follow an"
                " epoch schedule. Build it with `total_steps=estimated_stepping_batches(self.trainer)`"
                " (`from lightning_gradacc import estimated_stepping_batches`; with"
                " `accumulation_steps='auto'`: `most=True`, or a schedule over `items_consumed`)."
            )


def check_sharded_reduction(
    api: LightningNamespace,
    sync: WindowReduction,
    reduction: str,
    settings: AccumulationSettings,
    per_micro_batch: bool,
) -> None:
    """Refuse per-micro-batch modes and buffers when FSDP defers its reduction; warn when nothing defers.

    Args:
        api: The Trainer's namespace.
        sync: When FSDP reduces, as built for the wrapped model.
        reduction: The callback's ``sharded_reduction``.
        settings: The callback's settings.
        per_micro_batch: Whether a mode checks each micro-batch's gradient (``overflow='skip_micro_batch'``
            or ``clip_mode='micro_batch'``).
    """
    if sync.defers and per_micro_batch:
        raise RuntimeError(
            "`overflow='skip_micro_batch'` and `clip_mode='micro_batch'` check each micro-batch's reduced"
            f" gradient, but with `sharded_reduction={reduction!r}` FSDP holds it unsynced"
            " until the window's last backward. Use `sharded_reduction='every_micro_batch'`."
        )
    if sync.defers and settings.accumulation_dtype is not None:
        raise RuntimeError(
            f"`accumulation_dtype={settings.accumulation_dtype}` cannot take effect with"
            f" `sharded_reduction={reduction!r}`: FSDP then accumulates the window's"
            " gradients inside itself and `.grad` receives the window only at its last backward, so the"
            " buffers would never see a micro-batch. Use `sharded_reduction='every_micro_batch'` with"
            " buffers, or (FSDP2) accumulate in float32 inside FSDP with"
            " `fully_shard(..., mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))`."
        )
    if reduction != "every_micro_batch" and not sync.defers:
        if sync.sharded:  # "replicas_at_window_end" on FSDP2 without a replicate dimension
            reason = (
                "no module is sharded over an HSDP mesh (a replicate and a shard dimension), so there is"
                " no all-reduce across replicas to defer. Use 'window_end' to defer the reduce-scatter."
            )
        else:
            reason = "no module is sharded by FSDP (DDP already reduces once per window)."
        api.rank_zero_warn(f"`sharded_reduction={reduction!r}` has no effect: {reason}")


def check_window_can_end(sync: WindowReduction, reduction: str) -> None:
    """Refuse to end a window whose last batch ran no backward while FSDP defers its reduction to it."""
    if sync.defers:
        raise RuntimeError(
            f"With `sharded_reduction={reduction!r}` the window's gradients are reduced by"
            " its last backward, but the batch that ends this window ran none (`training_step` returned"
            " None): the window cannot be completed. Use `sharded_reduction='every_micro_batch'` with"
            " such data."
        )


def warn_step_schedulers_under_budget(api: LightningNamespace, trainer: pl.Trainer, policy: Any) -> None:
    """Warn where an item budget closes the windows and an LR scheduler steps by optimizer steps.

    The steps then follow the data: a schedule built for a number of steps reaches its end early or late
    (``estimated_stepping_batches(trainer, most=True)`` is only a bound where items are tokens).
    """
    if policy.budget is None:
        return
    stepped = [type(c.scheduler).__name__ for c in trainer.lr_scheduler_configs if c.interval == "step"]
    if stepped:
        api.rank_zero_warn(
            f"`{policy.describe()}` closes each optimizer step on its items, so the number of steps follows"
            f" the data, but {', '.join(stepped)} steps with `interval='step'`: its schedule runs by steps of"
            " different sizes. Schedule the learning rate by the items consumed"
            " (`lr_schedule=TokenSchedule(...)`), or size it with `estimated_stepping_batches(trainer)`"
            " (`most=True` where the items are tokens)."
        )


def warn_ddp_comm_hook(api: LightningNamespace, strategy: Any) -> None:
    """Warn that a DDP communication hook does not run while DDP's sync is off for the fit."""
    if internals.ddp_comm_hook(strategy) is not None:
        api.rank_zero_warn(
            "`DDPStrategy(ddp_comm_hook=...)` does not run with `clip_mode='micro_batch'` or"
            " `overflow='skip_micro_batch'`: no backward syncs through DDP there (each micro-batch"
            " must be checked on its own first); the window is averaged over the ranks with one"
            " plain all-reduce of the accumulation buffers at its end."
        )


def warn_noise_scale_unmeasurable(
    api: LightningNamespace, settings: AccumulationSettings, largest_k: int | None, world_size: int
) -> None:
    """Warn that ``noise_scale=True`` measures nothing when no window can hold 2 micro-batches.

    Args:
        api: The Trainer's namespace.
        settings: The callback's settings.
        largest_k: The largest K of the fit (``None``: a target batch size not resolved yet).
        world_size: The ranks.
    """
    if settings.noise_scale and (largest_k or 1) * world_size < 2:
        api.rank_zero_warn(
            f"`noise_scale=True` needs at least 2 micro-batches per window, but K={largest_k or 1} on"
            f" {world_size} rank(s) gives 1: no estimate is made."
        )


def grads_read_before_step(
    api: LightningNamespace, trainer: pl.Trainer, pl_module: pl.LightningModule, callback: object
) -> bool:
    """Whether anything may read ``.grad`` between ``callback``'s ``on_before_optimizer_step`` and the step.

    The module's ``on_before_optimizer_step`` (e.g. ``grad_norm`` logging), another callback's, and
    Lightning's clipping (``gradient_clip_val``, ``configure_gradient_clipping``) run after the callback's
    hook: they must see the final gradient, so a fused step is then not handed the window's multiplier.
    """
    hooks = ("on_before_optimizer_step", "configure_gradient_clipping")
    if trainer.gradient_clip_val or any(api.is_overridden(hook, pl_module) for hook in hooks):
        return True
    base = getattr(api.callback, "on_before_optimizer_step")  # noqa: B009 (a class held as `type`)
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    return any(type(cb).on_before_optimizer_step is not base for cb in callbacks if cb is not callback)


# ------------------------------------------------------------------------------------------ the dispatcher

Phase = Literal["configuration", "setup", "reduction", "train_start", "window_end"]


@dataclass(frozen=True)
class RunFacts:
    """What the run checks read: the Trainer, its module and the callback (its plan, settings and state).

    Attributes:
        api: The Trainer's namespace.
        trainer: The Trainer.
        pl_module: The module trained.
        callback: The callback checking (its plan, settings and ``sharded_reduction``).
        callback_type: The class every accumulation callback derives from (of either namespace).
        scaler: The fit's GradScaler (``None``: none, or not read yet).
        reduction: When the ranks reduce the window (set at train start).
    """

    api: LightningNamespace
    trainer: Any
    pl_module: Any
    callback: Any
    callback_type: type
    scaler: torch.amp.GradScaler | None
    reduction: WindowReduction


def _largest_k(facts: RunFacts) -> int | None:
    return facts.callback.plan.largest_k()  # type: ignore[no-any-return]


# Every check, by the phase of the fit whose facts it needs, in the order it runs (as Lightning's
# `configuration_validator.py` calls its `__verify_*` functions from one place):
# - configuration: at `setup`, before anything is built (the module, the strategy, the other callbacks);
# - setup: at `setup`, the plan started (K known) and the GradScaler read;
# - reduction: at train start, FSDP's reduction read from the wrapped model, before the accumulator is built;
# - train_start: the accumulator built (the optimizers, DDP's communication hook);
# - window_end: a window ends on a batch that ran no backward.
CHECKS: dict[Phase, tuple[Callable[[RunFacts], None], ...]] = {
    "configuration": (
        lambda f: check_automatic_optimization(f.pl_module),
        lambda f: check_strategy(f.api, f.trainer),
        lambda f: check_needs(f.api, f.trainer, f.callback),
        lambda f: check_callbacks(f.api, f.trainer.callbacks, f.callback, f.callback_type),
    ),
    "setup": (
        lambda f: check_training_step(f.api, f.pl_module, _largest_k(f), f.callback.plan.describe()),
        lambda f: warn_step_hooks_overridden(f.api, f.pl_module, _largest_k(f)),
        lambda f: check_gradient_clip_val(f.api, f.trainer, f.callback.settings),
        lambda f: check_grad_scaler(f.api, f.scaler, f.callback.settings.overflow),
        lambda f: check_driven_precision(f.trainer, f.callback.plan.run.per_window),
        lambda f: check_cuda_graphs(f.trainer, f.pl_module, _largest_k(f), f.callback.piece_size is not None),
    ),
    "reduction": (
        lambda f: check_sharded_reduction(
            f.api,
            f.reduction,
            f.callback.sharded_reduction,
            f.callback.settings,
            f.callback.settings.per_micro_batch,
        ),
        lambda f: warn_noise_scale_unmeasurable(
            f.api, f.callback.settings, _largest_k(f), f.trainer.world_size
        ),
    ),
    "train_start": (
        lambda f: check_optimizers(
            f.trainer,
            _largest_k(f),
            f.callback.plan.describe(),
            lambda trainer: f.callback.estimated_stepping_batches(trainer, most=True),
        ),
        lambda f: warn_step_schedulers_under_budget(f.api, f.trainer, f.callback.plan.policy),
        lambda f: warn_ddp_comm_hook(f.api, f.trainer.strategy) if f.reduction.core_reduces else None,
        lambda f: check_cuda_graphs(f.trainer, f.pl_module, _largest_k(f), f.callback.piece_size is not None),
    ),
    "window_end": (lambda f: check_window_can_end(f.reduction, f.callback.sharded_reduction),),
}


def verify(phase: Phase, facts: RunFacts) -> None:
    """Run every check of ``phase`` (:data:`CHECKS`), in order: the one place the callback's hooks check from.

    Raises:
        RuntimeError: A check refused the run (each names what to change).
    """
    for check in CHECKS[phase]:
        check(facts)
