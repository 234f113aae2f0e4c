"""Scaling modes: how a window's summed gradients become one big batch's gradient, one object each.

A mode says what it weights (each micro-batch's loss by its items, or not), what it needs counted (the
item counts of every micro-batch), whether the window's gradient is a sum or a mean, and the factor that
normalizes the window's sum (see ``docs/architecture.md``, "The contract"). The package asks the mode;
nothing compares mode names. A new mode is one more :class:`ScalingMode` in :data:`SCALING_MODES` (and its
name in ``settings.Scaling``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .scalars import Scalar


@dataclass(frozen=True)
class ScalingMode:
    """One scaling mode.

    Attributes:
        name: Its canonical name (``AccumulationSettings.scaling``).
        weighted: Each micro-batch's loss is multiplied by its items over a reference count, so the window
            is the item-weighted mean over the micro-batches and the ranks (its item counts are needed).
        summed: The window's gradient is the sum of its micro-batches' (else a mean).
        additive: Each loss is a sum over its items divided by a constant of the whole step, so losses add:
            the window's gradient is the sum over the micro-batches and the ranks (the average DDP, FSDP and
            DeepSpeed take over the ranks undone), and the pieces of a batch add without a share.

    Example:
        >>> SCALING_MODES["mean"].factor(4, dropped=1.0, weights=0.0, loss_scale=0.25, world_size=1)
        1.3333333333333333
        >>> SCALING_MODES["weighted"].weighted, SCALING_MODES["sum"].summed
        (True, True)
        >>> SCALING_MODES["constant"].factor(4, dropped=0.0, weights=0.0, loss_scale=0.25, world_size=2)
        8.0
    """

    name: str
    weighted: bool = False
    summed: bool = False
    additive: bool = False

    def factor(
        self, micro_batches: int, *, dropped: Scalar, weights: Scalar, loss_scale: float, world_size: int
    ) -> Scalar:
        """The factor that turns a window's sum into the contract's gradient.

        The sum holds, over micro-batches, weight x loss scale x gradient (averaged over ranks by DDP); a
        GradScaler has already divided its own scale out.

        Args:
            micro_batches: Micro-batches recorded in the window (on this rank).
            dropped: Those dropped by ``overflow="skip_micro_batch"``.
            weights: Sum of the micro-batches' weights over ranks (``weighted``).
            loss_scale: What every loss was multiplied by besides its weight (Lightning's ``1 / K``).
            world_size: Data-parallel ranks.
        """
        if self.weighted:
            # w = items / reference, so dividing by sum w (over ranks: times R for DDP's average) gives
            # sum n g / sum n. A window without items never steps.
            if isinstance(weights, Tensor):
                return world_size / (loss_scale * torch.where(weights > 0, weights, 1.0))
            return world_size / (loss_scale * (weights if weights > 0 else 1.0))
        if self.summed:
            return (world_size if self.additive else 1.0) / loss_scale
        if isinstance(dropped, Tensor):
            return 1.0 / ((micro_batches - dropped).clamp(min=1) * loss_scale)
        return 1.0 / (max(micro_batches - dropped, 1) * loss_scale)


SCALING_MODES = {
    "mean": ScalingMode("mean"),
    "sum": ScalingMode("sum", summed=True),
    "weighted": ScalingMode("weighted", weighted=True),
    # a loss divided by a constant of the step (a token budget, Dr. GRPO's): no count, so every engine
    "constant": ScalingMode("constant", summed=True, additive=True),
}
