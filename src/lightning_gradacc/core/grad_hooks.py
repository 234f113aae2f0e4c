"""Accumulation buffers filled inside the backward: each gradient added as soon as autograd produced it.

With :class:`~lightning_gradacc.core.buffers.GradBuffers` filled after the backward, the backward first
leaves the micro-batch's gradient of *every* parameter in ``.grad`` (bf16, say) beside the fp32 buffers.
A post-accumulate-grad hook on each parameter (``Tensor.register_post_accumulate_grad_hook``) adds the
gradient into its buffer the moment ``AccumulateGrad`` has put it into ``.grad``, and sets ``.grad`` to
``None``: the peak is the buffers plus one parameter's gradient in flight (as Megatron's and DeepSpeed's
fp32 ``main_grad``). The window's sum is bitwise the same: per parameter the same copy, then the same
``add_``, in the same order. (One exception: a parameter whose ``AccumulateGrad`` runs several times in
one backward, as under re-entrant activation checkpointing, has each piece added in the buffer's dtype
instead of first summed in ``.grad``'s: a smaller rounding error, not the same bits.)

Where the hook runs. ``AccumulateGrad::apply`` accumulates the incoming gradient into ``.grad``, then calls
the parameter's post-accumulate-grad hooks, and returns; the engine then runs the node's post hooks, among
them DDP's reducer hook (``Reducer::autograd_hook``, registered with ``add_post_hook`` on the same
``AccumulateGrad``), which copies ``.grad`` into its bucket and launches the bucket's all-reduce. So this
hook runs *before* DDP reads ``.grad``: in a backward that DDP synchronizes, DDP would all-reduce zeros
and write them back. The accumulator arms the hooks only for backwards DDP does not synchronize
(``no_sync()``, or ``reduce_gradients``): the window's last backward under DDP runs after the buffers were
flushed into ``.grad``, with the hooks off. Under ``no_sync()`` the reducer's hook returns without
touching ``.grad`` except that with ``find_unused_parameters=True`` (or ``static_graph=True``) it marks a
parameter as used only if ``.grad`` is defined, and that mark, kept over the ``no_sync()`` backwards,
decides which gradients the synchronized backward all-reduces: there the hooks must not be used at all
(the Lightning callback turns them off; a plain loop passes ``accumulate_in_backward=False``).

Sharded gradients (FSDP1 flat parameters, FSDP2 ``DTensor``) reach ``.grad`` by reduce-scatter, not by
an ``AccumulateGrad`` of the original parameter, and the per-micro-batch checks need a micro-batch's whole
gradient before adding it: both keep the after-backward path. ``torch.autograd.grad`` never runs
``AccumulateGrad``, so it never fires the hooks.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor
from torch.nn.parameter import is_lazy

from .buffers import GradBuffers


class WeakHook:
    """Calls ``method(index, tensor)`` of its owner while the owner lives; nothing after.

    Example:
        >>> import torch
        >>> class Owner:
        ...     def seen(self, index, tensor):
        ...         print(index, tensor.tolist())
        >>> owner = Owner()
        >>> hook = WeakHook(owner.seen, 3)
        >>> hook(torch.ones(1))
        3 [1.0]
        >>> del owner
        >>> hook(torch.ones(1))  # the owner is gone: nothing
    """

    __slots__ = ("index", "method")

    def __init__(self, method: Callable[[int, Tensor], None], index: int) -> None:
        self.method = weakref.WeakMethod(method)
        self.index = index

    def __call__(self, tensor: Tensor) -> None:
        """Autograd calls it with the gradient (or the parameter, for a post-accumulate-grad hook)."""
        method = self.method()
        if method is not None:
            method(self.index, tensor)


def remove_handles(handles: list[Any]) -> None:
    """Remove every hook in ``handles`` and empty the list (in place: a finalizer may hold it)."""
    for handle in handles:
        handle.remove()
    handles.clear()


def same_tensors(these: Sequence[Tensor], those: Sequence[Tensor]) -> bool:
    """Whether both hold the very same tensors, in the same order (identity, not values)."""
    return len(these) == len(those) and all(a is b for a, b in zip(these, those, strict=True))


class BufferHooks:
    """Post-accumulate-grad hooks that move each gradient into its buffer while they are armed.

    Armed by the accumulator from the start of a micro-batch's backward to its record, and only when the
    window's gradients go to the buffers; otherwise a hook returns at once and ``.grad`` keeps the gradient
    (the after-backward path then takes it, as before). A gradient that arrives while disarmed (a second
    ``backward()`` outside a micro-batch) therefore stays in ``.grad`` and is taken with the next
    micro-batch, exactly as without hooks.

    Args:
        buffers: The accumulation buffers; a hook's index is its parameter's position in ``buffers.params``.

    Example:
        >>> import torch
        >>> weight = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        >>> buffers = GradBuffers([("weight", weight)], torch.float32)
        >>> hooks = BufferHooks(buffers)
        >>> hooks.watch()
        >>> hooks.armed = True
        >>> for _ in range(3):
        ...     (weight * 0.5).sum().backward()
        >>> weight.grad, buffers.window()[0]
        (None, tensor([1.5000, 1.5000]))
        >>> hooks.remove()
    """

    def __init__(self, buffers: GradBuffers) -> None:
        self.buffers = buffers
        self.armed = False
        self._handles: list[Any] = []  # mutated in place: the finalizer below holds this list
        self._finalizer = weakref.finalize(self, remove_handles, self._handles)
        self._watched: tuple[tuple[int, Tensor], ...] = ()

    def _hookable(self) -> tuple[tuple[int, Tensor], ...]:
        params: Sequence[Tensor] = self.buffers.params
        return tuple((i, p) for i, p in enumerate(params) if p.requires_grad and not is_lazy(p))

    def watch(self, enabled: bool = True) -> None:
        """Hook the buffers' parameters that require a gradient (again, if they changed; else nothing).

        One pass over the parameters on the host; a parameter unfrozen since is hooked here, and until then
        its gradient goes the after-backward way. ``enabled=False`` removes the hooks (see :meth:`remove`).
        """
        if not enabled:
            self.remove()
            return
        hookable = self._hookable()
        if len(hookable) == len(self._watched) and all(
            i == j and p is q for (i, p), (j, q) in zip(hookable, self._watched, strict=True)
        ):
            return
        remove_handles(self._handles)
        self._watched = hookable
        self._handles.extend(
            param.register_post_accumulate_grad_hook(WeakHook(self._take, index))  # type: ignore[no-untyped-call]
            for index, param in hookable
        )

    def _take(self, index: int, param: Tensor) -> None:
        """The hook of the parameter at ``index``: its gradient into its buffer, while armed."""
        if self.armed:
            self.buffers.take(index)

    @property
    def watching(self) -> bool:
        """Whether the hooks are in place."""
        return bool(self._handles)

    def remove(self) -> None:
        """Remove the hooks (and disarm): no gradient is taken inside a backward until :meth:`watch`."""
        self.armed = False
        remove_handles(self._handles)
        self._watched = ()
