"""Sequences padded one per row or packed several per row, a per-token model, and the big-batch oracle.

Shared by the single-process tests (``tests/callback/test_normalizations.py``), the DDP run
(``tests/distributed/normalization_run.py``) and the tests of the step check. The model is per-token (an
embedding and a linear layer), so a sequence's token losses do not depend on what shares its row: the
oracle runs each sequence of a window alone, in plain PyTorch, and combines the window's token losses as
the normalization says, over every sequence the window holds (the data knows which, whatever the rows).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_gradacc import losses
from tests.helpers import ResumableLoader

VOCAB = 11
IGNORE = -100
NORMALIZER = 40.0  # the constant of "constant": about the target tokens of a window
# each normalization: the callback's settings for it, the loss the module returns under it
NORMALIZATIONS: dict[str, dict[str, Any]] = {
    "token_mean": {"scaling": "weighted", "item_count_fn": "lightning_gradacc.counters.count_tokens"},
    "sequence_mean": {"scaling": "weighted", "item_count_fn": "lightning_gradacc.counters.count_sequences"},
    "constant": {"scaling": "constant"},
}


@dataclass(frozen=True)
class Sequences:
    """Sequences (inputs, labels; some labels ignored) laid out in rows of equal width.

    Attributes:
        inputs: ``[rows, width]`` token ids.
        labels: ``[rows, width]``, ``-100`` at padding and at ignored positions.
        position_ids: ``[rows, width]``, restarting at 0 where a packed sequence starts.
        members: Each row's sequences (indices into ``sequences``).
        sequences: Each sequence's ``(inputs, labels)``.
    """

    inputs: Tensor
    labels: Tensor
    position_ids: Tensor
    members: list[list[int]]
    sequences: list[tuple[Tensor, Tensor]]


def make_sequences(rows: int, *, packed: bool, seed: int = 0) -> Sequences:
    """``rows`` rows: one sequence of 1-9 tokens each (``packed=False``), or up to 4 per row of 12."""
    generator = torch.Generator().manual_seed(seed)
    width = 12 if packed else 9
    inputs = torch.zeros(rows, width, dtype=torch.long)
    labels = torch.full((rows, width), IGNORE, dtype=torch.long)
    position_ids = torch.arange(width).repeat(rows, 1)
    members: list[list[int]] = []
    sequences: list[tuple[Tensor, Tensor]] = []
    for row in range(rows):
        members.append([])
        start = 0
        while start < width and (start == 0 or packed):
            length = int(torch.randint(1, 10, (), generator=generator))
            length = min(length, width - start)
            tokens = torch.randint(1, VOCAB, (length,), generator=generator)
            targets = torch.randint(0, VOCAB, (length,), generator=generator)
            targets[torch.rand(length, generator=generator) < 0.2] = IGNORE  # some positions ignored
            targets[0] = int(torch.randint(0, VOCAB, (), generator=generator))  # at least one target
            inputs[row, start : start + length] = tokens
            labels[row, start : start + length] = targets
            position_ids[row, start : start + length] = torch.arange(length)
            members[row].append(len(sequences))
            sequences.append((tokens, targets))
            start += length
            if packed and torch.rand((), generator=generator) < 0.2:
                break  # a row with padding at its end
        if packed and start < width:
            position_ids[row, start:] = torch.arange(width - start)  # padding: a segment with no target
    return Sequences(inputs, labels, position_ids, members, sequences)


class Rows(Dataset[dict[str, Tensor]]):
    """The rows as a dataset of mappings (Hugging Face's batch layout)."""

    def __init__(self, data: Sequences) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data.inputs)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        data = self.data
        return {
            "input_ids": data.inputs[index],
            "labels": data.labels[index],
            "position_ids": data.position_ids[index],
        }


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, 6), nn.Linear(6, VOCAB))


def token_losses(model: nn.Module, inputs: Tensor, labels: Tensor) -> Tensor:
    """Cross entropy at every position (0 where the label is ignored)."""
    logits = model(inputs)
    flat = nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE, reduction="none"
    )
    return flat.reshape(labels.shape)


class SequenceModule(pl.LightningModule):
    """Returns the loss of one normalization; ``bug`` writes it as the issues' users did.

    Bugs (each one a second factor between the update and the big batch):

    * ``"aux_per_micro_batch"``: an auxiliary term (here a logit penalty) averaged per micro-batch and
      added beside a token-summed loss divided by a constant: it arrives once per micro-batch;
    * ``"world_size"``: the token mean multiplied by the world size (to undo DDP's average) beside its
      local token count;
    * ``"token_weighted_sequence_mean"``: a mean of per-sequence means, weighted by tokens.
    """

    def __init__(
        self,
        data: Sequences,
        normalization: str,
        batch_size: int,
        *,
        bug: str | None = None,
        lr: float = 0.5,
        seed: int = 0,
        resumable: bool = False,
    ) -> None:
        super().__init__()
        self.net = net(seed)
        self.data, self.normalization, self.batch_size = data, normalization, batch_size
        self.bug, self.lr, self.resumable = bug, lr, resumable

    def on_train_epoch_start(self) -> None:
        if self.resumable:
            self.trainer.train_dataloader.consumed = 0

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        if self.resumable:  # the loader skips what was consumed when it resumes mid-epoch
            self.trainer.train_dataloader.consumed += 1
        labels = batch["labels"]
        token = token_losses(self.net, batch["input_ids"], labels)
        if self.bug == "world_size":
            return losses.token_mean(token, labels) * self.trainer.world_size
        if self.bug == "aux_per_micro_batch":
            penalty = self.net(batch["input_ids"]).pow(2).mean()  # a mean over this micro-batch's positions
            return losses.constant_normalized(token, labels, NORMALIZER) + 0.1 * penalty
        if self.normalization == "token_mean":
            return losses.token_mean(token, labels)
        if self.normalization == "sequence_mean":
            return losses.sequence_mean(token, labels, position_ids=batch["position_ids"])
        return losses.constant_normalized(token, labels, NORMALIZER)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader[Any]:
        rows, trainer = Rows(self.data), self._trainer
        loader = ResumableLoader if self.resumable else DataLoader
        if trainer is not None and trainer.world_size > 1:  # rank r reads rows r, r + R, ...
            sampler = DistributedSampler(rows, trainer.world_size, trainer.global_rank, shuffle=False)
            return loader(rows, batch_size=self.batch_size, sampler=sampler)
        return loader(rows, batch_size=self.batch_size, shuffle=False)


def settings(normalization: str) -> dict[str, Any]:
    """The callback's arguments for a normalization (the counter imported from its path)."""
    chosen = dict(NORMALIZATIONS[normalization])
    path = chosen.get("item_count_fn")
    if isinstance(path, str):
        module, _, name = path.rpartition(".")
        chosen["item_count_fn"] = getattr(__import__(module, fromlist=[name]), name)
    return chosen


def window_loss(model: nn.Module, data: Sequences, rows: Sequence[int], normalization: str) -> Tensor:
    """The big batch's loss of the window holding ``rows``: each sequence run alone, combined as meant."""
    sums, counts = [], []
    for row in rows:
        for index in data.members[row]:
            tokens, targets = data.sequences[index]
            kept = targets != IGNORE
            each = token_losses(model, tokens, targets)
            sums.append(each[kept].sum())
            counts.append(int(kept.sum()))
    if normalization == "token_mean":
        return torch.stack(sums).sum() / sum(counts)
    if normalization == "sequence_mean":
        return torch.stack([s / c for s, c in zip(sums, counts, strict=True) if c]).mean()
    return torch.stack(sums).sum() / NORMALIZER


def big_batch(
    data: Sequences,
    windows: Sequence[Sequence[int]],
    normalization: str,
    lr: float = 0.5,
    max_grad_norm: float | None = None,
) -> nn.Module:
    """Plain PyTorch: one SGD step per window on the window's sequences as one batch (clipped by norm)."""
    reference = copy.deepcopy(net())
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    for rows in windows:
        optimizer.zero_grad()
        window_loss(reference, data, rows, normalization).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), max_grad_norm)
        optimizer.step()
    return reference


def row_windows(rows: int, per_window: int) -> list[list[int]]:
    """Windows of ``per_window`` consecutive rows (the last one shorter)."""
    return [list(range(start, min(start + per_window, rows))) for start in range(0, rows, per_window)]


def budget_windows(
    data: Sequences,
    rows_per_micro_batch: int,
    normalization: str,
    budget: float,
    epochs: int = 1,
    counts: str | None = None,
) -> list[list[int]]:
    """The windows an item budget closes: micro-batches of rows (all ranks' together) until their items
    reach ``budget``; an epoch's end closes the last. Items (``counts``): ``"tokens"`` (target tokens) or
    ``"sequences"``; by default sequences for sequence mean, else tokens."""
    counts = counts or ("sequences" if normalization == "sequence_mean" else "tokens")
    rows = len(data.inputs)
    windows: list[list[int]] = []
    for _ in range(epochs):
        window: list[int] = []
        items = 0
        for start in range(0, rows, rows_per_micro_batch):
            chunk = list(range(start, min(start + rows_per_micro_batch, rows)))
            window += chunk
            if counts == "sequences":  # sequences with a target (every one here has one)
                items += sum(len(data.members[row]) for row in chunk)
            else:
                items += int((data.labels[chunk] != IGNORE).sum())
            if items >= budget:
                windows.append(window)
                window, items = [], 0
        if window:
            windows.append(window)
    return windows


def budget_settings(normalization: str, budget: int) -> dict[str, Any]:
    """The normalization's settings with an item budget: tokens, or sequences for sequence mean."""
    chosen = settings(normalization)
    if "item_count_fn" not in chosen:  # "constant": the budget counts target tokens
        from lightning_gradacc.counters import count_tokens

        chosen["item_count_fn"] = count_tokens
    return {**chosen, "items_per_step": budget}


BUDGETS = {"token_mean": 30, "sequence_mean": 6, "constant": 30}


def difference(module: nn.Module, reference: nn.Module) -> float:
    return max(
        (a - b).abs().max().item() for a, b in zip(module.parameters(), reference.parameters(), strict=True)
    )
