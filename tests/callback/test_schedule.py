"""How many micro-batches a window holds, through ``Trainer.fit``: a target batch size needs a fixed batch
size."""

from __future__ import annotations

import pytest
import torch

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h
from tests.helpers import BatchList


def test_target_batch_size_needs_a_fixed_batch_size() -> None:
    class NoBatchSize(h.RegressionModule):
        def train_dataloader(self):
            sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(self.data), 4, False)
            return torch.utils.data.DataLoader(self.data, batch_sampler=BatchList(sampler))

    with pytest.raises(RuntimeError, match="has no fixed `batch_size`"):
        h.trainer(callbacks=[GradientAccumulationCallback(target_batch_size=8)]).fit(
            NoBatchSize(h.regression_data(8))
        )
