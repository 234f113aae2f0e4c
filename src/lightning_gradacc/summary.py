"""The table printed at the end of ``lightning-gradacc fit``."""

from __future__ import annotations

import math

from .stats import AccumulationStats


def _bytes(value: int) -> str:
    return f"{value / 2**20:,.1f} MiB"


def _effective_batch(stats: AccumulationStats, full_step_items: int | None) -> str:
    items = stats.items_last_step
    shown = f"{int(items):,}" if float(items).is_integer() else f"{items:,.1f}"
    last = f"{shown} in the last step ({stats.micro_batches_last_step} of"
    last += f" {stats.accumulation_steps} micro-batches)"
    return last if full_step_items is None else f"{full_step_items:,} per full step; {last}"


def format_summary(
    stats: AccumulationStats, window_loss: float, log_dir: str | None, full_step_items: int | None = None
) -> str:
    """Render the statistics of a finished run as a two-column table.

    Args:
        stats: The callback's statistics at the end of ``fit``.
        window_loss: Mean loss of the last window.
        log_dir: Where the logger writes (``None``: no logger).
        full_step_items: Items in a full window (micro-batch size x K x ranks), when known.

    Example:
        >>> print(format_summary(AccumulationStats(accumulation_steps=4, windows=3), 0.5, None))
        Gradient accumulation summary
        ---------------------------------------------------------------
        optimizer steps taken        3 of 3 windows
        accumulation steps (K)       4
        ...
        logs                         no logger
    """
    k = stats.accumulation_steps
    rows = [
        ("optimizer steps taken", f"{stats.steps_taken:,} of {stats.windows:,} windows"),
        ("accumulation steps (K)", str(k)),
        ("effective batch (items)", _effective_batch(stats, full_step_items)),
        ("micro-batches", f"{stats.total_micro_batches:,}"),
        ("skipped steps", f"{stats.skipped_steps:,}"),
        ("empty windows (no step)", f"{stats.empty_windows:,}"),
        ("non-finite windows", f"{stats.non_finite_windows:,}"),
        ("dropped micro-batches", f"{stats.dropped_micro_batches:,}"),
        ("clipped steps", f"{stats.clipped_steps:,}"),
        ("last grad norm", f"{stats.last_grad_norm:.4g} (max seen {stats.max_grad_norm_seen:.4g})"),
        ("last window loss", "n/a" if math.isnan(window_loss) else f"{window_loss:.4f}"),
        ("peak memory", _bytes(stats.peak_memory_bytes)),
        ("accumulation buffers", _bytes(stats.buffer_bytes)),
        ("logs", log_dir or "no logger"),
    ]
    width = max(29, max(len(name) for name, _ in rows) + 4)  # a stable layout
    lines = ["Gradient accumulation summary", "-" * 63]
    lines += [f"{name:<{width}}{value}" for name, value in rows]
    return "\n".join(lines)
