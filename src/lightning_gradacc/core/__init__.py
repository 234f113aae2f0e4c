"""Torch-only accumulation math: no Lightning import anywhere under this package.

Usable from a plain PyTorch loop, Lightning Fabric or manual optimization.
"""

from .accumulator import GradAccumulator
from .errors import GradientOverflowError
from .kernels import clamp_, group_by_device_and_dtype, scale_, total_norm
from .memory import WindowPeakMemory

__all__ = [
    "GradAccumulator",
    "GradientOverflowError",
    "WindowPeakMemory",
    "clamp_",
    "group_by_device_and_dtype",
    "scale_",
    "total_norm",
]
