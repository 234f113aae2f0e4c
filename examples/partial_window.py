"""How far each accumulation ends from one big batch: Lightning's built-in against the callback.

Run: ``python examples/partial_window.py``. Two cases, each trained with real ``Trainer.fit`` runs and
compared with plain PyTorch taking one optimizer step per window on all of the window's data at once:

1. 10 micro-batches of 4 samples with K=4: the last window has 2 micro-batches. The built-in divides
   their sum by 4, so that step is half as large as it should be.
2. Padded token sequences of very different lengths with K=4: the built-in averages per-micro-batch
   means, so a token in a short micro-batch weighs more than one in a long micro-batch.
"""

from __future__ import annotations

import logging
import warnings

import torch
from tests import helpers as h

from lightning_gradacc import GradientAccumulationCallback


def run(case: str) -> tuple[float, float]:
    if case == "partial":
        data, make, batch, loss_fn, lr, k = h.regression_data(40), h.RegressionModule, 4, h.mse, 0.1, 4
        callback = GradientAccumulationCallback(k)
        windows = h.windows(10, k)
        reference = h.big_batch_reference(h.regression_net(), data, batch, windows, loss_fn, lr=lr)
    else:
        data, make, batch, loss_fn, lr, k = h.token_data(), h.TokenModule, 2, h.token_loss, 0.5, 4
        callback = GradientAccumulationCallback(k, scaling="weighted", item_count_fn=h.count_tokens)
        windows = h.windows(12, k)
        reference = h.big_batch_reference(h.token_net(), data, batch, windows, loss_fn, lr=lr)
    builtin = make(data)
    h.trainer(accumulate_grad_batches=k).fit(builtin)
    fixed = make(data)
    h.trainer(callbacks=[callback]).fit(fixed)
    return h.max_abs_diff(builtin.net, reference), h.max_abs_diff(fixed.net, reference)


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    print("| case | built-in `accumulate_grad_batches=4` | `GradientAccumulationCallback` |")
    print("|---|---|---|")
    for case, title in [
        ("partial", "10 micro-batches, K=4 (last window 2)"),
        ("tokens", "variable-length tokens, K=4"),
    ]:
        builtin, fixed = run(case)
        print(f"| {title} | {builtin:.2e} | {fixed:.2e} |")
    print("\nmax |parameter - big-batch reference| after one epoch (SGD)")


if __name__ == "__main__":
    main()
