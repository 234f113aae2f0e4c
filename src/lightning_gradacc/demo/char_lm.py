"""A character-level language model on bundled public-domain poems, one padded line per sequence.

Lines have 23 to 52 characters, so micro-batches hold very different numbers of real tokens: the case
where averaging per-micro-batch means (Lightning's built-in accumulation) is not the big-batch update.
"""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torchmetrics.text import Perplexity
from typing_extensions import override

if TYPE_CHECKING:  # the bodies are checked as pytorch_lightning classes; plain mixins at run time
    from pytorch_lightning import LightningDataModule as _LightningDataModuleBase
    from pytorch_lightning import LightningModule as _LightningModuleBase
else:
    _LightningDataModuleBase = object
    _LightningModuleBase = object

from ..counters import IGNORE_INDEX

PAD, BOS, EOS, UNKNOWN = 0, 1, 2, 3
_FIRST_CHAR = 4
# Printable ASCII: every character of the bundled text, and a fixed vocabulary for any other text.
_CHARS = "".join(chr(code) for code in range(32, 127))
VOCAB_SIZE = _FIRST_CHAR + len(_CHARS)


def encode(line: str) -> list[int]:
    """Character ids of ``line`` (unknown characters map to one id).

    Example:
        >>> encode("Hi")
        [44, 77]
    """
    return [_FIRST_CHAR + _CHARS.index(c) if c in _CHARS else UNKNOWN for c in line]


def load_lines(name: str = "poems.txt") -> list[str]:
    """Non-empty lines of a text bundled in ``lightning_gradacc/demo/data``."""
    text = resources.files("lightning_gradacc.demo").joinpath("data", name).read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def collate_lines(sequences: list[list[int]]) -> dict[str, Tensor]:
    """Pad a batch of id lists: inputs ``[BOS] + ids``, labels ``ids + [EOS]``, padding labels ignored."""
    length = max(len(ids) for ids in sequences) + 1
    input_ids = torch.full((len(sequences), length), PAD, dtype=torch.long)
    labels = torch.full((len(sequences), length), IGNORE_INDEX, dtype=torch.long)
    for row, ids in enumerate(sequences):
        input_ids[row, : len(ids) + 1] = torch.tensor([BOS, *ids])
        labels[row, : len(ids) + 1] = torch.tensor([*ids, EOS])
    return {"input_ids": input_ids, "labels": labels}


class _CharTextData(_LightningDataModuleBase):
    """Lines of a bundled text as variable-length sequences (padded per batch).

    Args:
        text: File name under ``lightning_gradacc/demo/data``.
        batch_size: Lines per micro-batch.
        val_every: Every ``val_every``-th line is held out for validation.
        seed: Seed of the shuffling.
    """

    def __init__(
        self, text: str = "poems.txt", batch_size: int = 4, val_every: int = 8, seed: int = 0
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        lines = [encode(line) for line in load_lines(text)]
        self.train_lines = [ids for index, ids in enumerate(lines) if index % val_every]
        self.val_lines = [ids for index, ids in enumerate(lines) if not index % val_every]
        self.batch_size = batch_size
        self.seed = seed

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            self.train_lines,  # type: ignore[arg-type]
            batch_size=self.batch_size,
            shuffle=True,
            generator=generator,
            collate_fn=collate_lines,
        )

    @override
    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.val_lines, batch_size=16, collate_fn=collate_lines)  # type: ignore[arg-type]


class _CharLM(_LightningModuleBase):
    """Embedding, GRU and a linear head; loss is the mean over real (non-padding) tokens.

    Args:
        embed_dim: Character embedding size.
        hidden: GRU width.
        lr: Adam learning rate.
    """

    def __init__(self, embed_dim: int = 32, hidden: int = 128, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(VOCAB_SIZE, embed_dim, padding_idx=PAD)
        self.rnn = nn.GRU(embed_dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB_SIZE)
        self.lr = lr
        self.val_perplexity = Perplexity(ignore_index=IGNORE_INDEX)

    @override
    def forward(self, input_ids: Tensor) -> Tensor:
        hidden, _ = self.rnn(self.embed(input_ids))
        logits: Tensor = self.head(hidden)
        return logits

    def _loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        logits = self(batch["input_ids"])
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB_SIZE), batch["labels"].reshape(-1), ignore_index=IGNORE_INDEX
        )
        return loss, logits

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss, _ = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=len(batch["labels"]))
        return loss

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss, logits = self._loss(batch)
        self.val_perplexity(logits, batch["labels"])
        self.log("val_loss", loss, batch_size=len(batch["labels"]))
        self.log("val_perplexity", self.val_perplexity, prog_bar=True, batch_size=len(batch["labels"]))

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class CharTextDataModule(_CharTextData, pl.LightningDataModule):  # noqa: D101  (the body's docstring: its Args feed the CLI's help)
    __doc__ = _CharTextData.__doc__


class CharLMModule(_CharLM, pl.LightningModule):  # noqa: D101  (the body's docstring: its Args feed the CLI's help)
    __doc__ = _CharLM.__doc__
