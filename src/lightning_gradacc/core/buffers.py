"""Accumulation buffers in a wider dtype than the parameters (e.g. fp32 for bf16 parameters).

Low-precision parameters accumulate gradients in their own dtype, so the rounding error of the sum grows
with the number of micro-batches, and bf16 drops a contribution entirely once the running sum is about
256 times larger (the reason DeepSpeed keeps fp32 gradient buffers). Here each micro-batch's gradient is
added into a buffer of the wider dtype right after its backward and ``.grad`` is released, so memory
grows by exactly the buffers; the final gradient is written back to ``.grad`` once per window.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .kernels import scale_


class GradBuffers:
    """One buffer per parameter, allocated lazily on the parameter's device.

    Args:
        named_parameters: The trainable parameters and their names.
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
        for name, param in named_parameters:
            wide_enough = torch.promote_types(param.dtype, dtype)
            if wide_enough != dtype:
                raise ValueError(
                    f"Argument `accumulation_dtype={dtype}` is narrower than parameter `{name}`"
                    f" ({param.dtype}); use a dtype that holds it exactly, e.g. {wide_enough}."
                )
        self.params = [param for _, param in named_parameters]
        self.dtype = dtype
        self.foreach = foreach
        self._buffers: list[Tensor] | None = None
        # True while the buffers hold nothing of the open window: the next absorb copies instead of adding,
        # which saves a zeroing pass per window.
        self._stale = True

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers (0 until the first micro-batch allocates them)."""
        return sum(b.numel() * b.element_size() for b in self._buffers) if self._buffers is not None else 0

    @property
    def holds_window(self) -> bool:
        """Whether the buffers hold gradients of the open window."""
        return not self._stale

    @property
    def tensors(self) -> list[Tensor]:
        """The buffers (allocating them if needed)."""
        if self._buffers is None:
            self._buffers = [torch.zeros_like(p, dtype=self.dtype) for p in self.params]
        return self._buffers

    def absorb(self, keep: Tensor | None = None, multiplier: Tensor | None = None) -> None:
        """Add every ``.grad`` into its buffer and release ``.grad``; never syncs.

        Args:
            keep: A device bool scalar; when false the micro-batch contributes nothing (its gradient may hold
                ``nan``, which no multiplication can remove).
            multiplier: A device scalar applied to the gradients first (per-micro-batch clipping).
        """
        buffers = self.tensors
        pairs = [(b, p.grad) for b, p in zip(buffers, self.params, strict=True) if p.grad is not None]
        grads = [g for _, g in pairs]
        if keep is not None:
            for grad in grads:  # masked_fill_ is the one in-place op that removes nan/inf; no foreach form
                grad.masked_fill_(~keep, 0)
        if multiplier is not None:
            scale_(grads, multiplier, foreach=self.foreach)
        targets = [b for b, _ in pairs]
        if self._stale:
            if len(pairs) != len(buffers):  # a parameter without gradient in this micro-batch
                torch._foreach_zero_(buffers)
                self._add(targets, grads)
            else:
                self._copy(targets, grads)
        else:
            self._add(targets, grads)
        self._stale = False
        for param in self.params:
            param.grad = None

    def _add(self, targets: list[Tensor], grads: list[Tensor]) -> None:
        if self.foreach is False:
            for target, grad in zip(targets, grads, strict=True):
                target.add_(grad)
        else:
            torch._foreach_add_(targets, grads)

    def _copy(self, targets: list[Tensor], grads: list[Tensor]) -> None:
        if self.foreach is False:
            for target, grad in zip(targets, grads, strict=True):
                target.copy_(grad)
        else:
            torch._foreach_copy_(targets, grads)

    def write_to_grads(self) -> None:
        """Set every ``.grad`` to its buffer, cast to the parameter's dtype; the buffers become free again.

        Called at the boundary (after scaling), or before the backward that DDP synchronizes or a GradScaler
        unscales, so that the window's sum takes part in them.
        """
        if self._stale:
            return
        for param, buffer in zip(self.params, self.tensors, strict=True):
            param.grad = buffer.to(param.dtype, copy=True)
        self._stale = True

    def load(self, tensors: Sequence[Tensor]) -> None:
        """Make ``tensors`` the sum of the open window (restoring a saved window)."""
        self._copy(self.tensors, list(tensors))
        self._stale = False

    def discard(self) -> None:
        """Forget the open window (the next absorb overwrites the buffers)."""
        self._stale = True
