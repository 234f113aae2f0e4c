"""Peak memory of one accumulation window.

On CUDA the allocator's peak is reset at the start of a window and read at its end. On CPU (Linux) the
kernel's resident-set high-water mark (``VmHWM``) is reset the same way through ``/proc/self/clear_refs``;
where that is not possible the resident set size sampled at the end of the window is reported instead.
Neither call synchronizes with a device.
"""

from __future__ import annotations

import re

import psutil
import torch

_HWM_PATTERN = re.compile(rb"VmHWM:\s+(\d+)\s+kB")


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
        self._process = psutil.Process()
        self._can_reset_hwm = device.type == "cpu" and self._try_reset_hwm()

    @staticmethod
    def _try_reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            with open("/proc/self/status", "rb") as handle:
                return _HWM_PATTERN.search(handle.read()) is not None
        except OSError:
            return False

    def start(self) -> None:
        """Begin a window: forget the peak seen so far."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._can_reset_hwm:
            self._try_reset_hwm()

    def read(self) -> int:
        """Return the peak in bytes since :meth:`start` (CUDA allocator peak, or process RSS on CPU)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self._can_reset_hwm:
            with open("/proc/self/status", "rb") as handle:
                match = _HWM_PATTERN.search(handle.read())
            if match is not None:
                return int(match.group(1)) * 1024
        return int(self._process.memory_info().rss)
