"""Count host-device synchronizations by patching the calls that force one (``CountingCallback``: in hooks).

On a CPU-only machine nothing really synchronizes, so the counter is a proxy: it records every call that
would block the host on a GPU — reading a value (``item``, ``tolist``, ``bool(t)``, ...), a copy to the CPU
that is not ``non_blocking`` (``.cpu()``, and ``.to("cpu")`` made by this package's code: on a CPU machine
every ``.to(device)`` of Lightning's targets the CPU), data-dependent shapes (``nonzero``), ``torch.equal``,
and ``torch.distributed.barrier``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from lightning_gradacc import GradientAccumulationCallback

SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "nonzero")
SYNC_FUNCTIONS = ((torch, "equal"), (torch, "nonzero"), (dist, "barrier"))


def _copies_to_cpu_blocking(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` names the CPU as its device without ``non_blocking=True``."""
    if kwargs.get("non_blocking") or (len(args) > 1 and isinstance(args[1], bool) and args[1]):
        return False
    device = kwargs.get("device", args[0] if args and isinstance(args[0], (str, torch.device)) else None)
    return device is not None and torch.device(device).type == "cpu"


def _called_from_the_package() -> bool:
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return bool(caller.startswith("lightning_gradacc") or caller.startswith("tests."))


class SyncCounter:
    """Counts calls of sync-forcing operations while ``active`` (patches are installed in ``patched``)."""

    def __init__(self) -> None:
        self.active = False
        self.calls: list[str] = []

    @contextlib.contextmanager
    def patched(self) -> Iterator[SyncCounter]:
        originals: dict[tuple[Any, str], Any] = {
            (torch.Tensor, name): getattr(torch.Tensor, name) for name in SYNC_METHODS
        }
        originals.update({(owner, name): getattr(owner, name) for owner, name in SYNC_FUNCTIONS})
        originals[(torch.Tensor, "to")] = torch.Tensor.to

        def wrap(owner: Any, name: str) -> Any:
            original = originals[(owner, name)]

            def counting(*args: Any, **kwargs: Any) -> Any:
                if self.active:
                    if name != "to":
                        self.calls.append(name)
                    elif _copies_to_cpu_blocking(args[1:], kwargs) and _called_from_the_package():
                        self.calls.append("to(cpu)")
                return original(*args, **kwargs)

            return counting

        for owner, name in originals:
            setattr(owner, name, wrap(owner, name))
        try:
            yield self
        finally:
            for (owner, name), original in originals.items():
                setattr(owner, name, original)

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        previous, self.active = self.active, True
        try:
            yield
        finally:
            self.active = previous


class CountingCallback(GradientAccumulationCallback):
    """Counts sync-forcing tensor calls made inside the callback's hooks."""

    def __init__(self, counter: SyncCounter, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counter = counter
        self.per_batch: list[tuple[bool, int]] = []  # (stepped, syncs) per micro-batch
        self._calls_at_start = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._calls_at_start = len(self.counter.calls)
        with self.counter.counting():
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_before_backward(self, trainer, pl_module, loss):
        with self.counter.counting():
            super().on_before_backward(trainer, pl_module, loss)

    def on_after_backward(self, trainer, pl_module):
        with self.counter.counting():
            super().on_after_backward(trainer, pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        with self.counter.counting():
            super().on_before_optimizer_step(trainer, pl_module, optimizer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with self.counter.counting():
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.per_batch.append((self._fit.batch.finalized, len(self.counter.calls) - self._calls_at_start))
