"""Which backward reduces over the ranks, where the fit changes it (FSDP deferring, DDP's sync off).

Only in a fit whose reduction acts (a deferring ``sharded_reduction``, or the core reducing the buffers
itself under DDP): elsewhere the strategy reduces as it always does and this part is not in the list.
"""

from __future__ import annotations

import torch
from torch import Tensor
from typing_extensions import override

from ..reduction import WindowReduction
from .base import Fit, FitPart


class ReductionPart(FitPart):
    """Switches the reduction around each backward and at each step (``reduction.WindowReduction``).

    Args:
        fit: The fit (its ``sync`` built by the window part).
    """

    def __init__(self, fit: Fit) -> None:
        super().__init__(fit)

    @staticmethod
    def acts(sync: WindowReduction) -> bool:
        """Whether a fit's reduction does anything (else the part is left out)."""
        return sync.defers or sync.core_reduces

    @property
    def sync(self) -> WindowReduction:
        """The fit's reduction."""
        sync = self.fit.sync
        assert sync is not None
        return sync

    @override
    def train_start(self) -> None:
        if self.sync.core_reduces:
            self.sync.start()

    @override
    def before_backward(self, loss: Tensor) -> None:
        self.sync.before_backward(self.fit.batch.last)  # "window_end": FSDP reduces the last backward only

    @override
    def after_backward(self) -> None:
        self.sync.after_backward()

    @override
    def window_end(self, optimizer: torch.optim.Optimizer) -> None:
        self.sync.after_step()

    @override
    def window_discarded(self) -> None:
        self.sync.drop_unsynced()  # what FSDP holds unsynced (`sharded_reduction="window_end"`)

    @override
    def exception(self) -> None:
        # With sync off FSDP keeps a window's gradients unsharded inside itself, where neither `zero_grad`
        # nor the next window would clear them: the next synced backward would add them in.
        self.sync.end(discard=True)

    @override
    def train_end(self) -> None:
        driver = self.fit.driver
        self.sync.end(discard=driver is not None and not driver.window.empty)
