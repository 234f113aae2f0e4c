"""Peak memory of one accumulation window.

On CUDA the allocator's peak is reset at the start of a window and read at its end. On Linux CPUs the
kernel's resident-set high-water mark is reset the same way (writing ``5`` to ``/proc/self/clear_refs``)
and read from ``VmHWM`` in ``/proc/self/status`` through descriptors kept open: about 10 µs per window.
(``getrusage`` would be cheaper but wrong: after ``fork``/``exec`` it starts at the parent's peak.) Where
that is not possible the resident set size sampled at the end of the window is reported instead.
Nothing here synchronizes with a device.
"""

from __future__ import annotations

import os
import re
import sys

import psutil
import torch

_HWM = re.compile(rb"VmHWM:\s+(\d+)\s+kB")


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
        self._status: int | None = None
        if device.type == "cpu" and sys.platform.startswith("linux"):
            try:
                self._clear_refs = os.open("/proc/self/clear_refs", os.O_WRONLY)
                self._status = os.open("/proc/self/status", os.O_RDONLY)
                os.write(self._clear_refs, b"5")
                if self._read_hwm() is None:
                    raise OSError("no VmHWM")
            except OSError:
                self._close()

    def _close(self) -> None:
        for fd in (self._clear_refs, self._status):
            if fd is not None:
                os.close(fd)
        self._clear_refs = self._status = None

    def __del__(self) -> None:
        self._close()

    def _read_hwm(self) -> int | None:
        assert self._status is not None
        match = _HWM.search(os.pread(self._status, 16384, 0))
        return int(match.group(1)) * 1024 if match else None

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
        if self._status is not None:
            peak = self._read_hwm()
            if peak is not None:
                return peak
        if self._process is None:
            self._process = psutil.Process()
        return int(self._process.memory_info().rss)
