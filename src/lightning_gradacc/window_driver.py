"""Which ``accumulate_grad_batches`` makes Lightning zero and step exactly where a window starts and ends.

Lightning decides by modulo, batch by batch (2.6, ``loops/optimization/automatic.py`` and
``loops/training_epoch_loop.py``): it zeroes the gradients before the backward of batch ``n`` when
``n % K == 0``, steps after it when ``ready % K == 0`` (``ready``: batches fetched this epoch, ``n + 1``)
or at the epoch's last batch, and divides the loss by ``K``. A schedule that changes K inside an epoch
cannot keep one K: the window after a change would start where Lightning does not zero and end where it
does not step.
Setting, per batch, a K whose modulo gives the wanted answers drives Lightning exactly:

- a batch that ends its window steps and must not zero: a divisor of ``ready`` that does not divide ``n``;
- any other batch must not step, and inside a window must not zero: a K dividing neither ``n`` nor ``ready``
  (a window's first batch is zeroed by the callback itself, whatever Lightning does).

Powers of two are preferred: Lightning's division of the loss by K, which the callback multiplies back, is
then exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .schedule import AccumulationPlan


def lightning_k(batch_idx: int, ready: int, *, ends_window: bool) -> int:
    """The ``accumulate_grad_batches`` to set for one batch (see the module's docstring).

    Args:
        batch_idx: The batch's index in the epoch (Lightning's ``batch_idx``).
        ready: Batches fetched this epoch, this one included (Lightning's ``batch_progress.current.ready``).
        ends_window: Whether the optimizer must step after this batch.

    Raises:
        RuntimeError: no K gives the wanted decisions (``ready`` and ``batch_idx`` out of step).

    Example:
        >>> batches = [(0, False), (1, False), (2, True), (3, True)]  # windows [0, 1, 2] and [3]
        >>> [lightning_k(n, n + 1, ends_window=last) for n, last in batches]
        [2, 4, 3, 4]
    """
    if ends_window:
        if batch_idx == 0 or ready == 1:
            return 1  # zeroing at the epoch's first batch is what a new window needs anyway
        power = ready & -ready  # the largest power of two dividing `ready`
        if power > 1 and batch_idx % power:
            return power
        for k in range(2, ready + 1):
            if ready % k == 0 and batch_idx % k:
                return k
    else:
        k = 2
        while k <= 2 * (max(batch_idx, ready) + 1):
            if ready % k and (batch_idx == 0 or batch_idx % k):
                return k
            k *= 2
    raise RuntimeError(
        f"No `accumulate_grad_batches` makes Lightning {'step' if ends_window else 'accumulate'} at batch"
        f" {batch_idx} with {ready} batch(es) ready this epoch; the schedule cannot be driven exactly here."
    )


class ScheduleDriver:
    """The windows of a schedule keyed by steps or items, and the K Lightning gets for each batch.

    Args:
        plan: The fit's plan (``schedule_unit`` ``"steps"`` or ``"items"``).

    Attributes:
        steps: Windows closed so far (optimizer steps taken or skipped).
        items: Items of the windows closed so far, over all ranks.
        window_k: K of the open window: the schedule's value at the count reached when it opened.
        batches_in_window: Batches of the open window started so far.
        lightning_k: The ``accumulate_grad_batches`` set for the current batch (Lightning divides its loss
            by it; the callback multiplies it back).

    Example:
        >>> from lightning_gradacc.schedule import AccumulationPlan
        >>> driver = ScheduleDriver(AccumulationPlan({0: 2, 1: 3}, schedule_unit="steps"))
        >>> for batch_idx in range(5):
        ...     _ = driver.batch_start(batch_idx, batch_idx + 1)
        ...     if driver.ends_window:
        ...         driver.window_closed(items=0.0)
        >>> driver.steps, driver.window_k  # windows of 2 and 3 batches
        (2, 3)
    """

    def __init__(self, plan: AccumulationPlan) -> None:
        self.plan = plan
        self.steps = 0
        self.items = 0.0
        self.window_k = plan.for_count(0)
        self.batches_in_window = 0
        self.lightning_k = 1

    @property
    def count(self) -> float:
        """What the schedule's thresholds count, so far."""
        return self.steps if self.plan.unit == "steps" else self.items

    @property
    def ends_window(self) -> bool:
        """Whether the current batch ends its window (the epoch's last batch ends it in any case)."""
        return self.batches_in_window >= self.window_k

    def batch_start(self, batch_idx: int, ready: int) -> bool:
        """A batch starts: open a window if none is open; choose Lightning's K for it.

        Returns:
            Whether this batch opens a window.
        """
        opens = self.batches_in_window == 0
        if opens:
            self.window_k = self.plan.for_count(self.count)
        self.batches_in_window += 1
        self.lightning_k = lightning_k(batch_idx, ready, ends_window=self.ends_window)
        return opens

    def window_closed(self, items: float) -> None:
        """The window was finalized (stepped or skipped), with ``items`` over all ranks."""
        self.steps += 1
        self.items += items
        self.batches_in_window = 0

    def window_abandoned(self) -> None:
        """The open window was discarded (e.g. an epoch ended inside it): the next batch opens a new one."""
        self.batches_in_window = 0

    def describe(self) -> str:
        """Where the schedule stands, for the summary.

        Example:
            >>> from lightning_gradacc.schedule import AccumulationPlan
            >>> driver = ScheduleDriver(AccumulationPlan({0: 1, 100: 2, "1k": 4}, schedule_unit="items"))
            >>> driver.window_closed(items=120.0)
            >>> driver.describe()
            'by items: 2 of 3 stages reached (K=2 now); 1 steps, 120 items consumed'
        """
        assert self.plan.schedule is not None
        reached = sum(threshold <= self.count for threshold in self.plan.schedule)
        now = self.plan.for_count(self.count)
        items = f"{self.items:,.0f}" if float(self.items).is_integer() else f"{self.items:,.1f}"
        return (
            f"by {self.plan.unit}: {reached} of {len(self.plan.schedule)} stages reached (K={now} now);"
            f" {self.steps:,} steps, {items} items consumed"
        )

    def state_dict(self) -> dict[str, Any]:
        """The counts and the open window's position, as plain numbers."""
        return {
            "steps": self.steps,
            "items": self.items,
            "window_k": self.window_k,
            "batches_in_window": self.batches_in_window,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position (a checkpoint taken inside a window resumes inside it)."""
        self.steps = int(state["steps"])
        self.items = float(state["items"])
        self.window_k = int(state["window_k"])
        self.batches_in_window = int(state["batches_in_window"])
