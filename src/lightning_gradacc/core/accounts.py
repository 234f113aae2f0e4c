"""RunAccounts: what a run has done so far: lifetime counters, the ledger of per-window statistics, the peak.

Windows are folded in once per boundary (host numbers at once, device values in rows copied at the next
read); micro-batches are counted as they are recorded. The accounts serialize themselves as plain numbers
(``torch.load(weights_only=True)`` reads them back), under the package's one format version.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .checkpoint import FORMAT_VERSION
from .ledger import COUNTERS, Ledger
from .memory import PeakMemory
from .scalars import Scalar
from .stats import AccumulationStats

Deferred = Callable[[], Scalar]


class RunAccounts:
    """Lifetime counters and per-window statistics of one accumulator.

    Args:
        device: Where device statistics live (and whose memory peak is read).
        dtype: Their dtype (float64, or float32 where the device has none).

    Example:
        >>> accounts = RunAccounts(torch.device("cpu"), torch.float64)
        >>> accounts.micro_batch_recorded(reevaluation=False)
        >>> accounts.close_window({"last_grad_norm": 2.0, "window_loss": 0.5}, micro_batches=1)
        >>> accounts.windows, accounts.total_micro_batches, accounts.window_loss
        (1, 1, 0.5)
    """

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.ledger = Ledger(dtype)
        self._memory = PeakMemory(device)  # read when the statistics are read; never reset
        # counters that never depend on tensor values live on the host
        self.windows = 0
        self.total_micro_batches = 0
        self.micro_batches_last_step = 0
        self.peak_memory_bytes = 0

    def micro_batch_recorded(self, *, reevaluation: bool) -> None:
        """Count a recorded micro-batch (a re-evaluation of the same one counts once)."""
        if not reevaluation:
            self.total_micro_batches += 1

    def close_window(
        self,
        statistics: Mapping[str, Scalar | bool | Deferred],
        *,
        micro_batches: int,
        reevaluation: bool = False,
    ) -> None:
        """Fold one window's statistics (see ``ledger.STATISTICS``) and count it.

        Args:
            statistics: The window's values by statistic name.
            micro_batches: The micro-batches it had.
            reevaluation: The same window evaluated again (LBFGS): its statistics replace the last ones and
                no counter advances.
        """
        self.ledger.fold(statistics, count=not reevaluation)
        self.micro_batches_last_step = micro_batches
        if not reevaluation:
            self.windows += 1

    def close_empty_window(self, *, reevaluation: bool = False) -> None:
        """Fold a window in which no micro-batch was recorded (counted in ``empty_windows``)."""
        self.close_window(
            {"empty_windows": 1.0, "last_grad_norm": 0.0, "items_last_step": 0.0, "window_loss": math.nan},
            micro_batches=0,
            reevaluation=reevaluation,
        )

    def snapshot(self, **current: Any) -> AccumulationStats:
        """A frozen snapshot of the counters and statistics, with the accumulator's ``current`` facts.

        Syncs once if a window closed since the last read.
        """
        ledger = self.ledger.values(deferred=False)
        ledger.pop("window_loss")  # not a field of the snapshot: see `window_loss`
        self.peak_memory_bytes = self._memory.read()  # the process's peak so far (a file read)
        return AccumulationStats(
            windows=self.windows,
            total_micro_batches=self.total_micro_batches,
            micro_batches_last_step=self.micro_batches_last_step,
            peak_memory_bytes=self.peak_memory_bytes,
            **current,
            **{name: int(value) if name in COUNTERS else value for name, value in ledger.items()},  # type: ignore[arg-type]
        )

    @property
    def window_loss(self) -> float:
        """Item-weighted mean loss of the last window, over ranks (``nan`` if no loss was recorded)."""
        return self.ledger.values()["window_loss"]

    def state_dict(self) -> dict[str, Any]:
        """The counters and statistics as plain numbers, with the format version."""
        return {
            "version": FORMAT_VERSION,
            "windows": self.windows,
            "total_micro_batches": self.total_micro_batches,
            "micro_batches_last_step": self.micro_batches_last_step,
            "peak_memory_bytes": self.peak_memory_bytes,
            **self.ledger.state_dict(),
        }

    def check_state(self, state: Mapping[str, Any]) -> tuple[int, int, int, int]:
        """The saved counters, converted; ``ValueError`` if ``state`` is not a readable saved form."""
        version = state.get("version")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"Cannot load accumulator state of version {version!r}; this version reads {FORMAT_VERSION}."
            )
        missing = [key for key in ("windows", "total_micro_batches", "skipped_steps") if key not in state]
        if missing:
            raise ValueError(f"Accumulator state is missing {missing}.")
        return (  # every value converted before anything is assigned
            int(state["windows"]),
            int(state["total_micro_batches"]),
            int(state.get("micro_batches_last_step", 0)),
            int(state.get("peak_memory_bytes", 0)),
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from counters saved by :meth:`state_dict`; nothing changes if they do not fit."""
        counters = self.check_state(state)
        self.ledger.load_state_dict(state)  # all or nothing itself
        self.windows, self.total_micro_batches, self.micro_batches_last_step, self.peak_memory_bytes = (
            counters
        )
