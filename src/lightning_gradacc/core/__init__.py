"""Torch-only accumulation math: no Lightning import anywhere under this package.

Usable from a plain PyTorch loop, Lightning Fabric or manual optimization. One idea per module:
``window`` (a window's lifecycle), ``weighting`` (item counts and the weighting rule), ``tally`` (a
window's counts), ``micro_batch`` (one micro-batch checked and clipped into the buffers), ``buffers``
(wider accumulation buffers), ``boundary`` (the stateless math at a window's end), ``kernels`` (foreach
kernels), ``shards`` (FSDP1 slices and FSDP2 shards), ``world`` (the data-parallel ranks), ``ledger``
(statistics folded over windows), ``stats`` (their snapshot), ``noise`` (the gradient noise scale),
``memory`` (the process's peak), ``store`` (gradients by name), ``checkpoint`` (saved forms),
``validation`` (the settings checked), ``errors``, and ``accumulator``, which wires them together.
"""

from .accumulator import GradAccumulator
from .boundary import apply_, clip_grads_, decide, measure
from .errors import GradientOverflowError
from .kernels import clamp_, group_by_device_and_dtype, scale_, total_norm
from .memory import PeakMemory
from .stats import AccumulationStats
from .store import WindowGradients
from .weighting import ItemCount, ItemWeighting
from .window import Window, WindowClosedError, WindowState

__all__ = [
    "AccumulationStats",
    "GradAccumulator",
    "GradientOverflowError",
    "ItemCount",
    "ItemWeighting",
    "PeakMemory",
    "Window",
    "WindowClosedError",
    "WindowGradients",
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
