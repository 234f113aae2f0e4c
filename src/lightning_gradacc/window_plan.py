"""The one owner of K: which K each window runs with, written into Lightning and the core from one place.

K lives in three places that must agree: ``trainer.accumulate_grad_batches`` (Lightning's loops read it:
where it zeroes, where it steps, what it divides every loss by), the core's ``accumulation_steps`` (when a
window is full) and its ``loss_scale`` (the 1/K every gradient carries). :class:`WindowPlan` is the only
writer of all three. It asks its policy (:mod:`~lightning_gradacc.k_policies`) what K a window gets when
the window opens, owns the position of training (steps, items consumed, the open window's K and
Lightning's K, batches in the window), saves and restores it, and handles every transition in one place:
a fit starting, a window opening, a window restored from a checkpoint, a window abandoned, the end of a
fit. The learning-rate factor, the step estimates and the summary read it.

**Driving Lightning window by window.** Lightning decides by modulo (2.6, ``loops/optimization/automatic.py``,
``loops/training_epoch_loop.py``): it zeroes the gradients before the backward of batch ``n`` when
``n % K == 0``, steps after it when ``ready % K == 0`` (``ready``: batches fetched this epoch, ``n + 1``) or
at the epoch's last batch, and divides the loss by ``K``. A policy that changes K inside an epoch cannot
keep one K for the fit: the window after a change would start where Lightning does not zero and end where it
does not step. One K per window drives it exactly: a window of ``L`` batches whose last one is fetched as
``ready = e`` needs a K that divides ``e`` (the step) and none of ``e - L + 1 .. e - 1`` (no step, and no
zeroing, inside the window). Any divisor of ``e`` that is at least ``L`` does: the multiple before ``e`` is
then at most ``e - L``. The smallest such power of two is taken where one exists (Lightning's division of the
loss, which the core's loss scale undoes at the boundary, is then exact), else the smallest such divisor. A
window that the epoch's end cuts short still ends there: Lightning steps at the epoch's last batch in any
case. The window's first batch is zeroed by the callback where Lightning does not.

**A strategy that accumulates itself** (DeepSpeed: ``handles_gradient_accumulation``) is stepped by Lightning
at an epoch's last batch only where ``ready % K == 0``. There every window is driven (``closes_epoch_tail``),
a fixed K included: a window the epoch's end cuts short gets a K that divides its real end, so that Lightning
counts its step (and steps its LR schedulers) where the engine takes it. The engine's driver is told the
window's own length beside its K (``EngineWindow.window_length``: its boundary and its normalization need
it before the window's first backward).

**The learning rate follows K** (``lr_scaling``): every step's learning rates are multiplied by
``(K of its window / K of the first window) ** p`` just before ``optimizer.step`` and restored just after it
(torch's step pre- and post-hooks), so LR schedulers, which set or read ``param_groups[i]["lr"]`` between
steps, never see the factor.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from . import lightning_internals as internals
from .core.settings import check_choice
from .engine_window import EngineWindow
from .k_policies import FixedK, KPolicy, WindowFacts, stepping_batches
from .lr_schedule import TokenSchedule

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from .window_driver import WindowDriver

Warn = Callable[[str], Any]
LRScalingMode = Literal["none", "sqrt", "linear"]
POWERS = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}
# an item budget of `lr_schedule` this far from what the fit will consume is warned of (at its first window)
BUDGET_TOLERANCE = 1.25


def window_lightning_k(first_ready: int, window_k: int) -> int:
    """The ``accumulate_grad_batches`` for a whole window of ``window_k`` batches (see the module).

    Args:
        first_ready: ``ready`` at the window's first batch (Lightning's ``batch_progress.current.ready``).
        window_k: The window's K.

    Example:
        >>> window_lightning_k(1, 2), window_lightning_k(3, 3), window_lightning_k(6, 3)  # ends at 2, 5, 8
        (2, 5, 4)
    """
    end = first_ready + window_k - 1
    power = end & -end  # the largest power of two dividing `end`
    if power >= window_k:
        return 1 << max(window_k - 1, 0).bit_length()  # the smallest power of two >= window_k divides `end`
    for k in range(window_k, end + 1):
        if end % k == 0:
            return k
    return end  # not reached: `end` divides itself and end >= window_k


@dataclass
class Position:
    """Where training stands: what the policies read, saved with a checkpoint (plain numbers).

    Attributes:
        steps: Windows closed so far (optimizer steps taken or skipped).
        items: Items of the windows closed so far, over all ranks (counted when the policy needs them).
        window_k: K of the open window (or of the last one): the policy's answer when it opened.
        lightning_k: ``accumulate_grad_batches`` for the open window: what Lightning divides its losses by.
        batches_in_window: Batches of the open window started so far (0: no window open).
        window_items: Items of the open window so far, over all ranks (an item budget closes it).
    """

    steps: int = 0
    items: float = 0.0
    window_k: int = 1
    lightning_k: int = 1
    batches_in_window: int = 0
    window_items: float = 0.0


class WindowPlan:
    """The only writer of K: Lightning's ``accumulate_grad_batches``, the core's K and its loss scale.

    Args:
        policy: How K is chosen, as configured (never changed: each fit works on its own copy).
        lr_scaling: ``"none"``, ``"sqrt"`` or ``"linear"``: every step's learning rates times
            ``(K_window / K_first) ** p`` with p = 0, 1/2 or 1.
        lr_schedule: A schedule by items consumed: every step's learning rates also times its factor at
            the items of the windows closed before the step's (over all ranks).

    Attributes:
        policy: The configured policy.
        run: The policy of the current fit (``None`` before the first ``setup``).
        position: Where training stands.
        lr_factor: The learning-rate factor of the last step (1 before any).

    Example:
        >>> from lightning_gradacc.k_policies import KeyedSchedule
        >>> plan = WindowPlan(KeyedSchedule({0: 2, 1: 3}, "steps"))
        >>> plan.run = plan.policy.for_fit(1)
        >>> for ready in range(1, 6):  # batches 0-4: windows of 2 and 3
        ...     _ = plan.open_window(ready) if plan.position.batches_in_window == 0 else None
        ...     plan.position.batches_in_window += 1
        ...     if plan.position.batches_in_window == plan.position.window_k:
        ...         plan.position.steps, plan.position.batches_in_window = plan.position.steps + 1, 0
        >>> plan.position.steps, plan.position.window_k, plan.position.lightning_k
        (2, 3, 5)
    """

    def __init__(
        self, policy: KPolicy, lr_scaling: Any = "none", lr_schedule: TokenSchedule | None = None
    ) -> None:
        self.policy = policy
        self.lr_schedule = lr_schedule
        # the items before the window that steps next: the step's pre-hook runs before Lightning's closure
        # closes the window, or after it where the callback steps the window itself
        self._items_before = 0.0
        self._closed_unstepped = False
        self.run: KPolicy | None = None
        self.position = Position()
        self.lr_scaling = check_choice("lr_scaling", lr_scaling, LRScalingMode)
        self.lr_factor = 1.0
        self._power = POWERS[self.lr_scaling]
        self._trainer: weakref.ref[pl.Trainer] | None = None  # the Trainer K was last written into
        self._written: int | None = None  # the value last written into it
        self._user_k: int | None = None  # its `accumulate_grad_batches` as the user set it
        self._built_train_data = False  # the train dataloader was built in `setup` (a target batch size)
        self._world_size = 1  # the fit's ranks
        self._restored = False  # a checkpoint's position was loaded, not yet attached to a fit
        self._warn: Warn | None = None  # the fit's (rank zero's) warning
        self._budget_checked = False  # the fit's item estimate was compared with `lr_schedule.total`
        self._accumulator: WindowDriver | None = None  # the fit's, once attached
        self._hooks: list[Any] = []  # the optimizers' step pre- and post-hooks (lr_scaling)
        self._saved_lrs: list[tuple[dict[str, Any], Any]] = []
        # Lightning does not step at an epoch's end by itself (a strategy that accumulates): every window
        # is driven and ends where its batches do (set by the callback for the fit's layout)
        self.closes_epoch_tail = False
        # an item budget counted by `budget_count_fn`: its windows consumed what it counted (every batch's
        # items, taken at each batch start); else what the windows recorded, as for every policy
        self.budget_counted_apart = False

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # ddp_spawn pickles the callbacks: a fit's objects stay behind
        state.update(_trainer=None, _accumulator=None, _hooks=[], _saved_lrs=[])
        return state

    # ------------------------------------------------------------------------------------------ reading

    @property
    def _policy(self) -> KPolicy:
        return self.run if self.run is not None else self.policy

    @property
    def accumulation_steps(self) -> int:
        """K of the open (or last) window; before training, the policy's first K (1 if unresolved)."""
        if self.run is None:
            return self.policy.first_k() or 1
        return self.position.window_k

    def largest_k(self) -> int | None:
        """The largest K of the current fit (``None`` while a target batch size is unresolved)."""
        return self._policy.largest_k()

    def describe(self) -> str:
        """How K is chosen, for messages."""
        return self._policy.describe()

    def progress(self) -> str | None:
        """Where training stands in a policy that changes K by steps or items (the summary's row)."""
        return self._policy.progress(self.position.steps, self.position.items)

    def metrics(self) -> dict[str, float]:
        """What the plan logs at each step: ``lr_factor`` (``lr_scaling``, ``lr_schedule``), the policy's."""
        factor = {"lr_factor": self.lr_factor} if self._scales_lrs else {}
        return {**factor, **self._policy.metrics()}

    def lightning_k(self) -> int:
        """What Lightning divides each loss of the open window by (its ``accumulate_grad_batches``)."""
        return self.position.lightning_k

    @staticmethod
    def lightning_zeroes(trainer: pl.Trainer, batch_idx: int) -> bool:
        """Whether Lightning zeroes the gradients before batch ``batch_idx``: its own test, on its own K.

        Lightning's copy, not the plan's: another callback may drive it for an epoch of its own.
        """
        return batch_idx % trainer.accumulate_grad_batches == 0

    @property
    def items_consumed(self) -> float | None:
        """Items of the windows closed so far, over all ranks.

        ``None`` before training, or when the fit's policy does not count them.
        """
        return self.position.items if self.run is not None and self._counts_items else None

    @property
    def closes_on_items(self) -> bool:
        """Whether an item budget closes each window (:meth:`take_items` decides, batch by batch)."""
        return self._policy.budget is not None

    def loss_correction(self, trainer: pl.Trainer) -> float:
        """What the running batch's loss must be multiplied by to carry the core's loss scale.

        Lightning divides it by its ``accumulate_grad_batches``; the core expects 1 / Lightning's K of the
        window. They differ only under an item budget, whose Lightning K changes batch by batch.
        """
        accumulator = self._accumulator
        scale = accumulator.loss_scale if accumulator is not None else 1.0
        return float(trainer.accumulate_grad_batches) * scale

    @property
    def _drives_windows(self) -> bool:
        """Whether a K is written window by window (else once per epoch)."""
        return self._policy.per_window or self.closes_epoch_tail

    def window_length(self, trainer: pl.Trainer, first_ready: int, k: int) -> int:
        """Micro-batches of a window of K ``k`` opening at ``first_ready``: cut at the epoch's end if needed.

        Only where the plan closes an epoch's tail itself (``closes_epoch_tail``) and the epoch's length is
        known; else ``k``.
        """
        batches = trainer.num_training_batches
        if not self.closes_epoch_tail or not math.isfinite(batches):
            return k
        return max(1, min(k, int(batches) - first_ready + 1))

    @property
    def _counts_items(self) -> bool:
        """Whether the items of each window are read (a host read per step): for the policy or the LR."""
        return self._policy.counts_items or self.lr_schedule is not None

    @property
    def _scales_lrs(self) -> bool:
        return self._power != 0.0 or self.lr_schedule is not None

    def stepping_batches(
        self, trainer: pl.Trainer, *, counts_samples: bool = True, most: bool = False
    ) -> int | float:
        """The exact number of optimizer steps of the fit under the policy.

        Args:
            trainer: The Trainer of the fit.
            counts_samples: Whether an item is a sample (no ``item_count_fn``): a policy keyed by items is
                then simulated from the train dataloader's batch sizes; with tokens it cannot be known
                before the data is read, and ``ValueError`` says so.
            most: For a policy that chooses K while training (``"auto"``), the most steps the fit can take
                (every window at the smallest K it may choose) instead of ``ValueError``.

        Raises:
            ValueError: The count cannot be known before training (K chosen while training, or keyed by
                tokens).
        """
        policy = self._policy
        if policy.budget is not None and not counts_samples:
            if not most:
                raise ValueError(
                    f"`{policy.describe()}` closes each window on its items as"
                    " `item_count_fn` or `budget_count_fn` counts them:"
                    " its optimizer steps are not known before the data is read. Schedule the learning rate"
                    " over the items consumed (`lr_schedule=TokenSchedule(...)`), or size a step schedule"
                    " for the most steps this fit can take: `estimated_stepping_batches(trainer, most=True)`"
                    " (one per micro-batch)."
                )
            policy = FixedK(1)
        if policy.adaptive:
            if not most:
                raise ValueError(
                    f"{policy.describe()} chooses K while training: its optimizer steps are not known before."
                    " Build the learning-rate schedule on something that is (a warmup and decay over"
                    " `callback.items_consumed`, or a scheduler without a step count), or size it for the"
                    " most steps this fit can take: `estimated_stepping_batches(trainer, most=True)`."
                )
            policy = FixedK(policy.smallest_k())
        with internals.reading_train_data_early(trainer):  # loads the train dataloader if needed
            lightning_estimate = trainer.estimated_stepping_batches
        batches = trainer.num_training_batches
        if (
            (policy.constant and policy is self._policy)  # Lightning's estimate holds for one K
            or policy.first_k() is None  # a target not resolved yet: Lightning's estimate at K=1 (warned)
            or trainer.max_epochs in (None, -1)
            or batches == float("inf")
        ):
            return lightning_estimate
        assert trainer.max_epochs is not None
        items = [0.0] * int(batches)
        if policy.counts_items:
            try:
                items = self._batch_items(trainer, int(batches), counts_samples)
            except ValueError:
                if not (most and policy.budget is not None):
                    raise
                return stepping_batches(FixedK(1), items, trainer.max_epochs, trainer.max_steps)
        return stepping_batches(policy, items, trainer.max_epochs, trainer.max_steps)

    @staticmethod
    def _batch_items(trainer: pl.Trainer, batches: int, counts_samples: bool) -> list[float]:
        """Items of each micro-batch of an epoch, over all ranks, from the train dataloader.

        Each rank reads ``len(sampler)`` samples (a ``DistributedSampler`` pads every rank to the same
        number), in batches of ``batch_size``; the epoch runs ``batches`` of them (``limit_train_batches``).
        """
        loader: Any = trainer.train_dataloader
        batch_size = getattr(loader, "batch_size", None)
        if not counts_samples or not isinstance(batch_size, int):
            raise ValueError(
                "The optimizer steps of a schedule keyed by items cannot be counted before training when"
                " an item is not a sample of a fixed-size micro-batch (an `item_count_fn` counts tokens,"
                " or the dataloader has no `batch_size`). Build step-interval schedulers from an upper"
                " bound (e.g. `trainer.estimated_stepping_batches` at the first K) or key the schedule by"
                " `schedule_unit='steps'`."
            )
        sampler = getattr(loader, "sampler", None)
        per_rank = len(sampler) if hasattr(sampler, "__len__") else None  # type: ignore[arg-type]
        if per_rank is None or getattr(loader, "drop_last", False):
            sizes = [batch_size] * batches
        else:
            sizes = [max(0, min(batch_size, per_rank - i * batch_size)) for i in range(batches)]
        return [float(size * trainer.world_size) for size in sizes]

    # -------------------------------------------------------------------------------------- writing

    def _write(self, trainer: pl.Trainer, window_k: int, lightning_k: int, length: int | None = None) -> None:
        """The one place K is written: into Lightning, the core's K and its loss scale (1 / Lightning's K).

        ``length``: the window's own micro-batches where the epoch's end cuts it (``closes_epoch_tail``).
        """
        self.position.window_k, self.position.lightning_k = window_k, lightning_k
        trainer.accumulate_grad_batches = lightning_k
        self._written = lightning_k
        self._trainer = weakref.ref(trainer)
        accumulator = self._accumulator
        if accumulator is not None:
            accumulator.accumulation_steps = window_k
            if self.closes_epoch_tail and isinstance(accumulator, EngineWindow):  # before its first backward
                accumulator.window_length = window_k if length is None else length
            # what Lightning divides every loss by; under an item budget its K changes batch by batch, and
            # each loss is brought back to 1 before its backward (`loss_correction`)
            accumulator.loss_scale = 1.0 if self.closes_on_items else 1.0 / lightning_k

    def _k_now(self, trainer: pl.Trainer) -> int | None:
        return self._policy.k_at(trainer.current_epoch, self.position.steps, self.position.items)

    # ---------------------------------------------------------------------------------- transitions

    def start_fit(self, trainer: pl.Trainer, warn: Warn) -> None:
        """A fit starts (``setup``): its own policy, K written before ``configure_optimizers`` reads it.

        A window left open by the last fit (it raised, or was interrupted, inside it) is abandoned: it can
        never be stepped, and windows never merge. A checkpoint loaded after this restores its own position.

        Raises:
            ValueError: ``Trainer(accumulate_grad_batches=...)`` contradicts the configured K.
        """
        trainer_k = trainer.accumulate_grad_batches
        ours = self._written if self._trainer is not None and self._trainer() is trainer else None
        if trainer_k != ours:
            self._user_k = trainer_k
        if self.policy.configured and trainer_k not in (1, ours, getattr(self.policy, "k", None)):
            raise ValueError(
                f"You have set `Trainer(accumulate_grad_batches={trainer_k})` and"
                f" `GradientAccumulationCallback({self.policy.describe()})`. The callback owns the"
                " accumulation factor: remove `accumulate_grad_batches` from the Trainer"
                + (" or set the same value." if getattr(self.policy, "k", None) is not None else ".")
            )
        previous, self._world_size = self.run, trainer.world_size
        self._warn, self._budget_checked = warn, False
        self.run = self.policy.for_fit(self._user_k or 1, trainer.world_size)
        if previous is not None:  # what an adaptive policy learned goes on (a checkpoint replaces it)
            self.run.load_state_dict(previous.state_dict())
        self._accumulator = None
        self._built_train_data = False
        self.position.batches_in_window = 0
        if self.run.needs_micro_batch_size:  # now, so that `configure_optimizers` sees K
            self._resolve_target_early(trainer, warn)
        k = self._k_now(trainer)
        if k is not None:
            self._write(trainer, k, k)

    def attach(self, trainer: pl.Trainer, accumulator: WindowDriver, warn: Warn) -> None:
        """Training starts (``on_train_start``): K written into the fit's new accumulator, LR hooks placed.

        A window restored from a checkpoint goes on with its own K and Lightning's K (a policy keyed by steps
        or items chose them when it opened); otherwise K is the policy's at the position reached. Call it
        before the saved window is loaded into ``accumulator`` (its sums are rescaled to the loss scale
        written here).
        """
        if self.run is not None and self.run.needs_micro_batch_size:
            self._resolve_target_again(trainer, warn)
        self._accumulator = accumulator
        position, restored, self._restored = self.position, self._restored, False
        if position.batches_in_window and self._drives_windows:
            length = None
            if (
                self.closes_epoch_tail
            ):  # the restored window ends at Lightning's K's first multiple from its start
                first = internals.batches_ready(trainer) - position.batches_in_window + 1
                length = -(-first // position.lightning_k) * position.lightning_k - first + 1
            self._write(trainer, position.window_k, position.lightning_k, length)
        else:
            k = self._k_now(trainer)
            assert k is not None
            # Restored between windows, Lightning's restarted epoch loop asks whether the saved batch stepped
            # (`ready % K == 0`) to advance its logging step: it must see the K it ran that window with (the
            # next window opening writes its own)
            self._write(trainer, k, position.lightning_k if restored and self._drives_windows else k)
        self._hook_optimizers(trainer.optimizers)

    def epoch_start(self, trainer: pl.Trainer) -> None:
        """An epoch starts: a window still open there is abandoned; a K per epoch is written."""
        self.position.batches_in_window = 0
        self.position.window_items = 0.0
        self._policy.epoch_started()
        if not self._drives_windows:
            k = self._k_now(trainer)
            assert k is not None
            self._write(trainer, k, k)

    def batch_start(self, trainer: pl.Trainer, forward_only: bool = False) -> bool:
        """A batch starts; returns whether it opens a window.

        A policy that changes K between windows chooses and writes the window's K here. A K per epoch was
        written when the epoch started and is not written again (another callback may drive Lightning for
        an epoch of its own: ``StochasticWeightAveraging``'s BatchNorm epoch is one window of every batch).
        In a batch of forwards only (``forward_only``: that epoch's) no window is chosen or written either:
        Lightning's K is the other callback's, and the window it steps is empty.
        """
        position, policy = self.position, self._policy
        opens = position.batches_in_window == 0
        self._closed_unstepped = self._closed_unstepped and not opens  # a window skipped took no step
        if opens and not forward_only and (policy.per_window or self.closes_epoch_tail):  # `_drives_windows`
            self.open_window(internals.batches_ready(trainer), trainer)
        position.batches_in_window += 1
        riders = policy.batch_started()  # e.g. the batch times of "auto"'s goodput rule
        if riders is not None and self._accumulator is not None:
            self._accumulator.ride(riders)
        return opens

    def open_window(self, ready: int, trainer: pl.Trainer | None = None) -> int:
        """Choose the K of a window whose first batch is fetched as ``ready``; write it (with a Trainer)."""
        epoch = trainer.current_epoch if trainer is not None else 0
        k = self._policy.k_at(epoch, self.position.steps, self.position.items)
        assert k is not None
        length = self.window_length(trainer, ready, k) if trainer is not None else k
        lightning_k = window_lightning_k(ready, length) if self._drives_windows else k
        if trainer is not None:
            self._write(trainer, k, lightning_k, length if self.closes_epoch_tail else None)
        else:
            self.position.window_k, self.position.lightning_k = k, lightning_k
        return k

    def take_items(self, trainer: pl.Trainer, items: float) -> bool:
        """An item budget: add the running batch's items (over all ranks); whether it closes the window.

        Lightning is driven for this batch alone: where the window goes on, the power of two above ``ready``,
        which divides neither it nor the batch before (no step, no zeroing); where it closes, the smallest
        K of at least the window's length that divides ``ready`` (:func:`window_lightning_k`). An epoch's
        last batch closes a window in any case.
        """
        position, budget = self.position, self._policy.budget
        assert budget is not None
        position.window_items += items
        ready = internals.batches_ready(trainer)
        closes = position.window_items >= budget
        length = position.batches_in_window
        # going on: a power of two above `ready` divides neither it nor the batch before (exact in any float)
        lightning_k = window_lightning_k(ready - length + 1, length) if closes else 1 << ready.bit_length()
        # the core's K grows with the window (full where the budget ends it); its loss scale stays 1
        self._write(trainer, length if closes else length + 1, lightning_k)
        return closes

    def window_closed(self, accumulator: WindowDriver) -> None:
        """The open window was finalized (stepped or skipped) by ``accumulator``.

        Its items over all ranks are read (a host read) only where the policy counts them; an adaptive
        policy is handed what the window measured (:class:`~lightning_gradacc.k_policies.WindowFacts`).
        """
        position, policy = self.position, self._policy
        position.steps += 1
        self._items_before, self._closed_unstepped = position.items, True  # this window's step's index
        budget_items, position.window_items = position.window_items, 0.0
        if self._counts_items:
            apart = self.budget_counted_apart and policy.budget is not None
            window_items = budget_items if apart else accumulator.statistic("items_last_step")
            position.items += window_items
            if not self._budget_checked:
                self._check_schedule_budget(window_items, position.batches_in_window)
        position.batches_in_window = 0
        if policy.adaptive:
            policy.window_closed(
                WindowFacts(
                    steps=position.steps,
                    items_consumed=position.items,
                    k=position.window_k,
                    micro_batches=int(accumulator.statistic("micro_batches_last_step")),
                    world_size=self._world_size,
                    items=accumulator.statistic("items_last_step"),
                    noise_scale=accumulator.statistic("noise_scale"),
                    ridden=accumulator.ridden,
                )
            )

    def window_abandoned(self) -> None:
        """The open window was discarded (an epoch or a fit ended inside it): the next batch opens one."""
        self.position.batches_in_window = 0
        self.position.window_items = 0.0

    def end_fit(self, trainer: pl.Trainer) -> None:
        """The fit ended: a window open there is abandoned, the hooks removed.

        A policy that drove Lightning window by window gives the user's ``accumulate_grad_batches`` back (the
        driven values are divisors of batch counts, meaningless outside the fit). A K per epoch stays in the
        Trainer, as Lightning's ``GradientAccumulationScheduler`` leaves it.
        """
        self.window_abandoned()
        self.interrupted()
        if self._drives_windows and self._user_k is not None:
            trainer.accumulate_grad_batches = self._user_k
            self._written = self._user_k

    def untrained(self, trainer: pl.Trainer) -> None:
        """The fit ended before training started: the user's ``accumulate_grad_batches`` goes back.

        ``Tuner.scale_batch_size`` ends its fit in ``on_fit_start``, after ``setup`` wrote K; nothing was
        accumulated, and the Trainer must read as the user left it (as with Lightning's scheduler, which
        writes K only when an epoch starts).
        """
        if self._user_k is not None and trainer.accumulate_grad_batches == self._written:
            trainer.accumulate_grad_batches = self._written = self._user_k

    def interrupted(self) -> None:
        """The fit raised: the learning-rate hooks go; the position stays for a checkpoint saved after."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._restore_lrs()
        self._accumulator = None

    # ---------------------------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """The position (and what the policy learned), as plain numbers."""
        return {**asdict(self.position), "policy": self._policy.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position (a checkpoint taken inside a window resumes inside it)."""
        self.position = Position(
            steps=int(state["steps"]),
            items=float(state["items"]),
            window_k=int(state["window_k"]),
            lightning_k=int(state["lightning_k"]),
            batches_in_window=int(state["batches_in_window"]),
            window_items=float(state.get("window_items", 0.0)),  # absent before item budgets
        )
        self._restored = True
        self._policy.load_state_dict(state.get("policy") or {})
        trainer = self._trainer() if self._trainer is not None else None
        if self._built_train_data and trainer is not None:  # built in `setup`, before the loop's state
            internals.forget_train_data(trainer)  # the fit builds it again and restores its position
            self._built_train_data = False

    def _check_schedule_budget(self, window_items: float, window_batches: int) -> None:
        """Warn once per fit where ``lr_schedule``'s item budget and what the fit will consume disagree.

        The fit's items are estimated from its first window with items: its items per batch (over the ranks)
        times the batches the Trainer's limits allow (``max_epochs`` x batches per epoch, or ``max_steps``
        windows of the current K).
        """
        schedule, trainer = self.lr_schedule, self._trainer() if self._trainer is not None else None
        if (
            schedule is None
            or trainer is None
            or self._warn is None
            or not (window_items > 0 and window_batches)
        ):
            return
        self._budget_checked = True
        per_epoch, epochs, steps = trainer.num_training_batches, trainer.max_epochs, trainer.max_steps
        bounds = []
        if per_epoch != float("inf") and epochs not in (None, -1):
            bounds.append(float(per_epoch) * float(epochs))
        if steps is not None and steps > 0:
            bounds.append(float(steps) * self.position.window_k)
        if not bounds:
            return
        batches = min(bounds)
        estimate = window_items / window_batches * batches
        total = float(schedule.total)
        if 1.0 / BUDGET_TOLERANCE <= estimate / total <= BUDGET_TOLERANCE:
            return
        self._warn(
            f"`lr_schedule` spans {total:,.0f} items (`total`), but this fit will consume about"
            f" {estimate:,.0f} ({window_items / window_batches:,.1f} items per batch in its first window x"
            f" {batches:,.0f} batches): the learning rate ends at {schedule.factor(estimate):.2f} of its peak"
            f" (`final={schedule.final:g}`). Set `lr_schedule.total` to the items the run consumes."
        )

    # ------------------------------------------------------------------------------ learning rate

    def _hook_optimizers(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if not self._scales_lrs:
            return
        for optimizer in optimizers:
            if not isinstance(optimizer, torch.optim.Optimizer):  # an engine's (DeepSpeed's ZeRO optimizer)
                self._hooks.append(_AroundStep(optimizer, self._scale_lrs, self._unscale_lrs))
                continue
            self._hooks.append(optimizer.register_step_pre_hook(self._scale_lrs))
            self._hooks.append(optimizer.register_step_post_hook(self._unscale_lrs))

    def _scale_lrs(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        first = self._policy.first_k() or 1
        self.lr_factor = (self.position.window_k / first) ** self._power
        if self.lr_schedule is not None:
            items = self._items_before if self._closed_unstepped else self.position.items
            self.lr_factor *= self.lr_schedule.factor(items)
        if self.lr_factor == 1.0:
            return
        for group in optimizer.param_groups:
            self._saved_lrs.append((group, group["lr"]))
            group["lr"] = group["lr"] * self.lr_factor

    def _unscale_lrs(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._closed_unstepped = False
        self._restore_lrs()

    def _restore_lrs(self) -> None:
        for group, lr in self._saved_lrs:
            group["lr"] = lr  # the very object the scheduler set (a float, or a tensor for capturable)
        self._saved_lrs.clear()

    # ---------------------------------------------------------------------------- target batch size

    def _resolve_target_early(self, trainer: pl.Trainer, warn: Warn) -> None:
        """Resolve K from the target batch size in ``setup``, so that ``configure_optimizers`` sees it."""
        with internals.reading_train_data_early(trainer) as built:
            try:
                internals.load_train_data(trainer)  # what `trainer.estimated_stepping_batches` does
            except Exception as error:  # e.g. data built in LightningModule.setup, which runs after this hook
                warn(
                    f"`{self.policy.describe()}` could not read the train dataloader in `setup`"
                    f" ({type(error).__name__}: {error}); K is resolved when training starts instead, so"
                    " `trainer.estimated_stepping_batches` in `configure_optimizers` assumes K=1. Build the"
                    " data in `__init__`, `prepare_data` or a LightningDataModule, or set"
                    " `accumulation_steps`."
                )
                return
            self._resolve_target(trainer, warn)
        self._built_train_data = built[0]  # forgotten if a checkpoint is restored (`load_state_dict`)

    def _resolve_target_again(self, trainer: pl.Trainer, warn: Warn) -> None:
        """Resolve K again at train start: the micro-batch size may have changed (``BatchSizeFinder``)."""
        run = self.run
        assert run is not None
        before = run.first_k()
        self._resolve_target(trainer, warn)
        if before not in (None, run.first_k()):
            warn(
                f"The micro-batch size changed after `setup` (e.g. `BatchSizeFinder`): K is now"
                f" {run.first_k()} for `{self.policy.describe()}`;"
                " `trainer.estimated_stepping_batches` read in `configure_optimizers` used"
                f" K={before}."
            )

    def _resolve_target(self, trainer: pl.Trainer, warn: Warn) -> None:
        assert self.run is not None
        loader = trainer.train_dataloader
        batch_size = getattr(loader, "batch_size", None) or getattr(
            getattr(loader, "batch_sampler", None), "batch_size", None
        )
        if not isinstance(batch_size, int) or batch_size < 1:
            raise RuntimeError(
                f"`{self.policy.describe()}` needs the micro-batch size, but the train"
                f" dataloader ({type(loader).__name__}) has no fixed `batch_size`. Use a single DataLoader"
                " with `batch_size=...` or set `accumulation_steps` instead."
            )
        for message in self.run.resolve(batch_size, trainer.world_size):
            warn(message)


class _AroundStep:
    """Pre- and post-step hooks on an optimizer that is not torch's: its ``step`` wrapped on the instance.

    DeepSpeed's ZeRO optimizer wraps torch's and steps it once per parameter group (with ``param_groups``
    cut to that group): torch's hooks on the inner one would run once per group, so the factor goes around
    the outer step, over its ``param_groups`` (the inner's dictionaries), once per window.

    Example:
        >>> class Engine:
        ...     param_groups = [{"lr": 1.0}]
        ...     def step(self): print("lr", self.param_groups[0]["lr"])
        >>> engine = Engine()
        >>> def double(o, args, kwargs): o.param_groups[0]["lr"] *= 2
        >>> def halve(o, args, kwargs): o.param_groups[0]["lr"] /= 2
        >>> hooks = _AroundStep(engine, double, halve)
        >>> engine.step()
        lr 2.0
        >>> hooks.remove(); engine.step()
        lr 1.0
    """

    def __init__(self, optimizer: Any, pre: Callable[..., None], post: Callable[..., None]) -> None:
        self.optimizer = optimizer
        step = optimizer.step

        def around(*args: Any, **kwargs: Any) -> Any:
            pre(optimizer, args, kwargs)
            try:
                return step(*args, **kwargs)
            finally:  # the scheduler's learning rates come back even if the step raised
                post(optimizer, args, kwargs)

        optimizer.step = around

    def remove(self) -> None:
        """Give the optimizer its own ``step`` back (the class's shows again)."""
        self.optimizer.__dict__.pop("step", None)
