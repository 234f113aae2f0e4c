"""One micro-batch's gradient on its way into the accumulation buffers: checked and clipped on its own.

With buffers each micro-batch's gradient is in ``.grad`` alone right after its backward, before it is added
to the window: ``overflow="skip_micro_batch"`` drops it if it is not finite (the same decision on every
rank: one scalar all-reduce), ``clip_mode="micro_batch"`` clips it to ``max_grad_norm`` after undoing its
item weight and loss scale. Neither syncs with the host.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .boundary import decide
from .buffers import GradBuffers
from .gradient_scale import GradientScale
from .kernels import total_norm
from .parameters import TrackedParameters
from .scalars import as_scalar
from .validation import AccumulationSettings
from .weighting import ItemCount
from .window import Window
from .world import World


class MicroBatchIntake:
    """Moves each micro-batch's ``.grad`` into the buffers, checked and clipped on its own where asked.

    Args:
        tracked: The parameters whose ``.grad`` is taken.
        buffers: The accumulation buffers.
        settings: ``overflow`` and ``clip_mode`` decide what is checked.
        scale: The loss and AMP scale the gradient carries (undone before clipping).
        world: The ranks over which a dropped micro-batch is agreed on.
        dtype: Dtype of the window's counters.
    """

    def __init__(
        self,
        tracked: TrackedParameters,
        buffers: GradBuffers,
        settings: AccumulationSettings,
        scale: GradientScale,
        world: World,
        dtype: torch.dtype,
    ) -> None:
        self.tracked, self.buffers, self.settings = tracked, buffers, settings
        self.scale, self.world, self.dtype = scale, world, dtype
        self.checks = settings.overflow == "skip_micro_batch" or settings.clip_mode == "micro_batch"

    def absorb(self, window: Window, count: ItemCount) -> Tensor | None:
        """Move the micro-batch's ``.grad`` into the buffers; count a drop or a clip in ``window``.

        Returns:
            A device bool saying whether the micro-batch was kept (``None`` when nothing checks it).
        """
        if self.tracked.flat_sharded:
            self.tracked.check_flat_gradients()
        keep: Tensor | None = None
        multiplier: Tensor | None = None
        if self.checks:
            keep, multiplier = self._check(window, count)
        self.buffers.absorb(keep, multiplier)
        return keep

    def _check(self, window: Window, count: ItemCount) -> tuple[Tensor | None, Tensor | None]:
        settings, tracked = self.settings, self.tracked
        device = tracked.device
        keep: Tensor | None = None
        multiplier: Tensor | None = None
        # Sharded (FSDP, reduced every micro-batch): `.grad` holds this rank's shard of micro-batch i of
        # every rank, averaged; its norm is combined over the shards (one small collective, no sync), so
        # the check and the clip act on that global micro-batch, the same on every rank.
        if tracked.sharded:
            norm = tracked.micro_batch_norm(settings.norm_type)
        else:
            grads = [grad for grad in tracked.grads() if grad is not None]
            norm = total_norm(grads, settings.norm_type, device=device, foreach=tracked.foreach)
        finite = torch.isfinite(norm)
        world_size, all_reduce = self.world.resolve()
        if settings.overflow == "skip_micro_batch":
            bad = (~finite).to(self.dtype)
            if all_reduce is not None:  # every rank drops the same micro-batch
                bad = all_reduce(bad.reshape(1)).reshape(())
            keep = bad == 0
            dropped = bad.clamp(max=1)
            window.tally.add("dropped", dropped)
        if settings.clip_mode == "micro_batch":
            assert settings.max_grad_norm is not None
            # undo the loss's weight and scale; a weight of 0 leaves a zero gradient, nothing to clip
            weight = as_scalar(count.weight, device, self.dtype)
            if (
                tracked.sharded and all_reduce is not None
            ):  # the gradient is the ranks' mean: so is its weight
                weight = all_reduce(weight.reshape(1).clone()).reshape(()) / world_size
            factor = (weight.to(norm.dtype) * self.scale.value()).abs().clamp(min=1e-30)
            decision = decide(norm / factor, max_norm=settings.max_grad_norm)
            clipped = (decision.clipped & finite).to(self.dtype)
            window.tally.add("micro_clips", clipped)
            multiplier = torch.where(finite, decision.multiplier, 1.0)  # type: ignore[arg-type]
        return keep, multiplier
