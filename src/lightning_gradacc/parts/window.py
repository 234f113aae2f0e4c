"""The window: the plan's K and the driver's gradients, micro-batch by micro-batch (every fit has it).

It builds the fit's window driver (the layout's: the core accumulator, or an engine's window) over what the
optimizers step, hands it the plan's K and the checkpoint's state, counts each micro-batch's items, begins
and ends each micro-batch on the driver, and drops a window that can no longer end in a step (an epoch
ended inside it, or Lightning zeroes the gradients where it should go on).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor
from typing_extensions import override

from .. import lightning_internals as internals
from ..core.torch_internals import disarm
from ..core.world import summed_over_ranks
from ..counters import count_micro_batch
from ..fit_accumulator import ParameterGroups, SavedState
from .base import Batch, Declaration, Fit, FitPart

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..core.settings import AccumulationSettings
    from ..window_driver import WindowDriver
    from ..window_plan import WindowPlan


class WindowPart(FitPart):
    """The fit's window: its K from the plan, its gradients in the driver (see the module).

    Args:
        fit: The fit.
        plan: The one owner of K.
        settings: The math settings.
        saved: A checkpoint's state, until the driver takes it.
        previous: The last fit's driver (its counters go on where no checkpoint is loaded).
        sharded_reduction: The callback's ``sharded_reduction``.
        item_count_fn: The item counter, or ``None``.
        budget_count_fn: What an item budget counts, where it is not ``item_count_fn``'s count; or ``None``.
        in_backward: Whether buffers may take each gradient inside the backward.
    """

    saved: ClassVar[Declaration] = {
        "*": "agreed",  # the entry's format stamp
        # every counter is computed from quantities summed over the ranks; the memory peak is the process's
        "accumulator": {"peak_memory_bytes": "local", "*": "agreed"},
        "window": "agreed",  # summed over the ranks by the driver itself
        # the position is the same on every rank; "auto"'s goodput timings are each rank's own clock
        "plan": {"policy": {"timed": "local", "in_flight": "local", "*": "agreed"}, "*": "agreed"},
    }

    def __init__(
        self,
        fit: Fit,
        *,
        plan: WindowPlan,
        settings: AccumulationSettings,
        saved: SavedState,
        previous: WindowDriver | None,
        sharded_reduction: str,
        item_count_fn: Callable[[Any], Any] | None,
        in_backward: bool,
        budget_count_fn: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__(fit)
        self.plan, self.settings, self.saved_state, self.previous = plan, settings, saved, previous
        self.sharded_reduction, self.item_count_fn, self.in_backward = (
            sharded_reduction,
            item_count_fn,
            in_backward,
        )
        self.budget_count_fn = budget_count_fn
        self.groups = ParameterGroups()  # the optimizers' parameter groups the driver tracks
        self.asks_last = False  # whether a backward must know that it ends the window
        self.closes_on_items = False  # an item budget closes the windows (read per batch: no call)
        self.driver: WindowDriver = None  # type: ignore[assignment]  # the fit's, built at train start

    # ---------------------------------------------------------------------------------------- the fit

    @override
    def train_start(self) -> None:
        """Build the reduction and the driver; K, the checkpoint's counters and window go into it."""
        fit, trainer = self.fit, self.fit.trainer
        try:
            fit.sync = fit.layout.reduction(
                trainer, reduction=self.sharded_reduction, per_micro_batch=self.settings.per_micro_batch
            )
        except ValueError as error:
            raise RuntimeError(str(error)) from None
        fit.verify("reduction")
        if self.previous is not None:
            self.previous.remove_hooks()  # its noise-scale hook must not keep measuring
        driver = fit.layout.driver(
            trainer,
            fit.pl_module,
            self.settings,
            scaler=fit.scaler,
            sync=fit.sync,
            in_backward=self.in_backward,
        )
        self.groups.tracked(trainer)
        try:  # K and the loss scale first: a restored window's sums are rescaled to them
            self.plan.attach(trainer, driver, fit.warn)
            # lifetime counters survive a second `fit()` and a resume from a checkpoint
            self.saved_state.restore(driver, self.previous, primary=trainer.global_rank == 0)
        except BaseException:
            driver.remove_hooks()  # it will never be used: its noise-scale hooks must not stay
            raise
        fit.driver = self.driver = driver
        # FSDP reducing at the window's end, or the core flushing its buffers for DDP or a GradScaler
        self.asks_last = fit.sync.defers or driver.uses_last
        self.closes_on_items = self.plan.closes_on_items

    @override
    def epoch_start(self) -> None:
        """A window still open from the last epoch is dropped; the plan's epoch starts."""
        if not self.driver.window.empty:
            self.fit.discard("the previous epoch ended inside it, e.g. `on_train_batch_start` returned -1")
        self.plan.epoch_start(self.fit.trainer)

    @override
    def window_discarded(self) -> None:
        self.driver.reset(set_grads_to_none=True)
        self.plan.window_abandoned()

    @override
    def exception(self) -> None:
        """The plan's position stays (a checkpoint saved after this hook); so does the open window."""
        self.plan.interrupted()
        for optimizer in self.fit.trainer.optimizers:  # a device step armed for a step that never came
            disarm(optimizer)
        self.driver.remove_hooks()  # the next `fit` discards the open window

    @override
    def train_end(self) -> None:
        """A window still open is discarded (it never steps); the plan's fit ends."""
        driver = self.driver
        if not driver.window.empty:
            self.fit.warn(
                f"Training ended inside a window: {driver.window.micro_batches} micro-batch(es) were"
                " back-propagated but never stepped; their gradients are discarded."
            )
            driver.reset(set_grads_to_none=True)
        driver.remove_hooks()
        self.plan.end_fit(self.fit.trainer)

    # ---------------------------------------------------------------------------------- per micro-batch

    @override
    def batch_start(self, batch: Any, batch_idx: int) -> None:
        """The window this batch is in (a new one where Lightning zeroes), and the batch's item count."""
        fit, driver, trainer = self.fit, self.driver, self.fit.trainer
        fit.batch = Batch()
        self._count(batch, batch_idx)
        empty = driver.window.empty
        if empty:  # e.g. `BaseFinetuning` added a group in `on_train_epoch_start`: the window measures
            self.groups.follow(trainer, fit.pl_module, driver)  # the new set from its start
        # forwards only (SWA's BatchNorm epoch): the other callback drives Lightning, and nothing is consumed
        forward_only = internals.backward_skipped(trainer)
        self.plan.batch_start(trainer, forward_only)  # a window opening here gets its K
        if self.closes_on_items and not forward_only:  # where this batch's items reach the budget, it ends
            self.plan.take_items(trainer, self._budget_items(batch, batch_idx))
        lightning_zeroes = self.plan.lightning_zeroes(trainer, batch_idx)
        if not forward_only:
            if not empty and lightning_zeroes:
                fit.discard(f"Lightning starts a new window at batch {batch_idx}")
                self.plan.batch_start(trainer)  # which this batch opens
            elif empty and not lightning_zeroes:
                # A window opening where Lightning does not zero the gradients (the batch before was None
                # from the dataloader, which skips every hook): it must not start from the last one's.
                driver.reset(set_grads_to_none=True)

    def _count(self, batch: Any, batch_idx: int) -> None:
        """The batch's item count, kept in the running batch (a warning about it said once)."""
        fit, current = self.fit, self.fit.batch
        weighted, once = self.settings.mode.weighted, fit.once
        # the labels of "weighted" without a counter are read once (a host read); a count's warning said once
        extract, check_labels = fit.api.extract_batch_size, weighted and "labels" not in once
        counted = count_micro_batch(batch, batch_idx, self.item_count_fn, weighted, extract, check_labels)
        current.items, current.label, current.error = counted.items, counted.label, counted.error
        if check_labels:
            once.add("labels")
        if counted.warning is not None and "counts" not in once:
            once.add("counts")
            fit.warn(counted.warning)

    def _budget_items(self, batch: Any, batch_idx: int) -> float:
        """The running batch's items as an item budget counts them, summed over the ranks.

        ``budget_count_fn``'s count where one is given, else the batch's item count (``item_count_fn``'s, or
        the batch size). One scalar all-reduce (none on one process): every rank decides where the window
        ends from the same number. A count that is not a number >= 0 (on any rank: it reaches every rank
        as a nan) raises on every rank together.
        """
        current, counter = self.fit.batch, "item_count_fn"
        items, error = current.items, current.error
        if self.budget_count_fn is not None:
            items, error, counter = self.budget_count_fn(batch), None, "budget_count_fn"
        local = _finite_count(None if error is not None else items)  # a bad count: nan, summed as one
        total = summed_over_ranks(local, self.fit.pl_module.device)
        if not (math.isfinite(total) and total >= 0):
            why = error or "a count that is not a finite number >= 0, on some rank"
            raise ValueError(
                f"`items_per_step` closes each window on its items, but the item count of batch {batch_idx}"
                f" over the ranks is {total} ({why}). Count every batch with `{counter}` (batch -> number of"
                " items)."
            )
        return total

    @override
    def before_backward(self, loss: Tensor) -> None:
        """Begin the micro-batch: ``loss`` is weighed in place (the core divides K and the AMP scale out).

        ``loss`` is the tensor Lightning back-propagates: its L / K, times the AMP scale under 16-mixed.
        """
        current, trainer = self.fit.batch, self.fit.trainer
        if self.closes_on_items:  # Lightning divided it by this batch's own K: back to the window's
            correction = self.plan.loss_correction(trainer)
            if correction != 1.0:
                loss.mul_(correction)
        # whether this backward ends the window, asked only where it matters (a private Lightning call)
        current.last = last = self.asks_last and not internals.should_accumulate(trainer)
        if current.in_pieces:  # the pieces weigh themselves through their handle
            current.pieces = self.driver.begin_pieces(
                loss,
                current.items,
                hold_in_grad=current.hold_in_grad,
                last=last,
                label=current.label,
                error=current.error,
                in_place=True,
            )
        else:
            self.driver.begin_micro_batch(
                loss, current.items, last=last, label=current.label, error=current.error, in_place=True
            )

    @override
    def after_backward(self) -> None:
        fit, current = self.fit, self.fit.batch
        self.groups.follow(fit.trainer, fit.pl_module, self.driver)  # a group added or changed since
        self.driver.end_micro_batch(reevaluation=current.finalized)
        current.recorded = True  # until `on_train_batch_end`: a save now is mid-batch
        current.backward_ran = True

    @override
    def batch_end(self, outputs: Any) -> None:
        self.fit.batch.recorded, self.fit.batch.ended = False, True
        if self.closes_on_items and isinstance(outputs, Mapping) and isinstance(outputs.get("loss"), Tensor):
            # Lightning's is the loss / this batch's own K, which follows `ready`: the loss as returned
            correction = self.plan.loss_correction(self.fit.trainer)
            if correction != 1.0:
                outputs["loss"].mul_(correction)  # Lightning's detached copy

    # ------------------------------------------------------------------------------------ reporting

    @override
    def statistics(self) -> dict[str, float]:
        """The plan's values (its learning-rate factor, ``"auto"``'s target and estimate)."""
        return self.plan.metrics()

    @override
    def state_dict(self) -> dict[str, Any]:
        """The driver's counters and open window (summed over the ranks), and the plan's position."""
        fit, driver, batch = self.fit, self.driver, self.fit.batch
        if not driver.saves_open_window and not driver.window.empty:
            fit.warn(
                f"This checkpoint is taken inside a window of {driver.window.micro_batches} micro-batch(es)"
                f" under {fit.layout.name}, whose checkpoint holds no accumulated gradients: a resume from"
                " it steps that window on its remaining micro-batches alone. Save at a window's end"
                " (`ModelCheckpoint(every_n_train_steps=...)`) to resume exactly."
            )
        entry = SavedState.save(driver, mid_batch=batch.recorded, in_batch=not batch.ended, warn=fit.warn)
        entry["plan"] = self.plan.state_dict()  # where training stands, inside a window too
        return entry


def _finite_count(items: Any) -> float | Tensor:
    """A count as a number >= 0, or nan (a missing, negative, non-finite or non-scalar count): no host read.

    Example:
        >>> _finite_count(3), _finite_count(-1), _finite_count(torch.tensor([2.0, 1.0]))
        (3.0, nan, nan)
    """
    if isinstance(items, Tensor):
        if items.numel() != 1 or items.is_complex():
            return math.nan
        value = items.detach().reshape(()).double()
        return torch.where(torch.isfinite(value) & (value >= 0), value, math.nan)
    try:
        number = float(items)
    except (TypeError, ValueError):
        return math.nan
    return number if math.isfinite(number) and number >= 0 else math.nan
