"""One micro-batch on its way into the buffers: a non-finite one is dropped without a host sync."""

from __future__ import annotations

import torch

from lightning_gradacc import GradAccumulator
from tests import helpers as h
from tests.syncs import SyncCounter


def test_skip_micro_batch_does_not_sync_while_accumulating() -> None:
    net = h.regression_net()
    accumulator = GradAccumulator(
        net.parameters(), 4, overflow="skip_micro_batch", accumulation_dtype="float64"
    )
    x, y = h.regression_data(16).tensors
    counter = SyncCounter()
    with counter.patched():
        for index in range(4):
            loss = h.mse(net, x[index * 4 : index * 4 + 4], y[index * 4 : index * 4 + 4])
            with counter.counting():
                accumulator.backward(loss * (float("nan") if index == 1 else 1.0), items=torch.tensor(4))
        assert counter.calls == []
        with counter.counting():
            assert accumulator.finalize()
        assert counter.calls == ["tolist"]
    assert (accumulator.stats.dropped_micro_batches, accumulator.stats.non_finite_windows) == (1, 0)
