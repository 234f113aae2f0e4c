"""Torch-only accumulation math: no Lightning import anywhere under this package.

Usable from a plain PyTorch loop, Lightning Fabric or manual optimization. One idea per module, and no
module imports back the one that wires them together:

- the window: ``window`` (its lifecycle and its quantities), ``weighting`` (item counts, weights and the
  gradient scale), ``settings`` (the math settings, declared and checked once);
- its gradients: ``parameters`` (the tracked parameters and their FSDP layouts), ``shards`` (FSDP1 slices
  and FSDP2 shards), ``buffers`` (wider accumulation buffers, one micro-batch checked and clipped into
  them), ``grad_hooks`` (the hooks that fill them inside the backward), ``store`` (gradients by name);
- the boundary: ``window_end`` (the window's end in five steps), ``boundary`` (the stateless math:
  normalization, decision, application), ``kernels`` (foreach kernels), ``scalars`` (host or device
  values), ``world`` (the data-parallel ranks);
- reporting: ``statistics`` (the run's counters and statistics, their snapshot and the memory peak),
  ``noise`` (the gradient noise scale);
- ``checkpoint`` (the saved forms), ``torch_internals`` (every private torch attribute relied on),
  ``versions`` (the oldest torch and Lightning supported);
- ``accumulator``: :class:`GradAccumulator`, which wires them together.
"""

from .accumulator import GradAccumulator
from .boundary import apply_, clip_grads_, decide, measure
from .kernels import clamp_, group_by_device_and_dtype, scale_, total_norm
from .statistics import AccumulationStats, PeakMemory
from .store import WindowGradients
from .versions import TORCH_FLOOR as _TORCH_FLOOR
from .versions import require as _require
from .weighting import ItemCount, ItemWeighting
from .window import Window, WindowClosedError, WindowState
from .window_end import GradientOverflowError

_require("torch", _TORCH_FLOOR)

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
