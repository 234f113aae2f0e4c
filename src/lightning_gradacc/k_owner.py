"""The callback's ownership of ``Trainer.accumulate_grad_batches``: which K each fit and epoch runs with.

:class:`~lightning_gradacc.schedule.AccumulationPlan` says *what K is*; :class:`KOwner` writes it into the
Trainer (Lightning's loops read it there: where windows end, what each loss is divided by), resolves a
target batch size from the train dataloader, and refuses a Trainer K that contradicts the plan.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import lightning_internals as internals
from .schedule import AccumulationPlan

if TYPE_CHECKING:
    import pytorch_lightning as pl

Warn = Callable[[str], Any]


class KOwner:
    """Writes the K of a plan into the Trainer, per fit and per epoch.

    Args:
        plan: How K is chosen, as configured; never changed (each fit works on its own copy).

    Attributes:
        plan: The configured plan.
        run: The plan of the current fit (``None`` before the first ``setup``).

    Example:
        >>> owner = KOwner(AccumulationPlan(target_batch_size=64))
        >>> owner.describe(), owner.accumulation_steps()
        ('target_batch_size=64', 1)
    """

    def __init__(self, plan: AccumulationPlan) -> None:
        self.plan = plan
        self.run: AccumulationPlan | None = None
        self._applied_k: int | None = None  # the value last written to `_applied_to`
        self._applied_to: weakref.ref[pl.Trainer] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_applied_to"] = None  # a weak reference does not pickle (ddp_spawn pickles the callbacks)
        return state

    def accumulation_steps(self) -> int:
        """K as last applied (else the plan's first K, else 1): the statistics before training starts."""
        return self._applied_k or (self.run or self.plan).for_epoch(0) or 1

    def describe(self) -> str:
        """How K is chosen, for messages."""
        if self.plan.target_batch_size is not None:
            return f"target_batch_size={self.plan.target_batch_size}"
        if not self.plan.configured and self.run is not None:
            k = self.run.fixed
            return f"K={k} adopted from `Trainer(accumulate_grad_batches={k})`"
        return f"accumulation_steps={self.plan.schedule or self.plan.fixed}"

    def largest_k(self) -> int | None:
        """The largest K of the current fit (``None`` while a target batch size is unresolved)."""
        assert self.run is not None
        return self.run.largest_k()

    def start_run(self, trainer: pl.Trainer) -> None:
        """Take the plan of a new fit; refuse a Trainer K that contradicts the configured plan.

        Raises:
            ValueError: ``Trainer(accumulate_grad_batches=...)`` differs from the configured K.
        """
        trainer_k = trainer.accumulate_grad_batches
        applied_here = (
            self._applied_k if self._applied_to is not None and self._applied_to() is trainer else None
        )
        if self.plan.configured and trainer_k not in (1, applied_here, self.plan.fixed):
            raise ValueError(
                f"You have set `Trainer(accumulate_grad_batches={trainer_k})` and"
                f" `GradientAccumulationCallback({self.describe()})`. The callback owns the"
                " accumulation factor: remove `accumulate_grad_batches` from the Trainer or set the same"
                " value."
            )
        self.run = self.plan.for_run(trainer_k)

    def apply(self, trainer: pl.Trainer) -> int | None:
        """Write the K of the Trainer's current epoch into it; ``None``: a target not resolved yet."""
        assert self.run is not None
        k = self.run.for_epoch(trainer.current_epoch)
        if k is None:  # resolved in `on_train_start`
            return None
        self.write(trainer, k)
        return k

    def write(self, trainer: pl.Trainer, k: int) -> None:
        """Write ``k`` into the Trainer, remembered as this callback's (a later fit accepts it there)."""
        trainer.accumulate_grad_batches = k
        self._applied_k = k
        self._applied_to = weakref.ref(trainer)

    def stepping_batches(self, trainer: pl.Trainer, *, counts_samples: bool = True) -> int | float:
        """The exact number of optimizer steps of the fit, following the schedule if there is one.

        Args:
            trainer: The Trainer of the fit.
            counts_samples: Whether an item is a sample (no ``item_count_fn``): a schedule keyed by items is
                then simulated from the train dataloader's batch size; with tokens it cannot be known
                before the data is read, and ``ValueError`` says so.
        """
        lightning_estimate = trainer.estimated_stepping_batches  # loads the train dataloader if needed
        plan = self.run or self.plan
        batches = trainer.num_training_batches
        if plan.schedule is None or trainer.max_epochs in (None, -1) or batches == float("inf"):
            return lightning_estimate
        assert trainer.max_epochs is not None
        items_per_batch = last_batch_items = None
        if plan.unit == "items":
            batch_size = getattr(trainer.train_dataloader, "batch_size", None)
            if not counts_samples or not isinstance(batch_size, int):
                raise ValueError(
                    "The optimizer steps of a schedule keyed by items cannot be counted before training when"
                    " an item is not a sample of a fixed-size micro-batch (an `item_count_fn` counts tokens,"
                    " or the dataloader has no `batch_size`). Build step-interval schedulers from an upper"
                    " bound (e.g. `trainer.estimated_stepping_batches` at the first K) or key the schedule by"
                    " `schedule_unit='steps'`."
                )
            items_per_batch = batch_size * trainer.world_size
            loader: Any = trainer.train_dataloader
            samples = len(loader.dataset) if hasattr(getattr(loader, "dataset", None), "__len__") else None
            if samples is not None and not getattr(loader, "drop_last", False) and samples % items_per_batch:
                last_batch_items = samples % items_per_batch  # what every rank's last batch holds together
        return plan.stepping_batches(
            int(batches), trainer.max_epochs, trainer.max_steps, items_per_batch, last_batch_items
        )

    # ----------------------------------------------------------------------------- target batch size

    def resolve_target_early(self, trainer: pl.Trainer, warn: Warn) -> None:
        """Resolve K from the target batch size in ``setup``, so that ``configure_optimizers`` sees it."""
        try:
            internals.load_train_data(trainer)  # what `trainer.estimated_stepping_batches` does
        except Exception as error:  # e.g. data built in LightningModule.setup, which runs after this hook
            warn(
                f"`target_batch_size={self.plan.target_batch_size}` could not read the train dataloader in"
                f" `setup` ({type(error).__name__}: {error}); K is resolved when training starts instead, so"
                " `trainer.estimated_stepping_batches` in `configure_optimizers` assumes K=1. Build the data"
                " in `__init__`, `prepare_data` or a LightningDataModule, or set `accumulation_steps`."
            )
            return
        self._resolve_target(trainer, warn)

    def resolve_target_again(self, trainer: pl.Trainer, warn: Warn) -> None:
        """Resolve K again at train start: the micro-batch size may have changed (``BatchSizeFinder``)."""
        assert self.run is not None
        if self.run.target_batch_size is None:
            return
        resolved_in_setup = self.run.target_k
        self._resolve_target(trainer, warn)
        if resolved_in_setup not in (None, self.run.target_k):
            warn(
                f"The micro-batch size changed after `setup` (e.g. `BatchSizeFinder`): K is now"
                f" {self.run.target_k} for `target_batch_size={self.plan.target_batch_size}`;"
                " `trainer.estimated_stepping_batches` read in `configure_optimizers` used"
                f" K={resolved_in_setup}."
            )

    def _resolve_target(self, trainer: pl.Trainer, warn: Warn) -> None:
        assert self.run is not None
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
        k, effective = self.run.resolve_target(batch_size, trainer.world_size)
        if self.run.target_schedule is not None:  # a size per stage: name the stages that are not multiples
            per_window = batch_size * trainer.world_size
            sizes = self.run.target_schedule.values()
            uneven = [f"{size} -> K={-(-size // per_window)}" for size in sizes if size % per_window]
            if uneven:
                warn(
                    f"`target_batch_size` stages that are not a multiple of micro-batch size {batch_size} x"
                    f" {trainer.world_size} rank(s) round up: {', '.join(uneven)}."
                )
            return
        if effective != self.plan.target_batch_size:
            warn(
                f"`target_batch_size={self.plan.target_batch_size}` is not a multiple of micro-batch size"
                f" {batch_size} x {trainer.world_size} rank(s); using K={k}, an effective batch size of"
                f" {effective}."
            )
