"""``python -m benchmarks.hook_cost``: the callback's fixed cost per micro-batch, hook by hook.

Trains the benchmark's small model with ``Trainer.fit`` in three modes, interleaved in one process with
their order rotated each repeat:

* ``builtin``: Lightning's ``accumulate_grad_batches``;
* ``empty``: the same plus a callback that defines the callback's hooks and does nothing in them: the
  floor any callback with these hooks pays (Lightning's dispatch of every hook to one more callback);
* ``callback``: :class:`~lightning_gradacc.GradientAccumulationCallback`.

Whole-fit time per micro-batch is the best of the repeats; on a shared machine it drifts by about 10%, so
the time spent inside each hook (``time.perf_counter`` around it, in separate probe fits) is the reliable
figure. Options: ``--ks 1 8``, ``--repeats 7``, ``--micro-batches 240``, ``--profile K`` (cProfile of the
callback's timed micro-batches, the functions of this package and Lightning's dispatch), ``--quick``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer import call

from lightning_gradacc import GradientAccumulationCallback

from .workloads import QUICK_SIZES, SIZES, BenchModule, MicroBatchTimer, Size, quiet

MODES = ("builtin", "empty", "callback")
HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
)
CORE_CALLS = ("begin_micro_batch", "end_micro_batch", "finalize")
MEDIANS: list[float] = []  # each fit's median window time per micro-batch, in order
LOG_EVERY_N_STEPS = [50]  # Lightning's default; `--log-every-n-steps 0` logs nothing
LIGHTNING_HOOKS = (*HOOKS, "on_before_zero_grad")  # the callback hooks Lightning calls per micro-batch/step


class EmptyHooks(pl.Callback):
    """The callback's per-batch hooks, doing nothing: what Lightning's dispatch of them costs."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        pass

    def on_before_backward(self, trainer: pl.Trainer, pl_module: Any, loss: Any) -> None:
        pass

    def on_after_backward(self, trainer: pl.Trainer, pl_module: Any) -> None:
        pass

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        pass

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        pass


class Clock:
    """Durations of named calls while ``on``: wraps methods of objects in place (instance attributes).

    A figure per call is the median of its durations (robust to the machine's hiccups); ``logging`` (the
    statistics handed to the loggers every ``log_every_n_steps``) is rare by design: a mean instead.
    """

    def __init__(self) -> None:
        self.on = False
        self.durations: dict[str, list[float]] = defaultdict(list)

    def wrap(self, owner: Any, name: str, key: str | None = None) -> None:
        original = getattr(owner, name)
        durations = self.durations[key or name]
        clock = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not clock.on:
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                durations.append(time.perf_counter() - start)

        setattr(owner, name, timed)

    def per_micro_batch(self, micro_batches: int) -> dict[str, float]:
        """µs per micro-batch of each name: median per call times calls per micro-batch."""
        figures: dict[str, float] = {}
        for name, durations in self.durations.items():
            if durations:
                typical = (
                    sum(durations) / len(durations) if name == "logging" else statistics.median(durations)
                )
                figures[name] = typical * len(durations) / micro_batches * 1e6
        return figures


class WindowTimer(pl.Callback):
    """The wall time of every window: from the start of its first batch to the next window's (or the end).

    Their median, per micro-batch, is robust to the hiccups of a shared machine, which a whole fit's mean
    is not.
    """

    def __init__(self, k: int) -> None:
        self.k = k
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx % self.k == 0:
            self.starts.append(time.perf_counter())

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.starts.append(time.perf_counter())

    @property
    def per_micro_batch(self) -> float:
        windows = [b - a for a, b in zip(self.starts[1:-1], self.starts[2:], strict=True)]  # no warm-up
        return statistics.median(windows) / self.k


def probe(callback: pl.Callback, clock: Clock) -> None:
    """Time ``callback``'s hooks (and its accumulator's calls) while the clock runs."""
    for hook in HOOKS:
        clock.wrap(callback, hook)
    if isinstance(callback, GradientAccumulationCallback):
        train_start = callback.on_train_start

        def on_train_start(trainer: pl.Trainer, pl_module: Any) -> None:
            train_start(trainer, pl_module)
            for name in CORE_CALLS:
                clock.wrap(callback.accumulator, name, f"core.{name}")

        callback.on_train_start = on_train_start  # type: ignore[method-assign]


@contextmanager
def timed_dispatch(clock: Clock, skip: int) -> Iterator[None]:
    """Time Lightning's ``_call_callback_hooks`` per hook (every callback's body and its dispatch).

    The clock runs from batch ``skip`` on: the call of ``on_train_batch_start`` switches it.
    """
    original = call._call_callback_hooks

    def dispatch(trainer: pl.Trainer, hook_name: str, *args: Any, **kwargs: Any) -> None:
        if hook_name == "on_train_batch_start":
            clock.on = args[1] >= skip
        if not clock.on or hook_name not in LIGHTNING_HOOKS:
            return original(trainer, hook_name, *args, **kwargs)
        start = time.perf_counter()
        try:
            return original(trainer, hook_name, *args, **kwargs)
        finally:
            clock.durations[f"lightning.{hook_name}"].append(time.perf_counter() - start)

    call._call_callback_hooks = dispatch  # type: ignore[assignment]
    try:
        yield
    finally:
        call._call_callback_hooks = original  # type: ignore[assignment]


def extra_callbacks(mode: str, k: int) -> list[pl.Callback]:
    if mode == "empty":
        return [EmptyHooks()]
    if mode == "callback":
        return [GradientAccumulationCallback(k)]
    return []


def fit(
    mode: str,
    size: Size,
    k: int,
    micro_batches: int,
    clock: Clock | None = None,
    around: Callable[[MicroBatchTimer], pl.Callback] | None = None,
) -> float:
    """Seconds per micro-batch of one ``Trainer.fit`` (the first window is warm-up)."""
    quiet()
    total = k * (-(-micro_batches // k) + 1)
    module = BenchModule(size, size.data(total))
    timer = MicroBatchTimer(skip=k, device="cpu")
    windows = WindowTimer(k)
    callbacks = extra_callbacks(mode, k)
    if clock is not None:
        for callback in callbacks:
            probe(callback, clock)
        for callback in callbacks:  # the statistics read for the loggers, every `log_every_n_steps`
            if isinstance(callback, GradientAccumulationCallback):
                clock.wrap(callback, "metrics", "logging")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        accumulate_grad_batches=k if mode != "callback" else 1,
        callbacks=[*callbacks, timer, windows, *([around(timer)] if around is not None else [])],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=LOG_EVERY_N_STEPS[0],
    )
    if clock is None:
        trainer.fit(module)
    else:
        with timed_dispatch(clock, skip=k):
            trainer.fit(module)
        clock.on = False
    MEDIANS.append(windows.per_micro_batch)
    return timer.per_micro_batch


def interleaved(size: Size, k: int, micro_batches: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Seconds per micro-batch of each mode over ``repeats`` rotations.

    The best whole-fit mean, and the median over the fits of each fit's median window.
    """
    samples: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    for repeat in range(repeats):
        for mode in MODES[repeat % len(MODES) :] + MODES[: repeat % len(MODES)]:
            gc.collect()
            mean = fit(mode, size, k, micro_batches)
            samples[mode].append((mean, MEDIANS[-1]))
    return {
        mode: (min(mean for mean, _ in values), statistics.median(median for _, median in values))
        for mode, values in samples.items()
        if values
    }


def per_hook(size: Size, k: int, micro_batches: int, repeats: int) -> dict[str, dict[str, float]]:
    """Best µs per micro-batch spent in each hook, core call and Lightning dispatch, per mode."""
    best: dict[str, dict[str, float]] = {mode: {} for mode in MODES}
    timed = k * -(-micro_batches // k)
    for repeat in range(repeats):
        for mode in MODES[repeat % len(MODES) :] + MODES[: repeat % len(MODES)]:
            gc.collect()
            clock = Clock()
            fit(mode, size, k, micro_batches, clock)
            for name, value in clock.per_micro_batch(timed).items():
                best[mode][name] = min(best[mode].get(name, value), value)
    return best


def profile(size: Size, k: int, micro_batches: int, top: int = 40) -> str:
    """A ``cProfile`` of the callback's timed micro-batches: this package's functions and Lightning's call."""
    profiler = cProfile.Profile()

    class Profiling(pl.Callback):
        def __init__(self, timer: MicroBatchTimer) -> None:
            self.timer = timer

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
            if self.timer.count == self.timer.skip:  # the warm-up window is over
                profiler.enable()

        def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
            profiler.disable()

    fit("callback", size, k, micro_batches, around=Profiling)
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("tottime").print_stats(r"lightning_gradacc|trainer/call.py|profilers", top)
    stats.sort_stats("cumulative").print_stats(r"lightning_gradacc", top)
    return stream.getvalue()


def report(
    size: Size, ks: tuple[int, ...], micro_batches: int, repeats: int, *, whole_fit: bool = True
) -> list[str]:
    lines: list[str] = []
    for k in ks:
        printed = len(lines)
        best = interleaved(size, k, micro_batches, repeats if whole_fit else 0)
        base = best.get("builtin", (0.0, 0.0))
        lines += (
            []
            if not whole_fit
            else [
                f"## K={k}: time per micro-batch (best of {repeats}, interleaved)\n",
                "| mode | best fit: µs per micro-batch | ratio to built-in"
                " | median window: µs per micro-batch | ratio to built-in |",
                "|---|---|---|---|---|",
                *(
                    f"| {mode} | {best[mode][0] * 1e6:.1f} | {best[mode][0] / base[0]:.3f}x"
                    f" | {best[mode][1] * 1e6:.1f} | {best[mode][1] / base[1]:.3f}x |"
                    for mode in MODES
                ),
                "",
            ]
        )
        print("\n".join(lines[printed:]), flush=True)
        printed = len(lines)
        hooks = per_hook(size, k, micro_batches, repeats)
        names = [*HOOKS, *(f"core.{name}" for name in CORE_CALLS), "logging"]
        lines += [
            f"## K={k}: µs per micro-batch inside each hook (best of {repeats} probe fits)\n",
            "| hook | callback | empty callback |",
            "|---|---|---|",
        ]
        for name in names:
            cells = [
                f"{hooks[mode][name]:.2f}" if name in hooks[mode] else "" for mode in ("callback", "empty")
            ]
            lines.append(f"| {name} | {' | '.join(cells)} |")
        ours = sum(hooks["callback"].get(name, 0.0) for name in HOOKS)
        empty = sum(hooks["empty"].get(name, 0.0) for name in HOOKS)
        lines += [f"| all hooks | {ours:.2f} | {empty:.2f} |", ""]
        lines += [
            f"## K={k}: µs per micro-batch in Lightning's `_call_callback_hooks` (every callback)\n",
            "| hook | built-in | empty callback | callback | callback - built-in |",
            "|---|---|---|---|---|",
        ]
        totals = dict.fromkeys(MODES, 0.0)
        for hook in LIGHTNING_HOOKS:
            values = {mode: hooks[mode].get(f"lightning.{hook}", 0.0) for mode in MODES}
            for mode in MODES:
                totals[mode] += values[mode]
            lines.append(
                f"| {hook} | {values['builtin']:.2f} | {values['empty']:.2f} | {values['callback']:.2f}"
                f" | {values['callback'] - values['builtin']:+.2f} |"
            )
        lines += [
            f"| all | {totals['builtin']:.2f} | {totals['empty']:.2f} | {totals['callback']:.2f}"
            f" | {totals['callback'] - totals['builtin']:+.2f} |",
            "",
        ]
        print("\n".join(lines[printed:]), flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--micro-batches", type=int, default=240, help="timed micro-batches per fit")
    parser.add_argument("--profile", type=int, default=None, metavar="K", help="cProfile the callback at K")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: physical cores)")
    parser.add_argument("--log-every-n-steps", type=int, default=50)
    parser.add_argument("--hooks-only", action="store_true", help="only the time inside each hook")
    parser.add_argument("--quick", action="store_true", help="the tiny model, one repeat: a smoke run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads or max(1, psutil.cpu_count(logical=False) or 1))
    size = QUICK_SIZES["small"] if args.quick else SIZES["small"]
    repeats = 1 if args.quick else args.repeats
    micro_batches = 8 if args.quick else args.micro_batches
    LOG_EVERY_N_STEPS[0] = args.log_every_n_steps
    if args.profile is not None:
        print(profile(size, args.profile, micro_batches))
        return
    print(
        f"# Fixed cost per micro-batch: {size.name}, torch {torch.__version__}, Lightning {pl.__version__}\n"
    )
    report(size, tuple(args.ks), micro_batches, repeats, whole_fit=not args.hooks_only)


if __name__ == "__main__":
    main()
