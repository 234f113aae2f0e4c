"""Item counts through ``Trainer.fit``: a bad ``item_count_fn`` result names its batch, and batches whose size
cannot be inferred warn once and still train."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h
from tests.helpers import BatchList


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
