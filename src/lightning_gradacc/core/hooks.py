"""Per-parameter autograd hooks that hold their owner weakly, and their handles.

A hook registered on a parameter lives as long as the parameter (the user's model), usually longer than
the accumulator that registered it: each hook calls its owner's method through a weak reference, so the
hooks of a dropped owner do nothing, and a ``weakref.finalize`` on the owner removes them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor


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
