"""The boundary pass against its foreach limit, memory per parameter, and host syncs."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor

from lightning_gradacc import GradAccumulator, GradientAccumulationCallback
from lightning_gradacc.core import PeakMemory

from .workloads import Size, lightning_run, synchronize

# ------------------------------------------------------------------------------------ boundary pass


def gradient_sets(quick: bool, device: str) -> dict[str, list[Tensor]]:
    """Two shapes of gradient lists: few large tensors (memory-bound) and many small ones (launch-bound)."""
    generator = torch.Generator().manual_seed(0)

    def tensors(count: int, numel: int) -> list[Tensor]:
        return [torch.randn(numel, generator=generator).to(device).requires_grad_() for _ in range(count)]

    if quick:
        return {"4 tensors x 1K": tensors(4, 1024)}
    return {"6 tensors, 25M elements": tensors(6, 25_000_000 // 6), "200 tensors x 4K": tensors(200, 4096)}


def _best_seconds(fn: Callable[[], Any], device: str, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)  # noise on a shared machine only ever adds time


def boundary_pass(params: list[Tensor], device: str, repeats: int) -> dict[str, float]:
    """Best-of-N seconds of three ways to do the boundary.

    ``ours``: the accumulator's boundary (overflow check, scaling, norm, clip, one sync); ``limit``:
    ``_foreach_norm`` + ``_foreach_mul_``, what ``clip_grad_norm_`` does; ``naive``: a per-parameter loop.
    Each does its multiply pass: the accumulator skips a multiply by exactly 1, so its loss scale
    alternates between 2 and 1/2 (the gradients stay bounded), and the others multiply by their clip
    coefficient, 1.
    """
    for param in params:
        param.grad = torch.ones_like(param)
    grads = [p.grad for p in params]
    accumulator = GradAccumulator(params, 1, max_grad_norm=1e9)  # clip coefficient computed, never < 1
    calls = [0]

    def ours() -> None:
        calls[0] += 1
        accumulator.loss_scale = 2.0 if calls[0] % 2 else 0.5
        accumulator.record()
        accumulator.finalize()

    def limit() -> None:
        norms = torch._foreach_norm(grads, 2.0)
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        torch._foreach_mul_(grads, torch.clamp(1e9 / (total + 1e-6), max=1.0))

    def naive() -> None:
        total = sum(float(g.norm()) ** 2 for g in grads) ** 0.5  # a sync per parameter, as such loops do
        if total != total or total == float("inf"):
            raise RuntimeError("non-finite")
        coefficient = min(1.0, 1e9 / (total + 1e-6))
        for g in grads:
            g.mul_(coefficient)

    return {
        name: _best_seconds(fn, device, repeats)
        for name, fn in (("ours", ours), ("limit", limit), ("naive", naive))
    }


# ------------------------------------------------------------------------------------------- memory


class PeakProbe(pl.Callback):
    """Peak memory over the training run (allocator peak on CUDA, resident peak on CPU).

    It runs in a process of its own (:func:`peak_memory_in_subprocess`), so it may reset the process-wide
    peak when training starts (the package itself never does): set-up is then not counted.
    """

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.tracker = PeakMemory(self.device)
        self.peak = 0
        self.start = 0  # in use when training starts (the model, its data, the framework)

    def _read(self) -> None:
        self.peak = max(self.peak, self.tracker.read())

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif sys.platform.startswith("linux"):
            with open("/proc/self/clear_refs", "w") as clear_refs:  # resets VmHWM (this process only)
                clear_refs.write("5")
        self.start = self.tracker.read()

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._read()

    def on_train_batch_end(self, *args: Any) -> None:
        self._read()

    def on_train_end(self, *args: Any) -> None:
        self._read()


def peak_memory_in_subprocess(
    mode: str, size_key: str, k: int, device: str, quick: bool, precision: str = "32-true"
) -> tuple[int, int, int, int]:
    """(peak bytes, trainable parameters, buffer bytes, bytes at train start) of a run in a fresh process.

    On CPU, glibc's malloc keeps freed memory for reuse, so a resident-set peak would hide new allocations;
    ``MALLOC_MMAP_THRESHOLD_`` makes every allocation above 128 KiB its own mapping, returned when freed.
    ``precision="bf16-true"`` takes the size from ``BF16_SIZES`` and trains with plain SGD.
    """
    command = [
        *(sys.executable, "-m", "benchmarks.measure", mode, size_key, str(k), device, str(int(quick))),
        precision,
    ]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    result = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    peak, params, held, start = result.stdout.split()[-4:]
    return int(peak), int(params), int(held), int(start)


def _memory_main(mode: str, size_key: str, k: str, device: str, quick: str, precision: str) -> None:
    from .workloads import BF16_SIZES, QUICK_BF16_SIZES, QUICK_SIZES, SIZES

    if precision == "bf16-true":
        size: Size = (QUICK_BF16_SIZES if quick == "1" else BF16_SIZES)[size_key]
    else:
        size = (QUICK_SIZES if quick == "1" else SIZES)[size_key]
    probe = PeakProbe(device)
    _, module = lightning_run(
        mode, size, int(k), windows=2, device=device, extra=[probe], precision=precision
    )
    callbacks = [c for c in module.trainer.callbacks if isinstance(c, GradientAccumulationCallback)]
    held = callbacks[0].stats.buffer_bytes if callbacks else 0
    print(probe.peak, sum(p.numel() for p in module.parameters()), held, probe.start)


# -------------------------------------------------------------------------------------------- syncs

SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")


@contextlib.contextmanager
def count_syncs(calls: list[str], active: Callable[[], bool]) -> Iterator[None]:
    """Patch the tensor methods that force a host sync; count calls while ``active()``."""
    originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def wrap(name: str) -> Any:
        def counting(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
            if active():
                calls.append(name)
            return originals[name](tensor, *args, **kwargs)

        return counting

    for name in SYNC_METHODS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def syncs_per_micro_batch_and_step(
    mode: str,
    size: Size,
    k: int,
    device: str,
    *,
    optimizer: str = "SGD",
    log_every_n_steps: int = 1,
    max_grad_norm: float | None = None,
) -> tuple[float, float]:
    """Host syncs made inside the callback's hooks, per accumulating micro-batch and per optimizer step.

    On CPU a patch counts the tensor methods that force a sync; on CUDA ``set_sync_debug_mode`` reports each
    real synchronization as a warning.
    """
    calls: list[str] = []
    state: dict[str, Any] = {"inside": False, "stepping": False, "mark": 0}
    per_batch: list[tuple[bool, int]] = []

    class Counting(pl.Callback):
        """Runs after the accumulation callback: attributes the syncs since the last batch to this one."""

        def on_train_start(self, *args: Any) -> None:
            state["mark"] = len(calls)

        def on_before_optimizer_step(self, *args: Any) -> None:
            state["stepping"] = True

        def on_train_batch_end(self, *args: Any) -> None:
            per_batch.append((bool(state["stepping"]), len(calls) - int(state["mark"])))
            state["mark"], state["stepping"] = len(calls), False

    settings: dict[str, Any] = {"scaling": "weighted"} if mode == "weighted" else {}
    callback = GradientAccumulationCallback(k, max_grad_norm=max_grad_norm, **settings)
    for hook in (
        "on_train_batch_start",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_train_batch_end",
    ):
        original = getattr(callback, hook)

        def marked(*args: Any, __original: Any = original, **kwargs: Any) -> Any:
            state["inside"] = True
            try:
                return __original(*args, **kwargs)
            finally:
                state["inside"] = False

        setattr(callback, hook, marked)
    if device == "cuda":
        context: Any = _cuda_sync_warnings(calls, lambda: bool(state["inside"]))
    else:
        context = count_syncs(calls, lambda: bool(state["inside"]))
    with context:
        _run_with(callback, Counting(), size, k, device, optimizer, log_every_n_steps)
    accumulating = [n for stepped, n in per_batch if not stepped]
    stepping = [n for stepped, n in per_batch if stepped]
    return sum(accumulating) / max(len(accumulating), 1), sum(stepping) / max(len(stepping), 1)


def _run_with(
    callback: pl.Callback,
    counting: pl.Callback,
    size: Size,
    k: int,
    device: str,
    optimizer: str = "SGD",
    log_every_n_steps: int = 1,
) -> None:
    import tempfile

    from .workloads import BenchModule, quiet

    quiet()
    module = BenchModule(size, size.data(3 * k), optimizer)
    pl.Trainer(
        accelerator=device,
        devices=1,
        max_epochs=1,
        callbacks=[callback, counting],
        logger=pl.loggers.CSVLogger(tempfile.mkdtemp()),
        log_every_n_steps=log_every_n_steps,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    ).fit(module)


@contextlib.contextmanager
def _cuda_sync_warnings(calls: list[str], active: Callable[[], bool]) -> Iterator[None]:
    import warnings

    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    original = warnings.showwarning

    def record(message: Any, *args: Any, **kwargs: Any) -> None:
        if active() and "synchroniz" in str(message):
            calls.append(str(message))

    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            yield
    finally:
        warnings.showwarning = original
        torch.cuda.set_sync_debug_mode(previous)


if __name__ == "__main__":
    _memory_main(*sys.argv[1:7])


def operators_per_boundary(settings: dict[str, Any], k: int, device: str) -> tuple[int, int]:
    """Operators that one ``finalize`` calls: top-level aten calls, and all of them (nested included).

    Measured with ``torch.profiler`` on the small model after a full window of K micro-batches.
    """
    from torch.profiler import ProfilerActivity, profile

    from lightning_gradacc import GradAccumulator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64)).to(
        device
    )
    accumulator = GradAccumulator(model.named_parameters(), k, **settings)
    for _ in range(2):  # the second window is the one measured (lazy set-up done)
        for _ in range(k):
            x = torch.randn(8, 64, device=device)
            items = torch.tensor(8, device=device) if settings.get("scaling") == "weighted" else 8
            accumulator.backward(model(x).pow(2).mean(), items=items)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            accumulator.finalize()
        model.zero_grad(set_to_none=True)
    aten = [event for event in prof.events() if event.name.startswith("aten::")]
    top_level = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return len(top_level), len(aten)
