"""How many micro-batches a window holds: fixed, an epoch schedule, or derived from a target batch size.

No Lightning import: the callback asks this module *what K is* and decides *when* to apply it.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from .core.validation import ScheduleUnit, check_choice, check_positive_int, check_schedule


def linear_ramp(
    first_k: int, last_k: int, over: int, *, increment: int = 1, start: int = 0
) -> dict[int, int]:
    """A schedule ``{threshold: K}`` growing K from ``first_k`` to ``last_k`` in equal stages over ``over``.

    The form of Megatron-LM's ``--rampup-batch-size <start> <increment> <ramp-up samples>``, in micro-batches
    per step: ``(last_k - first_k) / increment`` increments, one every ``over / increments`` units (steps or
    items, as ``schedule_unit`` says), the last reached at ``start + over``.

    Example:
        >>> linear_ramp(1, 4, 3000)  # K=1 from 0, 2 from 1000, 3 from 2000, 4 from 3000 on
        {0: 1, 1000: 2, 2000: 3, 3000: 4}
        >>> linear_ramp(2, 8, 9_000_000, increment=2, start=1_000_000)
        {0: 2, 4000000: 4, 7000000: 6, 10000000: 8}
    """
    first_k = check_positive_int("first_k", first_k)
    last_k = check_positive_int("last_k", last_k)
    over = check_positive_int("over", over)
    increment = check_positive_int("increment", increment)
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"Expected argument `start` to be an int >= 0, but got {start!r}.")
    steps, rest = divmod(last_k - first_k, increment)
    if last_k < first_k or rest:
        raise ValueError(
            f"Expected `last_k` ({last_k}) to be `first_k` ({first_k}) plus a whole number of `increment`"
            f" ({increment})."
        )
    ramp = {start + round(i * over / steps): first_k + i * increment for i in range(1, steps + 1)}
    return {0: first_k, **ramp}


class AccumulationPlan:
    """The accumulation factor K as configured: an int, a schedule, or a target batch size.

    Args:
        accumulation_steps: K, or a schedule ``{threshold: K}`` (K=1 before the first key), or ``None``.
        target_batch_size: Items per optimizer step wanted over all ranks; K is derived from the micro-batch
            size and the world size by :meth:`resolve_target`. With ``schedule_unit`` ``"steps"`` or
            ``"items"`` also a schedule ``{threshold: batch size}``: each stage's K derived alike.
        schedule_unit: What a schedule's thresholds count: ``"epochs"`` (Lightning's
            ``GradientAccumulationScheduler``), ``"steps"`` (optimizer steps taken: windows closed) or
            ``"items"`` (items consumed by the windows closed, over all ranks). A window's K is the
            schedule's value at the count reached when it opens.

    Example:
        >>> plan = AccumulationPlan({1: 2, 3: 4})
        >>> [plan.for_epoch(epoch) for epoch in range(5)]
        [1, 2, 2, 4, 4]
        >>> [AccumulationPlan({0: 1, 2: 3}, schedule_unit="steps").for_count(steps) for steps in range(4)]
        [1, 1, 3, 3]
    """

    def __init__(
        self, accumulation_steps: Any = None, target_batch_size: Any = None, schedule_unit: Any = "epochs"
    ) -> None:
        if accumulation_steps is not None and target_batch_size is not None:
            raise ValueError(
                f"Expected only one of `accumulation_steps` ({accumulation_steps!r}) and `target_batch_size`"
                f" ({target_batch_size!r}); K is derived from `target_batch_size`, so leave"
                " `accumulation_steps` unset."
            )
        self.unit = check_choice("schedule_unit", schedule_unit, ScheduleUnit)
        self.fixed: int | None = None
        self.schedule: dict[int, int] | None = None
        keyed_target = isinstance(target_batch_size, dict)
        if keyed_target and self.unit == "epochs":
            raise ValueError(
                f"A `target_batch_size` per stage ({target_batch_size!r}) needs `schedule_unit='steps'` or"
                " `'items'`: its thresholds count optimizer steps or items."
            )
        if self.unit != "epochs" and not isinstance(accumulation_steps, dict) and not keyed_target:
            raise ValueError(
                f"Argument `schedule_unit={self.unit!r}` keys a schedule, but `accumulation_steps` is"
                f" {accumulation_steps!r}: pass `accumulation_steps={{0: K0, threshold: K1, ...}}`"
                f" (thresholds counting {self.unit}), or leave `schedule_unit` at 'epochs'."
            )
        if isinstance(accumulation_steps, dict):
            self.schedule = check_schedule("accumulation_steps", accumulation_steps, self.unit)
        elif accumulation_steps is not None:
            self.fixed = check_positive_int("accumulation_steps", accumulation_steps)
        self.target_schedule = (  # batch size per stage, resolved into `schedule` by `resolve_target`
            check_schedule("target_batch_size", target_batch_size, self.unit) if keyed_target else None
        )
        self.target_batch_size: Any = (
            target_batch_size
            if target_batch_size is None or keyed_target
            else check_positive_int("target_batch_size", target_batch_size)
        )
        self.target_k: int | None = None

    def for_run(self, trainer_k: int) -> AccumulationPlan:
        """The plan of one fit: a copy that adopts ``trainer_k`` when nothing was configured.

        The configured plan itself never changes, so a callback reused with another Trainer starts from
        what the user gave (a target batch size is resolved again, an adopted K adopted again).

        Example:
            >>> plan = AccumulationPlan()
            >>> plan.for_run(4).fixed, plan.fixed
            (4, None)
        """
        run = copy.copy(self)
        run.schedule = dict(self.schedule) if self.schedule is not None else None
        run.target_k = None
        if not self.configured:
            run.fixed = check_positive_int("accumulate_grad_batches", trainer_k)
        return run

    def largest_k(self) -> int | None:
        """The largest K this plan can use (``None`` while a target batch size is unresolved)."""
        if self.schedule is not None:
            return max(1, *self.schedule.values())
        return self.for_epoch(0)

    def stepping_batches(
        self,
        batches_per_epoch: int,
        max_epochs: int,
        max_steps: int = -1,
        items_per_batch: int | None = None,
        last_batch_items: int | None = None,
    ) -> int:
        """Optimizer steps of a fit: one per window; windows end at every epoch's end.

        Args:
            batches_per_epoch: Micro-batches per epoch.
            max_epochs: Epochs of the fit.
            max_steps: Lightning's ``max_steps`` (-1: none).
            items_per_batch: Items of every micro-batch over all ranks (``schedule_unit="items"`` only).
            last_batch_items: Items of an epoch's last micro-batch, if it differs (a partial batch).

        Example:
            >>> AccumulationPlan({0: 4, 2: 1}).stepping_batches(10, 3)  # 3 + 3 + 10
            16
            >>> AccumulationPlan({0: 2, 2: 3}, schedule_unit="steps").stepping_batches(10, 1)  # 2 2 | 3 3 | 0
            4
        """
        if self.unit == "items" and items_per_batch is None:
            raise ValueError("A schedule keyed by items needs the items per micro-batch to count steps.")
        steps, items = 0, 0
        for epoch in range(max(max_epochs, 1)):
            if self.unit == "epochs":
                k = self.for_epoch(epoch)
                if k is None:
                    raise RuntimeError("The target batch size is not resolved yet.")
                steps += math.ceil(batches_per_epoch / k)
                continue
            left = batches_per_epoch
            while left > 0:
                window = min(self.for_count(steps if self.unit == "steps" else items), left)
                left -= window
                items += window * (items_per_batch or 0)
                if left == 0 and last_batch_items is not None:  # the epoch's last batch is partial
                    items += last_batch_items - (items_per_batch or 0)
                steps += 1
                if max_steps != -1 and steps >= max_steps:
                    return max_steps
        return min(steps, max_steps) if max_steps != -1 else steps

    @property
    def keyed_by_count(self) -> bool:
        """Whether K changes between windows inside an epoch (a schedule of steps or items)."""
        return self.schedule is not None and self.unit != "epochs"

    def for_count(self, count: float) -> int:
        """K of a window opening when ``count`` steps or items are done (1 before the first key)."""
        assert self.schedule is not None
        k = 1
        for threshold, steps in self.schedule.items():
            if threshold > count:
                break
            k = steps
        return k

    @property
    def configured(self) -> bool:
        """Whether K comes from this plan (else it is adopted from elsewhere, e.g. the Trainer)."""
        return self.fixed is not None or self.schedule is not None or self.target_batch_size is not None

    def for_epoch(self, epoch: int) -> int | None:
        """K for ``epoch``; ``None`` while a target batch size has not been resolved.

        A schedule of steps or items gives its first K (the callback then sets K window by window).
        """
        if self.keyed_by_count:
            return self.for_count(0)
        if self.schedule is not None:
            started = [steps for first_epoch, steps in self.schedule.items() if first_epoch <= epoch]
            return started[-1] if started else 1
        if self.target_batch_size is not None:
            return self.target_k
        return self.fixed

    def resolve_target(self, micro_batch_size: int, world_size: int) -> tuple[int, int]:
        """Derive K = ceil(target / (micro-batch size x world size)).

        Returns:
            ``(K, effective batch size)``; the two sizes differ when the target is not a multiple.

        Example:
            >>> AccumulationPlan(target_batch_size=100).resolve_target(16, 2)
            (4, 128)
        """
        if self.target_batch_size is None:
            raise RuntimeError("No `target_batch_size` to resolve.")
        per_window = micro_batch_size * world_size
        if self.target_schedule is not None:  # each stage alike; the first stage's K and size returned
            self.schedule = {
                threshold: max(1, math.ceil(size / per_window))
                for threshold, size in self.target_schedule.items()
            }
            self.target_k = self.for_count(0)
            return self.target_k, self.target_k * per_window
        self.target_k = max(1, math.ceil(self.target_batch_size / per_window))
        return self.target_k, self.target_k * per_window
