"""Which ``accumulate_grad_batches`` makes Lightning zero and step exactly where a window starts and ends.

Lightning decides by modulo (2.6, ``loops/optimization/automatic.py``, ``loops/training_epoch_loop.py``):
it zeroes the gradients before the backward of batch ``n`` when ``n % K == 0``, steps after it when
``ready % K == 0`` (``ready``: batches fetched this epoch, ``n + 1``) or at the epoch's last batch, and
divides the loss by ``K``. A schedule that changes K inside an epoch cannot keep one K for the fit: the
window after a change would start where Lightning does not zero and end where it does not step.

One K per window drives it exactly: a window of ``L`` batches whose last one is fetched as ``ready = e`` needs
a K that divides ``e`` (the step) and none of ``e - L + 1 .. e - 1`` (no step, and no zeroing, inside the
window). Any divisor of ``e`` that is at least ``L`` does: the multiple before ``e`` is then at most
``e - L``. The smallest such power of two is taken where one exists (Lightning's division of the loss, which
the callback's loss scale undoes at the boundary, is then exact), else the smallest such divisor. A window
that the epoch's end cuts short still ends there: Lightning steps at the epoch's last batch in any case. The
window's first batch is zeroed by the callback where Lightning does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .schedule import AccumulationPlan


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
        smallest = 1 << max(window_k - 1, 0).bit_length()  # the smallest power of two >= window_k
        return smallest  # divides `end`, since `power` (a larger or equal power of two) does
    for k in range(window_k, end + 1):
        if end % k == 0:
            return k
    return end  # not reached: `end` divides itself and end >= window_k


class ScheduleDriver:
    """The windows of a schedule keyed by steps or items, and the K Lightning gets for each batch.

    Args:
        plan: The fit's plan (``schedule_unit`` ``"steps"`` or ``"items"``).

    Attributes:
        steps: Windows closed so far (optimizer steps taken or skipped).
        items: Items of the windows closed so far, over all ranks.
        window_k: K of the open window: the schedule's value at the count reached when it opened.
        batches_in_window: Batches of the open window started so far.
        lightning_k: The ``accumulate_grad_batches`` of the open window (Lightning divides every loss of the
            window by it: the window's loss scale).

    Example:
        >>> from lightning_gradacc.schedule import AccumulationPlan
        >>> driver = ScheduleDriver(AccumulationPlan({0: 2, 1: 3}, schedule_unit="steps"))
        >>> for batch_idx in range(5):
        ...     _ = driver.batch_start(batch_idx + 1)
        ...     if driver.batches_in_window == driver.window_k:  # Lightning steps: the callback closes it
        ...         driver.window_closed(items=0.0)
        >>> driver.steps, driver.window_k, driver.lightning_k  # windows of 2 and 3: batches 0-1 and 2-4
        (2, 3, 5)
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

    def batch_start(self, ready: int) -> bool:
        """A batch starts (``ready``: Lightning's count of batches fetched this epoch, this one included).

        Returns:
            Whether this batch opens a window (its K and Lightning's K were chosen).
        """
        opens = self.batches_in_window == 0
        if opens:
            self.window_k = self.plan.for_count(self.count)
            self.lightning_k = window_lightning_k(ready, self.window_k)
        self.batches_in_window += 1
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
            "lightning_k": self.lightning_k,
            "batches_in_window": self.batches_in_window,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position (a checkpoint taken inside a window resumes inside it)."""
        self.steps = int(state["steps"])
        self.items = float(state["items"])
        self.window_k = int(state["window_k"])
        self.lightning_k = int(state["lightning_k"])
        self.batches_in_window = int(state["batches_in_window"])
