"""A learning-rate schedule indexed by the items consumed (tokens with a token counter), not by steps.

With a K that changes (a schedule keyed by tokens, ``"auto"``) the optimizer steps of a run are not known
in advance and a step is not a fixed number of tokens: a schedule by steps warms up and decays at the
wrong place. Megatron-LM schedules its warmup and decay in samples for that reason. :class:`TokenSchedule`
is that schedule over an item budget; the callback's ``lr_schedule`` applies it around each optimizer
step, as a factor on the learning rates the optimizer and any LR scheduler set, with the items of the
windows stepped before (over all ranks): the learning rate as a function of tokens is the same whatever
K runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from .core.settings import check_choice, parse_threshold

DecayShape = Literal["cosine", "linear", "constant"]


@dataclass(frozen=True)
class TokenSchedule:
    """Linear warmup from 0 over ``warmup`` items, then a decay to ``final`` over the rest of ``total``.

    The factor at ``n`` items consumed (before the step) is ``n / warmup`` during the warmup; then, with
    ``p = (n - warmup) / (total - warmup)``, ``final + (1 - final) * (1 + cos(pi p)) / 2`` (``"cosine"``),
    ``final + (1 - final) * (1 - p)`` (``"linear"``) or 1 (``"constant"``); ``final`` after ``total``.
    It multiplies the learning rates the optimizer and its scheduler set (the peak learning rate is
    theirs).

    Attributes:
        total: The item budget of the schedule (an int, or a string such as ``"2.4B"``, ``"10k"``).
        warmup: Items of the linear warmup (0: none).
        decay: ``"cosine"``, ``"linear"`` or ``"constant"``.
        final: The factor at ``total`` and after it, in [0, 1].

    Example:
        >>> schedule = TokenSchedule(total="10k", warmup=1000, decay="cosine", final=0.1)
        >>> [round(schedule.factor(n), 3) for n in (0, 500, 1000, 5500, 10000, 20000)]
        [0.0, 0.5, 1.0, 0.55, 0.1, 0.1]
    """

    total: int | str
    warmup: int | str = 0
    decay: DecayShape = "cosine"
    final: float = 0.0

    def __post_init__(self) -> None:
        total = parse_threshold("lr_schedule.total", self.total)
        warmup = parse_threshold("lr_schedule.warmup", self.warmup)
        if not 0 <= warmup <= total or total <= 0:
            raise ValueError(
                f"Expected `lr_schedule.warmup` ({self.warmup!r}) to be at least 0 and at most"
                f" `lr_schedule.total` ({self.total!r}), which must be more than 0."
            )
        check_choice("lr_schedule.decay", self.decay, DecayShape)
        final = self.final
        if isinstance(final, bool) or not isinstance(final, (int, float)) or not 0.0 <= final <= 1.0:
            raise ValueError(f"Expected `lr_schedule.final` to be a number in [0, 1], but got {final!r}.")
        if self.decay == "constant" and final != 0.0:
            raise ValueError(
                f"`lr_schedule.final` ({final!r}) cannot take effect with `lr_schedule.decay='constant'`:"
                " leave it unset, or choose 'cosine' or 'linear'."
            )
        object.__setattr__(self, "total", total)
        object.__setattr__(self, "warmup", warmup)
        object.__setattr__(self, "final", float(final))

    def factor(self, items: float) -> float:
        """The learning-rate factor after ``items`` items (over all ranks) were consumed."""
        total, warmup = float(self.total), float(self.warmup)
        if items < warmup:
            return items / warmup
        if self.decay == "constant":
            return 1.0
        if items >= total:
            return self.final
        progress = (items - warmup) / (total - warmup)
        shape = (1.0 + math.cos(math.pi * progress)) / 2 if self.decay == "cosine" else 1.0 - progress
        return self.final + (1.0 - self.final) * shape


def make_schedule(lr_schedule: Any) -> TokenSchedule | None:
    """The callback's ``lr_schedule``: a :class:`TokenSchedule`, its fields as a mapping, or ``None``.

    Example:
        >>> make_schedule({"total": "1M", "warmup": "10k"}).total
        1000000
    """
    if lr_schedule is None or isinstance(lr_schedule, TokenSchedule):
        return lr_schedule
    if isinstance(lr_schedule, dict):
        return TokenSchedule(**lr_schedule)
    raise TypeError(
        f"Expected argument `lr_schedule` to be a TokenSchedule, a mapping of its fields or None, but got"
        f" {lr_schedule!r}."
    )
