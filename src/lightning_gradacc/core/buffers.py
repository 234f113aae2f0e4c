"""Accumulation buffers in a wider dtype than the parameters (e.g. fp32 for bf16 parameters).

Low-precision parameters accumulate gradients in their own dtype, so the rounding error of the sum grows
with the number of micro-batches, and bf16 drops a contribution entirely once the running sum is about
256 times larger (the reason DeepSpeed keeps fp32 gradient buffers). Here each micro-batch's gradient is
added into a buffer of the wider dtype and ``.grad`` is released: parameter by parameter inside the
backward (:meth:`GradBuffers.take`, called by :mod:`~lightning_gradacc.core.grad_hooks`), or all at once
after it (:meth:`GradBuffers.absorb`); either way in the same order, with the same result. The final
gradient is written back to ``.grad`` once per window.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from .boundary import decide
from .kernels import scale_, total_norm
from .parameters import TrackedParameters
from .scalars import as_scalar
from .settings import AccumulationSettings
from .shards import as_sharded_like, local_shards
from .weighting import GradientScale, ItemCount
from .window import Window
from .world import AllReduce, World

# Elements per add of a narrower gradient into a wider buffer on a CPU (see `add_widening_`): a 1 MiB cast.
WIDENING_CHUNK = 2**18


def add_widening_(target: Tensor, source: Tensor) -> None:
    """``target.add_(source)``; on a CPU, a narrower ``source`` is added in chunks.

    torch's CPU kernels cast an input of another dtype to the common one as a temporary copy of the whole
    tensor (TensorIterator's CPU path; CUDA casts inside the kernel): a bf16 gradient added into its fp32
    buffer would hold 4 more bytes per element for the length of the add, the largest parameter's whole
    gradient in fp32 at the backward's peak. In chunks of :data:`WIDENING_CHUNK` elements the temporary is
    1 MiB; each element's sum is the same.

    Example:
        >>> buffer = torch.zeros(5)
        >>> add_widening_(buffer, torch.ones(5, dtype=torch.bfloat16))
        >>> buffer
        tensor([1., 1., 1., 1., 1.])
    """
    if (
        target.dtype == source.dtype
        or target.device.type != "cpu"
        or source.numel() <= WIDENING_CHUNK
        or not (target.is_contiguous() and source.is_contiguous())
    ):
        target.add_(source)
        return
    flat_target, flat_source = target.view(-1), source.view(-1)
    for start in range(0, flat_source.numel(), WIDENING_CHUNK):
        flat_target[start : start + WIDENING_CHUNK].add_(flat_source[start : start + WIDENING_CHUNK])


class GradBuffers:
    """One buffer per parameter and window, allocated on the parameter's device when its first gradient comes.

    A buffer lives while its window does: it is released the moment its sum is written into ``.grad`` (the
    buffers and the final gradients are never both whole in memory) or the window is discarded, and the next
    window allocates it again. A parameter that never gets a gradient (frozen, or unused) costs nothing; one
    unfrozen later gets its buffer then.

    Args:
        named_parameters: The parameters and their names.
        dtype: The buffers' dtype; it must hold every parameter dtype exactly (``float32`` for bf16 or
            fp16 parameters).
        foreach: Use fused ``torch._foreach_*`` kernels (``None``/``True``) or a per-tensor loop.

    Example:
        >>> weight = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        >>> buffers = GradBuffers([("weight", weight)], torch.float32)
        >>> weight.grad = torch.full((2,), 0.5, dtype=torch.bfloat16)
        >>> buffers.absorb()
        >>> weight.grad is None, buffers.nbytes
        (True, 8)
    """

    def __init__(
        self, named_parameters: Sequence[tuple[str, Tensor]], dtype: torch.dtype, foreach: bool | None = None
    ) -> None:
        self.dtype = dtype
        self.foreach = foreach
        self.params: list[Tensor] = []
        self._buffers: list[Tensor | None] = []
        # Per parameter: whether its buffer holds a gradient of the open window. A buffer that does not is
        # overwritten (not added to) by the next gradient, which saves a zeroing pass per window.
        self._holds: list[bool] = []
        self._nbytes: list[int] = []  # per parameter, its buffer's bytes (0 until its first gradient)
        self.retrack(named_parameters)

    def retrack(self, named_parameters: Sequence[tuple[str, Tensor]]) -> None:
        """Follow a new set of parameters, keeping the buffers (and open window) of those still present."""
        for name, param in named_parameters:
            wide_enough = torch.promote_types(param.dtype, self.dtype)
            if wide_enough != self.dtype:
                raise ValueError(
                    f"Argument `accumulation_dtype={self.dtype}` is narrower than parameter `{name}`"
                    f" ({param.dtype}); use a dtype that holds it exactly, e.g. {wide_enough}."
                )
        old = {
            id(param): (buffer, holds, size)
            for param, buffer, holds, size in zip(
                self.params, self._buffers, self._holds, self._nbytes, strict=True
            )
        }
        self.params = [param for _, param in named_parameters]
        kept = [old.get(id(param), (None, False, 0)) for param in self.params]
        self._buffers = [buffer for buffer, _, _ in kept]
        self._holds = [holds for _, holds, _ in kept]
        self._nbytes = [size for _, _, size in kept]

    def _buffer(self, index: int, like: Tensor, *, zeros: bool = False) -> Tensor:
        """Parameter ``index``'s buffer, allocated (uninitialized, or ``zeros``) like ``like`` if released."""
        buffer = self._buffers[index]
        if buffer is None:
            buffer = (torch.zeros_like if zeros else torch.empty_like)(like, dtype=self.dtype)
            self._buffers[index] = buffer
            self._nbytes[index] = buffer.numel() * buffer.element_size()
        return buffer

    @property
    def nbytes(self) -> int:
        """Bytes the buffers take while a window holds them (a parameter's count once it got a gradient)."""
        return sum(self._nbytes)

    @property
    def holds_window(self) -> bool:
        """Whether the buffers hold gradients of the open window."""
        return any(self._holds)

    @property
    def held(self) -> list[bool]:
        """Per parameter, whether its buffer holds a gradient of the open window."""
        return list(self._holds)

    def window(self) -> list[Tensor | None]:
        """The open window's sum per parameter (``None`` where a parameter has no gradient in it)."""
        return [buffer if holds else None for buffer, holds in zip(self._buffers, self._holds, strict=True)]

    def absorb(self, keep: Tensor | None = None, multiplier: Tensor | None = None) -> None:
        """Add every ``.grad`` into its buffer and release ``.grad``; never syncs.

        Args:
            keep: A device bool scalar; when false the micro-batch contributes nothing (its gradient may hold
                ``nan``, which no multiplication can remove).
            multiplier: A device scalar applied to the gradients first (per-micro-batch clipping).
        """
        indices = [i for i, param in enumerate(self.params) if param.grad is not None]
        grads, _ = local_shards([self.params[i].grad for i in indices])  # a sharded gradient: its local shard
        if keep is not None:
            for grad in grads:  # masked_fill_ is the one in-place op that removes nan/inf; no foreach form
                grad.masked_fill_(~keep, 0)  # type: ignore[union-attr]
        if multiplier is not None:
            scale_(grads, multiplier, foreach=self.foreach)  # type: ignore[arg-type]
        add_to: list[Tensor] = []
        add_from: list[Tensor] = []
        copy_to: list[Tensor] = []
        copy_from: list[Tensor] = []
        for i, grad in zip(indices, grads, strict=True):
            assert grad is not None
            buffer = self._buffer(i, grad)  # a local shard when sharded: 1 / world
            (add_to if self._holds[i] else copy_to).append(buffer)
            (add_from if self._holds[i] else copy_from).append(grad)
            self._holds[i] = True
        if add_to:
            self._add(add_to, add_from)
        if copy_to:
            self._copy(copy_to, copy_from)
        for i in indices:
            self.params[i].grad = None

    def take(self, index: int) -> None:
        """Add parameter ``index``'s ``.grad`` into its buffer and release ``.grad`` (nothing if it has none).

        The one-parameter :meth:`absorb` (without a check or clip), for a post-accumulate-grad hook: the
        same copy or ``add_``, so a window summed this way is bitwise the one :meth:`absorb` gives.

        Example:
            >>> weight = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
            >>> buffers = GradBuffers([("weight", weight)], torch.float32)
            >>> for _ in range(2):
            ...     weight.grad = torch.full((2,), 0.5, dtype=torch.bfloat16)
            ...     buffers.take(0)
            >>> weight.grad, buffers.window()[0]
            (None, tensor([1., 1.]))
        """
        param = self.params[index]
        grad = param.grad
        if grad is None or grad.is_sparse:  # sparse: left to `absorb`, which handles it as before
            return
        if grad.requires_grad:  # a backward with create_graph=True: the buffer stays out of the graph
            grad = grad.detach()
        buffer = self._buffer(index, grad)
        if self._holds[index]:
            add_widening_(buffer, grad)
        else:
            buffer.copy_(grad)  # a copy casts inside the kernel: no temporary
            self._holds[index] = True
        param.grad = None

    def _add(self, targets: list[Tensor], grads: list[Tensor]) -> None:
        widening_on_cpu = targets[0].device.type == "cpu" and any(g.dtype != self.dtype for g in grads)
        if self.foreach is False or widening_on_cpu:  # the foreach add casts on a CPU as `add_` does
            for target, grad in zip(targets, grads, strict=True):
                add_widening_(target, grad)
        else:
            torch._foreach_add_(targets, grads)

    def _copy(self, targets: list[Tensor], grads: list[Tensor]) -> None:
        if self.foreach is False:
            for target, grad in zip(targets, grads, strict=True):
                target.copy_(grad)
        else:
            torch._foreach_copy_(targets, grads)

    def write_to_grads(self) -> None:
        """Set every ``.grad`` to its buffer, cast to the parameter's dtype, releasing each buffer as it goes.

        Called at the boundary (after scaling), or before the backward that DDP synchronizes or a GradScaler
        unscales, so that the window's sum takes part in them. Parameters without a gradient in the window
        keep ``.grad = None`` (optimizers skip them, as without buffers). Each buffer is released right after
        its gradient is written (a buffer of the parameter's dtype becomes the gradient itself), so the
        memory holds at most the buffers and one parameter's gradient, then only the gradients.
        """
        if not self.holds_window:
            return
        for i, param in enumerate(self.params):
            if self._holds[i]:
                buffer, self._buffers[i] = self._buffers[i], None
                assert buffer is not None
                self._holds[i] = False
                param.grad = as_sharded_like(
                    param, buffer if buffer.dtype == param.dtype else buffer.to(param.dtype)
                )
                del buffer  # released before the next parameter's gradient is made

    def load(self, tensors: Sequence[Tensor | None]) -> None:
        """Make ``tensors`` the sum of the open window (restoring a saved window); ``None``: no gradient."""
        self.discard()
        targets: list[Tensor] = []
        sources: list[Tensor] = []
        for i, tensor in enumerate(tensors):
            if tensor is None:
                continue
            targets.append(self._buffer(i, tensor))  # a local shard when sharded
            sources.append(tensor)
            self._holds[i] = True
        if targets:
            self._copy(targets, sources)

    def average_over_ranks(
        self, all_reduce: AllReduce, world_size: int, held_anywhere: Sequence[bool]
    ) -> None:
        """Replace every buffer by its mean over the ranks (what DDP's backward does to ``.grad``).

        Args:
            all_reduce: Sums a tensor over the ranks in place and returns it.
            world_size: The ranks the sum is divided by.
            held_anywhere: Per parameter, whether any rank's buffer holds a gradient of the window (the
                same on every rank): those take part, with zeros where this rank holds none; the others
                stay without a gradient, as DDP leaves a parameter no rank used.
        """
        taking_part = [i for i, held in enumerate(held_anywhere) if held]
        for i in taking_part:
            if self._holds[i]:
                continue
            self._buffers[i] = None  # this rank has none of it: zeros
            self._buffer(i, self.params[i], zeros=True)
            self._holds[i] = True
        buffers = [buffer for i in taking_part if (buffer := self._buffers[i]) is not None]
        # One all-reduce per bucket of up to 2**25 elements: few calls, bounded extra memory.
        bucket: list[Tensor] = []
        elements = 0
        for index, buffer in enumerate(buffers):
            bucket.append(buffer)
            elements += buffer.numel()
            if index + 1 < len(buffers) and elements + buffers[index + 1].numel() <= 2**25:
                continue
            flat = all_reduce(torch.cat([b.reshape(-1) for b in bucket])).div_(world_size)
            pieces = torch.split(flat, [b.numel() for b in bucket])
            self._copy(bucket, [piece.view_as(b) for piece, b in zip(pieces, bucket, strict=True)])
            bucket, elements = [], 0

    def average_window(self, world: World) -> None:
        """The window's sums become their mean over the ranks (``reduce_gradients``, at the window's end).

        Which parameters take part is decided over all ranks: one small all-reduce of per-parameter "holds a
        gradient" flags, read on the host (the one sync). A parameter with a gradient on some rank only is
        averaged with the other ranks' zeros, as DDP does; one with none anywhere stays without a gradient.
        """
        world_size, all_reduce = world.resolve()
        if all_reduce is None:
            return
        held = torch.tensor([float(holds) for holds in self._holds], device=self.params[0].device)
        anywhere = all_reduce(held).tolist()
        self.average_over_ranks(all_reduce, world_size, [count > 0 for count in anywhere])

    def forget(self, index: int) -> None:
        """Take parameter ``index`` out of the open window (its buffer is released)."""
        self._holds[index] = False
        self._buffers[index] = None

    def discard(self) -> None:
        """Forget the open window and release its buffers (the next window allocates them again)."""
        self._holds = [False] * len(self.params)
        self._buffers = [None] * len(self.params)


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
        self.checks = settings.per_micro_batch

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


def buffers_for(
    tracked: TrackedParameters,
    settings: AccumulationSettings,
    scale: GradientScale,
    world: World,
    dtype: torch.dtype,
    *,
    reduce_gradients: bool,
    foreach: bool | None = None,
) -> tuple[GradBuffers | None, MicroBatchIntake | None]:
    """The accumulation buffers ``settings`` ask for, with their intake (``None, None``: none asked).

    Warns when the buffers would change nothing (the parameters already are of their dtype).

    Raises:
        ValueError: ``reduce_gradients`` without buffers, or with sharded parameters (FSDP reduces them).
    """
    buffer_dtype = settings.accumulation_dtype
    if reduce_gradients and (buffer_dtype is None or tracked.sharded):
        raise ValueError(
            "Argument `reduce_gradients=True` averages the accumulation buffers over ranks: it needs"
            " `accumulation_dtype` and unsharded parameters (FSDP reduces sharded gradients itself),"
            f" but got accumulation_dtype={buffer_dtype} with {'sharded' if tracked.sharded else 'plain'}"
            " parameters."
        )
    if buffer_dtype is None:
        return None, None
    buffers = GradBuffers(tracked.named, buffer_dtype, foreach)
    intake = MicroBatchIntake(tracked, buffers, settings, scale, world, dtype)
    if not intake.checks and all(param.dtype == buffer_dtype for param in tracked.params):
        warnings.warn(
            f"`accumulation_dtype={buffer_dtype}` changes nothing: the parameters are already {buffer_dtype}"
            " (e.g. 'bf16-mixed' keeps float32 weights). Leave it unset to save the buffers' memory.",
            stacklevel=3,
        )
    return buffers, intake
