"""Count host-device synchronizations by patching the tensor methods that force one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")


class SyncCounter:
    """Counts calls of sync-forcing tensor methods while ``active`` (patches are installed in ``patched``)."""

    def __init__(self) -> None:
        self.active = False
        self.calls: list[str] = []

    @contextlib.contextmanager
    def patched(self) -> Iterator[SyncCounter]:
        originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

        def wrap(name: str) -> Any:
            original = originals[name]

            def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if self.active:
                    self.calls.append(name)
                return original(tensor, *args, **kwargs)

            return counting

        for name in SYNC_METHODS:
            setattr(torch.Tensor, name, wrap(name))
        try:
            yield self
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        previous, self.active = self.active, True
        try:
            yield
        finally:
            self.active = previous
