"""Each normalization on 2 CPU processes (DDP, gloo): ``python tests/distributed/normalization_run.py OUT``.

Lightning's DDP strategy re-runs this script for the second rank; every scenario is one ``Trainer.fit`` in
the same two processes. Rank 0 saves each scenario's parameters for ``test_normalizations.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: `tests` importable

import pytorch_lightning as pl
import torch

from lightning_gradacc import GradientAccumulationCallback
from lightning_gradacc.counters import count_tokens
from tests import normalization_cases as cases
from tests.helpers import exit_together

ROWS = 40  # 20 per rank; windows of 16 rows over both ranks: 16, 16 and a short 8
PER_RANK_WINDOW = 8


def scenarios() -> dict[str, tuple[str, bool, int, dict[str, Any]]]:
    """name -> (normalization, packed, micro-batch rows, callback settings)."""
    found: dict[str, tuple[str, bool, int, dict[str, Any]]] = {}
    for normalization in cases.NORMALIZATIONS:
        for packed in (False, True):
            for micro_batch in (1, 2, 8):
                name = f"{normalization}-{'packed' if packed else 'padded'}-{micro_batch}"
                found[name] = (normalization, packed, micro_batch, cases.settings(normalization))
    for normalization in cases.NORMALIZATIONS:  # windows closed by an item budget, over 2 epochs
        for packed in (False, True):
            for micro_batch in (1, 4):
                name = f"budget-{normalization}-{'packed' if packed else 'padded'}-{micro_batch}"
                budget = cases.budget_settings(normalization, cases.BUDGETS[normalization])
                found[name] = (normalization, packed, micro_batch, budget)
    # a token budget for sequence means (`budget_count_fn`): the windows of both ranks' tokens
    by_tokens = {**cases.settings("sequence_mean"), "items_per_step": 30, "budget_count_fn": count_tokens}
    found["budget-tokens-sequence_mean-packed-2"] = ("sequence_mean", True, 2, by_tokens)
    found["constant-as-sum"] = ("constant", True, 2, {"scaling": "sum"})  # the negative control
    found["world_size-bug"] = ("token_mean", True, 2, cases.settings("token_mean"))
    return found


def trainer(callback: pl.Callback, epochs: int = 1) -> pl.Trainer:
    return pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # the module shards rows in order (rank r reads r, r + 2, ...)
        callbacks=[callback],
    )


def main(out: Path) -> None:
    for name, (normalization, packed, micro_batch, settings) in scenarios().items():
        data = cases.make_sequences(ROWS, packed=packed)
        bug = "world_size" if name == "world_size-bug" else None
        module = cases.SequenceModule(data, normalization, micro_batch, bug=bug)
        if "items_per_step" in settings:
            fit = trainer(GradientAccumulationCallback(**settings), epochs=2)
        else:
            fit = trainer(GradientAccumulationCallback(max(1, PER_RANK_WINDOW // micro_batch), **settings))
        fit.fit(module)
        if fit.global_rank == 0:
            torch.save((module.net.state_dict(), fit.global_step), out / f"{name}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    exit_together()  # both ranks: Lightning re-runs this script for the second
