"""The process's peak memory on the gradients' device, read without resetting anything.

On CUDA it is the caching allocator's peak (``torch.cuda.max_memory_allocated``); on Linux CPUs the
kernel's resident-set high-water mark of this process (``VmHWM`` in ``/proc/self/status``, tens of µs);
elsewhere ``getrusage``'s peak, or the resident set size now. These are process-wide counters that the
user, Lightning's ``DeviceStatsMonitor`` and profilers read too: a library never resets them, so the
peak is the one since the process started (or since the user last reset it), not a window's.
Nothing here synchronizes with a device.
"""

from __future__ import annotations

import re
import sys

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

import psutil
import torch

_HWM = re.compile(r"VmHWM:\s+(\d+)\s+kB")


class PeakMemory:
    """Reads the peak memory of ``device`` so far (the process's, never reset here).

    Args:
        device: The device the gradients live on.

    Example:
        >>> PeakMemory(torch.device("cpu")).read() > 0
        True
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def read(self) -> int:
        """The peak in bytes: CUDA allocator peak on GPU, process resident-set peak on CPU."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if sys.platform.startswith("linux"):
            try:
                with open("/proc/self/status") as status:
                    match = _HWM.search(status.read())
                if match:
                    return int(match.group(1)) * 1024
            except OSError:
                pass
        if resource is not None:  # kB on Linux, bytes on macOS
            peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
            return peak if sys.platform == "darwin" else peak * 1024
        return int(psutil.Process().memory_info().rss)
