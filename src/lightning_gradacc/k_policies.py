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
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .core.settings import (
    ScheduleUnit,
    check_bool,
    check_choice,
    check_positive_int,
    check_schedule,
    parse_threshold,
)


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


@dataclass(frozen=True)
class WindowFacts:
    """What the window plan tells an adaptive policy when a window closes: host numbers, equal on all ranks.

    Attributes:
        steps: Windows closed so far, this one included.
        items_consumed: Items of the windows closed so far, over all ranks.
        k: The window's K.
        micro_batches: The micro-batches it held on each rank (fewer than K at an epoch's end).
        world_size: The data-parallel ranks.
        items: Its items over all ranks (0: no item counts known).
        noise_scale: The gradient noise scale after this window (``nan`` before the first estimate).
        ridden: What the policy's :meth:`KPolicy.batch_started` asked to sum over the ranks, summed.
    """

    steps: int
    items_consumed: float
    k: int
    micro_batches: int
    world_size: int
    items: float
    noise_scale: float
    ridden: Mapping[str, float] = field(default_factory=dict)


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
        adaptive: Whether K is chosen from what training measures (its steps are not known in advance; the
            plan hands it :class:`WindowFacts` when each window closes).
        needs_micro_batch_size: Whether K is derived from the train loader's batch size: the plan reads it
            (in ``setup``, and again at train start) and hands it to :meth:`resolve`.
        budget: Items over all ranks that close a window (``None``: K closes it): a window then ends at the
            first micro-batch at which its items reach the budget, decided batch by batch.
    """

    budget: float | None = None
    per_window = False
    counts_items = False
    configured = True
    constant = False
    adaptive = False
    needs_micro_batch_size = False

    def for_fit(self, trainer_k: int, world_size: int = 1) -> KPolicy:
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

    def resolve(self, micro_batch_size: int, world_size: int) -> list[str]:
        """Take the loader's batch size (``needs_micro_batch_size``); returns what to warn of."""
        return []

    def smallest_k(self) -> int:
        """The smallest K an adaptive policy can choose in this fit (its most steps are counted at it)."""
        raise NotImplementedError

    def describe(self) -> str:
        """How K is chosen, for messages."""
        raise NotImplementedError

    def progress(self, steps: int, items: float) -> str | None:
        """Where training stands in the policy, for the summary (``None``: nothing to say)."""
        return None

    def batch_started(self) -> dict[str, float] | None:
        """A batch starts: numbers by name to sum over the ranks with the window's totals (``None``: none)."""
        return None

    def epoch_started(self) -> None:
        """An epoch starts (time between epochs is not a batch's)."""

    def window_closed(self, facts: WindowFacts) -> None:
        """A window was finalized (an adaptive policy is handed what it measured)."""

    def metrics(self) -> dict[str, float]:
        """What the policy logs at each step, by name under ``grad_accum/``."""
        return {}

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

    def for_fit(self, trainer_k: int, world_size: int = 1) -> KPolicy:
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
        >>> policy.resolve(16, 2), policy.k_at(0, 0, 0.0)  # doctest: +ELLIPSIS
        (['`target_batch_size=100` is not a multiple of ... using K=4, an effective batch size of 128.'], 4)
    """

    needs_micro_batch_size = True

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

    def for_fit(self, trainer_k: int, world_size: int = 1) -> KPolicy:
        """An unresolved copy: resolved again for every fit (the micro-batch size may differ)."""
        fresh = copy.copy(self)
        fresh.resolved = None
        return fresh

    def resolve(self, micro_batch_size: int, world_size: int) -> list[str]:
        """Derive K (each stage's K) from the micro-batch size and the ranks; warn of sizes rounded up."""
        per_window = micro_batch_size * world_size
        ranks = f"micro-batch size {micro_batch_size} x {world_size} rank(s)"
        if self.schedule is not None:
            ks = {
                threshold: max(1, math.ceil(size / per_window)) for threshold, size in self.schedule.items()
            }
            self.resolved = KeyedSchedule(ks, self.unit, name="target_batch_size")
            uneven = [
                f"{size} -> K={-(-size // per_window)}"
                for size in self.schedule.values()
                if size % per_window
            ]
            if uneven:  # name the stages that are not multiples
                stages = ", ".join(uneven)
                return [f"`target_batch_size` stages that are not a multiple of {ranks} round up: {stages}."]
            return []
        assert isinstance(self.size, int)
        k = max(1, math.ceil(self.size / per_window))
        self.resolved = FixedK(k)
        if k * per_window != self.size:
            return [
                f"`{self.describe()}` is not a multiple of {ranks}; using K={k}, an effective batch size of"
                f" {k * per_window}."
            ]
        return []

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


# the largest K of an item budget: a window holds as many micro-batches as its items need
UNBOUNDED_K = 2**31 - 1


class ItemBudget(KPolicy):
    """Each window closes at the first micro-batch at which its items over all ranks reach ``items``.

    Items are what the callback counts for it (``budget_count_fn``, else ``item_count_fn``: tokens; else the
    batch size). Every window is still one big batch of its own micro-batches; the number of micro-batches,
    and of steps, follows the data.

    Example:
        >>> policy = ItemBudget("4k").for_fit(1)
        >>> policy.budget, policy.describe(), policy.k_at(0, 3, 12000.0)
        (4000.0, 'items_per_step=4000', 1)
    """

    per_window = True
    counts_items = True

    def __init__(self, items: Any) -> None:
        try:
            count = parse_threshold("items_per_step", items)
        except ValueError:
            count = 0
        if not count > 0:
            raise ValueError(
                "Expected argument `items_per_step` to be a whole number > 0 (or a string such as '4k',"
                f" '1M'), but got {items!r}."
            )
        self.budget: float = float(count)

    def k_at(self, epoch: int, steps: int, items: float) -> int | None:
        """1 when a window opens: it grows batch by batch until its items reach the budget."""
        return 1

    def first_k(self) -> int | None:
        """1: a learning-rate factor by K has no meaning here (``lr_scaling`` is refused)."""
        return 1

    def largest_k(self) -> int | None:
        """Unbounded: a window holds as many micro-batches as its items need."""
        return UNBOUNDED_K

    def smallest_k(self) -> int:
        """1: the most steps a fit can take is one per micro-batch."""
        return 1

    def describe(self) -> str:
        """``items_per_step=N``."""
        return f"items_per_step={self.budget:.0f}"  # a whole number

    def progress(self, steps: int, items: float) -> str | None:
        """The steps and the items consumed.

        Example:
            >>> ItemBudget(100).progress(3, 320.0)
            'by an item budget of 100 per step: 3 steps, 320 items consumed (106.7 per step)'
        """
        per_step = f" ({items / steps:,.1f} per step)" if steps else ""
        budget = f"by an item budget of {self.budget:,g} per step"
        return f"{budget}: {steps:,} steps, {items:,.0f} items consumed{per_step}"


AutoRule = Literal["budget", "goodput"]


@dataclass(frozen=True)
class AutoSettings:
    """How ``accumulation_steps="auto"`` chooses K from the measured gradient noise scale B_noise.

    McCandlish et al. (2018) model training to a given loss as taking S = S_min (1 + B_noise / B) steps and
    E = E_min (1 + B / B_noise) examples at a batch of B items. Under pure accumulation on fixed hardware a
    larger K does not make a micro-batch faster: it trades optimizer steps for examples. The batch is
    B = K b W (b: items per micro-batch per rank, tokens with a token counter; W: ranks).

    - ``"budget"``: the largest K whose batch stays within a fraction ``budget`` of B_noise,
      K = floor(budget B_noise / (b W)): at most about ``budget`` more examples than the fewest the loss
      needs (E / E_min = 1 + B / B_noise), in 1 + 1 / ``budget`` times the fewest steps.
    - ``"goodput"``: the K that reaches the loss soonest. Time is proportional to
      (K t_micro + t_step)(1 + B_noise / (K b W)), smallest at K* = sqrt(t_step B_noise / (t_micro b W)),
      with t_micro the time of an accumulating micro-batch and t_step what the window's last one costs on
      top (the optimizer step, the deferred all-reduce or reduce-scatter), both measured by the callback
      on every rank and averaged over the ranks. It pays where a step is expensive (many ranks, slow
      links); on one device a step is cheap and K* stays small.

    Before the first estimate (and whenever the estimate is not positive) K stays at ``start_k``. A new
    target is taken once ``patience`` consecutive windows asked for it (hysteresis; each decision uses the
    noise scale's exponential average, not one window's estimate); K does not fall unless ``decrease``.

    Attributes:
        rule: ``"budget"`` or ``"goodput"``.
        budget: The fraction of B_noise the batch may reach (``"budget"``): 1.0 trains at the noise scale,
            the critical batch size's estimate, at most twice the fewest examples and twice the fewest steps.
        min_k: The smallest K.
        max_k: The largest K (memory and time set it: K micro-batches are not held at once, but each step
            waits for them).
        start_k: K until the rule has an estimate; ``None``: 2 on one rank (the estimate needs two
            micro-batches per window over the ranks) and for ``"goodput"`` (which times an accumulating
            micro-batch), else 1; at least ``min_k``.
        powers_of_two: K a power of two (rounded down for ``"budget"``, to the nearest in log scale for
            ``"goodput"``).
        patience: Consecutive windows a new target must hold before K follows it.
        decrease: Whether K may also fall (it only grows otherwise, as the critical batch does in training).
        clock: Seconds, monotonic, for ``"goodput"``'s timings; ``None``: ``time.perf_counter``. Tests and
            simulations pass their own to make the decisions reproducible.

    On one rank a window of one micro-batch gives no estimate, so K stays at 2 or more there.

    Example:
        >>> AutoSettings(rule="goodput", max_k=32).max_k
        32
    """

    rule: AutoRule = "budget"
    budget: float = 1.0
    min_k: int = 1
    max_k: int = 64
    start_k: int | None = None
    powers_of_two: bool = True
    patience: int = 3
    decrease: bool = False
    clock: Callable[[], float] | None = None

    def __post_init__(self) -> None:
        check_choice("auto.rule", self.rule, AutoRule)
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)) or not self.budget > 0:
            raise ValueError(f"Expected argument `auto.budget` to be a number > 0, but got {self.budget!r}.")
        object.__setattr__(self, "budget", float(self.budget))
        for name in ("min_k", "max_k", "patience"):
            check_positive_int(f"auto.{name}", getattr(self, name))
        if self.start_k is not None:
            check_positive_int("auto.start_k", self.start_k)
        if self.max_k < self.min_k or not self.min_k <= (self.start_k or self.min_k) <= self.max_k:
            raise ValueError(
                f"Expected `auto.min_k` <= `auto.start_k` <= `auto.max_k`, but got {self.min_k},"
                f" {self.start_k}, {self.max_k}."
            )
        check_bool("auto.powers_of_two", self.powers_of_two)
        check_bool("auto.decrease", self.decrease)
        if self.clock is not None and not callable(self.clock):
            raise TypeError(f"Expected argument `auto.clock` to be callable, but got {self.clock!r}.")


# "goodput"'s batch times since the last boundary, summed over the ranks with the window's totals
TIMINGS = ("accumulating_seconds", "accumulating_batches", "stepping_seconds", "stepping_batches")


class AutoK(KPolicy):
    """K chosen window by window from the measured gradient noise scale (``accumulation_steps="auto"``).

    Each window's K is decided when it opens, from what the windows before it measured (:class:`WindowFacts`,
    the same on every rank: the noise scale comes from totals summed over the ranks, and the timings of
    ``"goodput"`` ride in the same all-reduce), through the window plan's exact transitions: every window is
    the step of one big batch of its own micro-batches. The decisions are a function of the logged and
    saved state: a resume goes on exactly, next decisions included, and an injected ``clock`` makes
    ``"goodput"`` reproducible in tests.

    Args:
        settings: The rule, its bounds and its clock.

    Example:
        >>> policy = AutoK(AutoSettings(budget=1.0, patience=1)).for_fit(1, world_size=1)
        >>> policy.k_at(0, 0, 0.0)  # two micro-batches per window until there is an estimate
        2
        >>> facts = WindowFacts(1, 64.0, 2, 2, 1, 64.0, noise_scale=300.0)  # b = 32 items per micro-batch
        >>> policy.window_closed(facts)
        >>> policy.k_at(0, 1, 64.0), policy.metrics()["auto_target_k"]  # floor(300 / 32) = 9 -> 8
        (8, 8.0)
    """

    per_window = True
    counts_items = True  # the trajectory is shown in items too
    adaptive = True

    def __init__(self, settings: AutoSettings | None = None) -> None:
        self.settings = settings if settings is not None else AutoSettings()
        self.clock: Callable[[], float] = self.settings.clock or time.perf_counter
        self.min_k = self.settings.min_k  # on one rank at least 2 (see `for_fit`)
        self.k = self.settings.start_k or self.min_k
        self.pending: int | None = None  # a target different from K, and the windows that asked for it
        self.pending_count = 0
        self.target = math.nan  # the rule's last target, and the noise scale and items it came from
        self.estimate = math.nan
        self.batch_items = math.nan
        self.trajectory: list[tuple[int, float, int]] = [(0, 0.0, self.k)]  # (step, items, K) at each change
        self.t_micro = math.nan  # seconds: an accumulating micro-batch, and a step's extra (goodput)
        self.t_step = math.nan
        self._timed = dict.fromkeys(TIMINGS, 0.0)  # since the last boundary
        self._last_start: float | None = None  # the clock at the last batch start
        self._last_closed = False  # whether a window closed since then (the batch was a stepping one)
        self._carried: float | None = None  # a resumed batch's seconds before the save (clocks do not carry)

    def for_fit(self, trainer_k: int, world_size: int = 1) -> KPolicy:
        """A fresh controller for a fit (its state carried over by the plan): K starts at ``start_k``.

        Raises:
            ValueError: On one rank, bounds that leave K at 1 (no window would give an estimate).
        """
        settings = self.settings
        fresh = AutoK(settings)
        if world_size == 1:
            if settings.max_k < 2 or settings.start_k == 1:
                raise ValueError(
                    f"`accumulation_steps='auto'` on one rank with `auto.start_k={settings.start_k}` and"
                    f" `auto.max_k={settings.max_k}`: a window of one micro-batch gives no noise-scale"
                    " estimate, so K would never change. Let K be 2 or more (leave `start_k` unset)."
                )
            fresh.min_k = max(settings.min_k, 2)
        if settings.rule == "goodput" and (settings.start_k == 1 or settings.max_k < 2):
            raise ValueError(
                f"`auto.rule='goodput'` with `auto.start_k={settings.start_k}` and `auto.max_k="
                f"{settings.max_k}`: at K=1 every micro-batch steps, so the time of an accumulating one is"
                " never measured and K would never change. Let K start at 2 or more (leave `start_k` unset)."
            )
        timed = world_size == 1 or settings.rule == "goodput"  # needs two micro-batches in a window
        start = settings.start_k or max(fresh.min_k, 2 if timed else 1)
        fresh.k = start
        fresh.trajectory = [(0, 0.0, start)]
        return fresh

    def k_at(self, epoch: int, steps: int, items: float) -> int | None:
        """The K decided so far."""
        return self.k

    def first_k(self) -> int | None:
        """The K training starts with (the learning-rate factor is relative to it)."""
        return self.trajectory[0][2]

    def largest_k(self) -> int | None:
        """``max_k``."""
        return self.settings.max_k

    def smallest_k(self) -> int:
        """The smallest K a window can get in this fit (``start_k`` unless K may fall)."""
        return self.min_k if self.settings.decrease else self.trajectory[0][2]

    def describe(self) -> str:
        """The rule and its bounds."""
        settings = self.settings
        extra = f", budget={settings.budget:g}" if settings.rule == "budget" else ""
        bounds = f"K in [{settings.min_k}, {settings.max_k}]"
        return f"accumulation_steps='auto' (rule={settings.rule!r}{extra}, {bounds})"

    # -------------------------------------------------------------------------------- measuring time

    def batch_started(self) -> dict[str, float] | None:
        """Time the batch that just ended; with ``"goodput"`` the sums since the last boundary ride along."""
        if self.settings.rule != "goodput":
            return None
        now = self.clock()
        seconds = now - self._last_start if self._last_start is not None else self._carried
        if seconds is not None:
            kind = "stepping" if self._last_closed else "accumulating"  # the batch before closed a window
            self._timed[f"{kind}_seconds"] += seconds
            self._timed[f"{kind}_batches"] += 1.0
        self._last_start, self._last_closed, self._carried = now, False, None
        return dict(self._timed)

    def epoch_started(self) -> None:
        """The time between epochs (validation, the loader's start) is no batch's."""
        self._last_start = self._carried = None

    # ------------------------------------------------------------------------------------- deciding

    def window_closed(self, facts: WindowFacts) -> None:
        """Take the window's measurements and decide the K of the windows that open next."""
        self._last_closed = True
        if self.settings.rule == "goodput":
            self._take_times(facts.ridden)
        if not facts.items > 0:  # an empty window (every step None, or 0 items) measured nothing: no decision
            self.target = math.nan
            return
        per_micro_batch = facts.items / (facts.micro_batches * facts.world_size)
        self.batch_items = per_micro_batch
        self.estimate = facts.noise_scale
        target = self._target(facts.noise_scale, per_micro_batch * facts.world_size)
        self.target = math.nan if target is None else float(target)
        if target is None or target == self.k or (target < self.k and not self.settings.decrease):
            self.pending, self.pending_count = None, 0
            return
        same_way = self.pending is not None and (self.pending > self.k) == (target > self.k)
        self.pending, self.pending_count = target, self.pending_count + 1 if same_way else 1
        if self.pending_count >= self.settings.patience:
            self.k, self.pending, self.pending_count = target, None, 0
            self.trajectory.append((facts.steps, facts.items_consumed, target))

    def _target(self, noise_scale: float, items_per_window_k: float) -> int | None:
        """The rule's K for a noise scale (``None`` without a positive estimate, or timings for goodput)."""
        settings = self.settings
        if not (math.isfinite(noise_scale) and noise_scale > 0):
            return None
        if settings.rule == "budget":
            raw = settings.budget * noise_scale / items_per_window_k
        else:
            if not (self.t_micro > 0 and self.t_step >= 0):
                return None
            raw = math.sqrt(self.t_step * noise_scale / (self.t_micro * items_per_window_k))
        bounded = min(max(raw, self.min_k), settings.max_k)
        powers = [1 << e for e in range(settings.max_k.bit_length()) if self.min_k <= 1 << e]
        if settings.powers_of_two and powers:
            if settings.rule == "budget":  # the largest within the budget (the smallest power if none is)
                return max([p for p in powers if p <= bounded] or powers[:1])
            return min(powers, key=lambda p: abs(math.log2(p) - math.log2(bounded)))
        return int(math.floor(bounded) if settings.rule == "budget" else round(bounded))

    def _take_times(self, ridden: Mapping[str, float]) -> None:
        """Fold the batch times summed over the ranks into running means (t_micro, and a step's extra)."""
        self._timed = dict.fromkeys(TIMINGS, 0.0)
        if set(ridden) != set(TIMINGS):
            return
        micro_seconds, micro_count = ridden["accumulating_seconds"], ridden["accumulating_batches"]
        step_seconds, step_count = ridden["stepping_seconds"], ridden["stepping_batches"]
        if micro_count > 0:
            micro = micro_seconds / micro_count
            self.t_micro = micro if math.isnan(self.t_micro) else 0.9 * self.t_micro + 0.1 * micro
        if step_count > 0 and self.t_micro > 0:
            extra = max(step_seconds / step_count - self.t_micro, 0.0)
            self.t_step = extra if math.isnan(self.t_step) else 0.9 * self.t_step + 0.1 * extra

    # ---------------------------------------------------------------------------------- reporting

    def metrics(self) -> dict[str, float]:
        """The rule's last target, the noise scale and items per micro-batch it used (and, goodput, times)."""
        logged = {
            "auto_target_k": self.target,
            "auto_noise_scale": self.estimate,
            "auto_items_per_micro_batch": self.batch_items,
        }
        if self.settings.rule == "goodput":
            logged.update(auto_t_micro=self.t_micro, auto_t_step=self.t_step)
        return logged

    def progress(self, steps: int, items: float) -> str | None:
        """K's trajectory: where each K was reached (step, items)."""
        stages = [f"K={k} at step {step:,} ({items_at:,.0f} items)" for step, items_at, k in self.trajectory]
        return f"auto ({self.settings.rule}): " + " -> ".join(stages)

    def state_dict(self) -> dict[str, Any]:
        """The controller's state as plain numbers."""
        return {
            "k": self.k,
            "pending": self.pending,
            "pending_count": self.pending_count,
            "target": self.target,
            "estimate": self.estimate,
            "batch_items": self.batch_items,
            "trajectory": [list(stage) for stage in self.trajectory],
            "t_micro": self.t_micro,
            "t_step": self.t_step,
            # goodput's timings of the open window, and of the batch in flight up to the save (a clock's
            # readings mean nothing in another process: the seconds elapsed do)
            "timed": dict(self._timed),
            "in_flight": None if self._last_start is None else self.clock() - self._last_start,
            "last_closed": self._last_closed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue deciding from a saved state (the open window's timings and the batch in flight too)."""
        if not state:
            return
        self.k = int(state["k"])
        self.pending = None if state["pending"] is None else int(state["pending"])
        self.pending_count = int(state["pending_count"])
        self.target, self.estimate = float(state["target"]), float(state["estimate"])
        self.batch_items = float(state["batch_items"])
        self.trajectory = [(int(step), float(items), int(k)) for step, items, k in state["trajectory"]]
        self.t_micro, self.t_step = float(state["t_micro"]), float(state["t_step"])
        timed = state.get("timed", {})
        if not isinstance(timed, Mapping):  # saved by an earlier release: a list in the order of TIMINGS
            timed = dict(zip(TIMINGS, timed, strict=True))
        self._timed = {name: float(timed.get(name, 0.0)) for name in TIMINGS}
        in_flight = state.get("in_flight")
        self._last_start, self._carried = None, None if in_flight is None else float(in_flight)
        self._last_closed = bool(state.get("last_closed", False))


def make_policy(
    accumulation_steps: Any = None,
    target_batch_size: Any = None,
    schedule_unit: Any = "epochs",
    auto: AutoSettings | dict[str, Any] | None = None,
    items_per_step: Any = None,
) -> KPolicy:
    """The policy the callback's arguments describe; every combination checked, before any training.

    Example:
        >>> make_policy({0: 1, "10k": 4}, schedule_unit="items").describe()
        "accumulation_steps={0: 1, 10000: 4} (schedule_unit='items')"
        >>> make_policy("auto", auto={"max_k": 16}).describe()
        "accumulation_steps='auto' (rule='budget', budget=1, K in [1, 16])"
    """
    unit = check_choice("schedule_unit", schedule_unit, ScheduleUnit)
    if items_per_step is not None:
        given = {
            "accumulation_steps": accumulation_steps,
            "target_batch_size": target_batch_size,
            "auto": auto,
        }
        others = [f"`{name}` ({value!r})" for name, value in given.items() if value is not None]
        if others or unit != "epochs":
            others += [f"`schedule_unit` ({unit!r})"] if unit != "epochs" else []
            raise ValueError(
                f"`items_per_step={items_per_step!r}` closes each window on its items, so it cannot be"
                f" combined with {', '.join(others)}: leave them unset."
            )
        return ItemBudget(items_per_step)
    if auto is not None and accumulation_steps != "auto":
        raise ValueError(
            f"Argument `auto` ({auto!r}) sets how `accumulation_steps='auto'` chooses K, but"
            f" `accumulation_steps` is {accumulation_steps!r}: pass `accumulation_steps='auto'`, or drop"
            " `auto`."
        )
    if accumulation_steps == "auto":
        if target_batch_size is not None or unit != "epochs":
            raise ValueError(
                "`accumulation_steps='auto'` chooses K from the measured noise scale: leave"
                f" `target_batch_size` ({target_batch_size!r}) and `schedule_unit` ({unit!r}) unset."
            )
        return AutoK(AutoSettings(**auto) if isinstance(auto, dict) else auto)
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
    if isinstance(accumulation_steps, str):
        raise ValueError(
            f"Expected argument `accumulation_steps` to be a positive int, a schedule dict, 'auto' or None,"
            f" but got {accumulation_steps!r}."
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
        >>> stepping_batches(ItemBudget(10), [4.0] * 10, 2)  # 3 3 3 1 per epoch
        8
    """
    steps, items = 0, 0.0
    batches = len(batch_items)
    for epoch in range(max(max_epochs, 1)):
        start = 0
        while start < batches and policy.budget is not None:  # each window: until its items reach it
            end, window = start, 0.0
            while end < batches and window < policy.budget:
                window, end = window + batch_items[end], end + 1
            items, start, steps = items + window, end, steps + 1
            if max_steps != -1 and steps >= max_steps:
                return max_steps
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
