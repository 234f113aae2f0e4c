"""DeviceStep: an optimizer step that skips itself on the device, with no host read of the decision.

torch's fused optimizers (``Adam``/``AdamW``/``SGD``/``Adagrad`` with ``fused=True``) read two tensors a
GradScaler leaves on them for the length of one ``step()``: ``found_inf`` (1.0: change neither the parameters
nor any state, ``step`` counters included) and ``grad_scale`` (every gradient is divided by it inside the
kernel, and written back divided). A window's decision made on the device (non-finite, no items, an invalid
count) becomes ``found_inf``; its multiplier (normalization x clip coefficient) may become ``grad_scale``,
which saves the separate multiply pass over every gradient. No host sync: the step is launched at once.

A skip never multiplies by 0 (0 x nan = nan would reach Adam's moments): the kernel returns before it reads
a gradient.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

ARMED = ("found_inf", "grad_scale")


def skips_on_device(optimizer: Any) -> bool:
    """Whether ``optimizer``'s next ``step()`` honours ``found_inf`` and ``grad_scale`` exactly.

    True for torch's fused optimizers, except fused SGD with momentum before its first step: it creates its
    momentum buffers with ``empty_like`` in that step even when ``found_inf`` skips it, and the next step
    would read the uninitialized memory (a GradScaler's first overflow meets the same). That one step is
    decided on the host.

    Example:
        >>> params = [torch.nn.Parameter(torch.zeros(1))]
        >>> skips_on_device(torch.optim.Adam(params, fused=True)), skips_on_device(torch.optim.Adam(params))
        (True, False)
        >>> skips_on_device(torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True))  # no step yet
        False
    """
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    if isinstance(optimizer, torch.optim.SGD) and not optimizer.state:
        return not any(group.get("momentum", 0) for group in optimizer.param_groups)
    return True


@dataclass(frozen=True, slots=True)
class DeviceStep:
    """The device tensors one fused optimizer step reads.

    Attributes:
        found_inf: A float32 scalar: 1.0 skips the step, 0.0 takes it.
        grad_scale: A float32 scalar every gradient is divided by in the step (the reciprocal of the
            window's multiplier), or ``None`` when the gradients already are final.

    Example:
        >>> param = torch.nn.Parameter(torch.zeros(1))
        >>> optimizer = torch.optim.SGD([param], lr=1.0, fused=True)
        >>> param.grad = torch.ones(1)
        >>> step = DeviceStep(torch.tensor(0.0), grad_scale=torch.tensor(4.0))
        >>> step.arm(optimizer)
        >>> optimizer.step()
        >>> param.detach(), hasattr(optimizer, "found_inf")  # the gradient was divided by 4; disarmed
        (tensor([-0.2500]), False)
    """

    found_inf: Tensor
    grad_scale: Tensor | None = None

    def arm(self, optimizer: torch.optim.Optimizer) -> None:
        """Leave the tensors on ``optimizer`` for its next ``step()`` only (a one-shot post-hook disarms).

        Raises:
            RuntimeError: ``optimizer`` cannot skip on the device, or something else (a GradScaler's step)
                armed it already.
        """
        if not skips_on_device(optimizer):
            raise RuntimeError(
                f"{type(optimizer).__name__} does not read `found_inf`/`grad_scale` in its step: only torch's"
                " fused optimizers (`fused=True`) skip a step on the device."
            )
        if any(hasattr(optimizer, name) for name in ARMED):
            raise RuntimeError(
                "The optimizer already carries `found_inf`/`grad_scale` for its next step (a GradScaler's"
                " step?): a window's device step cannot be added to it."
            )
        optimizer.found_inf = self.found_inf  # type: ignore[attr-defined]
        optimizer.grad_scale = self.grad_scale  # type: ignore[attr-defined]
        _PENDING[optimizer] = optimizer.register_step_post_hook(_disarm_after_step)


# the one-shot step post-hook of each armed optimizer, removed by `disarm` with the tensors
_PENDING: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _disarm_after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    disarm(optimizer)


def disarm(optimizer: Any) -> None:
    """Remove what :meth:`DeviceStep.arm` left on ``optimizer``: the tensors and its step post-hook.

    Nothing happens if nothing is there. Called after the step, and for a step that never came (an
    exception), so that no hook of this package stays on the optimizer.
    """
    handle = _PENDING.pop(optimizer, None)
    if handle is not None:
        handle.remove()
    for name in ARMED:
        if name in vars(optimizer):
            delattr(optimizer, name)
