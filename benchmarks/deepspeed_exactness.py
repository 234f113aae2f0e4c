"""DeepSpeed's accumulation against one big batch: Lightning's built-in and the callback, in the same run.

    python -m benchmarks.deepspeed_exactness

Real ``Trainer.fit`` runs with Lightning's ``DeepSpeedStrategy`` on one CPU process (DeepSpeed's CPU
accelerator, gloo; Lightning's CUDA guard lifted by the test shims of ``tests/deepspeed_run.py``): a
5-batch epoch, 2 epochs, SGD. The reference is plain PyTorch taking one step per window over the window's
rows as one batch, each epoch's short last window closed in its epoch. Printed: max |parameter - reference|,
and the optimizer steps Lightning counted (``trainer.global_step``) against those DeepSpeed took.
A second table: token-weighted windows (20 padded sequences of 1-9 tokens, micro-batches of 2, K=3), the
reference the mean over every real token of a window.
Needs DeepSpeed (``pip install -e ".[deepspeed]"`` with ``DS_BUILD_OPS=0``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from tests import helpers as h
from tests.deepspeed_run import Scenario, run


def difference(result: dict[str, Any], reference: torch.nn.Module) -> float:
    """The largest |parameter - reference| of a run."""
    state = result["state"]
    return max((state[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())


def main() -> None:
    cases = [(stage, k, None) for stage in (0, 2) for k in (2, 3)] + [(2, 2, "bf16-mixed")]
    scenarios = []
    for stage, k, precision in cases:
        trainer = {"precision": precision} if precision else {}
        scenarios += [
            Scenario(callback=None, trainer_k=k, stage=stage, trainer=trainer),
            Scenario(callback={"accumulation_steps": k}, stage=stage, trainer=trainer),
        ]
    with tempfile.TemporaryDirectory() as tmp:
        results = run(scenarios, Path(tmp))
    print(
        "| ZeRO stage, K, precision | windows | built-in: difference, steps (Lightning / DeepSpeed) "
        "| callback: difference, steps |"
    )
    print("|---|---|---|---|")
    for index, (stage, k, precision) in enumerate(cases):
        windows = h.windows(5, k, epochs=2)
        reference = h.big_batch_reference(h.regression_net(), h.regression_data(20), 4, windows, h.mse)
        row = [
            f"{difference(result, reference):.1e}, {result['global_step']} / {result['engine_steps']}"
            for result in results[2 * index : 2 * index + 2]
        ]
        print(f"| {stage}, {k}, {precision or '32-true'} | {len(windows)} | {row[0]} | {row[1]} |")
    tokens()


def tokens() -> None:
    """Token weighting: padded sequences of 1-9 tokens, each window the mean over all its real tokens."""
    weighted = {"accumulation_steps": 3, "scaling": "weighted", "item_count_fn": h.count_tokens}
    stages = (0, 2, 3)
    scenarios = []
    for stage in stages:
        common = {"stage": stage, "task": "tokens", "lr": 0.5}
        scenarios += [
            Scenario(callback=None, trainer_k=3, **common),
            Scenario(callback={"accumulation_steps": 3}, **common),
            Scenario(callback=weighted, **common),
        ]
    with tempfile.TemporaryDirectory() as tmp:
        results = run(scenarios, Path(tmp))
    windows = h.windows(10, 3, epochs=2)
    reference = h.big_batch_reference(h.token_net(), h.token_data(20), 2, windows, h.token_loss, lr=0.5)
    print()
    print('| ZeRO stage, K=3, tokens | built-in | callback, `"mean"` | callback, `"weighted"` |')
    print("|---|---|---|---|")
    for index, stage in enumerate(stages):
        row = [f"{difference(result, reference):.1e}" for result in results[3 * index : 3 * index + 3]]
        print(f"| {stage} | {' | '.join(row)} |")


if __name__ == "__main__":
    main()
