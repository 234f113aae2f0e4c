"""One micro-batch's gradient on its way into the accumulation buffers: checked and clipped on its own.

With buffers each micro-batch's gradient is in ``.grad`` alone right after its backward, before it is added
to the window: ``overflow="skip_micro_batch"`` drops it if it is not finite (the same decision on every
rank: one scalar all-reduce), ``clip_mode="micro_batch"`` clips it to ``max_grad_norm`` after undoing its
item weight and loss scale. Neither syncs with the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .boundary import decide
from .kernels import total_norm
from .weighting import ItemCount

if TYPE_CHECKING:
    from .accumulator import GradAccumulator


def absorb_micro_batch(accumulator: GradAccumulator, count: ItemCount) -> Tensor | None:
    """Move the micro-batch's ``.grad`` into ``accumulator``'s buffers, checked and clipped on its own.

    Returns:
        A device bool saying whether the micro-batch was kept (``None`` when nothing checks it).
    """
    assert accumulator._buffers is not None
    settings, window = accumulator.settings, accumulator._window
    keep: Tensor | None = None
    multiplier: Tensor | None = None
    if settings.overflow == "skip_micro_batch" or settings.clip_mode == "micro_batch":
        grads = [param.grad for _, param in accumulator._named if param.grad is not None]
        # Sharded (FSDP, reduced every micro-batch): `.grad` holds this rank's shard of micro-batch i of
        # every rank, averaged; its norm is combined over the shards (one small collective, no sync), so
        # the check and the clip act on that global micro-batch, the same on every rank.
        sharded = accumulator._sharded
        if sharded:
            norm = accumulator._micro_batch_norm()
        else:
            device, foreach = accumulator.device, accumulator.foreach
            norm = total_norm(grads, settings.norm_type, device=device, foreach=foreach)
        finite = torch.isfinite(norm)
        if settings.overflow == "skip_micro_batch":
            bad = (~finite).to(accumulator._ledger_dtype)
            _, all_reduce = accumulator._world.resolve()
            if all_reduce is not None:  # every rank drops the same micro-batch
                bad = all_reduce(bad.reshape(1)).reshape(())
            keep = bad == 0
            dropped = bad.clamp(max=1)
            window.dropped = dropped if window.dropped is None else window.dropped + dropped
        if settings.clip_mode == "micro_batch":
            assert settings.max_grad_norm is not None
            # undo the loss's weight and scale; a weight of 0 leaves a zero gradient, nothing to clip
            weight = accumulator._scalar(count.weight)
            _, all_reduce = accumulator._world.resolve()
            if sharded and all_reduce is not None:  # the gradient is the ranks' mean: so is its weight
                world_size, _ = accumulator._world.resolve()
                weight = all_reduce(weight.reshape(1).clone()).reshape(()) / world_size
            factor = (weight.to(norm.dtype) * accumulator._gradient_scale()).abs().clamp(min=1e-30)
            decision = decide(norm / factor, max_norm=settings.max_grad_norm)
            clipped = (decision.clipped & finite).to(accumulator._ledger_dtype)
            window.micro_clips = clipped if window.micro_clips is None else window.micro_clips + clipped
            multiplier = torch.where(finite, decision.multiplier, 1.0)  # type: ignore[arg-type]
    accumulator._buffers.absorb(keep, multiplier)
    return keep
