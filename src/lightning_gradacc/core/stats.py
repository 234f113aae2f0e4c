"""AccumulationStats: what the accumulator measured, as plain Python numbers.

Every field is named for what it counts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


def _comparable(value: float) -> object:
    """``nan`` ("not measured") as a value equal to itself, for snapshot equality."""
    return "nan" if isinstance(value, float) and math.isnan(value) else value


@dataclass(frozen=True, eq=False)
class AccumulationStats:
    """A snapshot of the accumulator's statistics.

    Attributes:
        accumulation_steps: Micro-batches per window now (K).
        open_window_micro_batches: Micro-batches recorded in the window that is still open.
        windows: Windows closed: stepped, skipped (not finite) or empty (nothing in them).
        steps_taken: Windows that ended in an optimizer step (``windows - skipped_steps - empty_windows``).
        total_micro_batches: Micro-batches recorded since creation (re-evaluations by LBFGS not counted).
        skipped_steps: Windows not stepped because their gradient was not finite (by the accumulator, or
            by a ``GradScaler``).
        non_finite_windows: Windows whose accumulated gradient was not finite (skipped or not, depending on
            ``overflow``).
        dropped_micro_batches: Micro-batches dropped by ``overflow="skip_micro_batch"``.
        empty_windows: Windows that took no step because nothing was in them: every ``training_step``
            returned ``None`` (or backward was skipped, as in ``StochasticWeightAveraging``'s BatchNorm
            epoch), or ``scaling="weighted"`` counted 0 items in total.
        clipped_steps: Windows whose gradient clipping changed (with ``clip_mode="micro_batch"``: where it
            changed some micro-batch's gradient).
        last_grad_norm: Total gradient norm of the last window, after scaling and before clipping.
        max_grad_norm_seen: Largest finite ``last_grad_norm`` so far.
        items_last_step: Items (samples, tokens) in the last window, summed over ranks: the real effective
            batch size (a float: counts such as ``attention_mask.float().sum()`` need not be integers).
        items_last_full_step: Items in the last window that held K micro-batches, summed over ranks: what
            a full optimizer step holds (``items_last_step`` is often an epoch's shorter, last window).
        micro_batches_last_step: Micro-batches in the last window (k, which is < K for a partial window).
        num_parameters: Trainable parameter elements tracked: the whole model's, also when FSDP shards it
            (not this rank's shards).
        buffer_bytes: Extra memory held by the accumulator (0: gradients accumulate in ``.grad``).
        peak_memory_bytes: The process's peak memory on the gradients' device so far: the CUDA
            allocator's peak on GPU (since the process started or the user last called
            ``torch.cuda.reset_peak_memory_stats``), the process's resident-set peak on CPU. Read when the
            statistics are read; this package never resets a process-wide counter, so it is not a
            window's peak.
        noise_scale: The gradient noise scale B_simple = tr(Σ) / |G|² in items (samples, tokens: what the
            item counts count), from bias-corrected exponential averages of the two estimates below
            (``noise_scale=True``; ``nan`` until a window of at least 2 micro-batches gave one). It
            predicts the critical batch size (McCandlish et al. 2018).
        grad_sq_norm_estimate: The last window's unbiased estimate of |G|², the squared norm of the true
            gradient (may be negative: it is a noisy estimate).
        trace_sigma_estimate: The last window's unbiased estimate of tr(Σ), the summed variance of one
            item's gradient (may be negative).

    Example:
        >>> stats = AccumulationStats(accumulation_steps=4, windows=3, skipped_steps=1)
        >>> stats.steps_taken, stats.as_dict()["accumulation_steps"]
        (2, 4)
    """

    accumulation_steps: int = 1
    open_window_micro_batches: int = 0
    windows: int = 0
    total_micro_batches: int = 0
    skipped_steps: int = 0
    non_finite_windows: int = 0
    dropped_micro_batches: int = 0
    empty_windows: int = 0
    clipped_steps: int = 0
    last_grad_norm: float = 0.0
    max_grad_norm_seen: float = 0.0
    items_last_step: float = 0.0
    items_last_full_step: float = 0.0
    micro_batches_last_step: int = 0
    num_parameters: int = 0
    buffer_bytes: int = 0
    peak_memory_bytes: int = 0
    noise_scale: float = math.nan
    grad_sq_norm_estimate: float = math.nan
    trace_sigma_estimate: float = math.nan

    @property
    def steps_taken(self) -> int:
        """Windows that ended in an optimizer step."""
        return self.windows - self.skipped_steps - self.empty_windows

    def __eq__(self, other: object) -> bool:
        """Field by field; two snapshots that both did not measure something (``nan``) agree on it."""
        if not isinstance(other, AccumulationStats):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple[object, ...]:
        return tuple(_comparable(value) for value in asdict(self).values())

    def as_dict(self) -> dict[str, int | float]:
        """Return the fields by name, in declaration order, and ``steps_taken``."""
        values = asdict(self)
        values["steps_taken"] = self.steps_taken
        return values
