"""The language-model recipe (``examples/lm_finetune.py``) and its YAML twin, run for 3 epochs.

Oracle: plain PyTorch on the tiny GPT-2 the recipe builds: per window (read from the Trainer), one AdamW step
on all its sequences as one batch (the mean over every predicted token), the gradient clipped to norm 1, at
the learning rate the recipe asks for, written out here: the peak times sqrt(K / 2) (K=2, then 4 once 4,000
tokens were consumed) times the warmup-and-cosine factor at the tokens consumed before the window.

A SIGTERM inside a window (as a cluster sends it) stops the run with a checkpoint of the open window; the same
command again resumes from it to the parameters of the uninterrupted run. The YAML twin trains the same model.
"""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from examples import lm_finetune as recipe
from torch import Tensor

from lightning_gradacc.cli import build_cli
from lightning_gradacc.counters import count_predicted_tokens
from lightning_gradacc.lightning import GradientAccumulationCallback
from tests.helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")]
EPOCHS = 3
PEAK, TOTAL, WARMUP, FINAL = 1e-3, 12_000, 2_000, 0.1


class Batches(L.Callback):
    """Every micro-batch the Trainer trained on, with the optimizer steps taken after it."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, Tensor], int]] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, *args: Any
    ) -> None:
        self.seen.append(({k: v.clone() for k, v in batch.items()}, trainer.global_step))


def lr_at(tokens: float, k: int) -> float:
    """The recipe's learning rate, from its definition: sqrt(K / 2) x linear warmup, cosine to 0.1."""
    if tokens < WARMUP:
        factor = tokens / WARMUP
    else:
        progress = min((tokens - WARMUP) / (TOTAL - WARMUP), 1.0)
        factor = FINAL + (1 - FINAL) * 0.5 * (1 + math.cos(math.pi * progress))
    return PEAK * math.sqrt(k / 2) * factor


def big_batch_reference(seen: list[tuple[dict[str, Tensor], int]]) -> torch.nn.Module:
    model = recipe.CausalLM().model
    optimizer = torch.optim.AdamW(model.parameters(), lr=PEAK, weight_decay=0.01)
    tokens, window, last_step = 0.0, [], 0
    for batch, step in seen:
        window.append(batch)
        if step == last_step:
            continue
        last_step = step
        sequences = [
            ids[mask.bool()].tolist()
            for b in window
            for ids, mask in zip(b["input_ids"], b["attention_mask"], strict=True)
        ]
        big = recipe.pad_and_mask(sequences)
        optimizer.zero_grad()
        model(**big).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(tokens, 2 if tokens < 4_000 else 4)
        optimizer.step()
        tokens += float(count_predicted_tokens(big))
        window = []
    assert not window  # every window stepped
    return model


def parameters(trainer: L.Trainer) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in trainer.lightning_module.model.named_parameters()}  # type: ignore[union-attr]


def max_difference(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Tensor], Batches, L.Trainer]:
    batches = Batches()
    trainer = recipe.main(
        ["--root", str(tmp_path_factory.mktemp("lm")), "--max_epochs", str(EPOCHS)], batches
    )
    return parameters(trainer), batches, trainer


def test_the_recipe_is_the_big_batch_of_every_window_at_its_learning_rate(uninterrupted: Any) -> None:
    final, batches, trainer = uninterrupted
    reference = {n: p.detach() for n, p in big_batch_reference(batches.seen).named_parameters()}
    assert max_difference(final, reference) < 1e-5  # measured 2.6e-6: float32, amplified by Adam
    callback = next(c for c in trainer.callbacks if isinstance(c, GradientAccumulationCallback))
    assert callback.plan.position.window_k == 4 and callback.items_consumed > 4_000  # K grew by tokens
    logged = set(trainer.logged_metrics)
    assert {"grad_accum/noise_scale", "grad_accum/lr_factor", "grad_accum/items_last_step"} <= logged


class Sigterm(L.Callback):
    """Sends this process a SIGTERM at the end of global micro-batch ``at``, as a cluster's scheduler does."""

    def __init__(self, at: int) -> None:
        self.at, self.seen = at, 0

    def on_train_batch_end(self, *args: Any) -> None:
        if self.seen == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        self.seen += 1


def test_a_sigterm_inside_a_window_resumes_to_the_uninterrupted_run(
    uninterrupted: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Micro-batch 26 of 48 is the first of a window after K became 4: the run stops there with a checkpoint
    holding the open window and the loader's position; the same command resumes from it."""
    final = uninterrupted[0]
    command = ["--root", str(tmp_path), "--max_epochs", str(EPOCHS)]
    with pytest.raises(SystemExit):
        recipe.main(command, Sigterm(26))
    saved = torch.load(tmp_path / "lm_finetune" / "checkpoints" / "preempted.ckpt", weights_only=False)
    window = next(v for k, v in saved["callbacks"].items() if "GradientAccumulation" in k)["window"]
    assert window is not None and window["micro_batches"] >= 1  # saved inside a window
    capsys.readouterr()
    resumed = recipe.main(command)  # ckpt_path "last": the newest checkpoint, the preempted one
    assert max_difference(parameters(resumed), final) < 1e-6
    assert "Gradient accumulation summary" in capsys.readouterr().out  # the recipe prints its summary


def test_the_yaml_twin_trains_the_same_model(
    uninterrupted: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the config writes logs/lm_finetune_yaml/ where it runs
    args = ["fit", "--config", str(ROOT / "examples" / "lm_finetune.yaml"), f"--trainer.max_epochs={EPOCHS}"]
    cli = build_cli(args)
    assert max_difference(parameters(cli.trainer), uninterrupted[0]) < 1e-7
    assert (tmp_path / "logs" / "lm_finetune_yaml" / "checkpoints" / "last.ckpt").exists()
