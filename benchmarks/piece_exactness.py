"""``piece_size`` against one big batch, out-of-memory errors injected; and a halving without reweighting.

    python -m benchmarks.piece_exactness

Real ``Trainer.fit`` runs on the CPU (the regression of the tests, batches of 8, K=2, 5 batches; or the
token task's padded sequences): a forward raises ``torch.OutOfMemoryError`` when its piece holds more items
than a cap that falls during the run, a backward half-way (after the last layer's gradient was added). The
reference is plain PyTorch taking one step per window over the window's items as one batch. The "halved,
not reweighted" column is the same run with every piece weighted as a whole batch (what halving the batch
with K unchanged does, as ``auto_find_batch_size`` in transformers): the window is then no longer the big
batch. Printed: max |parameter - reference|, the out-of-memory errors recovered, and the fit's time with
whole batches (no ``piece_size``, nothing capped) and with pieces (same process, best of 3): the extra passes,
and of one full garbage collection per recovered error (which frees the failed pass; a few tenths of a
second in a process holding Lightning).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tests import helpers as h
from tests.callback.test_pieces import OomModule

from lightning_gradacc import GradientAccumulationCallback, piece_runner


def _fit(make: Callable[[], Any], kwargs: dict[str, Any]) -> tuple[Any, Any, float]:
    """The best of 3 fits of ``make()`` with a callback of ``kwargs`` (K=2): the module, callback, time."""
    best, module, callback = float("inf"), None, None
    for _ in range(3):
        module, callback = make(), GradientAccumulationCallback(2, **kwargs)
        started = time.perf_counter()
        h.fit(module, callback)
        best = min(best, time.perf_counter() - started)
    return module, callback, best


def main() -> None:
    data, tokens = h.regression_data(40), h.token_data()
    reference = h.big_batch_reference(h.regression_net(), data, 8, h.windows(5, 2), h.mse)
    token_reference = h.big_batch_reference(h.token_net(), tokens, 6, h.windows(4, 2), h.token_loss, lr=0.5)
    cases: list[tuple[str, Callable[[], Any], dict[str, Any], Any]] = [
        ("int piece_size=3", lambda: OomModule(data, batch_size=8), {"piece_size": 3}, reference),
        (
            "auto, forward OOMs (8 -> 4 -> 2)",
            lambda: OomModule(
                data, batch_size=8, forward_cap=lambda b: None if b < 1 else (5 if b < 3 else 3)
            ),
            {"piece_size": "auto"},
            reference,
        ),
        (
            "auto, a backward OOM in a window's 2nd batch, fp64 buffers",
            lambda: OomModule(data, batch_size=8, backward_cap=lambda b: 4 if b == 1 else 8),
            {"piece_size": "auto", "accumulation_dtype": "float64"},
            reference,
        ),
        (
            "padded tokens (weighted), pieces of 4 of 6 sequences",
            lambda: h.TokenModule(tokens, batch_size=6),
            {"piece_size": 4, "scaling": "weighted", "item_count_fn": h.count_tokens},
            token_reference,
        ),
    ]
    print("| case | halved, not reweighted | callback | OOMs recovered | fit, ms: whole batches / pieces |")
    print("|---|---|---|---|---|")
    for name, make, kwargs, expected in cases:
        whole = {k: v for k, v in kwargs.items() if k != "piece_size"}
        _, _, whole_time = _fit(lambda make=make: _never_out_of_memory(make()), whole)
        module, callback, piece_time = _fit(make, kwargs)
        diff = h.max_abs_diff(module.net, expected)
        retries = int(callback.metrics()["grad_accum/oom_retries"])
        share = piece_runner.PieceRunner._share
        piece_runner.PieceRunner._share = lambda self, piece, run: 1.0  # type: ignore[method-assign]
        try:
            control = make()
            h.fit(control, GradientAccumulationCallback(2, **kwargs))
        finally:
            piece_runner.PieceRunner._share = share  # type: ignore[method-assign]
        control_diff = h.max_abs_diff(control.net, expected)
        times = f"{whole_time * 1e3:.0f} / {piece_time * 1e3:.0f}"
        print(f"| {name} | {control_diff:.1e} | {diff:.1e} | {retries} | {times} |")


def _never_out_of_memory(module: Any) -> Any:
    if isinstance(module, OomModule):  # the same module with no cap
        module.forward_cap = module.backward_cap = lambda b: None
    return module


if __name__ == "__main__":
    main()
