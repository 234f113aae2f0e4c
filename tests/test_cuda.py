"""CUDA checks: skipped without a GPU, run by sessions that are lent one (`pytest -m cuda`)."""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_partial_window_oracle_on_cuda() -> None:
    module = h.RegressionModule(h.regression_data(40))
    h.trainer(accelerator="cuda", callbacks=[GradientAccumulationCallback(4, max_grad_norm=0.5)]).fit(module)
    expected = h.big_batch_reference(
        h.regression_net(), h.regression_data(40), 4, h.windows(10, 4), h.mse, max_grad_norm=0.5
    )
    assert h.max_abs_diff(module.net.cpu(), expected) < 1e-5


def guard_hooks_against_syncs(callback: GradientAccumulationCallback) -> None:
    """Make every host sync inside the callback's per-micro-batch hooks an error (CUDA's sync debug mode)."""
    for hook in ("on_train_batch_start", "on_before_backward", "on_after_backward"):
        original = getattr(callback, hook)

        def guarded(trainer: pl.Trainer, *args: Any, __original: Any = original) -> Any:
            accumulating = trainer.fit_loop._should_accumulate()
            torch.cuda.set_sync_debug_mode("error" if accumulating else "default")
            try:
                return __original(trainer, *args)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        setattr(callback, hook, guarded)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"scaling": "weighted", "item_count_fn": h.count_tokens}, {"accumulation_dtype": "float64"}],
)
def test_no_host_sync_while_accumulating_on_cuda(kwargs: dict[str, Any]) -> None:
    callback = GradientAccumulationCallback(4, **kwargs)
    guard_hooks_against_syncs(callback)
    h.trainer(accelerator="cuda", callbacks=[callback]).fit(h.TokenModule(h.token_data()))
    assert callback.stats.windows == 3
