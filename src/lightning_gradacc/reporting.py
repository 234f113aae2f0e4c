"""What the callback reports: the scalars logged at each step, skip warnings, the table at the end of fit."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields, replace
from typing import Any

from .core import AccumulationStats

# Statistics logged under "grad_accum/" with their own names: as each field of AccumulationStats declares.
_LOGGED = [f for f in fields(AccumulationStats) if f.metadata["logged"]]
NOISE_STATISTICS = tuple(f.name for f in _LOGGED if f.metadata["noise"])  # with noise_scale=True
# logged where the fit has the part that keeps them (the plan's learning-rate factor and "auto", the pieces)
PART_STATISTICS = tuple(f.name for f in _LOGGED if f.metadata["kept"] == "part")
LOGGED_STATISTICS = (
    *(f.name for f in _LOGGED if not f.metadata["noise"] and f.metadata["kept"] != "part"),
    "steps_taken",
)


def with_parts(stats: AccumulationStats, parts: Mapping[str, float]) -> AccumulationStats:
    """``stats`` with the values the fit's parts keep (``PART_STATISTICS``, by name).

    Example:
        >>> with_parts(AccumulationStats(windows=2), {"oom_retries": 1.0}).oom_retries
        1
    """
    if not parts:
        return stats
    unknown = set(parts) - set(PART_STATISTICS)
    if unknown:  # a part's value must be declared once, as a field of AccumulationStats
        raise KeyError(f"{sorted(unknown)} are not statistics kept by a part (AccumulationStats).")
    integers = {f.name for f in fields(AccumulationStats) if type(f.default) is int}
    return replace(stats, **{n: int(v) if n in integers else v for n, v in parts.items()})  # type: ignore[arg-type]


def step_metrics(
    stats: AccumulationStats | None,
    *,
    noise_scale: bool,
    parts: Iterable[str] = (),
    absent: frozenset[str] = frozenset(),
) -> dict[str, float]:
    """The logged scalars: ``LOGGED_STATISTICS`` (and ``NOISE_STATISTICS``), and the parts' values.

    Args:
        stats: The fit's statistics, the parts' values in them (``None``: nothing to log yet).
        noise_scale: Whether the noise scale is estimated.
        parts: The names of the values the fit's parts keep (``PART_STATISTICS``): logged from ``stats``.
        absent: Statistics the accumulator cannot show (``EngineWindow.absent``): not logged.

    Example:
        >>> stats = with_parts(AccumulationStats(windows=2), {"piece_size": 4})
        >>> metrics = step_metrics(stats, noise_scale=False, parts=["piece_size"])
        >>> metrics["grad_accum/piece_size"], "grad_accum/noise_scale" in metrics
        (4.0, False)
    """
    if stats is None:
        return {}
    values = stats.as_dict()
    names = (*LOGGED_STATISTICS, *(NOISE_STATISTICS if noise_scale else ()), *parts)
    return {f"grad_accum/{name}": float(values[name]) for name in names if name not in absent}


class SkipWarnings:
    """Warns of steps skipped for non-finite gradients, rate-limited: at the 1st, 2nd, 4th, 8th, ... skip.

    Attributes:
        seen: The skipped steps counted at the last look (set when an accumulator takes over its counters).

    Example:
        >>> skips = SkipWarnings()
        >>> for skipped in (1, 2, 3, 4):
        ...     skips.update(skipped, global_step=10 * skipped, warn=lambda message: print(message[:38]))
        Non-finite gradient at global step 10:
        Non-finite gradient at global step 20:
        Non-finite gradient at global step 40:
    """

    def __init__(self) -> None:
        self.seen = 0
        self._warned = 0  # the skips counted at the last warning

    def update(
        self, skipped: int, global_step: int, warn: Callable[[str], Any], *, late: bool = False
    ) -> None:
        """Look at the run's ``skipped`` steps after a step that was skipped; warn if it is time to.

        ``late``: the count was read after steps decided on the device, so the skips happened by
        ``global_step``, not at it.
        """
        if skipped > self.seen and (skipped >= 2 * self._warned or skipped == 1):
            self._warned = max(skipped, 1)
            where = (
                f"by global step {global_step} (a fused optimizer skipped it on the device)"
                if late
                else f"at global step {global_step}"
            )
            warn(
                f"Non-finite gradient {where}: the optimizer step was skipped"
                f" ({skipped} skipped so far). Parameters and optimizer state are unchanged; `global_step`"
                " and step-interval LR schedulers still advance."
            )
        self.seen = skipped


# ------------------------------------------------------------------------------------------ the summary


def _bytes(value: int) -> str:
    return f"{value / 2**20:,.1f} MiB"


def _items(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:,.1f}"


def effective_batch(stats: AccumulationStats) -> float:
    """Items in a full optimizer step: the last window of K micro-batches (else the last window).

    Example:
        >>> effective_batch(AccumulationStats(items_last_step=94.0, items_last_full_step=182.0))
        182.0
    """
    return stats.items_last_full_step or stats.items_last_step


def _effective_batch(stats: AccumulationStats) -> str:
    k = stats.accumulation_steps
    full = f"{_items(stats.items_last_full_step)} in the last full step (K micro-batches)"
    if stats.micro_batches_last_step == k and stats.items_last_full_step == stats.items_last_step:
        return full
    last = f"{_items(stats.items_last_step)} in the last step ({stats.micro_batches_last_step} of {k})"
    return f"{full}; {last}" if stats.items_last_full_step else f"{last}; no full step yet"


def noise_sentence(stats: AccumulationStats) -> str | None:
    """A plain sentence comparing the effective batch with the gradient noise scale (``None``: not measured).

    The noise scale approximates the critical batch size (McCandlish et al. 2018): far below it, a larger
    batch still cuts the number of steps almost in proportion; far above it, steps use items they do not
    need.

    Example:
        >>> noise_sentence(AccumulationStats(items_last_step=128.0, noise_scale=1000.0))[:62]
        'The effective batch (128 items) is well below the gradient noi'
    """
    noise = stats.noise_scale
    if math.isnan(noise):
        return None
    if not math.isfinite(noise) or noise <= 0:
        return (
            "The gradient noise scale has no usable estimate yet (it is not positive: too few or too noisy"
            " windows); train longer before reading it."
        )
    batch = effective_batch(stats)
    if batch <= 0:  # no item counts: the noise scale is in micro-batches
        return (
            f"The gradient noise scale is {noise:,.1f} micro-batches (no item counts were known: pass"
            " `item_count_fn` to have it in samples or tokens)."
        )
    compared = f"The effective batch ({batch:,.0f} items) is {{}} the gradient noise scale"
    compared += f" ({noise:,.0f} items)"
    if batch < noise / 2:
        return compared.format("well below") + (
            ": a larger batch (a larger K, or more ranks) would still cut the number of optimizer steps"
            " almost in proportion."
        )
    if batch > 2 * noise:
        return compared.format("well above") + (
            ": each step uses more items than it needs; a smaller K would reach the same loss with less"
            " compute, in not many more steps."
        )
    return compared.format("close to") + ": a balanced trade-off between steps and compute."


def _noise_scale(stats: AccumulationStats) -> str:
    noise = stats.noise_scale
    if not math.isfinite(noise) or noise <= 0:
        return "no usable estimate yet (not positive)"
    unit = "items" if effective_batch(stats) > 0 else "micro-batches"  # no item counts: micro-batches
    return f"{noise:,.1f} {unit} (averaged over recent steps)"


def _pieces(stats: AccumulationStats) -> str:
    errors = stats.oom_retries
    recovered = f"{errors:,} out-of-memory error{'s' if errors != 1 else ''} recovered"
    return f"{recovered}; the last batch's largest piece {stats.piece_size:,} items"


def format_summary(stats: AccumulationStats, log_dir: str | None, schedule: str | None = None) -> str:
    """Render the statistics of a finished run as a two-column table (``callback.summary()`` prints it).

    Args:
        stats: The callback's statistics at the end of ``fit`` (its parts' values in them).
        log_dir: Where the logger writes (``None``: no logger).
        schedule: Where a schedule keyed by steps or items stands (``None``: none).

    Example:
        >>> print(format_summary(AccumulationStats(accumulation_steps=4, windows=3), None))
        Gradient accumulation summary
        ---------------------------------------------------------------
        optimizer steps taken        3 of 3 windows
        accumulation steps (K)       4
        ...
        logs                         no logger
    """
    k, window_loss = stats.accumulation_steps, stats.window_loss
    rows = [
        ("optimizer steps taken", f"{stats.steps_taken:,} of {stats.windows:,} windows"),
        ("accumulation steps (K)", str(k)),
        *([("schedule", schedule)] if schedule is not None else []),
        ("effective batch (items)", _effective_batch(stats)),
        ("micro-batches", f"{stats.total_micro_batches:,}"),
        ("skipped steps", f"{stats.skipped_steps:,}"),
        ("empty windows (no step)", f"{stats.empty_windows:,}"),
        ("non-finite windows", f"{stats.non_finite_windows:,}"),
        ("dropped micro-batches", f"{stats.dropped_micro_batches:,}"),
        ("clipped steps", f"{stats.clipped_steps:,}"),
        ("last grad norm", f"{stats.last_grad_norm:.4g} (max seen {stats.max_grad_norm_seen:.4g})"),
        ("last window loss", "n/a" if math.isnan(window_loss) else f"{window_loss:.4f}"),
        *([("gradient noise scale", _noise_scale(stats))] if not math.isnan(stats.noise_scale) else []),
        *([("batches in pieces", _pieces(stats))] if stats.piece_size or stats.oom_retries else []),
        ("peak memory", _bytes(stats.peak_memory_bytes)),
        ("accumulation buffers", _bytes(stats.buffer_bytes)),
        ("logs", log_dir or "no logger"),
    ]
    width = max(29, max(len(name) for name, _ in rows) + 4)  # a stable layout
    lines = ["Gradient accumulation summary", "-" * 63]
    lines += [f"{name:<{width}}{value}" for name, value in rows]
    sentence = noise_sentence(stats)
    if sentence is not None:
        lines += ["", sentence]
    return "\n".join(lines)


def monitors_statistics(callbacks: list[Any]) -> bool:
    """Whether a callback monitors a ``grad_accum/`` key (``ModelCheckpoint``, ``EarlyStopping``)."""
    return any(
        str(getattr(callback, "monitor", None) or "").startswith("grad_accum/") for callback in callbacks
    )
