"""How many micro-batches a window holds: fixed, an epoch schedule, or derived from a target batch size.

No Lightning import: the callback asks this module *what K is* and decides *when* to apply it.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from .core.validation import check_positive_int, check_schedule


class AccumulationPlan:
    """The accumulation factor K as configured: an int, ``{epoch: K}``, or a target batch size.

    Args:
        accumulation_steps: K, or ``{epoch: K}`` with the semantics of Lightning's
            ``GradientAccumulationScheduler`` (K=1 before the first key), or ``None``.
        target_batch_size: Items per optimizer step wanted over all ranks; K is derived from the micro-batch
            size and the world size by :meth:`resolve_target`.

    Example:
        >>> plan = AccumulationPlan({1: 2, 3: 4})
        >>> [plan.for_epoch(epoch) for epoch in range(5)]
        [1, 2, 2, 4, 4]
    """

    def __init__(self, accumulation_steps: Any = None, target_batch_size: Any = None) -> None:
        if accumulation_steps is not None and target_batch_size is not None:
            raise ValueError(
                f"Expected only one of `accumulation_steps` ({accumulation_steps!r}) and `target_batch_size`"
                f" ({target_batch_size!r}); K is derived from `target_batch_size`, so leave"
                " `accumulation_steps` unset."
            )
        self.fixed: int | None = None
        self.schedule: dict[int, int] | None = None
        if isinstance(accumulation_steps, dict):
            self.schedule = check_schedule("accumulation_steps", accumulation_steps)
        elif accumulation_steps is not None:
            self.fixed = check_positive_int("accumulation_steps", accumulation_steps)
        self.target_batch_size = (
            None if target_batch_size is None else check_positive_int("target_batch_size", target_batch_size)
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

    def stepping_batches(self, batches_per_epoch: int, max_epochs: int, max_steps: int = -1) -> int:
        """Optimizer steps of a fit: one per window, windows cut per epoch with that epoch's K.

        Example:
            >>> AccumulationPlan({0: 4, 2: 1}).stepping_batches(10, 3)  # 3 + 3 + 10
            16
        """
        steps = 0
        for epoch in range(max(max_epochs, 1)):
            k = self.for_epoch(epoch)
            if k is None:
                raise RuntimeError("The target batch size is not resolved yet.")
            steps += math.ceil(batches_per_epoch / k)
        return min(steps, max_steps) if max_steps != -1 else steps

    @property
    def configured(self) -> bool:
        """Whether K comes from this plan (else it is adopted from elsewhere, e.g. the Trainer)."""
        return self.fixed is not None or self.schedule is not None or self.target_batch_size is not None

    def for_epoch(self, epoch: int) -> int | None:
        """K for ``epoch``; ``None`` while a target batch size has not been resolved."""
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
        self.target_k = max(1, math.ceil(self.target_batch_size / per_window))
        return self.target_k, self.target_k * per_window
