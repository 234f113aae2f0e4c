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
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import pytorch_lightning as pl
import torch
from torch import Tensor
from typing_extensions import override

from . import compatibility as compat
from . import lightning_internals as internals
from .batch_pieces import SplitFn, check_split_fn
from .core import AccumulationStats
from .core.settings import SETTINGS, AccumulationSettings, with_setting_docs
from .core.versions import LIGHTNING_FLOOR, require
from .counters import check_budget_count_fn, check_item_count_fn
from .fit_accumulator import SavedState
from .k_policies import AutoSettings, KPolicy, make_policy
from .layouts import layout_of
from .lr_schedule import TokenSchedule, make_schedule
from .namespaces import PYTORCH_LIGHTNING, LightningNamespace, namespace
from .parts import Fit, Parts, assemble
from .parts.reporting import ReportingPart
from .parts.window import WindowPart
from .piece_runner import PieceRunner, check_piece_size
from .reduction import WindowReduction, check_reduction
from .reporting import LOGGED_STATISTICS as LOGGED_STATISTICS  # importable from here too
from .reporting import NOISE_STATISTICS as NOISE_STATISTICS
from .reporting import SkipWarnings, format_summary, with_parts
from .window_driver import WindowDriver
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


def check_budget(policy: KPolicy, *, lr_scaling: str, piece_size: Any) -> None:
    """Refuse what an item budget (``items_per_step``) cannot drive: ``lr_scaling`` and ``piece_size``."""
    if policy.budget is None:
        return
    if lr_scaling != "none":
        raise ValueError(
            f"`{policy.describe()}` cannot be combined with `lr_scaling={lr_scaling!r}`: a window's K is not"
            " chosen, so there is no K to scale the learning rate by (an `lr_schedule` over the items"
            " consumed is)."
        )
    if piece_size is not None:
        raise ValueError(
            f"`{policy.describe()}` cannot be combined with `piece_size={piece_size!r}` yet: the pieces of a"
            " batch are weighed by a K that an item budget changes batch by batch."
        )


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
        items_per_step: An item budget (``4096``, ``"1M"``): each window closes at the first micro-batch at
            which its items over all ranks (``budget_count_fn``'s or ``item_count_fn``'s, e.g. tokens; else
            the batch size) reach it, and an epoch's end closes the last one. The steps follow the data:
            ``estimated_stepping_batches`` counts them only where items are samples of fixed-size batches
            (``most=True``: a bound). One scalar all-reduce per micro-batch under DDP/FSDP. Exclusive with
            the other ways to set K.
        item_count_fn: ``batch -> number | Tensor``: items in a micro-batch for ``"weighted"`` (default: the
            batch size, when every tensor of the batch agrees on it). Any finite number >= 0; a device tensor
            is fine (no sync). A micro-batch with 0 items weighs nothing.
        budget_count_fn: ``batch -> number | Tensor``: what ``items_per_step`` counts, where it differs from
            what the micro-batches are weighted by (e.g. a step of 4096 tokens whose loss is a mean over
            sequences, weighted by ``count_sequences``). Default: ``item_count_fn``'s count.
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
        items_per_step: int | str | None = None,
        scaling: Literal["mean", "sum", "weighted", "constant", "average", "dynamic"] = "mean",
        item_count_fn: ItemCountFn | None = None,
        budget_count_fn: ItemCountFn | None = None,
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
        policy = make_policy(accumulation_steps, target_batch_size, schedule_unit, auto, items_per_step)
        check_budget(policy, lr_scaling=lr_scaling, piece_size=piece_size)
        self.plan = WindowPlan(policy, lr_scaling, make_schedule(lr_schedule))
        self.sharded_reduction = check_reduction(sharded_reduction)
        # the settings the user chose: only those warn where they cannot take effect (None: "skip")
        self.chosen = frozenset() if overflow is None else frozenset({"overflow"})
        given = locals()  # the math settings are declared once, by `AccumulationSettings`, which checks them
        implied = {"noise_scale": True} if policy.adaptive else {}  # "auto" decides from the noise scale
        self.settings = AccumulationSettings(**{name: given[name] for name in SETTINGS} | implied)
        self.piece_size = check_piece_size(piece_size)
        weighted, pieces = self.settings.mode.weighted, self.piece_size is not None
        budget_counts = policy.budget is not None and budget_count_fn is None  # `item_count_fn` counts it
        check_item_count_fn(
            item_count_fn,
            weighted=weighted,
            scaling=scaling,
            pieces=pieces,
            budget=budget_counts,
            budget_counter=budget_count_fn is not None,
        )
        if not isinstance(log_stats, bool):
            raise TypeError(f"Expected argument `log_stats` to be a bool, but got {log_stats!r}.")
        check_budget_count_fn(budget_count_fn, budget=policy.budget is not None)
        self.plan.budget_counted_apart = budget_count_fn is not None
        self.item_count_fn, self.budget_count_fn, self.log_stats = item_count_fn, budget_count_fn, log_stats
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
        self._runner = (  # kept over fits: "auto" goes on at the size reached
            None
            if self.piece_size is None
            else PieceRunner(self.piece_size, split_fn=self.split_fn, snapshot=oom_snapshot)
        )
        self._stage: str | None = None  # the stage of the last `setup`
        self._saved = SavedState()  # a checkpoint's state, until the next driver takes it
        self._driver: WindowDriver | None = None  # the window driver of the current (or last) fit
        self._fit: Fit | None = None  # what the parts of the current (or last) fit share
        self._parts = Parts([])  # the parts of the current (or last) fit, from train start
        self._reporting: ReportingPart | None = None
        self._skips = SkipWarnings()  # steps skipped for non-finite gradients: warned of over the fits
        self._once: set[str] = set()  # what is said or read once over the fits (a count's warning)
        self._log_dir: str | None = None  # the last fit's logger's, for `summary()`
        self._trained = False  # training started in the current fit (`on_train_start`)
        self._accumulate_in_backward = True  # buffers filled inside the backward (False: after; benchmarks)

    def __getstate__(self) -> dict[str, Any]:
        """Pickles (``ddp_spawn``) without the last fit's Trainer: its driver's counters go on."""
        state = self.__dict__.copy()
        state.update(_fit=None, _parts=Parts([]), _reporting=None)
        return state

    # ------------------------------------------------------------------------------------ reporting

    @property
    def stats(self) -> AccumulationStats:
        """A frozen snapshot of the statistics (see :class:`~lightning_gradacc.AccumulationStats`).

        The same values as the logged ones, the parts' (learning-rate factor, ``"auto"``, pieces) included.
        """
        driver = self.accumulator
        if self._reports_checkpoint:
            stats = self._saved.stats(self.plan.accumulation_steps)
        elif driver is not None:
            stats = driver.stats
        else:
            stats = AccumulationStats(accumulation_steps=self.plan.accumulation_steps)
        values = self.plan.metrics()
        if self._runner is not None:  # kept over fits, as the plan is
            values.update(self._runner.metrics())
        return with_parts(stats, values)

    def metrics(self) -> dict[str, float]:
        """The scalars logged under ``grad_accum/`` (:func:`~lightning_gradacc.reporting.step_metrics`)."""
        return {} if self._reporting is None else self._reporting.metrics()

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
    def accumulator(self) -> WindowDriver | None:
        """The window driver of the current run (``None`` before training starts).

        The core's accumulator, or under DeepSpeed the engine's window
        (:class:`~lightning_gradacc.engine_window.EngineWindow`): both are
        :class:`~lightning_gradacc.window_driver.WindowDriver`.
        """
        return self._driver

    def estimated_stepping_batches(self, trainer: pl.Trainer, *, most: bool = False) -> int | float:
        """The exact number of optimizer steps of this fit, following the epoch schedule if there is one.

        See the module-level :func:`estimated_stepping_batches`, which finds the callback for you.
        """
        counter = self.item_count_fn if self.budget_count_fn is None else self.budget_count_fn
        return self.plan.stepping_batches(trainer, counts_samples=counter is None, most=most)

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
        driver = self.accumulator
        if driver is not None and not driver.window.empty:
            # the last fit raised inside a window: it can never be stepped, and any K may follow
            driver.reset(set_grads_to_none=True)
        self.plan.start_fit(trainer, self._api.rank_zero_warn)
        # a strategy that accumulates itself: Lightning steps at an epoch's end only where `ready % K == 0`
        self.plan.closes_epoch_tail = bool(trainer.strategy.handles_gradient_accumulation)
        scaler = internals.grad_scaler(trainer)
        self._verify("setup", trainer, pl_module, scaler)
        layout = layout_of(self._api, trainer)
        layout.prepare(  # before the strategy's setup reads its configuration
            trainer,
            self.settings,
            chosen=self.chosen,
            plan=self.plan,
            sharded_reduction=self.sharded_reduction,
            warn=self._api.rank_zero_warn,
        )
        verify, skips, once = self._verifier(), self._skips, self._once  # skips and once: over the fits
        self._fit = Fit(
            trainer, pl_module, self._api, layout, scaler=scaler, verify=verify, skips=skips, once=once
        )
        self._go_first(trainer)

    def _verifier(self) -> Callable[[str], None]:
        def verify(phase: str) -> None:
            fit = self._fit
            assert fit is not None
            self._verify(phase, fit.trainer, fit.pl_module, fit.scaler, fit.sync)  # type: ignore[arg-type]

        return verify

    def _verify(
        self,
        phase: compat.Phase,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        scaler: torch.amp.GradScaler | None = None,
        sync: WindowReduction | None = None,
    ) -> None:
        """Run the checks of ``phase`` (``compatibility.CHECKS``) over this fit's facts."""
        facts = compat.RunFacts(
            self._api, trainer, pl_module, self, GradientAccumulationLogic, scaler, sync or WindowReduction()
        )
        compat.verify(phase, facts)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert trainer.model is not None and self._fit is not None
        self._trained = True
        fit = self._fit
        fit.discard = self._discard
        window = WindowPart(
            fit,
            plan=self.plan,
            settings=self.settings,
            saved=self._saved,
            previous=self._driver,  # the last fit's: its counters go on where no checkpoint is loaded
            sharded_reduction=self.sharded_reduction,
            item_count_fn=self.item_count_fn,
            budget_count_fn=self.budget_count_fn,
            in_backward=self._accumulate_in_backward,
        )
        window.train_start()  # the reduction and the driver: what decides the other parts
        self._driver = fit.driver
        parts, self._reporting = assemble(
            fit,
            window,
            runner=self._runner,
            item_count_fn=self.item_count_fn,
            callback=self,
            log_stats=self.log_stats,
        )
        self._parts = Parts(parts)
        for hook in self._parts.train_start[1:]:  # the window's ran
            hook()
        self._verify("train_start", trainer, pl_module, fit.scaler, fit.sync)
        fit.stepped_on_device = False
        self._go_first(trainer)  # again: another callback may have moved itself in its own `setup`

    def _go_first(self, trainer: pl.Trainer) -> None:
        """Go first in every hook: the other callbacks and the module then see the final gradient."""
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        if callbacks and callbacks[0] is not self:  # a new list: Lightning may be iterating over the old one
            trainer.callbacks = [self, *(c for c in callbacks if c is not self)]  # type: ignore[attr-defined]

    def _discard(self, why: str) -> None:
        """Drop an open window that can no longer end in a step: windows never merge."""
        fit = self._fit
        assert fit is not None and fit.driver is not None
        fit.warn(
            f"A window of {fit.driver.window.micro_batches} micro-batch(es) never reached its optimizer step"
            f" ({why}); its gradients are discarded so that it does not leak into the next window (global"
            f" step {fit.trainer.global_step})."
        )
        for hook in self._parts.window_discarded:
            hook()

    # ------------------------------------------------------------- the hooks: loops over the fit's parts

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for hook in self._parts.epoch_start:
            hook()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        for hook in self._parts.batch_start:
            hook(batch, batch_idx)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        for hook in self._parts.before_backward:
            hook(loss)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for hook in self._parts.after_backward:  # in reverse (as contexts exit): the reduction's first
            hook()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        for hook in self._parts.window_end:
            hook(optimizer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        for hook in self._parts.batch_end:
            hook(outputs)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        for hook in self._parts.exception:  # the open window stays for a checkpoint saved after
            hook()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_dir = trainer.logger.log_dir if trainer.logger is not None else None
        for hook in self._parts.train_end:  # in reverse: the window, and the plan's fit, end last
            hook()

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
        """Every part's state, by name (plain tensors and numbers: ``weights_only=True`` loads it).

        Under DDP the open window is summed over the ranks, the agreed numbers are checked equal and the
        others reduced (every rank takes part, as in every Lightning save).
        """
        fit = self._fit
        if fit is None or fit.driver is None or not self._parts.parts:  # no fit trained here: the plan alone
            entry = SavedState.save(None, mid_batch=False, warn=self._api.rank_zero_warn)
            entry["plan"] = self.plan.state_dict()
            if self._runner is not None:
                entry["pieces"] = self._runner.counters.state_dict()
            return entry
        return self._parts.state_dict(fit.trainer.world_size, fit.trainer.strategy.root_device)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._stage not in (None, "fit"):  # validate/test/predict(ckpt_path=...) never train: keep nothing
            return
        self._saved.load(state_dict)
        runner = self._runner
        if runner is not None and state_dict.get("pieces") is not None:
            # an int size is this run's setting; "auto" goes on from the saved one
            runner.counters.load_state_dict(state_dict["pieces"], size=runner.auto)
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
