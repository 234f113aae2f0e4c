"""No host sync on the micro-batches that accumulate through ``Trainer.fit``; one per optimizer step.

On CPU the calls that force one are counted by patching them (``tests/syncs.py``); on a GPU, CUDA's sync debug
mode makes any of them an error.
"""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h
from tests.helpers import cuda_only
from tests.syncs import CountingCallback, SyncCounter


@pytest.mark.parametrize("scaling", ["mean", "weighted"])
def test_no_host_sync_on_accumulating_micro_batches(scaling: str) -> None:
    counter = SyncCounter()
    kwargs = {"item_count_fn": h.count_tokens} if scaling == "weighted" else {}
    callback = CountingCallback(counter, 4, scaling=scaling, max_grad_norm=1.0, **kwargs)
    with counter.patched():
        h.trainer(callbacks=[callback], logger=h.MetricsRecorder(), log_every_n_steps=1).fit(
            h.TokenModule(h.token_data())
        )
    accumulating = [syncs for stepped, syncs in callback.per_batch if not stepped]
    stepping = [syncs for stepped, syncs in callback.per_batch if stepped]
    assert len(accumulating) == 9 and set(accumulating) == {0}
    assert len(stepping) == 3 and set(stepping) == {1}  # the skip decision; logging reuses it


@pytest.mark.parametrize(
    ("optimizer", "per_step"),
    [
        ("sgd", [1, 1, 1]),
        ("adam", [1, 1, 1]),
        ("adam_fused", [0, 1, 0]),
        ("adamw_fused", [0, 1, 0]),
        ("sgd_fused", [1, 1, 0]),  # with momentum: its first step on the host (`skips_on_device`)
    ],
)
@pytest.mark.parametrize("scaling", ["mean", "weighted"])
def test_host_reads_per_optimizer_step_by_optimizer_kind(
    optimizer: str, per_step: list[int], scaling: str
) -> None:
    """Skip + clip + normalization: one read per step, none with a fused optimizer; one on a logged step."""
    counter = SyncCounter()
    kwargs = {"item_count_fn": h.count_tokens} if scaling == "weighted" else {}
    callback = CountingCallback(counter, 4, scaling=scaling, max_grad_norm=1.0, **kwargs)
    module = h.TokenModule(h.token_data(), optimizer=optimizer, lr=0.05)
    with counter.patched():  # logged at the 2nd step only (`log_every_n_steps=2`)
        h.trainer(callbacks=[callback], logger=h.MetricsRecorder(), log_every_n_steps=2).fit(module)
    stepping = [syncs for stepped, syncs in callback.per_batch if stepped]
    accumulating = [syncs for stepped, syncs in callback.per_batch if not stepped]
    assert set(accumulating) == {0}
    assert stepping == per_step


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


@cuda_only
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"scaling": "weighted", "item_count_fn": h.count_tokens}, {"accumulation_dtype": "float64"}],
)
def test_no_host_sync_while_accumulating_on_cuda(kwargs: dict[str, Any]) -> None:
    callback = GradientAccumulationCallback(4, **kwargs)
    guard_hooks_against_syncs(callback)
    h.trainer(accelerator="cuda", callbacks=[callback]).fit(h.TokenModule(h.token_data()))
    assert callback.stats.windows == 3


@cuda_only
@pytest.mark.parametrize("scaling", ["mean", "weighted"])
def test_a_fused_adam_window_runs_under_the_sync_debug_mode_on_cuda(scaling: str) -> None:
    """Every hook of an unlogged window, the step's skip + clip + normalization included, with no sync."""
    kwargs = {"item_count_fn": h.count_tokens} if scaling == "weighted" else {}
    callback = GradientAccumulationCallback(4, scaling=scaling, max_grad_norm=1.0, **kwargs)
    original = callback.on_before_optimizer_step

    def guarded(trainer: pl.Trainer, *args: Any) -> Any:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return original(trainer, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    callback.on_before_optimizer_step = guarded  # type: ignore[method-assign]
    guard_hooks_against_syncs(callback)
    module = h.TokenModule(h.token_data(), optimizer="adam_fused", lr=0.05)
    h.trainer(accelerator="cuda", callbacks=[callback], log_every_n_steps=100).fit(module)
    assert callback.stats.windows == 3
    assert callback.accumulator is not None and callback.accumulator.device_step is not None
