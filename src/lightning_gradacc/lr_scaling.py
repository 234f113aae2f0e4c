"""The learning rate of each step scaled with its window's K: ``lr x (K_window / K_first) ** p``.

When the batch grows, the step size should follow (linearly for SGD, by the square root for Adam, as
OLMo-core and nanochat do). The factor is applied around each ``optimizer.step`` with torch's step pre- and
post-hooks: the learning rates are multiplied just before the step and restored just after it, so LR
schedulers, which set or read ``param_groups[i]["lr"]`` between steps, never see the factor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch

from .core.validation import check_choice

LRScalingMode = Literal["none", "sqrt", "linear"]
POWERS = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}


class LRScaling:
    """Multiplies every step's learning rates by ``(K_window / K_first) ** p``, and restores them after.

    Args:
        mode: ``"none"`` (p = 0), ``"sqrt"`` (p = 1/2) or ``"linear"`` (p = 1).

    Attributes:
        factor: The factor of the last step (1 before any).

    Example:
        >>> weight = torch.nn.Parameter(torch.ones(1))
        >>> optimizer = torch.optim.SGD([weight], lr=0.1)
        >>> scaling = LRScaling("linear")
        >>> scaling.attach([optimizer], window_k=lambda: 4, first_k=1)
        >>> weight.grad = torch.ones(1)
        >>> optimizer.step()
        >>> round(float(weight), 4), optimizer.param_groups[0]["lr"], scaling.factor  # a step of 4 x 0.1
        (0.6, 0.1, 4.0)
        >>> scaling.detach()
    """

    def __init__(self, mode: Any = "none") -> None:
        self.mode = check_choice("lr_scaling", mode, LRScalingMode)
        self.power = POWERS[self.mode]
        self.factor = 1.0
        self._handles: list[Any] = []
        self._saved: list[tuple[dict[str, Any], Any]] = []
        self._window_k: Callable[[], int] = lambda: 1
        self._first_k = 1

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # hooks belong to a fit's optimizers (ddp_spawn pickles the callbacks)
        state["_handles"], state["_saved"], state["_window_k"] = [], [], None
        return state

    @property
    def active(self) -> bool:
        """Whether the learning rate follows K."""
        return self.power != 0.0

    def attach(
        self, optimizers: Iterable[torch.optim.Optimizer], window_k: Callable[[], int], first_k: int
    ) -> None:
        """Hook ``optimizers`` for a fit: ``window_k()`` gives the K of the window being stepped."""
        self.detach()
        if not self.active:
            return
        self._window_k, self._first_k = window_k, first_k
        for optimizer in optimizers:
            self._handles.append(optimizer.register_step_pre_hook(self._before_step))
            self._handles.append(optimizer.register_step_post_hook(self._after_step))

    def detach(self) -> None:
        """Remove the hooks (at the end of a fit, or when it raised)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._restore()

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.factor = (self._window_k() / self._first_k) ** self.power
        if self.factor == 1.0:
            return
        for group in optimizer.param_groups:
            self._saved.append((group, group["lr"]))
            group["lr"] = group["lr"] * self.factor

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._restore()

    def _restore(self) -> None:
        for group, lr in self._saved:
            group["lr"] = lr  # the very object the scheduler set (a float, or a tensor for capturable)
        self._saved.clear()
