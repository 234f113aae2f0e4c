"""``sharded_reduction`` is checked when the callback is built, and says so when no module is sharded."""

from __future__ import annotations

import pytest

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h


def test_sharded_reduction_is_checked_when_the_callback_is_built() -> None:
    expected = r"one of \['every_micro_batch', 'window_end', 'replicas_at_window_end'\], but got 'never'"
    with pytest.raises(ValueError, match=r"argument `sharded_reduction` to be " + expected):
        GradientAccumulationCallback(2, sharded_reduction="never")  # type: ignore[arg-type]


@pytest.mark.parametrize("reduction", ["window_end", "replicas_at_window_end"])
def test_a_sharded_reduction_without_fsdp_warns_that_it_does_nothing(reduction: str) -> None:
    trainer = h.trainer(callbacks=[GradientAccumulationCallback(2, sharded_reduction=reduction)])  # type: ignore[arg-type]
    expected = r"has no effect: no module is sharded by FSDP \(DDP already reduces once per window\)\.$"
    with pytest.warns(UserWarning, match=rf"`sharded_reduction='{reduction}'` {expected}"):
        trainer.fit(h.RegressionModule(h.regression_data(8)))
