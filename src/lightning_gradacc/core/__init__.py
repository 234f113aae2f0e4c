"""Torch-only accumulation math: no Lightning import anywhere under this package.

Usable from a plain PyTorch loop, Lightning Fabric or manual optimization. One idea per module, and no
module imports back the one that wires them together:

- the window: ``window`` (its lifecycle), ``tally`` (its counts), ``weighting`` (item counts and weights);
- its gradients: ``parameters`` (the tracked parameters and their FSDP layouts), ``shards`` (FSDP1 slices
  and FSDP2 shards), ``buffers`` (wider accumulation buffers), ``micro_batch`` (one micro-batch checked
  and clipped into the buffers), ``gradient_scale`` (the loss scale times the AMP scale), ``store``
  (gradients by name);
- the boundary: ``measurement`` (what is measured, and its one host copy), ``boundary`` (the stateless
  math: normalization, decision, application), ``kernels`` (foreach kernels), ``scalars`` (host or device
  values), ``world`` (the data-parallel ranks);
- reporting: ``accounts`` (the run's counters and statistics, saved as numbers), ``ledger`` (statistics
  folded over windows), ``stats`` (their snapshot), ``noise`` (the
  gradient noise scale), ``memory`` (the process's peak);
- ``checkpoint`` (the saved forms), ``validation`` (the settings checked), ``errors``;
- ``accumulator``: :class:`GradAccumulator`, which wires them together.
"""

from .accumulator import GradAccumulator
from .boundary import apply_, clip_grads_, decide, measure
from .kernels import clamp_, group_by_device_and_dtype, scale_, total_norm
from .statistics import AccumulationStats, PeakMemory
from .store import WindowGradients
from .weighting import ItemCount, ItemWeighting
from .window import Window, WindowClosedError, WindowState
from .window_end import GradientOverflowError

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
