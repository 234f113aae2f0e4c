"""AccumulationStats: what the accumulator measured, as plain Python numbers."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class AccumulationStats:
    """A snapshot of the accumulator's statistics.

    Attributes:
        accumulation_steps: Current number of micro-batches per window (K).
        current_step: Micro-batches recorded in the window that is still open.
        optimizer_steps: Windows finished (optimizer steps asked for: taken, skipped or empty).
        total_micro_batches: Micro-batches recorded since creation.
        skipped_steps: Optimizer steps skipped because the gradient was not finite.
        overflow_count: Windows whose accumulated gradient was not finite, plus micro-batches dropped by
            ``overflow="skip_micro_batch"``.
        empty_windows: Windows that took no step because nothing was in them: every ``training_step``
            returned ``None`` (or backward was skipped, as in ``StochasticWeightAveraging``'s BatchNorm
            epoch), or ``scaling="weighted"`` counted 0 items in total. Also counted in ``optimizer_steps``.
        clip_count: Steps where clipping changed the gradient (with ``clip_mode="micro_batch"``: steps
            where it changed some micro-batch's gradient).
        last_grad_norm: Total gradient norm of the last step, after scaling and before clipping.
        max_grad_norm_seen: Largest finite ``last_grad_norm`` so far.
        items_last_step: Items (samples, tokens) in the last step, summed over ranks: the real effective
            batch size (a float: counts such as ``attention_mask.float().sum()`` need not be integers).
        micro_batches_last_step: Micro-batches in the last step (k, which is < K for a partial window).
        num_parameters: Trainable parameter elements tracked.
        buffer_bytes: Extra memory held by the accumulator (0: gradients accumulate in ``.grad``).
        peak_memory_bytes: Peak device memory during the last window (CUDA allocator peak on GPU,
            process resident-set peak on CPU).

    Example:
        >>> AccumulationStats(accumulation_steps=4).as_dict()["accumulation_steps"]
        4
    """

    accumulation_steps: int = 1
    current_step: int = 0
    optimizer_steps: int = 0
    total_micro_batches: int = 0
    skipped_steps: int = 0
    overflow_count: int = 0
    clip_count: int = 0
    empty_windows: int = 0
    last_grad_norm: float = 0.0
    max_grad_norm_seen: float = 0.0
    items_last_step: float = 0.0
    micro_batches_last_step: int = 0
    num_parameters: int = 0
    buffer_bytes: int = 0
    peak_memory_bytes: int = 0

    def as_dict(self) -> dict[str, int | float]:
        """Return the fields by name, in declaration order."""
        return asdict(self)
