"""The sync counter of ``tests/syncs.py`` sees each call it claims to see."""

from __future__ import annotations

import torch

from tests.syncs import SyncCounter


def test_the_sync_counter_sees_each_kind_of_sync() -> None:
    """The counter itself can fail: each call it claims to see, it sees."""
    counter = SyncCounter()
    tensor = torch.ones(3)
    with counter.patched(), counter.counting():
        tensor.sum().item()
        bool(tensor.sum())
        tensor.to("cpu")
        tensor.to(device=torch.device("cpu"), non_blocking=True)  # not counted: non-blocking
        tensor.to(torch.float64)  # not counted: no device
        torch.equal(tensor, tensor)
        tensor.nonzero()
    assert counter.calls == ["item", "__bool__", "to(cpu)", "equal", "nonzero"]
