"""GradientAccumulationCallback: the Lightning shell around :class:`~lightning_gradacc.core.GradAccumulator`.

It decides *when* (which hook, which micro-batch, which rank); the core computes *what*. The hooks hand
the rest on: the run checks to :mod:`~lightning_gradacc.compatibility`, K to
:mod:`~lightning_gradacc.window_plan`, item counts to :mod:`~lightning_gradacc.counters`, which backward
reduces over the ranks to :mod:`~lightning_gradacc.reduction`, the checkpoint entry to
:mod:`~lightning_gradacc.fit_accumulator`, what is logged to :mod:`~lightning_gradacc.reporting`, and every
private attribute of Lightning to :mod:`~lightning_gradacc.lightning_internals`. What the callback knows of
the current micro-batch is one :class:`_Batch`.

The logic (:class:`GradientAccumulationLogic`) depends on neither Lightning namespace: it takes the classes
it checks against from the Trainer's own namespace (:mod:`lightning_gradacc.namespaces`). This module's
``GradientAccumulationCallback`` is the ``pytorch_lightning`` callback; ``lightning_gradacc.lightning``
has the one for ``lightning.pytorch``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import pytorch_lightning as pl
import torch
from torch import Tensor
from typing_extensions import override

from . import compatibility as compat
from . import lightning_internals as internals
from .batch_pieces import SplitFn, check_split_fn
from .core import AccumulationStats, GradAccumulator
from .core.settings import SETTINGS, AccumulationSettings, with_setting_docs
from .core.torch_internals import disarm
from .core.versions import LIGHTNING_FLOOR, require
from .counters import check_item_count_fn, count_micro_batch
from .engine_window import EngineWindow
from .fit_accumulator import ParameterGroups, SavedState, build_accumulator
from .k_policies import AutoSettings, make_policy
from .layouts import Layout, layout_of
from .lr_schedule import TokenSchedule, make_schedule
from .namespaces import PYTORCH_LIGHTNING, LightningNamespace, namespace
from .piece_runner import PieceRunner, check_piece_size
from .reduction import WindowReduction, check_reduction
from .reporting import LOGGED_STATISTICS as LOGGED_STATISTICS  # importable from here too
from .reporting import NOISE_STATISTICS as NOISE_STATISTICS
from .reporting import SkipWarnings, format_summary, monitors_statistics, step_metrics, with_parts
from .window_plan import WindowPlan

require("pytorch-lightning", LIGHTNING_FLOOR)

# Type-checked against pytorch_lightning's Callback (both namespaces have the same hooks); a plain mixin at
# run time, so that each namespace's callback class can put its own Callback beside it.
if TYPE_CHECKING:
    from pytorch_lightning import Callback as _LogicBase
else:
    _LogicBase = object

# Returns a number or a Tensor. Annotated Any: jsonargparse rejects a function returning `int` for a union.
ItemCountFn = Callable[[Any], Any]


@dataclass(slots=True)
class _Batch:
    """What the callback knows of the current micro-batch: ``on_train_batch_start`` starts a fresh one."""

    items: Any = None  # its item count (a number or a tensor); None: unknown
    label: str = ""  # what `items` is, for the core's messages
    error: str | None = None  # why `items` is unknown, raised at the boundary (on every rank together)
    backward_ran: bool = False  # False: `training_step` returned None
    recorded: bool = False  # recorded in the window, the batch not ended: a save now is mid-batch
    finalized: bool = False  # the window was finalized (stepped or skipped) in it; LBFGS may re-evaluate
    ended: bool = False  # `on_train_batch_end` ran: a save now is between batches


def estimated_stepping_batches(trainer: pl.Trainer, *, most: bool = False) -> int | float:
    """The exact number of optimizer steps of ``trainer``'s fit, following the callback's plan.

    E.g. ``OneCycleLR(..., total_steps=estimated_stepping_batches(trainer))`` in ``configure_optimizers``;
    Lightning's estimate without the callback. ``"auto"``: ``ValueError``; ``most=True``: the most steps.
    """
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, GradientAccumulationLogic):
            return callback.estimated_stepping_batches(trainer, most=most)
    return trainer.estimated_stepping_batches


class GradientAccumulationLogic(_LogicBase):
    """Exact, observable gradient accumulation for automatic optimization.

    It owns ``Trainer.accumulate_grad_batches`` and fixes what the built-in gets wrong: the last, partial
    window of an epoch is divided by the micro-batches actually run (the built-in divides by K), and
    ``scaling="weighted"`` weights each micro-batch by its items (e.g. non-padding tokens) across
    micro-batches and ranks. It also detects non-finite gradients once per step, clips the final gradient
    once, and logs what happened in each window under ``grad_accum/``.

    It puts itself first among the Trainer's callbacks: every other callback and the module see the final
    gradient in ``on_before_optimizer_step`` (after the step, where it steps a window itself).

    Args:
        accumulation_steps: K; or a schedule ``{threshold: K}`` of ``schedule_unit`` (by epoch: as Lightning's
            ``GradientAccumulationScheduler``; keys may be written ``"10k"``, ``"2.4B"``); ``"auto"``: chosen
            window by window from the measured gradient noise scale (``auto``; ``noise_scale`` is then on);
            ``None`` adopts ``Trainer(accumulate_grad_batches=...)``.
        target_batch_size: Items per optimizer step over all ranks; K = ceil(target / (micro-batch size x
            world size)), resolved in ``setup`` (before ``configure_optimizers``, so that
            ``trainer.estimated_stepping_batches`` is exact); or a size per stage ``{threshold: items}``
            keyed by ``schedule_unit="steps"`` or ``"items"``. Exclusive with ``accumulation_steps``.
        item_count_fn: ``batch -> number | Tensor``: items in a micro-batch for ``"weighted"`` (default: the
            batch size, when every tensor of the batch agrees on it). Any finite number >= 0; a device tensor
            is fine (no sync). A micro-batch with 0 items weighs nothing.
        log_stats: Log the statistics under ``grad_accum/`` at every optimizer step (respecting
            ``log_every_n_steps``) to the Trainer's loggers and ``trainer.callback_metrics`` (also without a
            logger: under ``ddp_spawn`` these reach the launching process).
        sharded_reduction: Under ``FSDPStrategy`` and ``ModelParallelStrategy``: ``"every_micro_batch"``
            reduce-scatters each micro-batch's gradient (Lightning's behaviour: sharded memory, K times the
            communication); ``"window_end"`` turns FSDP's gradient sync off for all but the window's last
            micro-batch (one reduce-scatter per step; the unsharded gradients are kept across the window);
            ``"replicas_at_window_end"`` (FSDP2 on an HSDP mesh) reduce-scatters every micro-batch inside
            each replica but all-reduces across replicas once per step (sharded memory).
        schedule_unit: What the keys of an ``accumulation_steps`` schedule count: ``"epochs"``, ``"steps"``
            (optimizer steps so far) or ``"items"`` (items of the windows closed so far, over all ranks). A
            window's K is the schedule's value at the count reached when it opens, mid-epoch.
        lr_scaling: ``"none"``, ``"sqrt"`` or ``"linear"``: every step's learning rates are multiplied by
            (K of its window / K of the first window) to the power 0, 1/2 or 1, around the step only (LR
            schedulers never see it); logged as ``grad_accum/lr_factor``.
        auto: How ``"auto"`` chooses K: the rule (an example budget, or goodput), the bounds, the hysteresis
            (:class:`~lightning_gradacc.k_policies.AutoSettings`, its fields documented there).
        lr_schedule: A learning-rate schedule by items consumed (tokens with a token counter): warmup and
            decay over an item budget (:class:`~lightning_gradacc.lr_schedule.TokenSchedule`, or its fields as
            a mapping), a factor on every step's learning rates at the items of the windows before it, over
            all ranks: the same learning rate per token whatever K runs; logged in ``lr_factor``.
        piece_size: Run each loader batch as pieces of at most this many items, each with its own
            backward and its loss weighted by its share of the batch's items (tokens with
            ``item_count_fn``): the same gradient in less memory, every counter and K unchanged. ``"auto"``
            runs whole batches and halves the piece size on each out-of-memory error, redoing what it must
            (:mod:`~lightning_gradacc.piece_runner`); ``None``: batches run whole. One device or DDP.
        split_fn: ``(batch, size) -> list of pieces`` for a batch the default splitter (tensors, mappings,
            lists, tuples, cut on their first dimension) cannot cut.
        oom_snapshot: With ``piece_size="auto"``: copy the gradients before each batch whose window's
            earlier gradients are in ``.grad`` (one gradient of memory), so that an out-of-memory error in a
            backward can redo the batch (not DDP's all-reducing one); without it a backward's error is redone
            where ``.grad`` holds that batch alone (it opens its window, or the window is in buffers), else
            raised.
        Math settings: (each field of ``AccumulationSettings``, documented there once, listed here)

    Attributes:
        plan: The one owner of K (:class:`~lightning_gradacc.window_plan.WindowPlan`): its ``policy`` is how K
            is chosen, as configured (each fit works on its own copy); its ``position`` where training stands.
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

    # The Lightning namespace whose Trainer this callback plugs into (set by each concrete class).
    namespace: ClassVar[str] = PYTORCH_LIGHTNING

    def __init__(
        self,
        accumulation_steps: int | dict[int | str, int] | Literal["auto"] | None = None,
        *,
        target_batch_size: int | dict[int | str, int] | None = None,
        scaling: Literal["mean", "sum", "weighted", "average", "dynamic"] = "mean",
        item_count_fn: ItemCountFn | None = None,
        max_grad_norm: float | None = None,
        norm_type: float = 2.0,
        clip_scope: Literal["global", "parameter"] = "global",
        clip_value: float | None = None,
        overflow: Literal["skip", "raise", "ignore", "skip_micro_batch"] | None = None,
        log_stats: bool = True,
        accumulation_dtype: str | None = None,
        clip_mode: Literal["step", "micro_batch"] = "step",
        sharded_reduction: Literal[
            "every_micro_batch", "window_end", "replicas_at_window_end"
        ] = "every_micro_batch",
        noise_scale: bool = False,
        noise_scale_decay: float = 0.95,
        noise_scale_every: int = 1,
        schedule_unit: Literal["epochs", "steps", "items"] = "epochs",
        lr_scaling: Literal["none", "sqrt", "linear"] = "none",
        auto: AutoSettings | dict[str, Any] | None = None,
        lr_schedule: TokenSchedule | dict[str, Any] | None = None,
        piece_size: int | Literal["auto"] | None = None,
        split_fn: SplitFn | None = None,
        oom_snapshot: bool = False,
    ) -> None:
        policy = make_policy(accumulation_steps, target_batch_size, schedule_unit, auto)
        self.plan = WindowPlan(policy, lr_scaling, make_schedule(lr_schedule))
        self.sharded_reduction = check_reduction(sharded_reduction)
        # the settings the user chose: only those warn where they cannot take effect (None: "skip")
        self.chosen = frozenset() if overflow is None else frozenset({"overflow"})
        given = locals()  # the math settings are declared once, by `AccumulationSettings`, which checks them
        implied = {"noise_scale": True} if policy.adaptive else {}  # "auto" decides from the noise scale
        self.settings = AccumulationSettings(**{name: given[name] for name in SETTINGS} | implied)
        check_item_count_fn(item_count_fn, weighted=self.settings.mode.weighted, scaling=scaling)
        self.item_count_fn = item_count_fn
        if not isinstance(log_stats, bool):
            raise TypeError(f"Expected argument `log_stats` to be a bool, but got {log_stats!r}.")
        self.log_stats = log_stats
        self.piece_size = check_piece_size(piece_size)
        self.split_fn = check_split_fn(split_fn)
        if not isinstance(oom_snapshot, bool):
            raise TypeError(f"Expected argument `oom_snapshot` to be a bool, but got {oom_snapshot!r}.")
        if self.piece_size is None and split_fn is not None:
            raise ValueError("`split_fn` has no effect without `piece_size`: set `piece_size` or remove it.")
        if oom_snapshot and self.piece_size != "auto":
            raise ValueError(
                f"`oom_snapshot=True` has an effect only with `piece_size='auto'`, but got"
                f" `piece_size={self.piece_size!r}`."
            )
        self._pieces = (
            None
            if self.piece_size is None
            else PieceRunner(self.piece_size, split_fn=self.split_fn, snapshot=oom_snapshot)
        )

        self._stage: str | None = None  # the stage of the last `setup`
        self._accumulator: GradAccumulator | EngineWindow | None = None
        self._engine: EngineWindow | None = None  # the accumulator, where the strategy's engine accumulates
        self._saved = SavedState()  # a checkpoint's state, until the next accumulator takes it
        self._scaler: torch.amp.GradScaler | None = None  # the fit's, set in `setup`
        self._groups = ParameterGroups()  # the optimizers' parameter groups the accumulator tracks
        self._layout: Layout = (
            Layout()
        )  # what the strategy means for the gradients: the fit's, set at train start
        self._sync = WindowReduction()  # which backward reduces over the ranks: the fit's, set at train start
        self._asks_last = False  # whether a backward must know that it ends the window (set at train start)
        self._batch = _Batch(ended=True)
        self._paused_clipping: internals.PausedClipping | None = None  # Lightning's, until the batch ends
        self._skips = SkipWarnings()
        self._grads_read_before_step = True  # by a hook after this callback's: set at train start
        self._stepped_on_device = False  # a step of this fit was decided on the device
        self._warned_of_counts = False  # a count warning is shown once
        self._labels_checked = False  # the labels of "weighted" without a counter: read once (a host read)
        self._monitored = False  # a callback monitors a `grad_accum/` key: read the statistics every step
        self._log_dir: str | None = None  # the last fit's logger's, for `summary()`
        self._trained = False  # training started in the current fit (`on_train_start`)
        self._accumulate_in_backward = True  # buffers filled inside the backward (False: after; benchmarks)

    # ------------------------------------------------------------------------------------ reporting

    @property
    def stats(self) -> AccumulationStats:
        """A frozen snapshot of the statistics (see :class:`~lightning_gradacc.AccumulationStats`).

        The same values as the logged ones, the parts' (learning-rate factor, ``"auto"``, pieces) included.
        """
        if self._reports_checkpoint:
            stats = self._saved.stats(self.plan.accumulation_steps)
        elif self._accumulator is not None:
            stats = self._accumulator.stats
        else:
            stats = AccumulationStats(accumulation_steps=self.plan.accumulation_steps)
        return with_parts(stats, self._part_values())

    def _part_values(self) -> dict[str, float]:
        """The values the fit's parts keep, by their names in ``AccumulationStats``."""
        values = self.plan.metrics()
        if self._pieces is not None:
            values.update(self._pieces.metrics())
        return values

    def summary(self) -> str:
        """The statistics of the last fit as the table ``lightning-gradacc fit`` prints (for scripts).

        Example:
            >>> print(GradientAccumulationCallback(4).summary().splitlines()[0])
            Gradient accumulation summary
        """
        return format_summary(self.stats, self._log_dir, self.plan.progress())

    @property
    def _reports_checkpoint(self) -> bool:
        """A checkpoint was loaded by a fit that has not trained (or never will: its run is finished)."""
        return not self._trained and self._saved.counters is not None

    @property
    def items_consumed(self) -> float | None:
        """Items of the windows closed so far, over ranks, where counted (keyed by items, "auto", LR)."""
        return self.plan.items_consumed

    @property
    def accumulator(self) -> GradAccumulator | EngineWindow | None:
        """The accumulator of the current run (``None`` before training starts).

        The core's, or under DeepSpeed the engine's driver
        (:class:`~lightning_gradacc.engine_window.EngineWindow`).
        """
        return self._accumulator

    def estimated_stepping_batches(self, trainer: pl.Trainer, *, most: bool = False) -> int | float:
        """The exact number of optimizer steps of this fit, following the epoch schedule if there is one.

        See the module-level :func:`estimated_stepping_batches`, which finds the callback for you.
        """
        return self.plan.stepping_batches(trainer, counts_samples=self.item_count_fn is None, most=most)

    # ------------------------------------------------------------------------------------- set-up

    @property
    def _api(self) -> LightningNamespace:
        return namespace(self.namespace)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        compat.check_namespace(trainer, self.namespace)
        self._stage = stage
        if stage != "fit":
            return
        self._trained = False
        self._verify("configuration", trainer, pl_module)
        if self._accumulator is not None and not self._accumulator.window.empty:
            # the last fit raised inside a window: it can never be stepped, and any K may follow
            self._accumulator.reset(set_grads_to_none=True)
        self.plan.start_fit(trainer, self._api.rank_zero_warn)
        # a strategy that accumulates itself: Lightning steps at an epoch's end only where `ready % K == 0`
        self.plan.closes_epoch_tail = bool(trainer.strategy.handles_gradient_accumulation)
        self._scaler = internals.grad_scaler(trainer)
        self._verify("setup", trainer, pl_module)
        layout_of(self._api, trainer).prepare(  # before the strategy's setup reads its configuration
            trainer,
            self.settings,
            chosen=self.chosen,
            plan=self.plan,
            sharded_reduction=self.sharded_reduction,
            warn=self._api.rank_zero_warn,
        )
        self._go_first(trainer)

    def _verify(self, phase: compat.Phase, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Run the checks of ``phase`` (``compatibility.CHECKS``) over this fit's facts."""
        facts = compat.RunFacts(
            self._api, trainer, pl_module, self, GradientAccumulationLogic, self._scaler, self._sync
        )
        compat.verify(phase, facts)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert trainer.model is not None
        self._trained = True
        self._layout = layout_of(self._api, trainer)
        try:
            self._sync = self._layout.reduction(
                trainer, reduction=self.sharded_reduction, per_micro_batch=self.settings.per_micro_batch
            )
        except ValueError as error:
            raise RuntimeError(str(error)) from None
        self._verify("reduction", trainer, pl_module)
        self._build_accumulator(trainer, pl_module)
        if self._pieces is not None:
            self._pieces.install(
                trainer,
                self._accumulator,
                count=self.item_count_fn,
                extract=self._api.extract_batch_size,
                warn=self._api.rank_zero_warn,
                lightning_k=self.plan.lightning_k,
            )
        self._monitored = monitors_statistics(trainer.callbacks)  # type: ignore[attr-defined]
        self._verify("train_start", trainer, pl_module)
        if self._sync.core_reduces:
            self._sync.start()
        self._grads_read_before_step = compat.grads_read_before_step(self._api, trainer, pl_module, self)
        self._stepped_on_device = False
        self._go_first(trainer)  # again: another callback may have moved itself in its own `setup`

    def _go_first(self, trainer: pl.Trainer) -> None:
        """Go first in every hook: the other callbacks and the module then see the final gradient."""
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        if callbacks and callbacks[0] is not self:  # a new list: Lightning may be iterating over the old one
            trainer.callbacks = [self, *(c for c in callbacks if c is not self)]  # type: ignore[attr-defined]

    def _build_accumulator(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        previous = self._accumulator
        if previous is not None:
            previous.remove_hooks()  # its noise-scale hook must not keep measuring
        accumulator: GradAccumulator | EngineWindow
        if self._layout.engine_accumulates:  # the engine keeps the window: the callback drives it
            accumulator = self._layout.engine_window(trainer, self.settings)
        else:
            accumulator = build_accumulator(
                trainer,
                pl_module,
                settings=self.settings,
                grad_scaler=self._scaler,
                reduction=self._sync,
                sharded_model=self._layout.sharded_model(trainer, self._sync),
                in_backward=self._accumulate_in_backward,
            )
        self._groups.tracked(trainer)
        try:  # K and the loss scale first: a restored window's sums are rescaled to them
            self.plan.attach(trainer, accumulator, self._api.rank_zero_warn)
            # lifetime counters survive a second `fit()` and a resume from a checkpoint
            self._saved.restore(accumulator, previous, primary=trainer.global_rank == 0)
        except BaseException:
            accumulator.remove_hooks()  # it will never be used: its noise-scale hooks must not stay
            raise
        self._engine = accumulator if isinstance(accumulator, EngineWindow) else None
        restored_inside = self.plan.position.batches_in_window
        if self._engine is not None and restored_inside:
            self._engine.lost(restored_inside)
            self._api.rank_zero_warn(
                f"Resumed inside a window under DeepSpeed: the gradients of its first {restored_inside}"
                " micro-batch(es) are in no DeepSpeed checkpoint, so this window steps on its remaining"
                " micro-batches alone (normalized over them). Checkpoints taken at a window's end resume"
                " exactly."
            )
        self._accumulator = accumulator
        # FSDP reducing at the window's end, or the core flushing its buffers for DDP or a GradScaler
        self._asks_last = self._sync.defers or accumulator.uses_last
        self._skips.seen = accumulator.stats.skipped_steps

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._accumulator is not None and not self._accumulator.window.empty:
            self._discard_window(
                trainer, "the previous epoch ended inside it, e.g. `on_train_batch_start` returned -1"
            )
        self.plan.epoch_start(trainer)

    def _discard_window(self, trainer: pl.Trainer, why: str) -> None:
        """Drop an open window that can no longer end in a step: windows never merge."""
        assert self._accumulator is not None
        self._api.rank_zero_warn(
            f"A window of {self._accumulator.window.micro_batches} micro-batch(es) never reached its"
            f" optimizer step ({why}); its gradients are discarded so that it does not leak into the next"
            f" window (global step {trainer.global_step})."
        )
        self._accumulator.reset(set_grads_to_none=True)
        self._sync.drop_unsynced()  # and what FSDP holds unsynced (`sharded_reduction="window_end"`)
        self.plan.window_abandoned()

    # --------------------------------------------------------------------------------- per micro-batch

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        accumulator = self._accumulator
        assert accumulator is not None
        self._batch = current = _Batch()
        if accumulator.window.empty:  # e.g. `BaseFinetuning` added a group in `on_train_epoch_start`: the
            self._groups.follow(trainer, pl_module, accumulator)  # window measures the new set from its start
        self.plan.batch_start(trainer)  # a window opening here gets its K
        lightning_zeroes = self.plan.lightning_zeroes(trainer, batch_idx)
        if not internals.backward_skipped(trainer):
            if not accumulator.window.empty and lightning_zeroes:
                self._discard_window(trainer, f"Lightning starts a new window at batch {batch_idx}")
                self.plan.batch_start(trainer)  # which this batch opens
            elif accumulator.window.empty and not lightning_zeroes:
                # A window opening where Lightning does not zero the gradients (the batch before was None
                # from the dataloader, which skips every hook): it must not start from the last one's.
                accumulator.reset(set_grads_to_none=True)
        if self._engine is not None:  # before the forward, of the window this batch is in (after a discard)
            self._engine.batch_start()
        weighted = self.settings.mode.weighted
        extract, check_labels = self._api.extract_batch_size, not self._labels_checked
        counted = count_micro_batch(batch, batch_idx, self.item_count_fn, weighted, extract, check_labels)
        current.items, current.label, current.error = counted.items, counted.label, counted.error
        self._labels_checked = self._labels_checked or weighted
        if self._pieces is not None:
            self._pieces.begin_batch(batch, counted.items)
        if counted.warning is not None and not self._warned_of_counts:
            self._warned_of_counts = True
            self._api.rank_zero_warn(counted.warning)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        accumulator, current = self._accumulator, self._batch
        assert accumulator is not None
        # whether this backward ends the window, asked only where it matters (a private Lightning call)
        last = self._asks_last and not internals.should_accumulate(trainer)
        # `loss` is the tensor that is back-propagated: Lightning's L / K, times the AMP scale under 16-mixed,
        # weighed here in place (the core divides K and the AMP scale out once per window)
        pieces = self._pieces
        accumulator.begin_micro_batch(
            loss,
            current.items,
            last=last,
            label=current.label,
            error=current.error,
            in_place=True,
            share=1.0 if pieces is not None and pieces.in_pieces else None,  # the runner weighs the pieces
            hold_in_grad=pieces is not None and pieces.auto,  # "auto" may drop them after an error
        )
        self._sync.before_backward(last)  # "window_end": FSDP reduces the window's last backward only

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        accumulator, current = self._accumulator, self._batch
        assert accumulator is not None
        self._sync.after_backward()
        self._groups.follow(trainer, pl_module, accumulator)  # a group added or changed since the last look
        accumulator.end_micro_batch(reevaluation=current.finalized)
        current.recorded = True  # until `on_train_batch_end`: a save now is mid-batch
        current.backward_ran = True

    # ---------------------------------------------------------------------------------------- boundary

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        accumulator, current, scaler = self._accumulator, self._batch, self._scaler
        assert accumulator is not None
        engine = self._engine
        if engine is not None:  # called every micro-batch: the engine steps at its end
            if not internals.should_accumulate(trainer) and not current.finalized:
                engine.end_window()
                self.plan.window_closed(engine)
                current.finalized = True
            return
        self._groups.follow(trainer, pl_module, accumulator)
        if not current.backward_ran and not accumulator.window.empty:
            self._verify("window_end", trainer, pl_module)
        # Under a GradScaler, Lightning neither unscales nor steps when the batch that ends a window returned
        # None: the window's earlier micro-batches would be dropped. The callback steps it itself.
        steps_itself = (
            scaler is not None
            and not current.backward_ran
            and not accumulator.window.empty
            and not current.finalized
        )
        # The scaler unscales here where Lightning did not: a window the callback steps itself, and a fused
        # optimizer (Lightning leaves the AMP scale in for it, which the norm and clipping must not see; the
        # scaler's step then only skips on its `found_inf`). Logged at this batch's end: the statistics then
        # come along in the step's one sync.
        stepped = accumulator.end_window(
            optimizer,
            unscale=steps_itself or (current.backward_ran and not internals.lightning_unscales(optimizer)),
            fold_multiplier=not self._grads_read_before_step,
            reevaluation=current.finalized,
            read_statistics=self.log_stats and internals.logs_this_step(trainer),
        )
        self._stepped_on_device = self._stepped_on_device or accumulator.device_step is not None
        if not current.finalized:  # items: the window's, over ranks (read if the policy counts them)
            self.plan.window_closed(accumulator)
        current.finalized = True
        self._sync.after_step()
        if steps_itself:
            assert scaler is not None
            if stepped:  # Lightning's clipping (and the module's hook), before the step it would miss
                internals.clip_as_lightning(trainer, pl_module, optimizer)
            scaler.step(optimizer)
            scaler.update()
        elif stepped:
            return
        if not stepped:  # `skipped_steps` syncs, on this rare path only
            self._skips.update(accumulator.stats.skipped_steps, trainer.global_step, self._api.rank_zero_warn)
        # Lightning clips after this hook (`gradient_clip_val`, or `configure_gradient_clipping`): by value
        # it crashes on a list with no gradient at all, and a window the callback stepped itself
        # was clipped before its step. Both go through the precision plugin, paused until the batch ends.
        paused = self._paused_clipping
        if paused is None or paused.plugin is not trainer.precision_plugin:
            self._paused_clipping = internals.pause_clipping(trainer.precision_plugin)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batch.recorded, self._batch.ended = False, True
        if self._pieces is not None:
            self._pieces.end_batch(outputs)
        if not self._batch.finalized:
            return
        self._resume_clipping()
        engine = self._engine
        if engine is not None:  # its norm and fp16 overflows, known after its step
            engine.after_step()
            self._skips.update(engine.stats.skipped_steps, trainer.global_step, self._api.rank_zero_warn)
        if self.log_stats and internals.logs_this_step(trainer):
            # to the loggers and `callback_metrics` (`ddp_spawn` returns these, `ModelCheckpoint` reads them)
            logged = self.metrics()
            internals.log_step_metrics(trainer, logged)
            if self._stepped_on_device and logged:  # skipped on the device (or by an engine): counted here
                skipped = int(logged["grad_accum/skipped_steps"])
                self._skips.update(skipped, trainer.global_step, self._api.rank_zero_warn, late=True)
        elif self.log_stats and self._monitored:  # `callback_metrics` at every step for a monitor (0.3 ms)
            internals.log_step_metrics(trainer, self.metrics(), to_loggers=False)

    def metrics(self) -> dict[str, float]:
        """The scalars logged under ``grad_accum/`` (:func:`~lightning_gradacc.reporting.step_metrics`)."""
        engine, accumulator = self._engine, self._accumulator
        if accumulator is None:
            return {}
        parts = self._part_values()
        return step_metrics(
            with_parts(accumulator.stats, parts),
            noise_scale=self.settings.noise_scale,
            parts=parts,
            absent=engine.absent if engine is not None else frozenset(),
        )

    def _resume_clipping(self) -> None:
        paused, self._paused_clipping = self._paused_clipping, None
        if paused is not None:
            paused.resume()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._resume_clipping()
        if self._pieces is not None:
            self._pieces.uninstall()
        self.plan.interrupted()  # its position stays for a checkpoint saved after this hook
        for optimizer in trainer.optimizers:  # a device step armed for a step that never came
            disarm(optimizer)
        if self._accumulator is not None:  # its open window stays for a checkpoint saved after this hook
            self._accumulator.remove_hooks()  # (`OnExceptionCheckpoint`); the next `fit` discards it
        # With sync off FSDP keeps a window's gradients unsharded inside itself, where neither `zero_grad`
        # nor the next window would clear them: the next synced backward would add them in.
        self._sync.end(discard=True)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_dir = trainer.logger.log_dir if trainer.logger is not None else None
        if self._pieces is not None:
            self._pieces.uninstall()
        self._sync.end(discard=self._accumulator is not None and not self._accumulator.window.empty)
        if self._accumulator is not None and not self._accumulator.window.empty:
            self._api.rank_zero_warn(
                f"Training ended inside a window: {self._accumulator.window.micro_batches} micro-batch(es)"
                " were back-propagated but never stepped; their gradients are discarded."
            )
            self._accumulator.reset(set_grads_to_none=True)
        if self._accumulator is not None:
            self._accumulator.remove_hooks()
            if self.log_stats:  # the last statistics, also where no logging step came (a short run)
                internals.log_step_metrics(trainer, self.metrics(), to_loggers=False)
            if self._stepped_on_device:  # the last steps' skips, and invalid counts held on the device
                skipped = self._accumulator.stats.skipped_steps
                self._skips.update(skipped, trainer.global_step, self._api.rank_zero_warn, late=True)
        self.plan.end_fit(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and not self._trained:  # e.g. `Tuner.scale_batch_size` ended it at fit start
            self.plan.untrained(trainer)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._reports_checkpoint:
            return
        # Lightning skips training when the checkpoint's run already reached the limits: say so, in the
        # callback's terms (its statistics are then the checkpoint's)
        self._log_dir = trainer.logger.log_dir if trainer.logger is not None else None
        self._api.rank_zero_warn(
            f"Nothing was trained: the checkpoint's run is finished (epoch {trainer.current_epoch}, global"
            f" step {trainer.global_step}; `max_epochs={trainer.max_epochs}`,"
            f" `max_steps={trainer.max_steps}`)."
            f" The callback's statistics are the checkpoint's ({self.stats.windows} windows). Raise"
            " `max_epochs` or `max_steps` to train on, or leave `ckpt_path` unset to train from the start."
        )

    # ------------------------------------------------------------------------------------- checkpoint

    @override
    def state_dict(self) -> dict[str, Any]:
        """Counters and the open window, if any (plain tensors and numbers: ``weights_only=True`` loads it).

        Under DDP this sums the open window over ranks (every rank takes part, as in every Lightning save).
        """
        warn = self._api.rank_zero_warn
        batch = self._batch
        engine = self._engine
        if engine is not None and not engine.window.empty:
            warn(
                "This checkpoint is taken inside a window of"
                f" {engine.window.micro_batches} micro-batch(es) under DeepSpeed, whose checkpoint holds"
                " no accumulated gradients: a resume from it steps that window on its remaining"
                " micro-batches alone. Save at a window's end"
                " (`ModelCheckpoint(every_n_train_steps=...)`) to resume exactly."
            )
        entry = SavedState.save(
            self._accumulator, mid_batch=batch.recorded, in_batch=not batch.ended, warn=warn
        )
        entry["plan"] = self.plan.state_dict()  # where training stands, inside a window too
        if self._pieces is not None:  # the size that fits: a resume does not run out of memory again
            entry["pieces"] = self._pieces.counters.state_dict()
        return entry

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._stage not in (None, "fit"):  # validate/test/predict(ckpt_path=...) never train: keep nothing
            return
        self._saved.load(state_dict)
        if self._pieces is not None and state_dict.get("pieces") is not None:
            pieces = self._pieces  # an int size is this run's setting; "auto" goes on from the saved one
            pieces.counters.load_state_dict(state_dict["pieces"], size=pieces.auto)
        position = state_dict.get("plan", state_dict.get("schedule"))  # "schedule": keyed schedules, 0.2
        if position is not None:  # Lightning restores callbacks after `setup`
            self.plan.load_state_dict(position)


GradientAccumulationLogic.__doc__ = with_setting_docs(GradientAccumulationLogic.__doc__)


class GradientAccumulationCallback(GradientAccumulationLogic, pl.Callback):
    """:class:`GradientAccumulationLogic` as a ``pytorch_lightning`` callback (``import pytorch_lightning``).

    For ``lightning.pytorch`` (``import lightning as L``) use
    ``from lightning_gradacc.lightning import GradientAccumulationCallback``: the same arguments and
    behaviour.
    """

    namespace: ClassVar[str] = PYTORCH_LIGHTNING
