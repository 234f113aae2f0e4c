"""Policy-gradient fine-tuning with the shape of RL: completions of varying length, their advantages given.

Run: ``python examples/rl_policy_gradient.py`` (``--ranks 1`` skips the two-process part of the check).

Each completion is a row of actions (tokens; padding labelled -100) with one advantage. The loss of a token
is ``-advantage x log pi(action)``; GRPO's variants differ in how those are averaged, about 10x apart in
gradient norm. Each normalization is a loss of :mod:`lightning_gradacc.losses` with the callback's settings
for it, and windows closed on a budget of 40 action tokens (``items_per_step``; the sequence mean weighs
completions and counts its budget in tokens with ``budget_count_fn``):

* token mean (DAPO, GRPO at token level): ``scaling="weighted", item_count_fn=count_tokens``;
* sequence mean (GRPO): ``scaling="weighted", item_count_fn=count_sequences, budget_count_fn=count_tokens``;
* a constant (Dr. GRPO: a fixed number of tokens): ``scaling="constant"``.

For each, ``Trainer.fit`` runs one epoch; the script prints the steps' tokens and completions, the largest
difference of the parameters from plain PyTorch taking one SGD step per window on all of its completions at
once, and :func:`~lightning_gradacc.step_check.check_step`'s verdict on the step. It exits 1 if a
normalization misses its big batch or its check. The same check from the command line, on the YAML beside
this file::

    cd examples && lightning-gradacc check --config rl_policy_gradient.yaml --ranks 2
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import warnings
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_gradacc import GradientAccumulationCallback, losses
from lightning_gradacc.counters import IGNORE_INDEX, count_sequences, count_tokens
from lightning_gradacc.step_check import check_step

VOCAB = 16
CONSTANT = 64.0  # Dr. GRPO's normaliser: about the tokens of a step
NORMALIZATIONS: dict[str, dict[str, Any]] = {
    "token mean": {"scaling": "weighted", "item_count_fn": count_tokens, "items_per_step": 40},
    "sequence mean": {
        "scaling": "weighted",
        "item_count_fn": count_sequences,
        "budget_count_fn": count_tokens,  # steps of 40 tokens, each completion weighed once
        "items_per_step": 40,
    },
    "constant": {"scaling": "constant", "item_count_fn": count_tokens, "items_per_step": 40},
}


class Completions(Dataset[dict[str, Tensor]]):
    """``count`` completions of 1-12 actions after a one-token prompt, each with an advantage."""

    def __init__(self, count: int = 48, width: int = 13, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.zeros(count, width, dtype=torch.long)
        self.labels = torch.full((count, width), IGNORE_INDEX, dtype=torch.long)
        rewards = torch.randn(count, generator=generator)
        self.advantages = (rewards - rewards.mean()) / rewards.std()
        for row in range(count):
            length = int(torch.randint(1, width, (), generator=generator))
            tokens = torch.randint(1, VOCAB, (length + 1,), generator=generator)  # the prompt, then actions
            self.inputs[row, :length] = tokens[:-1]  # the policy sees the token before each action
            self.labels[row, :length] = tokens[1:]

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {
            "input_ids": self.inputs[index],
            "labels": self.labels[index],
            "advantages": self.advantages[index],
        }


def policy(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Tanh(), nn.Linear(16, VOCAB))


def token_losses(net: nn.Module, inputs: Tensor, labels: Tensor, advantages: Tensor) -> Tensor:
    """``-advantage x log pi(action)`` at every position (0 at padding)."""
    logprobs = net(inputs).log_softmax(-1)
    taken = logprobs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(labels != IGNORE_INDEX, -advantages.unsqueeze(-1) * taken, 0.0)


class PolicyModule(pl.LightningModule):
    """REINFORCE with given advantages; ``normalization`` says how the token losses are averaged."""

    def __init__(
        self, normalization: str = "token mean", micro_batch: int = 3, lr: float = 0.5, bug: str | None = None
    ) -> None:
        super().__init__()
        self.net = policy()
        self.normalization, self.micro_batch, self.lr, self.bug = normalization, micro_batch, lr, bug

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        labels = batch["labels"]
        each = token_losses(self.net, batch["input_ids"], labels, batch["advantages"])
        if self.bug == "entropy bonus per micro-batch":  # a mean over this micro-batch's tokens, added as is
            logprobs = self.net(batch["input_ids"]).log_softmax(-1)
            entropy = -(logprobs.exp() * logprobs).sum(-1)
            bonus = 0.01 * losses.token_mean(entropy, labels)
            return losses.constant_normalized(each, labels, CONSTANT) - bonus
        if self.bug == "loss times the world size":  # to undo DDP's average, beside a local token count
            return losses.token_mean(each, labels) * self.trainer.world_size
        if self.normalization == "token mean":
            return losses.token_mean(each, labels)
        if self.normalization == "sequence mean":
            return losses.sequence_mean(each, labels)
        return losses.constant_normalized(each, labels, CONSTANT)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Completions(), batch_size=self.micro_batch)


def budget_windows(data: Completions, micro_batch: int, count: Any, budget: float) -> list[list[int]]:
    """The rows of each window an item budget closes (the epoch's end closes the last)."""
    windows: list[list[int]] = [[]]
    items = 0.0
    for start in range(0, len(data), micro_batch):
        rows = list(range(start, min(start + micro_batch, len(data))))
        windows[-1] += rows
        items += float(count({"labels": data.labels[rows]}))
        if items >= budget:
            windows.append([])
            items = 0.0
    return [window for window in windows if window]


def big_batch(normalization: str, windows: list[list[int]], data: Completions) -> nn.Module:
    """Plain PyTorch: one SGD step per window, its completions as one batch, combined as the name says."""
    net = copy.deepcopy(policy())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    for rows in windows:
        sums, lengths = [], []
        for row in rows:  # each completion alone: the policy is per token
            kept = data.labels[row] != IGNORE_INDEX
            inputs, labels = data.inputs[row][kept], data.labels[row][kept]
            sums.append(token_losses(net, inputs, labels, data.advantages[row]).sum())
            lengths.append(int(kept.sum()))
        total = torch.stack(sums)
        if normalization == "token mean":
            loss = total.sum() / sum(lengths)
        elif normalization == "sequence mean":
            loss = (total / torch.tensor(lengths)).mean()
        else:
            loss = total.sum() / CONSTANT
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return net


def difference(a: nn.Module, b: nn.Module) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max(float((p - q).detach().abs().max()) for p, q in pairs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="processes of the check's DDP cut (1: none)")
    options = parser.parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")  # Lightning's own use of torch's pytree
    data, failed = Completions(), False
    print("| normalization | steps | tokens per step | completions per step | off the big batch |")
    print("|---|---|---|---|---|")
    for name, settings in NORMALIZATIONS.items():
        module = PolicyModule(name)
        trainer = pl.Trainer(
            max_epochs=1,
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[GradientAccumulationCallback(**settings)],
        )
        trainer.fit(module)
        count = settings.get("budget_count_fn", settings["item_count_fn"])
        budget = settings["items_per_step"]
        windows = budget_windows(data, module.micro_batch, count, budget)
        tokens = [int((data.labels[w] != IGNORE_INDEX).sum()) for w in windows]
        off = difference(module.net, big_batch(name, windows, data))
        failed |= trainer.global_step != len(windows) or not off < 1e-6
        print(
            f"| {name} | {trainer.global_step} | {min(tokens)}-{max(tokens)} |"
            f" {min(map(len, windows))}-{max(map(len, windows))} | {off:.1e} |"
        )
    print()
    for name, settings in NORMALIZATIONS.items():
        batches = list(DataLoader(Completions(16), batch_size=4))
        result = check_step(PolicyModule(name), batches, settings, ranks=options.ranks)
        worst = max(result.yours.differences.values())
        verdict = "invariant" if result.invariant else "NOT invariant"
        print(f"check of the {name} step: {verdict} ({worst:.1e})")
        failed |= not result.invariant
    print()
    # the three bug shapes as users wrote them (verl #7225, NeMo Automodel #3846, tunix #1662), their settings
    bugs = {
        "entropy bonus per micro-batch": ("constant", NORMALIZATIONS["constant"]),
        "loss times the world size": ("token mean", NORMALIZATIONS["token mean"]),
        "sequence means weighted by tokens": ("sequence mean", NORMALIZATIONS["token mean"]),
    }
    for bug, (normalization, settings) in bugs.items():
        batches = list(DataLoader(Completions(16), batch_size=4))
        module = PolicyModule(normalization, bug=None if bug.startswith("sequence") else bug)
        result = check_step(module, batches, settings, ranks=options.ranks)
        cuts = ", ".join(f"{cut} {value:.1e}" for cut, value in result.yours.differences.items())
        suggested = ", ".join(s.name for s in result.suggestions) or "none"
        verdict = "flagged" if not result.invariant else "not flagged"
        print(f"check of a step with {bug}: {verdict} ({cuts}); invariant with: {suggested}")
        failed |= result.invariant and (options.ranks > 1 or "world" not in bug)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
