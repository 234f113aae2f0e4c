"""``python -m benchmarks [--device cuda] [--quick] [--only SECTION ...] [--out FILE]``: measure, report.

The report is a markdown file; ``--only`` measures some sections (e.g. ``--only gradient-memory``).
"""

from __future__ import annotations

import argparse
import gc
import platform
import time
from pathlib import Path

import psutil
import pytorch_lightning as pl
import torch

from .auto_batch import PLOT, auto_batch
from .measure import (
    boundary_pass,
    gradient_sets,
    operators_per_boundary,
    peak_memory_in_subprocess,
    syncs_per_micro_batch_and_step,
)
from .workloads import MODE_TITLES, MODES, OPTIMIZERS, QUICK_SIZES, SIZES, seconds_per_micro_batch


def machine(device: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = f"{cpu}, {psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB"
    if device == "cuda":
        text += f", {torch.cuda.get_device_name()}"
    return (
        f"{text}; torch {torch.__version__}, pytorch-lightning {pl.__version__}, {time.strftime('%Y-%m-%d')}"
    )


def throughput(device: str, quick: bool, repeats: int) -> list[str]:
    sizes = QUICK_SIZES if quick else SIZES
    ks = (2,) if quick else (1, 8, 32)
    lines = [
        "| model | K | " + " | ".join(MODE_TITLES[m] for m in MODES) + " |",
        "|---|---|" + "---|" * len(MODES),
    ]
    for size in sizes.values():
        for k in ks:
            windows = 1 if quick else max(3, -(-24 // k))  # at least 24 timed micro-batches
            # interleave the modes, rotating their order each repeat, so that drifts of the machine and
            # the position in a repeat hit all of them alike; collect garbage (old Trainers) before each
            samples: dict[str, list[float]] = {mode: [] for mode in MODES}
            for repeat in range(repeats):
                for mode in MODES[repeat % len(MODES) :] + MODES[: repeat % len(MODES)]:
                    gc.collect()
                    samples[mode].append(seconds_per_micro_batch(mode, size, k, windows, device))
            # the best of the repeats: on a shared machine noise only ever adds time
            best = {mode: min(values) for mode, values in samples.items()}
            base = best["builtin"]
            cells = [f"{best[m] * 1e3:.2f} ms" if m == "builtin" else f"{best[m] / base:.3f}x" for m in MODES]
            lines.append(f"| {size.name} | {k} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    return lines


def boundary(device: str, quick: bool, repeats: int) -> list[str]:
    lines = [
        "| gradients | foreach limit | accumulator boundary | ratio to limit | per-parameter loop"
        " | loop / boundary |",
        "|---|---|---|---|---|---|",
    ]
    for name, params in gradient_sets(quick, device).items():
        t = boundary_pass(params, device, repeats)
        lines.append(
            f"| {name} | {t['limit'] * 1e3:.3f} ms | {t['ours'] * 1e3:.3f} ms | {t['ours'] / t['limit']:.2f}x"
            f" | {t['naive'] * 1e3:.3f} ms | {t['naive'] / t['ours']:.1f}x |"
        )
        print(lines[-1], flush=True)
    return lines


def memory(device: str, quick: bool) -> list[str]:
    key, k = ("small", 4) if quick else ("big", 8)
    modes = ("builtin", "buffers") if quick else ("builtin", "callback", "weighted", "buffers")  # smoke: 2
    peaks = {mode: peak_memory_in_subprocess(mode, key, k, device, quick) for mode in modes}
    base, params, _, _ = peaks["builtin"]
    lines = [
        "| mode | peak memory during training | peak over the built-in, per trainable parameter"
        " | held by the accumulator (`buffer_bytes`) per parameter |",
        "|---|---|---|---|",
    ]
    for mode in modes:
        peak, _, held, _ = peaks[mode]
        extra = (peak - base) / params
        lines.append(
            f"| {MODE_TITLES[mode]} | {peak / 2**20:,.1f} MiB | {extra:+.2f} B | {held / params:.2f} B |"
        )
        print(lines[-1], flush=True)
    return lines


def gradient_memory(device: str, quick: bool) -> list[str]:
    """The peak above the start of training per bf16 parameter (``bf16-true``, plain SGD, K=4).

    Lightning's built-in, fp32 buffers filled after the backward, and filled inside it.
    """
    modes = ("builtin", "buffers") if quick else ("builtin", "buffers_after", "buffers")  # smoke: 2
    peaks = {
        mode: peak_memory_in_subprocess(mode, "bf16", 4, device, quick, precision="bf16-true")
        for mode in modes
    }
    above = {mode: peak - start for mode, (peak, _, _, start) in peaks.items()}
    params = peaks["builtin"][1]
    lines = [
        "| mode | peak above the start of training | per parameter | over the built-in, per parameter"
        " | buffers (`buffer_bytes`) per parameter |",
        "|---|---|---|---|---|",
    ]
    for mode in modes:
        title = 'callback `accumulation_dtype="float32"`, inside the backward' if mode == "buffers" else None
        lines.append(
            f"| {title or MODE_TITLES[mode]} | {above[mode] / 2**20:,.1f} MiB | {above[mode] / params:.2f} B"
            f" | {(above[mode] - above['builtin']) / params:+.2f} B | {peaks[mode][2] / params:.2f} B |"
        )
        print(lines[-1], flush=True)
    return lines


def syncs(device: str, quick: bool) -> list[str]:
    size = (QUICK_SIZES if quick else SIZES)["small"]
    lines = ["| mode | syncs per accumulating micro-batch | syncs per optimizer step |", "|---|---|---|"]
    for mode in ("callback", "weighted", "noise"):
        per_micro_batch, per_step = syncs_per_micro_batch_and_step(mode, size, 4, device)
        lines.append(f"| {MODE_TITLES[mode]} | {per_micro_batch:g} | {per_step:g} |")
        print(lines[-1], flush=True)
    return lines


def syncs_by_optimizer(device: str, quick: bool) -> list[str]:
    """Host reads per optimizer step (skip + clip + normalization) by optimizer kind, logged or not."""
    size = (QUICK_SIZES if quick else SIZES)["small"]
    lines = [
        "| optimizer | unlogged step | logged step |",
        "|---|---|---|",
    ]
    for optimizer in ("SGD", "Adam (fused)") if quick else OPTIMIZERS:  # smoke: 2
        cells = []
        for log_every in (1000, 1):
            _, per_step = syncs_per_micro_batch_and_step(
                "callback",
                size,
                4,
                device,
                optimizer=optimizer,
                log_every_n_steps=log_every,
                max_grad_norm=1.0,
            )
            cells.append(f"{per_step:g}")
        lines.append(f"| {optimizer} | {cells[0]} | {cells[1]} |")
        print(lines[-1], flush=True)
    return lines


def operators(device: str) -> list[str]:
    lines = [
        "| mode (K=4) | aten operators called by `finalize` | including the nested ones |",
        "|---|---|---|",
    ]
    for title, settings in (
        ("default (mean, overflow skip)", {}),
        ('`overflow="ignore"`', {"overflow": "ignore"}),
        ("`max_grad_norm=1.0`", {"max_grad_norm": 1.0}),
        ('`max_grad_norm=1.0, clip_scope="parameter"`', {"max_grad_norm": 1.0, "clip_scope": "parameter"}),
        ('`scaling="weighted"`, tensor counts', {"scaling": "weighted"}),
        ('`accumulation_dtype="float64"`', {"accumulation_dtype": "float64"}),
    ):
        top_level, every = operators_per_boundary(settings, 4, device)
        lines.append(f"| {title} | {top_level} | {every} |")
        print(lines[-1], flush=True)
    return lines


def sharded(quick: bool) -> list[str]:
    """``sharded_reduction`` modes under FSDP2, HSDP and FSDP1, each a fit of 2 CPU processes."""
    if quick:
        return ["Skipped in `--quick` (seven 2-process fits)."]
    import json
    import subprocess
    import sys
    import tempfile

    runs = [
        ("model_parallel", "every_micro_batch"),
        ("model_parallel", "window_end"),
        ("fsdp", "every_micro_batch"),
        ("fsdp", "window_end"),
        ("hsdp", "every_micro_batch"),
        ("hsdp", "replicas_at_window_end"),
        ("hsdp", "window_end"),
    ]
    titles = {
        "model_parallel": "FSDP2 (`ModelParallelStrategy`)",
        "fsdp": "FSDP1 (`FSDPStrategy`)",
        "hsdp": "FSDP2 on HSDP (2 replicas x 1 shard)",
    }
    lines = [
        "| strategy | `sharded_reduction` | reduce-scatters / step | MiB reduce-scattered / step |"
        " all-reduces / step | MiB all-reduced / step | peak gradient memory held (MiB) |"
        " peak resident memory, rank 0 / 1 (MiB) | s / step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    script = Path(__file__).parent / "sharded.py"
    with tempfile.TemporaryDirectory() as out:
        for strategy, mode in runs:
            command = [sys.executable, str(script), out, strategy, mode]
            subprocess.run(command, check=True, capture_output=True)
            files = [Path(out) / f"{strategy}-{mode}-{rank}.json" for rank in (0, 1)]
            ranks = [json.loads(file.read_text()) for file in files]
            first = ranks[0]
            lines.append(
                f"| {titles[strategy]} | `{mode}` | {first['reduce_scatters_per_step']:g} |"
                f" {first['scattered_bytes_per_step'] / 2**20:.1f} | {first['all_reduces_per_step']:g} |"
                f" {first['all_reduced_bytes_per_step'] / 2**20:.1f} |"
                f" {first['peak_held_gradient_bytes'] / 2**20:.1f} |"
                f" {ranks[0]['peak_rss'] / 2**20:.0f} / {ranks[1]['peak_rss'] / 2**20:.0f} |"
                f" {max(r['seconds_per_step'] for r in ranks):.3f} |"
            )
            print(lines[-1], flush=True)
    return lines


SECTIONS = (
    "throughput",
    "boundary",
    "memory",
    "gradient-memory",
    "syncs",
    "operators",
    "sharded",
    "auto-batch",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: a smoke run")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument(
        "--out", type=Path, default=None, help="markdown file (default benchmarks/results-DEVICE.md)"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SECTIONS,
        default=SECTIONS,
        help="measure these sections only (e.g. `--only gradient-memory`)",
    )
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    torch.set_num_threads(max(1, psutil.cpu_count(logical=False) or 1))
    device, quick = args.device, args.quick
    model = "tiny model" if quick else "33.6M parameters"
    out = args.out or Path(__file__).parent / f"results-{args.device}{'-quick' if args.quick else ''}.md"
    measured = {
        "throughput": lambda: [
            "## Time per micro-batch, as a ratio to Lightning's built-in\n",
            *throughput(device, quick, repeats),
        ],
        "boundary": lambda: [
            "\n## The boundary pass (overflow check, scaling, norm, clipping) against its foreach limit\n",
            *boundary(device, quick, max(repeats, 5)),
        ],
        "memory": lambda: [
            f"\n## Memory ({'tiny model, K=4' if quick else 'big model, K=8'}, a fresh process each)\n",
            *memory(device, quick),
        ],
        "gradient-memory": lambda: [
            f"\n## Peak gradient memory, bf16 parameters ({model}, `bf16-true`, SGD, K=4, a fresh process"
            " each)\n",
            *gradient_memory(device, quick),
        ],
        "syncs": lambda: [
            "\n## Host syncs made by the callback (K=4, logging every step)\n",
            *syncs(device, quick),
            '\n## Host reads per optimizer step by optimizer (K=4, `max_grad_norm=1.0`, `overflow="skip"`)\n',
            *syncs_by_optimizer(device, quick),
        ],
        "operators": lambda: [
            "\n## Operators launched by one boundary (`finalize`, small model, torch.profiler)\n",
            *operators(device),
        ],
        "sharded": lambda: [
            "\n## Gradient reduction under sharded strategies"
            " (2 CPU processes, gloo, 4.2M parameters, K=4)\n",
            *sharded(quick),
        ],
        "auto-batch": lambda: [
            '\n## `accumulation_steps="auto"` against fixed K: samples and time to a target loss (CPU)\n',
            *auto_batch(quick, PLOT if not quick else out.with_suffix(".svg")),
        ],
    }
    sections = [f"# Benchmarks ({device})\n\nMachine: {machine(device)}. Best of {repeats} repeat(s).\n"]
    for name in SECTIONS:
        if name in args.only:
            sections.extend(measured[name]())
    out.write_text("\n".join(sections) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
