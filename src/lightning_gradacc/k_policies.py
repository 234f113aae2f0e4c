"""How many micro-batches a window holds: the policies of the one K authority, the window plan.

A policy says *what K is* for a window that opens at a given point of training: a fixed K (configured, or
adopted from ``Trainer(accumulate_grad_batches=...)``), a schedule keyed by epochs (Lightning's
``GradientAccumulationScheduler``), one keyed by optimizer steps or items consumed (K changes between windows
inside an epoch), or K derived from a target batch size (fixed, or per stage). It never writes K anywhere:
:class:`~lightning_gradacc.window_plan.WindowPlan` asks it when a window opens and writes the answer.

No Lightning import. The policy as configured never changes: each fit works on its own copy
(:meth:`KPolicy.for_fit`), so a callback reused with another Trainer starts from what the user gave.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

from .core.settings import ScheduleUnit, check_choice, check_positive_int, check_schedule


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


def _value_at(schedule: dict[int, int], count: float) -> int:
    """The schedule's K at ``count`` (1 before its first key)."""
    k = 1
    for threshold, value in schedule.items():
        if threshold > count:
            break
        k = value
    return k


class KPolicy:
    """How K is chosen; a policy answers, the window plan writes.

    Attributes:
        per_window: Whether K may change between windows inside an epoch: the plan then drives Lightning
            window by window (its ``accumulate_grad_batches`` is set for each window).
        counts_items: Whether K depends on the items consumed (the plan counts them: a host read per step).
        configured: Whether K comes from the policy (``False``: adopted from the Trainer).
        constant: Whether every window of the fit has the same K (Lightning's own step estimate holds).
    """

    per_window = False
    counts_items = False
    configured = True
    constant = False

    def for_fit(self, trainer_k: int) -> KPolicy:
        """The policy of one fit: a copy (``trainer_k``: the Trainer's ``accumulate_grad_batches``)."""
        return copy.deepcopy(self)

    def k_at(self, epoch: int, steps: int, items: float) -> int | None:
        """K of a window opening in ``epoch`` after ``steps`` optimizer steps and ``items`` items consumed.

        ``None`` while the policy cannot tell yet (a target batch size before the data is read).
        """
        raise NotImplementedError

    def first_k(self) -> int | None:
        """K of the first window of training (the learning-rate factor is relative to it)."""
        return self.k_at(0, 0, 0.0)

    def largest_k(self) -> int | None:
        """The largest K the policy can choose (``None`` while unresolved)."""
        raise NotImplementedError

    def describe(self) -> str:
        """How K is chosen, for messages."""
        raise NotImplementedError

    def progress(self, steps: int, items: float) -> str | None:
        """Where training stands in the policy, for the summary (``None``: nothing to say)."""
        return None

    def window_closed(self, statistics: dict[str, float]) -> None:
        """A window was finalized; ``statistics`` are its values, if the policy asked for them."""

    def state_dict(self) -> dict[str, Any]:
        """What the policy learned during training (saved with the plan's position)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`."""


class FixedK(KPolicy):
    """The same K for every window; ``None`` adopts the Trainer's ``accumulate_grad_batches`` at each fit.

    Example:
        >>> FixedK(4).k_at(3, 10, 0.0), FixedK(None).for_fit(2).k_at(0, 0, 0.0)
        (4, 2)
    """

    constant = True

    def __init__(self, k: int | None) -> None:
        self.k = None if k is None else check_positive_int("accumulation_steps", k)
        self.configured = k is not None

    def for_fit(self, trainer_k: int) -> KPolicy:
        """A copy that adopts ``trainer_k`` when nothing was configured."""
        if self.configured:
            return FixedK(self.k)
        return AdoptedK(check_positive_int("accumulate_grad_batches", trainer_k))

    def k_at(self, epoch: int, steps: int, items: float) -> int | None:
        """The K."""
        return self.k if self.k is not None else 1

    def largest_k(self) -> int | None:
        """The K."""
        return self.k_at(0, 0, 0.0)

    def describe(self) -> str:
        """``accumulation_steps=K``."""
        return f"accumulation_steps={self.k}"


class AdoptedK(FixedK):
    """The K of ``Trainer(accumulate_grad_batches=...)``, adopted for one fit."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.configured = False

    def describe(self) -> str:
        """Where K came from."""
        return f"K={self.k} adopted from `Trainer(accumulate_grad_batches={self.k})`"


class EpochSchedule(KPolicy):
    """``{epoch: K}`` as Lightning's ``GradientAccumulationScheduler``: K=1 before the first key.

    Example:
        >>> [EpochSchedule({1: 2, 3: 4}).k_at(epoch, 0, 0.0) for epoch in range(5)]
        [1, 2, 2, 4, 4]
    """

    def __init__(self, schedule: Any) -> None:
        self.schedule = check_schedule("accumulation_steps", schedule, "epochs")

    def k_at(self, epoch: int, steps: int, items: float) -> int | None:
        """K of ``epoch``."""
        return _value_at(self.schedule, epoch)

    def largest_k(self) -> int | None:
        """The schedule's largest K."""
        return max(1, *self.schedule.values())

    def describe(self) -> str:
        """The schedule."""
        return f"accumulation_steps={self.schedule}"


class KeyedSchedule(KPolicy):
    """``{threshold: K}`` keyed by optimizer steps or items consumed: K changes between windows, mid-epoch.

    A window's K is the schedule's value at the count reached when it opens.

    Example:
        >>> schedule = KeyedSchedule({0: 1, 2: 3}, "steps")
        >>> [schedule.k_at(0, steps, 0.0) for steps in range(4)], schedule.per_window
        ([1, 1, 3, 3], True)
    """

    per_window = True

    def __init__(self, schedule: Any, unit: str, *, name: str = "accumulation_steps") -> None:
        self.unit = unit
        self.schedule = check_schedule(name, schedule, unit)
        self.counts_items = unit == "items"

    def k_at(self, epoch: int, steps: int, items: float) -> int | None:
        """The schedule's K at the steps or items reached."""
        return _value_at(self.schedule, steps if self.unit == "steps" else items)

    def largest_k(self) -> int | None:
        """The schedule's largest K."""
        return max(1, *self.schedule.values())

    def describe(self) -> str:
        """The schedule."""
        return f"accumulation_steps={self.schedule} (schedule_unit={self.unit!r})"

    def progress(self, steps: int, items: float) -> str | None:
        """The stages reached, the K now and the counts.

        Example:
            >>> KeyedSchedule({0: 1, 100: 2, "1k": 4}, "items").progress(1, 120.0)
            'by items: 2 of 3 stages reached (K=2 now); 1 steps, 120 items consumed'
        """
        count = steps if self.unit == "steps" else items
        reached = sum(threshold <= count for threshold in self.schedule)
        shown = f"{items:,.0f}" if float(items).is_integer() else f"{items:,.1f}"
        return (
            f"by {self.unit}: {reached} of {len(self.schedule)} stages reached"
            f" (K={_value_at(self.schedule, count)} now); {steps:,} steps, {shown} items consumed"
        )


class TargetBatchSize(KPolicy):
    """K = ceil(target / (micro-batch size x ranks)), or per stage (``{threshold: batch size}``).

    Unresolved (``k_at`` gives ``None``) until :meth:`resolve` is told the micro-batch size and the ranks.

    Example:
        >>> policy = TargetBatchSize(100).for_fit(1)
        >>> policy.resolve(16, 2), policy.k_at(0, 0, 0.0)
        ((4, 128), 4)
    """

    def __init__(self, size: Any, unit: str = "epochs") -> None:
        self.unit = unit
        self.schedule = (  # a batch size per stage
            check_schedule("target_batch_size", size, unit) if isinstance(size, dict) else None
        )
        self.size: int | dict[int, int] = (
            self.schedule if self.schedule is not None else check_positive_int("target_batch_size", size)
        )
        self.resolved: KPolicy | None = None
        self.constant = self.schedule is None
        self.per_window = self.schedule is not None
        self.counts_items = self.schedule is not None and unit == "items"

    def for_fit(self, trainer_k: int) -> KPolicy:
        """An unresolved copy: resolved again for every fit (the micro-batch size may differ)."""
        fresh = copy.copy(self)
        fresh.resolved = None
        return fresh

    def resolve(self, micro_batch_size: int, world_size: int) -> tuple[int, int]:
        """Derive K (each stage's K) from the micro-batch size and the ranks.

        Returns:
            ``(K, effective batch size)`` of the first stage.
        """
        per_window = micro_batch_size * world_size
        if self.schedule is not None:
            ks = {
                threshold: max(1, math.ceil(size / per_window)) for threshold, size in self.schedule.items()
            }
            self.resolved = KeyedSchedule(ks, self.unit, name="target_batch_size")
        else:
            assert isinstance(self.size, int)
            self.resolved = FixedK(max(1, math.ceil(self.size / per_window)))
        k = self.resolved.first_k()
        assert k is not None
        return k, k * per_window

    def k_at(self, epoch: int, steps: int, items: float) -> int | None:
        """The resolved K (``None`` before :meth:`resolve`)."""
        return self.resolved.k_at(epoch, steps, items) if self.resolved is not None else None

    def largest_k(self) -> int | None:
        """The resolved policy's largest K."""
        return self.resolved.largest_k() if self.resolved is not None else None

    def describe(self) -> str:
        """The target."""
        return f"target_batch_size={self.size}"

    def progress(self, steps: int, items: float) -> str | None:
        """The resolved schedule's progress (per stage)."""
        return self.resolved.progress(steps, items) if self.resolved is not None else None


def make_policy(
    accumulation_steps: Any = None, target_batch_size: Any = None, schedule_unit: Any = "epochs"
) -> KPolicy:
    """The policy the callback's arguments describe; every combination checked, before any training.

    Example:
        >>> make_policy({0: 1, "10k": 4}, schedule_unit="items").describe()
        "accumulation_steps={0: 1, 10000: 4} (schedule_unit='items')"
    """
    unit = check_choice("schedule_unit", schedule_unit, ScheduleUnit)
    if accumulation_steps is not None and target_batch_size is not None:
        raise ValueError(
            f"Expected only one of `accumulation_steps` ({accumulation_steps!r}) and `target_batch_size`"
            f" ({target_batch_size!r}); K is derived from `target_batch_size`, so leave"
            " `accumulation_steps` unset."
        )
    keyed_target = isinstance(target_batch_size, dict)
    if keyed_target and unit == "epochs":
        raise ValueError(
            f"A `target_batch_size` per stage ({target_batch_size!r}) needs `schedule_unit='steps'` or"
            " `'items'`: its thresholds count optimizer steps or items."
        )
    if unit != "epochs" and not isinstance(accumulation_steps, dict) and not keyed_target:
        raise ValueError(
            f"Argument `schedule_unit={unit!r}` keys a schedule, but `accumulation_steps` is"
            f" {accumulation_steps!r}: pass `accumulation_steps={{0: K0, threshold: K1, ...}}`"
            f" (thresholds counting {unit}), or leave `schedule_unit` at 'epochs'."
        )
    if target_batch_size is not None:
        return TargetBatchSize(target_batch_size, unit)
    if isinstance(accumulation_steps, dict):
        return (
            EpochSchedule(accumulation_steps) if unit == "epochs" else KeyedSchedule(accumulation_steps, unit)
        )
    return FixedK(accumulation_steps)


def stepping_batches(
    policy: KPolicy,
    batch_items: Sequence[float],
    max_epochs: int,
    max_steps: int = -1,
) -> int:
    """Optimizer steps of a fit under ``policy``: one per window; an epoch's end closes a window.

    Args:
        policy: The fit's policy (resolved).
        batch_items: Items of each micro-batch of an epoch, over all ranks (one entry per micro-batch that
            runs; only read when K depends on items).
        max_epochs: Epochs of the fit.
        max_steps: Lightning's ``max_steps`` (-1: none).

    Example:
        >>> stepping_batches(EpochSchedule({0: 4, 2: 1}), [4.0] * 10, 3)  # 3 + 3 + 10
        16
        >>> stepping_batches(KeyedSchedule({0: 2, 2: 3}, "steps"), [4.0] * 10, 1)  # 2 2 | 3 3 | 0
        4
    """
    steps, items = 0, 0.0
    batches = len(batch_items)
    for epoch in range(max(max_epochs, 1)):
        start = 0
        while start < batches:
            k = policy.k_at(epoch, steps, items)
            if k is None:
                raise RuntimeError("The target batch size is not resolved yet.")
            end = min(start + k, batches)
            items += sum(batch_items[start:end])
            start = end
            steps += 1
            if max_steps != -1 and steps >= max_steps:
                return max_steps
    return steps
