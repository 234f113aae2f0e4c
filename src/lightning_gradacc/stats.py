"""``from lightning_gradacc.stats import AccumulationStats`` still works; the class lives in the core."""

from .core.stats import AccumulationStats

__all__ = ["AccumulationStats"]
