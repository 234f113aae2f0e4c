"""Correct, observable and fast gradient accumulation for PyTorch Lightning.

``GradientAccumulationCallback`` and ``estimated_stepping_batches`` are imported lazily so that
``lightning_gradacc.core`` (torch only) can be used without importing Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .core import AccumulationStats, GradAccumulator, GradientOverflowError
from .k_policies import AutoSettings, linear_ramp
from .lr_schedule import TokenSchedule

if TYPE_CHECKING:
    from .callback import GradientAccumulationCallback, estimated_stepping_batches

__version__ = "0.2.0"

__all__ = [
    "AccumulationStats",
    "AutoSettings",
    "GradAccumulator",
    "GradientAccumulationCallback",
    "GradientOverflowError",
    "TokenSchedule",
    "__version__",
    "estimated_stepping_batches",
    "linear_ramp",
]


def __getattr__(name: str) -> Any:
    if name in ("GradientAccumulationCallback", "estimated_stepping_batches"):
        from . import callback

        return getattr(callback, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
