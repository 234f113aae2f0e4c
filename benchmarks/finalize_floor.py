"""``python -m benchmarks.finalize_floor``: the window's end against its floor, in one process.

A window's end (``GradAccumulator.finalize``, K=1, default settings) must at least take the gradients'
total norm, check it is finite and read the verdict on the host once: that is the floor
(``torch.nn.utils.get_total_norm`` + ``isfinite`` + one host read), timed on the same gradients in the
same process, interleaved with ``finalize``. Printed: both medians, their ratio, and the Python function
calls one ``finalize`` makes (cProfile), so that a change that adds Python to the step shows; and, for
comparison, the kernels alone (each gradient's norm in one fused pass, stacked, read once).

The model is a 5-layer MLP of about 77k parameters (micro-batches of 32), on one thread. Options:
``--windows N`` (timed finalizes, default 3000), ``--threads T``, ``--quick``.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import statistics
import time

import torch
from torch import nn

from lightning_gradacc import GradAccumulator

WIDTHS = (32, 128, 256, 128, 48, 10)  # 76,826 parameters in 5 linear layers


def model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(WIDTHS)):
        layers.append(nn.Linear(a, b))
        if i < len(WIDTHS) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def floor(grads: list[torch.Tensor]) -> bool:
    """What the window's default decision needs at least: the total norm, finite or not, read once."""
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    return bool(torch.isfinite(norm).item())


def kernels(grads: list[torch.Tensor]) -> list[float]:
    """The kernels alone: each gradient's norm in one fused pass, copied to the host in one read."""
    return torch.stack(torch._foreach_norm(grads, 2.0)).tolist()


def measure(windows: int) -> dict[str, float]:
    net = model()
    x, y = torch.randn(32, WIDTHS[0]), torch.randn(32, WIDTHS[-1])
    accumulator = GradAccumulator(net.named_parameters(), 1)
    grads: list[torch.Tensor] = []
    finalize_times: list[float] = []
    floor_times: list[float] = []
    kernel_times: list[float] = []

    def backward() -> None:
        net.zero_grad(set_to_none=True)
        accumulator.backward(nn.functional.mse_loss(net(x), y), items=32)

    for index in range(windows + 50):  # 50 to warm up
        backward()
        grads[:] = [p.grad for p in net.parameters() if p.grad is not None]
        start = time.perf_counter()
        floor(grads)
        middle = time.perf_counter()
        kernels(grads)
        kernel_end = time.perf_counter()
        accumulator.finalize()
        end = time.perf_counter()
        if index >= 50:
            floor_times.append(middle - start)
            kernel_times.append(kernel_end - middle)
            finalize_times.append(end - kernel_end)
    profiler = cProfile.Profile()
    profiled = 200
    for _ in range(profiled):
        backward()
        profiler.enable()
        accumulator.finalize()
        profiler.disable()
    calls = pstats.Stats(profiler).total_calls / profiled  # type: ignore[attr-defined]
    finalize = statistics.median(finalize_times) * 1e6
    least = statistics.median(floor_times) * 1e6
    bare = statistics.median(kernel_times) * 1e6
    return {
        "finalize_us": finalize,
        "floor_us": least,
        "ratio": finalize / least,
        "kernels_us": bare,
        "kernel_ratio": finalize / bare,
        "calls": calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--windows", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="few windows: a smoke run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = measure(100 if args.quick else args.windows)
    print(
        f"# The window's end against its floor ({sum(p.numel() for p in model().parameters()):,}-parameter"
        f" MLP, K=1, default settings, torch {torch.__version__}, {args.threads} thread(s))\n\n"
        "| finalize, µs | floor: `get_total_norm` + `isfinite` + one host read, µs | ratio | the kernels"
        " alone: `_foreach_norm` + stack + one host read, µs | ratio | Python calls per finalize |\n"
        "|---|---|---|---|---|---|\n"
        f"| {result['finalize_us']:.1f} | {result['floor_us']:.1f} | {result['ratio']:.2f}x |"
        f" {result['kernels_us']:.1f} | {result['kernel_ratio']:.2f}x | {result['calls']:.0f} |"
    )


if __name__ == "__main__":
    main()
