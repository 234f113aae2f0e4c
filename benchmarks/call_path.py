"""``python -m benchmarks.call_path``: which of the package's files a stepping micro-batch passes through.

Trains the benchmark's tiny model with ``Trainer.fit`` (K=4, one probe callback before the accumulation
callback and one after it) and follows, with ``sys.setprofile``, every Python call between the start and
the end of the last micro-batch of the second window (the one whose backward is followed by the
optimizer step). It prints:

* the package's files that run code in that micro-batch (``files``), and how many times the call stack
  enters ``lightning_gradacc.core`` from outside it (``core entries``);
* for the window's end alone (``GradAccumulator.finalize``): how many *stays* it makes (runs of
  consecutive calls in one file), in how many modules, and how many returns cross from one file back to
  another (``returns``).

These are structure figures, not timings: they change only when the code's shape does. ``--modes`` picks
the callback settings to follow (``default``, ``weighted``, ``buffers``, ``noise``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytorch_lightning as pl

import lightning_gradacc
from lightning_gradacc import GradientAccumulationCallback

from .workloads import QUICK_SIZES, BenchModule, quiet

PACKAGE = Path(lightning_gradacc.__file__).resolve().parent
CORE = PACKAGE / "core"
K = 4
STEPPING_BATCH = 2 * K - 1  # the last micro-batch of the second window (the first warms caches up)
MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "weighted": {"scaling": "weighted"},
    "buffers": {"accumulation_dtype": "float32"},
    "noise": {"noise_scale": True},
}


def _module(path: str) -> str | None:
    """The package-relative module file of ``path``, or ``None`` outside the package."""
    resolved = Path(path).resolve()
    try:
        return str(resolved.relative_to(PACKAGE))
    except ValueError:
        return None


class Trace:
    """Every call and return into the package's files while it is on (``sys.setprofile``)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str | None, str | None]] = []  # (event, callee file, caller file)

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        callee = _module(frame.f_code.co_filename)
        caller = _module(frame.f_back.f_code.co_filename) if frame.f_back is not None else None
        if callee is not None or caller is not None:
            self.events.append((event, callee, caller))

    def files(self) -> set[str]:
        return {callee for event, callee, _ in self.events if event == "call" and callee is not None}

    def core_entries(self) -> int:
        return sum(
            1
            for event, callee, caller in self.events
            if event == "call"
            and callee is not None
            and callee.startswith("core/")
            and (caller is None or not caller.startswith("core/"))
        )


class Probe(pl.Callback):
    """Turns the trace on at the stepping micro-batch's start (``first``) or off at its end (last)."""

    def __init__(self, trace: Trace, *, first: bool) -> None:
        self.trace, self.first = trace, first

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.first and batch_idx == STEPPING_BATCH:
            sys.setprofile(self.trace.profile)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if not self.first and args[-1] == STEPPING_BATCH:
            sys.setprofile(None)


def window_end_shape(trace_finalize: list[tuple[str, str | None, str | None]]) -> tuple[int, int, int]:
    """(stays, modules, returns across files) of the calls inside one ``finalize``."""
    stays, modules, returns, current = 0, set(), 0, None
    for event, callee, caller in trace_finalize:
        if event == "call" and callee is not None:
            modules.add(callee)
            if callee != current:
                stays += 1
                current = callee
        elif event == "return" and callee is not None and caller is not None and caller != callee:
            returns += 1
            current = caller
    return stays, len(modules), returns


def follow(mode: str) -> dict[str, Any]:
    """Train once in ``mode`` and return its figures."""
    size = QUICK_SIZES["small"]
    trace = Trace()
    finalize_events: list[tuple[str, str | None, str | None]] = []
    callback = GradientAccumulationCallback(accumulation_steps=K, **MODES[mode])
    original: Callable[..., Any] | None = None

    def wrap(accumulator: Any) -> None:
        nonlocal original
        original = accumulator.finalize

        def finalize(*args: Any, **kwargs: Any) -> Any:
            if sys.getprofile() is None:
                return original(*args, **kwargs)
            start = len(trace.events)
            try:
                return original(*args, **kwargs)
            finally:
                finalize_events.extend(trace.events[start:])

        accumulator.finalize = finalize

    class Wrapper(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            wrap(callback.accumulator)

    trainer = pl.Trainer(
        max_epochs=1,
        limit_train_batches=3 * K,
        callbacks=[Probe(trace, first=True), callback, Wrapper(), Probe(trace, first=False)],
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BenchModule(size, size.data(3 * K)))
    stays, modules, returns = window_end_shape(finalize_events)
    return {
        "files": sorted(trace.files()),
        "core entries": trace.core_entries(),
        "window end": (stays, modules, returns),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    parser.add_argument("--list", action="store_true", help="name the files, not only count them")
    options = parser.parse_args()
    quiet()
    header = (
        "mode",
        "files a stepping micro-batch passes",
        "core entries",
        "window end: stays / modules / returns",
    )
    print("| " + " | ".join(header) + " |")
    print("|---|---|---|---|")
    for mode in options.modes:
        found = follow(mode)
        stays, modules, returns = found["window end"]
        files, entries = len(found["files"]), found["core entries"]
        print(f"| {mode} | {files} | {entries} | {stays} / {modules} / {returns} |")
        if options.list:
            print("|  | " + ", ".join(found["files"]) + " | | |")


if __name__ == "__main__":
    main()
