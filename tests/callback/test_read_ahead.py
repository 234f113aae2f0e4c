"""Reading a window's batches ahead from Lightning's fetcher leaves what Lightning sees unchanged.

``lightning_internals.read_ahead`` wraps the fit loop's batch iterator: the batches it returns are the ones
Lightning takes next, in order, and Lightning's own counts (``fetched``, ``done``, the last-batch flag) are
those of a run without it. The DeepSpeed oracles (``tests/distributed/test_deepspeed.py``) weigh by it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradacc import lightning_internals as internals
from tests import helpers as h


class Peeking(h.pl.Callback):  # type: ignore[name-defined]
    """Reads ``ahead`` batches at every batch and records what it read and what Lightning gave."""

    def __init__(self, ahead: int) -> None:
        self.ahead, self.read, self.seen, self.last = ahead, [], [], []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(int(batch[0][0, 0]))
        self.last.append(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        self.read.append([int(b[0][0, 0]) for b in internals.read_ahead(trainer, self.ahead)])


@pytest.mark.parametrize("sized", [True, False], ids=["sized", "iterable"])
def test_batches_read_ahead_are_the_ones_lightning_takes_next(sized: bool) -> None:
    rows = torch.arange(7.0).repeat_interleave(2).reshape(7, 2)  # batch i's first value is i
    data = TensorDataset(rows, rows)
    loader: Any = DataLoader(data, batch_size=1)
    if not sized:
        loader = Unsized(loader)
    module = h.RegressionModule(data)
    module.net = torch.nn.Linear(2, 1)
    module.train_dataloader = lambda: loader  # type: ignore[method-assign]
    peeking = Peeking(ahead=2)
    h.fit(module, peeking, max_epochs=2)
    epoch = list(range(7))
    assert peeking.seen == epoch * 2
    assert peeking.read == [epoch[i + 1 : i + 3] for i in epoch] * 2  # the next two, fewer at the epoch's end
    assert peeking.last == [i == 6 for i in epoch] * 2  # Lightning's last-batch flag is unchanged


class Unsized:
    """A loader without a length: Lightning's fetcher then prefetches one batch itself."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Any:
        return iter(self.loader)
