"""Peak memory of one accumulation window.

On CUDA the allocator's peak is reset at the start of a window and read at its end. On Linux CPUs the
kernel's resident-set high-water mark is reset the same way (writing ``5`` to ``/proc/self/clear_refs``)
and read with ``getrusage`` (about 2 µs). After ``fork``/``exec`` from a larger parent, ``getrusage`` keeps
reporting the parent's peak; that is detected once, against ``VmHWM`` in ``/proc/self/status``, which is
then read instead (tens of µs in a busy process). Where neither is possible the resident set size sampled
at the end of the window is reported instead.
Nothing here synchronizes with a device.
"""

from __future__ import annotations

import os
import re
import sys

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

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
        self._use_rusage = False
        if device.type == "cpu" and sys.platform.startswith("linux"):
            try:
                self._clear_refs = os.open("/proc/self/clear_refs", os.O_WRONLY)
                self._status = os.open("/proc/self/status", os.O_RDONLY)
                os.write(self._clear_refs, b"5")
                hwm = self._read_hwm()
                if hwm is None:
                    raise OSError("no VmHWM")
                self._use_rusage = resource is not None and self._rusage() <= hwm * 1.05 + 2**20
            except OSError:
                self._close()

    def _close(self) -> None:
        for fd in (self._clear_refs, self._status):
            if fd is not None:
                os.close(fd)
        self._clear_refs = self._status = None

    def __del__(self) -> None:
        self._close()

    @staticmethod
    def _rusage() -> int:
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # kB on Linux

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
        if self._use_rusage:
            return self._rusage()
        if self._status is not None:
            peak = self._read_hwm()
            if peak is not None:
                return peak
        if self._process is None:
            self._process = psutil.Process()
        return int(self._process.memory_info().rss)
