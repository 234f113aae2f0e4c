"""CUDA checks: skipped without a GPU, run by sessions that are lent one (`pytest -m cuda`)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_gradacc import GradAccumulator, GradientAccumulationCallback
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


def test_bf16_buffers_on_cuda() -> None:
    net = torch.nn.Linear(64, 8).cuda().to(torch.bfloat16)
    accumulator = GradAccumulator(net.parameters(), 256, accumulation_dtype="float32")
    generator = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(256):
        x = torch.randn(2, 64, device="cuda", generator=generator, dtype=torch.bfloat16)
        accumulator.backward(net(x).float().pow(2).mean(), items=2)
    assert accumulator.finalize()
    assert accumulator.stats.buffer_bytes == 4 * (64 * 8 + 8)
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in net.parameters())


@pytest.mark.parametrize("amp", [False, True])
def test_noise_scale_records_micro_batches_without_a_host_sync_on_cuda(amp: bool) -> None:
    """The noise-scale hooks and their recording run inside every backward: no sync there, also under a
    GradScaler (its scale is a device tensor, the counts host numbers)."""
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).cuda()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cuda") if amp else None
    accumulator = GradAccumulator(net.parameters(), 4, noise_scale=True, grad_scaler=scaler)
    generator = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(3):
        for index in range(4):
            x = torch.randn(8, 64, device="cuda", generator=generator)
            loss = net(x).pow(2).mean()
            torch.cuda.set_sync_debug_mode("error" if index < 3 else "default")
            try:
                accumulator.backward(loss, items=8)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        accumulator.step(optimizer)
    assert math.isfinite(accumulator.stats.trace_sigma_estimate)
    accumulator.remove_hooks()
