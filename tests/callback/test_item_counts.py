"""Item counts through ``Trainer.fit``: of any kind, zero, ambiguous, bad, or not inferable.

Counts of any kind (tensor, float, numpy) and micro-batches or windows without items match the big batch;
``scaling="weighted"`` refuses an ambiguous batch size, a bad ``item_count_fn`` result names its batch, and
batches whose size cannot be inferred warn once.
"""

from __future__ import annotations

import collections
import math
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h
from tests.helpers import BatchList, fit

reference = h.regression_reference


Batch = collections.namedtuple("Batch", ["length", "x", "y"])


Pair = collections.namedtuple("Pair", ["x", "y"])


class NamedTupleModule(h.RegressionModule):
    def __init__(self, with_length: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.with_length = with_length

    def train_dataloader(self) -> DataLoader[Any]:
        def collate(rows: list[tuple[Tensor, Tensor]]) -> Any:
            x, y = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
            return Batch(torch.tensor(len(rows)), x, y) if self.with_length else Pair(x, y)

        return DataLoader(self.data, batch_size=self.batch_size, collate_fn=collate)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return nn.functional.mse_loss(self.net(batch.x), batch.y)


def test_weighted_refuses_an_ambiguous_batch_size_and_asks_for_item_count_fn() -> None:
    module = NamedTupleModule(True, data=h.regression_data(38))
    callback = GradientAccumulationCallback(4, scaling="weighted")
    with pytest.raises(
        ValueError, match=r"batch size of batch 0 is ambiguous: it holds a 0-dim.*item_count_fn"
    ):
        fit(module, callback)
    assert h.max_abs_diff(module.net, h.regression_net()) == 0  # raised before any update


def test_weighted_accepts_a_batch_whose_tensors_agree() -> None:
    module = NamedTupleModule(False, data=h.regression_data(38))
    fit(module, GradientAccumulationCallback(4, scaling="weighted"))
    assert h.max_abs_diff(module.net, reference(h.windows(10, 4), num_samples=38)) < 1e-6


def tokens_float(batch: Any) -> Tensor:
    return (batch[1] != h.IGNORE_INDEX).float().sum()


def tokens_python_float(batch: Any) -> float:
    return float((batch[1] != h.IGNORE_INDEX).sum())


def tokens_numpy(batch: Any) -> Any:
    return np.int64((batch[1] != h.IGNORE_INDEX).sum().item())


@pytest.mark.parametrize("counter", [tokens_float, tokens_python_float, tokens_numpy, h.count_tokens])
def test_any_kind_of_token_count_matches_one_big_batch(counter: Any) -> None:
    data = h.token_data()
    module = h.TokenModule(data)
    fit(module, GradientAccumulationCallback(4, scaling="weighted", item_count_fn=counter))
    expected = h.big_batch_reference(h.token_net(), data, 2, h.windows(12, 4), h.token_loss, lr=0.5)
    assert h.max_abs_diff(module.net, expected) < 1e-6


def padded(data: Any, rows: list[int]) -> Any:
    inputs, labels = (t.clone() for t in data.tensors)
    labels[rows] = h.IGNORE_INDEX  # e.g. SFT samples whose labels are all masked
    return torch.utils.data.TensorDataset(inputs, labels)


@pytest.mark.parametrize("counter", [h.count_tokens, tokens_python_float])
def test_micro_batches_and_windows_with_zero_items(counter: Any) -> None:
    # micro-batch 1 (rows 2-3) has no token; window 2 (micro-batches 8-11, rows 16-23) has none at all
    data = padded(h.token_data(), [2, 3, *range(16, 24)])
    module, recorder = h.TokenModule(data), h.MetricsRecorder()
    callback = GradientAccumulationCallback(4, scaling="weighted", item_count_fn=counter)
    fit(module, callback, logger=recorder, log_every_n_steps=1)
    # the big batch of window 2 has no token: its loss is nan and the reference takes no step either
    losses: list[float] = []
    expected = h.big_batch_reference(
        h.token_net(), data, 2, h.windows(12, 4), h.token_loss, lr=0.5, skip_windows=[2], losses=losses
    )
    assert h.max_abs_diff(module.net, expected) < 1e-6
    # the first window's loss is its tokens' mean: the masked micro-batch's nan weighs nothing
    logged = [loss for _, loss in recorder.series("grad_accum/window_loss")]
    assert logged[:2] == pytest.approx(losses[:2], rel=1e-6) and math.isnan(logged[2])
    stats = callback.stats
    assert (stats.empty_windows, stats.skipped_steps, stats.windows) == (1, 0, 3)
    assert math.isnan(callback.metrics()["grad_accum/window_loss"])  # the empty window has no loss


@pytest.mark.parametrize("bad", [-3, float("nan"), "many"])
def test_bad_item_count_fn_result_raises_naming_that_batch(bad: Any) -> None:
    calls = iter(range(100))

    def counter(batch: Any) -> Any:
        return bad if next(calls) == 3 else 4

    module = h.RegressionModule(h.regression_data(40))
    callback = GradientAccumulationCallback(2, scaling="weighted", item_count_fn=counter)
    with pytest.raises(ValueError, match=f"item count of batch 3 \\(from `item_count_fn`\\).*{bad}"):
        h.trainer(callbacks=[callback]).fit(module)
    # raised at that window's boundary, before its update: only the window of batches 0 and 1 was stepped
    expected = h.big_batch_reference(h.regression_net(), h.regression_data(40), 4, [[0, 1]], h.mse)
    assert h.max_abs_diff(module.net, expected) < 1e-6


def test_batches_without_an_inferable_size_warn_once_and_still_train() -> None:
    class Opaque(h.RegressionModule):
        def train_dataloader(self):
            # plain lists: nothing Lightning can take a batch size from
            return BatchList([{"x": x.tolist(), "y": y.tolist()} for x, y in super().train_dataloader()])

        def training_step(self, batch, batch_idx):
            return super().training_step((torch.tensor(batch["x"]), torch.tensor(batch["y"])), batch_idx)

    callback = GradientAccumulationCallback(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning, not only the first per code location
        h.trainer(callbacks=[callback]).fit(Opaque(h.regression_data(40)))
    inferred = [w for w in caught if "Could not infer the batch size" in str(w.message)]
    assert len(inferred) == 1 and "batch 0" in str(inferred[0].message)  # 10 batches, one warning
    assert callback.stats.windows == 3
    assert callback.stats.items_last_step == 0


def _ignored_label_warnings(**callback: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(h.TokenModule(h.token_data(24)), GradientAccumulationCallback(4, **callback), max_epochs=2)
    return [str(w.message) for w in caught if "labels hold -100" in str(w.message)]


def test_weighted_by_samples_on_labels_with_ignored_tokens_warns_once_naming_the_counter() -> None:
    """Padded token batches with `scaling="weighted"` and no `item_count_fn` are weighted by sequences, not
    tokens: said once (the first batch's labels are read once), with the counters to use."""
    (message,) = _ignored_label_warnings(scaling="weighted")
    assert "item_count_fn=count_predicted_tokens" in message and "`count_tokens`" in message
    assert _ignored_label_warnings(scaling="weighted", item_count_fn=h.count_tokens) == []
    assert _ignored_label_warnings(scaling="mean") == []  # not weighted: the counts only feed statistics
