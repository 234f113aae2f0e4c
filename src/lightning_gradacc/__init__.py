"""Correct, observable and fast gradient accumulation for PyTorch Lightning.

``GradientAccumulationCallback`` is imported lazily so that ``lightning_gradacc.core`` (torch only) can be
used without importing Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .core import GradAccumulator, GradientOverflowError
from .stats import AccumulationStats

if TYPE_CHECKING:
    from .callback import GradientAccumulationCallback

__version__ = "0.1.0"

__all__ = [
    "AccumulationStats",
    "GradAccumulator",
    "GradientAccumulationCallback",
    "GradientOverflowError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name == "GradientAccumulationCallback":
        from .callback import GradientAccumulationCallback

        return GradientAccumulationCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
