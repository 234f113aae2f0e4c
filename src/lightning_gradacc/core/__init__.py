"""Torch-only accumulation math: no Lightning import anywhere under this package.

Usable from a plain PyTorch loop, Lightning Fabric or manual optimization. One idea per module:
``window`` (a window's lifecycle), ``boundary`` (the stateless math at its end), ``ledger`` (statistics
folded over windows), ``store`` (gradients by name), ``buffers``, ``tally``, ``kernels``, ``world``, and
``accumulator``, which wires them together.
"""

from .accumulator import GradAccumulator, ItemCount
from .boundary import apply_, clip_grads_, decide, measure
from .errors import GradientOverflowError
from .kernels import clamp_, group_by_device_and_dtype, scale_, total_norm
from .memory import WindowPeakMemory
from .stats import AccumulationStats
from .store import WindowGradients
from .window import Window, WindowClosedError, WindowState

__all__ = [
    "AccumulationStats",
    "GradAccumulator",
    "GradientOverflowError",
    "ItemCount",
    "Window",
    "WindowClosedError",
    "WindowGradients",
    "WindowPeakMemory",
    "WindowState",
    "apply_",
    "clamp_",
    "clip_grads_",
    "decide",
    "group_by_device_and_dtype",
    "measure",
    "scale_",
    "total_norm",
]
