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


def noise_sentence(stats: AccumulationStats, full_step_items: int | None = None) -> str | None:
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
    batch = float(full_step_items or stats.items_last_step)
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
        *(
            [("gradient noise scale", f"{stats.noise_scale:,.1f} items (averaged over recent steps)")]
            if not math.isnan(stats.noise_scale)
            else []
        ),
        ("peak memory", _bytes(stats.peak_memory_bytes)),
        ("accumulation buffers", _bytes(stats.buffer_bytes)),
        ("logs", log_dir or "no logger"),
    ]
    width = max(29, max(len(name) for name, _ in rows) + 4)  # a stable layout
    lines = ["Gradient accumulation summary", "-" * 63]
    lines += [f"{name:<{width}}{value}" for name, value in rows]
    sentence = noise_sentence(stats, full_step_items)
    if sentence is not None:
        lines += ["", sentence]
    return "\n".join(lines)
