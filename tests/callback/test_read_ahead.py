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
        self.ahead, self.read, self.seen, self.last, self.held = ahead, [], [], [], []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(int(batch[0][0, 0]))
        self.last.append(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        self.read.append([int(b[0][0, 0]) for b in internals.read_ahead(trainer, self.ahead)])
        self.held.append(internals.held_ahead(trainer))


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
    # held for Lightning: what was read and not taken (the iterable loader's one is in Lightning's own queue)
    assert peeking.held == [len(read) - (0 if sized else min(1, len(read))) for read in peeking.read]


class Unsized:
    """A loader without a length: Lightning's fetcher then prefetches one batch itself."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Any:
        return iter(self.loader)


def _fit_reading(ahead: list[Any], loader: Any = None) -> tuple[Any, list[str]]:
    """A fit whose engine window opens a window of 3 with ``ahead`` read ahead (the loader's batches)."""
    from types import SimpleNamespace

    from lightning_gradacc.core.settings import AccumulationSettings
    from lightning_gradacc.engine_window import EngineWindow
    from lightning_gradacc.parts.base import Batch
    from tests.core.test_window_driver import _Engine

    warned: list[str] = []
    driver = EngineWindow(_Engine(), settings=AccumulationSettings(scaling="weighted"), world_size=1)
    driver.window_length = 3
    trainer = SimpleNamespace(world_size=1, train_dataloader=loader, batches=ahead)
    fit = SimpleNamespace(
        driver=driver,
        trainer=trainer,
        batch=Batch(items=2, label="the item count of batch 0"),
        api=SimpleNamespace(extract_batch_size=len),
        warn=warned.append,
        once=set(),
    )
    return fit, warned


def test_a_weighted_engine_window_is_counted_ahead_none_batches_as_nothing(monkeypatch: Any) -> None:
    from lightning_gradacc.parts.read_ahead import ItemsReadAhead

    monkeypatch.setattr(internals, "read_ahead", lambda trainer, count: trainer.batches[:count])
    counts = lambda batch: batch["n"]  # noqa: E731
    fit, warned = _fit_reading([{"n": torch.tensor(5)}, None])
    ItemsReadAhead(fit, item_count_fn=counts).batch_start(None, 0)
    assert fit.driver.expecting and list(fit.driver._ahead) == [2.0, 5.0, 0.0]
    assert float(fit.driver.begin_micro_batch(torch.tensor(7.0), 2)) == pytest.approx(7.0 * 2 / 7)
    # a bad count ahead raises before any backward, naming it; a window of no items warns once
    fit, _ = _fit_reading([{"n": -1.0}, {"n": 1}])
    with pytest.raises(RuntimeError, match="the item count of batch 1"):
        ItemsReadAhead(fit, item_count_fn=counts).batch_start(None, 0)
    fit, warned = _fit_reading([{"n": 0}, {"n": 0}])
    fit.batch.items = 0
    ItemsReadAhead(fit, item_count_fn=counts).batch_start(None, 0)
    assert len(warned) == 1 and "holds no items on any rank" in warned[0]


def test_a_save_with_batches_held_ahead_warns_where_the_loader_saves_its_position(monkeypatch: Any) -> None:
    from lightning_gradacc.parts.read_ahead import ItemsReadAhead

    monkeypatch.setattr(internals, "read_ahead", lambda trainer, count: trainer.batches[:count])
    monkeypatch.setattr(internals, "held_ahead", lambda trainer: 2)  # the fetcher's (tested above)
    stateful = type("Stateful", (), {"state_dict": lambda self: {}})()
    for loader, warns in ((stateful, True), (object(), False)):
        fit, warned = _fit_reading([{"n": 1}, {"n": 1}], loader)
        part = ItemsReadAhead(fit, item_count_fn=lambda batch: batch["n"])
        part.batch_start(None, 0)
        assert part.state_dict() == {}
        assert bool(warned) is warns and (not warns or "read ahead" in warned[0])
