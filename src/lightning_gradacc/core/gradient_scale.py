"""GradientScale: what every micro-batch's gradient carries besides its item weight.

A back-propagated loss is ``loss * weight * loss_scale * amp_scale``: the loss scale is the factor the
caller multiplied it by (Lightning's ``1 / K``; 1 in a plain loop), the AMP scale is a GradScaler's. The
boundary divides both out once per window. The AMP scale is read from the scaler as a device tensor
(``get_scale()`` would sync with the host); it is read as a number only for a checkpoint.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .scalars import Scalar


class GradientScale:
    """The loss scale (a host number) and the GradScaler's scale (read from it, never stored).

    Args:
        grad_scaler: An enabled ``torch.amp.GradScaler``, or ``None``.
        loss_scale: The initial loss scale.

    Example:
        >>> scale = GradientScale(None, loss_scale=0.25)
        >>> scale.value(), scale.state_dict()
        (0.25, {'loss_scale': 0.25, 'amp_scale': 1.0})
    """

    def __init__(self, grad_scaler: Any = None, *, loss_scale: float = 1.0) -> None:
        self.scaler = grad_scaler
        self.loss_scale = self.checked(loss_scale)

    @staticmethod
    def checked(value: Any) -> float:
        """``value`` as a loss scale: a finite number > 0, else ``ValueError``."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"Expected `loss_scale` to be a finite number > 0, but got {value!r}.")
        return float(value)

    def amp(self) -> Tensor | None:
        """The GradScaler's scale as a device tensor (``None`` without a scaler); never syncs."""
        if self.scaler is None:
            return None
        scale = getattr(self.scaler, "_scale", None)
        own_scale = getattr(type(self.scaler), "scale", None) is torch.amp.GradScaler.scale
        if scale is None and own_scale:  # torch's `scale()`, not called yet
            raise RuntimeError(
                "The GradScaler has not scaled a loss yet, but gradients were recorded: under a"
                " `grad_scaler` every micro-batch's loss must be scaled by it before backward"
                " (`scaler.scale(loss).backward()`, or `accumulator.backward(loss)`, which does)."
            )
        if not isinstance(scale, Tensor):
            raise RuntimeError(
                f"The GradScaler ({type(self.scaler).__name__}) keeps no tensor `_scale`, which the"
                " accumulator reads (without a host sync) to undo the loss scale in its statistics and"
                " clipping. Use `torch.amp.GradScaler`."
            )
        return scale

    def value(self) -> Scalar:
        """Loss scale times AMP scale: a number without a scaler, a device scalar with one."""
        amp = self.amp()
        return self.loss_scale * amp if amp is not None else self.loss_scale

    def amp_value(self) -> float:
        """The GradScaler's scale as a number (syncs: for checkpoints only).

        Before its first ``scale()`` call the scaler has no ``_scale`` tensor yet; ``get_scale()`` gives the
        scale it will start from.
        """
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def state_dict(self) -> dict[str, float]:
        """Both scales as numbers, saved with an open window whose sums carry them (syncs)."""
        return {"loss_scale": self.loss_scale, "amp_scale": self.amp_value()}

    def rescale_from(self, saved: dict[str, Any]) -> float:
        """The factor turning sums saved under ``saved`` (a :meth:`state_dict`) into sums under these scales.

        Example:
            >>> GradientScale(None, loss_scale=0.5).rescale_from({"loss_scale": 0.25, "amp_scale": 1.0})
            2.0
        """
        return self.loss_scale * self.amp_value() / (float(saved["loss_scale"]) * float(saved["amp_scale"]))
