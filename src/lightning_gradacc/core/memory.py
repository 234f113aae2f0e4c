"""Peak memory of one accumulation window.

On CUDA the allocator's peak is reset at the start of a window and read at its end. On Linux CPUs the
kernel's resident-set high-water mark is reset the same way (writing ``5`` to ``/proc/self/clear_refs``)
and read with ``getrusage``: two system calls, about 2 µs per window. Where that is not possible the
resident set size sampled at the end of the window is reported instead. Nothing here synchronizes with a
device.
"""

from __future__ import annotations

import os
import sys

import psutil
import torch

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]


class WindowPeakMemory:
    """Measures the device's peak memory between :meth:`start` and :meth:`read`.

    Args:
        device: The device the gradients live on.

    Example:
        >>> tracker = WindowPeakMemory(torch.device("cpu"))
        >>> tracker.start()
        >>> tracker.read() > 0
        True
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._process: psutil.Process | None = None
        self._clear_refs: int | None = None
        if device.type == "cpu" and sys.platform.startswith("linux") and resource is not None:
            try:
                self._clear_refs = os.open("/proc/self/clear_refs", os.O_WRONLY)
                os.write(self._clear_refs, b"5")
            except OSError:
                self._clear_refs = None

    def __del__(self) -> None:
        if self._clear_refs is not None:
            os.close(self._clear_refs)

    def __getstate__(self) -> dict[str, object]:  # picklable (ddp_spawn): the descriptor is reopened
        return {"device": self.device}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["device"])  # type: ignore[misc]

    def start(self) -> None:
        """Begin a window: forget the peak seen so far."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._clear_refs is not None:
            os.write(self._clear_refs, b"5")

    def read(self) -> int:
        """Return the peak in bytes since :meth:`start` (CUDA allocator peak, or process RSS on CPU)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self._clear_refs is not None:
            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # kB on Linux
        if self._process is None:
            self._process = psutil.Process()
        return int(self._process.memory_info().rss)
