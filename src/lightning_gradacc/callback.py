"""GradientAccumulationCallback: the Lightning shell around :class:`~lightning_gradacc.core.GradAccumulator`.

It decides *when* (which hook, which micro-batch, which rank); the core computes *what*. See
``ARCHITECTURE.md`` section 3 for the Lightning internals relied on here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, GradientAccumulationScheduler
from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy
from pytorch_lightning.utilities import rank_zero_warn
from pytorch_lightning.utilities.data import extract_batch_size
from torch import Tensor
from typing_extensions import override

from .core import GradAccumulator
from .core.validation import AccumulationSettings, check_item_count
from .schedule import AccumulationPlan
from .stats import AccumulationStats

_STATE_VERSION = 2  # 2: adds the open window; 1 (counters only) still loads
# Logged tag (under "grad_accum/") of each statistic; per-step quantities read better without "last".
LOGGED_NAMES = {
    "accumulation_steps": "accumulation_steps",
    "optimizer_steps": "optimizer_steps",
    "total_micro_batches": "total_micro_batches",
    "skipped_steps": "skipped_steps",
    "overflow_count": "overflow_count",
    "clip_count": "clip_count",
    "last_grad_norm": "grad_norm",
    "max_grad_norm_seen": "max_grad_norm_seen",
    "items_last_step": "items_per_step",
    "micro_batches_last_step": "micro_batches_per_step",
    "num_parameters": "num_parameters",
    "buffer_bytes": "buffer_bytes",
    "peak_memory_bytes": "peak_memory_bytes",
}
# Returns int | Tensor. Annotated Any: jsonargparse rejects a function returning just `int` for a union.
ItemCountFn = Callable[[Any], Any]


def _inferred_batch_size(batch: Any) -> int:
    """The batch size Lightning infers: the length of the first tensor.

    A fast path covers ``(inputs, targets)``, tensor and dict batches; Lightning's general walk (the fallback)
    costs about 10 µs per micro-batch.
    """
    first = batch
    if isinstance(batch, (list, tuple)) and batch:
        first = batch[0]
    elif isinstance(batch, dict) and batch:
        first = next(iter(batch.values()))
    if isinstance(first, Tensor) and first.dim() > 0:
        return len(first)
    return extract_batch_size(batch)


def _should_accumulate(trainer: pl.Trainer) -> bool:
    """Whether the current micro-batch does not end a window (Lightning's own, private, test)."""
    return bool(trainer.fit_loop._should_accumulate())


class GradientAccumulationCallback(Callback):
    """Exact, observable gradient accumulation for automatic optimization.

    It owns ``Trainer.accumulate_grad_batches`` and fixes what the built-in gets wrong: the last, partial
    window of an epoch is divided by the micro-batches actually run (the built-in divides by K), and
    ``scaling="weighted"`` weights each micro-batch by its items (e.g. non-padding tokens) across
    micro-batches and ranks. It also detects non-finite gradients once per step, clips the final gradient
    once, and logs what happened in each window under ``grad_accum/``.

    Args:
        accumulation_steps: K; or ``{epoch: K}`` (as Lightning's ``GradientAccumulationScheduler``);
            ``None`` adopts ``Trainer(accumulate_grad_batches=...)``.
        target_batch_size: Items per optimizer step over all ranks; K = ceil(target / (micro-batch size x
            world size)), resolved when training starts. Exclusive with ``accumulation_steps``.
        scaling: ``"mean"`` (alias ``"average"``), ``"sum"`` or ``"weighted"`` (alias ``"dynamic"``).
        item_count_fn: ``batch -> int | Tensor``: items in a micro-batch for ``"weighted"`` (default: the
            batch size Lightning infers). A device tensor is fine (no sync).
        max_grad_norm: Clip the total gradient norm to this value once per optimizer step.
        norm_type: Order of the norm (any ``p > 0``, or ``inf``).
        clip_value: Clamp each gradient element to ``[-clip_value, clip_value]`` once per step.
        overflow: Non-finite gradient policy: ``"skip"`` the step, ``"raise"``
            :class:`~lightning_gradacc.GradientOverflowError`, ``"ignore"`` (count only), or
            ``"skip_micro_batch"``: drop only the micro-batch whose gradient is not finite (needs
            ``accumulation_dtype``). Under a ``GradScaler`` (``precision="16-mixed"``) the scaler skips
            such steps itself; they are counted.
        log_stats: Log the statistics under ``grad_accum/`` at every optimizer step (respecting
            ``log_every_n_steps``) to the Trainer's loggers.
        accumulation_dtype: Accumulate in buffers of this dtype, e.g. ``"float32"`` with
            ``precision="bf16-true"``, instead of in the parameters' dtype.
        clip_mode: ``"step"`` clips the final gradient; ``"micro_batch"`` clips each micro-batch's own
            gradient to ``max_grad_norm`` before it is added (needs ``accumulation_dtype``).

    Attributes:
        plan: How K is chosen (:class:`~lightning_gradacc.schedule.AccumulationPlan`).
        settings: The checked math settings, shared with the core accumulator.
        item_count_fn: The item counter, or ``None``.
        log_stats: Whether statistics are logged.

    Example:
        >>> from pytorch_lightning import Trainer
        >>> callback = GradientAccumulationCallback(4, max_grad_norm=1.0)
        >>> trainer = Trainer(callbacks=[callback], logger=False, enable_progress_bar=False,
        ...                   enable_model_summary=False, enable_checkpointing=False)
        >>> callback.stats.accumulation_steps
        4
    """

    def __init__(
        self,
        accumulation_steps: int | dict[int, int] | None = None,
        *,
        target_batch_size: int | None = None,
        scaling: Literal["mean", "sum", "weighted", "average", "dynamic"] = "mean",
        item_count_fn: ItemCountFn | None = None,
        max_grad_norm: float | None = None,
        norm_type: float = 2.0,
        clip_value: float | None = None,
        overflow: Literal["skip", "raise", "ignore", "skip_micro_batch"] = "skip",
        log_stats: bool = True,
        accumulation_dtype: str | None = None,
        clip_mode: Literal["step", "micro_batch"] = "step",
    ) -> None:
        self.plan = AccumulationPlan(accumulation_steps, target_batch_size)
        self.settings = AccumulationSettings.checked(
            scaling=scaling,
            max_grad_norm=max_grad_norm,
            norm_type=norm_type,
            clip_value=clip_value,
            overflow=overflow,
            accumulation_dtype=accumulation_dtype,
            clip_mode=clip_mode,
        )
        if item_count_fn is not None:
            if not callable(item_count_fn):
                raise TypeError(
                    f"Expected argument `item_count_fn` to be callable (batch -> int),"
                    f" but got {item_count_fn!r}."
                )
            if self.settings.scaling != "weighted":
                raise ValueError(
                    f"Argument `item_count_fn` is only used with `scaling='weighted'`, but got"
                    f" scaling={scaling!r}. Set `scaling='weighted'` or remove `item_count_fn`."
                )
        self.item_count_fn = item_count_fn
        if not isinstance(log_stats, bool):
            raise TypeError(f"Expected argument `log_stats` to be a bool, but got {log_stats!r}.")
        self.log_stats = log_stats

        self._accumulator: GradAccumulator | None = None
        self._loaded_state: dict[str, Any] | None = None
        self._loaded_window: dict[str, Any] | None = None
        self._applied_k: int | None = None  # the value this callback last wrote to the Trainer
        self._scaler: torch.amp.GradScaler | None = None
        self._pending_items: int | Tensor | None = None
        self._pending_loss: Tensor | None = None
        self._stepped = False
        self._stashed_clip_val: float | int | None = None
        self._skips_warned = 0
        self._warned_no_items = False

    # ------------------------------------------------------------------------------------ reporting

    @property
    def stats(self) -> AccumulationStats:
        """A frozen snapshot of the statistics (see :class:`~lightning_gradacc.AccumulationStats`)."""
        if self._accumulator is not None:
            return self._accumulator.stats
        return AccumulationStats(accumulation_steps=self._applied_k or self.plan.for_epoch(0) or 1)

    @property
    def accumulator(self) -> GradAccumulator | None:
        """The core accumulator of the current run (``None`` before training starts)."""
        return self._accumulator

    # ------------------------------------------------------------------------------------- set-up

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._check_compatibility(trainer, pl_module)
        trainer_k = trainer.accumulate_grad_batches
        if not self.plan.configured:
            self.plan.fixed = trainer_k  # adopt the Trainer's value
        elif trainer_k not in (1, self._applied_k, self.plan.fixed):
            raise ValueError(
                f"You have set `Trainer(accumulate_grad_batches={trainer_k})` and"
                f" `GradientAccumulationCallback({self._describe_plan()})`. The callback owns the"
                " accumulation factor: remove `accumulate_grad_batches` from the Trainer or set the same"
                " value."
            )
        self._apply_k(trainer, self.plan.for_epoch(trainer.current_epoch))
        if trainer.gradient_clip_val and (
            self.settings.max_grad_norm is not None or self.settings.clip_value is not None
        ):
            rank_zero_warn(
                f"Both `Trainer(gradient_clip_val={trainer.gradient_clip_val})` and the callback's clipping"
                f" (max_grad_norm={self.settings.max_grad_norm}, clip_value={self.settings.clip_value}) are"
                " set: the gradient is clipped twice. Remove `gradient_clip_val` from the Trainer."
            )
        self._scaler = getattr(trainer.precision_plugin, "scaler", None)
        if self._scaler is not None and self.settings.overflow == "skip_micro_batch":
            raise RuntimeError(
                "`overflow='skip_micro_batch'` cannot be used with a GradScaler (`precision='16-mixed'`): the"
                " scaler must see every overflow to lower its scale. Use `overflow='skip'` (the scaler skips"
                " the window) or bf16."
            )
        if self._scaler is not None and self.settings.overflow != "skip":
            rank_zero_warn(
                f"`overflow={self.settings.overflow!r}` cannot take effect under a GradScaler"
                " (`precision='16-mixed'`): the scaler skips steps with non-finite gradients and lowers its"
                " scale; those overflows are counted in `overflow_count` and `skipped_steps`."
            )

    def _describe_plan(self) -> str:
        if self.plan.target_batch_size is not None:
            return f"target_batch_size={self.plan.target_batch_size}"
        return f"accumulation_steps={self.plan.schedule or self.plan.fixed}"

    def _check_compatibility(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise RuntimeError(
                "`GradientAccumulationCallback` works with automatic optimization only. With"
                " `automatic_optimization=False`, use `lightning_gradacc.GradAccumulator` in your"
                " `training_step` (it does the same math) and remove the callback."
            )
        strategy = trainer.strategy
        if strategy.handles_gradient_accumulation or "deepspeed" in type(strategy).__name__.lower():
            raise RuntimeError(
                f"`{type(strategy).__name__}` performs gradient accumulation itself (its config's"
                " `gradient_accumulation_steps`). Remove `GradientAccumulationCallback` and configure"
                " accumulation there."
            )
        if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
            raise RuntimeError(
                f"`GradientAccumulationCallback` supports single-device and DDP strategies, but the Trainer"
                f" uses `{type(strategy).__name__}`, whose sharded gradients would give wrong norms and"
                " scaling. Use `strategy='ddp'` or remove the callback."
            )
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, GradientAccumulationScheduler) or (
                type(callback).__name__ == "GradientAccumulationScheduler"
            ):
                raise RuntimeError(
                    "You are using Lightning's `GradientAccumulationScheduler` and"
                    " `GradientAccumulationCallback`. Remove the scheduler and pass its schedule as"
                    " `GradientAccumulationCallback(accumulation_steps={epoch: K})`."
                )
            if isinstance(callback, GradientAccumulationCallback) and callback is not self:
                raise RuntimeError(
                    "Two `GradientAccumulationCallback` instances were passed to the Trainer. Keep one."
                )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.plan.target_batch_size is not None and self.plan.target_k is None:
            self._resolve_target(trainer)
        self._apply_k(trainer, self.plan.for_epoch(trainer.current_epoch))
        self._build_accumulator(trainer, pl_module)

    def _resolve_target(self, trainer: pl.Trainer) -> None:
        loader = trainer.train_dataloader
        batch_size = getattr(loader, "batch_size", None) or getattr(
            getattr(loader, "batch_sampler", None), "batch_size", None
        )
        if not isinstance(batch_size, int) or batch_size < 1:
            raise RuntimeError(
                f"`target_batch_size={self.plan.target_batch_size}` needs the micro-batch size, but the train"
                f" dataloader ({type(loader).__name__}) has no fixed `batch_size`. Use a single DataLoader"
                " with `batch_size=...` or set `accumulation_steps` instead."
            )
        k, effective = self.plan.resolve_target(batch_size, trainer.world_size)
        if effective != self.plan.target_batch_size:
            rank_zero_warn(
                f"`target_batch_size={self.plan.target_batch_size}` is not a multiple of micro-batch size"
                f" {batch_size} x {trainer.world_size} rank(s); using K={k}, an effective batch size of"
                f" {effective}."
            )

    def _build_accumulator(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        k = trainer.accumulate_grad_batches
        world_size = trainer.world_size
        strategy = trainer.strategy

        def all_reduce_sum(tensor: Tensor) -> Tensor:
            reduced: Tensor = strategy.reduce(tensor, reduce_op="sum")
            return reduced

        previous = self._accumulator
        accumulator = GradAccumulator(
            pl_module.named_parameters(),
            k,
            world_size=world_size,
            all_reduce=all_reduce_sum if world_size > 1 else None,
            **vars(self.settings),
        )
        # Lifetime counters survive a second `fit()` and a resume from a checkpoint.
        state = (
            self._loaded_state
            if self._loaded_state is not None
            else (previous.state_dict() if previous is not None else None)
        )
        if state is not None:
            accumulator.load_state_dict(state)
            accumulator.accumulation_steps = k
        self._restore_window(trainer, accumulator)  # validates everything before it changes anything
        self._loaded_state = None
        self._accumulator = accumulator

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply_k(trainer, self.plan.for_epoch(trainer.current_epoch))

    def _apply_k(self, trainer: pl.Trainer, k: int | None) -> None:
        if k is None:  # target batch size not resolved yet: resolved in `on_train_start`
            return
        trainer.accumulate_grad_batches = k
        self._applied_k = k
        if self._accumulator is not None:
            self._accumulator.accumulation_steps = k  # raises if a window were open

    # --------------------------------------------------------------------------------- per micro-batch

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._stepped = False
        if self.item_count_fn is not None:
            self._pending_items = check_item_count(
                self.item_count_fn(batch), f"the result of `item_count_fn` at batch {batch_idx}"
            )
            return
        try:
            self._pending_items = _inferred_batch_size(batch)
        except Exception as error:
            if self.settings.scaling == "weighted":
                raise RuntimeError(
                    f"`scaling='weighted'` needs the item count of every batch, but Lightning could not infer"
                    f" the batch size of batch {batch_idx}. Pass `item_count_fn=`."
                ) from error
            if not self._warned_no_items:
                self._warned_no_items = True
                rank_zero_warn(
                    f"Could not infer the batch size of batch {batch_idx} ({error}); the `items_per_step`"
                    " statistic will not count such batches. Scaling is unaffected."
                )
            self._pending_items = None

    def _amp_scale(self) -> Tensor | None:
        # The GradScaler's scale as a device tensor: `get_scale()` would sync with the host.
        scale = getattr(self._scaler, "_scale", None) if self._scaler is not None else None
        return scale if isinstance(scale, Tensor) else None

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        assert self._accumulator is not None
        # `loss` is the tensor that is back-propagated: Lightning's L / K, times the AMP scale under 16-mixed.
        # It is kept as is (finalize's loss_scale undoes K and the scale once per window); only a loss about
        # to be weighted in place needs a copy.
        self._pending_loss = loss.detach().clone() if self.settings.scaling == "weighted" else loss.detach()
        if self.settings.scaling == "weighted" and self._pending_items is not None:
            weight = self._pending_items
            loss.mul_(weight.to(loss.device, non_blocking=True) if isinstance(weight, Tensor) else weight)
        if (trainer.world_size > 1 or self._scaler is not None) and not _should_accumulate(trainer):
            # Buffers go back into .grad before the last backward of the window, so that DDP's one
            # all-reduce carries the whole window and the GradScaler unscales and checks all of it.
            self._accumulator.flush_to_grad()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._accumulator is not None
        grad_scale: float | Tensor = 1.0
        if (
            self.settings.clip_mode == "micro_batch"
        ):  # the factor between each micro-batch's gradient and .grad
            scale = self._amp_scale()
            grad_scale = 1.0 / trainer.accumulate_grad_batches
            grad_scale = grad_scale * scale if scale is not None else grad_scale
        self._accumulator.record(self._pending_items, self._pending_loss, grad_scale=grad_scale)
        self._pending_loss = None

    # ---------------------------------------------------------------------------------------- boundary

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        assert self._accumulator is not None
        self._stepped = True
        k = trainer.accumulate_grad_batches
        scale = self._amp_scale()
        stepped = self._accumulator.finalize(
            grad_scale=1.0 / k,
            overflow_handled_externally=self._scaler is not None,
            loss_scale=k / scale if scale is not None else k,
        )
        if stepped:
            return
        self._warn_skip(trainer)
        # Lightning clips after this hook; clipping by value crashes on a list with no gradient at all.
        if trainer.gradient_clip_val:
            self._stashed_clip_val = trainer.gradient_clip_val
            trainer.gradient_clip_val = None

    def _warn_skip(self, trainer: pl.Trainer) -> None:
        skipped = self._accumulator.stats.skipped_steps if self._accumulator is not None else 0
        if skipped >= 2 * self._skips_warned or skipped == 1:  # 1, 2, 4, 8, ...: rate-limited
            self._skips_warned = max(skipped, 1)
            rank_zero_warn(
                f"Non-finite gradient at global step {trainer.global_step}: the optimizer step was skipped"
                f" ({skipped} skipped so far). Parameters and optimizer state are unchanged; `global_step`"
                " and step-interval LR schedulers still advance."
            )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._stepped:
            return
        self._restore_clip_val(trainer)
        if self.log_stats and trainer.loggers and trainer._logger_connector.should_update_logs:
            pl_module.log_dict(self.metrics(), on_step=True, on_epoch=False, batch_size=1)

    def metrics(self) -> dict[str, float]:
        """The logged scalars: the statistics but ``current_step`` (``LOGGED_NAMES``), and ``window_loss``."""
        if self._accumulator is None:
            return {}
        stats = self._accumulator.stats.as_dict()
        logged = {f"grad_accum/{tag}": float(stats[name]) for name, tag in LOGGED_NAMES.items()}
        logged["grad_accum/window_loss"] = self._accumulator.window_loss
        return logged

    def _restore_clip_val(self, trainer: pl.Trainer) -> None:
        if self._stashed_clip_val is not None:
            trainer.gradient_clip_val = self._stashed_clip_val
            self._stashed_clip_val = None

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._restore_clip_val(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._accumulator is not None and self._accumulator.current_step:
            rank_zero_warn(
                f"Training ended inside a window: {self._accumulator.current_step} micro-batch(es) were"
                " back-propagated but never stepped; their gradients are discarded."
            )
            self._accumulator.reset(set_grads_to_none=False)

    # ------------------------------------------------------------------------------------- checkpoint

    @override
    def state_dict(self) -> dict[str, Any]:
        """Counters and the open window, if any (plain tensors and numbers: ``weights_only=True`` loads it).

        Under DDP this sums the open window over ranks (every rank takes part, as in every Lightning save).
        """
        accumulator = self._accumulator
        window = accumulator.window_state_dict() if accumulator is not None else None
        if window is not None:
            window["accumulate_grad_batches"] = self._applied_k
            window["amp_scale"] = float(self._scaler.get_scale()) if self._scaler is not None else None
        return {
            "version": _STATE_VERSION,
            "accumulator": accumulator.state_dict() if accumulator is not None else None,
            "window": window,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") not in (1, _STATE_VERSION):
            raise ValueError(
                f"Cannot load `GradientAccumulationCallback` state of version {state_dict.get('version')!r};"
                f" this version reads 1 and {_STATE_VERSION}."
            )
        self._loaded_state = state_dict.get("accumulator")
        self._loaded_window = state_dict.get("window")

    def _restore_window(self, trainer: pl.Trainer, accumulator: GradAccumulator) -> None:
        """Re-open the window a mid-window checkpoint saved (on rank 0; other ranks start from zero)."""
        window, self._loaded_window = self._loaded_window, None
        if window is None:
            return
        # The saved sum was made with loss / K_saved (times the AMP scale then): bring it to today's units.
        rescale = window.get("accumulate_grad_batches") or trainer.accumulate_grad_batches
        rescale /= trainer.accumulate_grad_batches
        if self._scaler is not None and window.get("amp_scale"):
            rescale *= float(self._scaler.get_scale()) / window["amp_scale"]
        accumulator.load_window_state_dict(window, primary=trainer.global_rank == 0, rescale=rescale)
