"""Fine-tune a causal language model with gradient accumulation: the whole path, in one file.

    python examples/lm_finetune.py                    # a tiny random GPT-2: offline, about 10 s on a CPU
    python examples/lm_finetune.py                    # again after a preemption: resumes where it stopped
    python examples/lm_finetune.py --model_name gpt2  # a real checkpoint (downloads it)
    lightning-gradacc fit --config examples/lm_finetune.yaml --ckpt_path last   # the same run from YAML

What it puts together, each piece the package's:

- padded sequences whose padding labels are -100, and a Hugging Face model that shifts the labels itself:
  ``scaling="weighted"`` with ``count_predicted_tokens`` makes every optimizer step the step of one big
  batch of all the window's predicted tokens (Lightning's built-in averages per-micro-batch means);
- a batch-size warmup keyed by tokens (K=2, then 4 after 4,000 tokens) with the learning rate following K
  (``lr_scaling="sqrt"``), and a warmup-and-cosine learning-rate schedule over a token budget
  (``lr_schedule``): the same learning rate per token whatever K runs;
- the gradient noise scale, logged with every statistic to TensorBoard (``grad_accum/*``);
- preemption: a cluster's SIGTERM (or any exception) ends the run after the current micro-batch, and
  ``OnExceptionCheckpoint`` saves a checkpoint holding the open window and torchdata's
  ``StatefulDataLoader`` position. The same command again resumes from the newest checkpoint (Lightning's
  ``ckpt_path="last"``: the preempted one, or ``ModelCheckpoint``'s last), exactly where the window was.

It is written for ``import lightning as L`` (``lightning.pytorch``); for ``pytorch_lightning`` change the
imports: the callback is ``lightning_gradacc.GradientAccumulationCallback`` there.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from lightning_gradacc import TokenSchedule
from lightning_gradacc.counters import IGNORE_INDEX, count_predicted_tokens
from lightning_gradacc.demo.char_lm import load_lines
from lightning_gradacc.lightning import GradientAccumulationCallback

BYTES = 256  # the tiny model reads UTF-8 bytes: ids 1..256, 0 pads


def pad_and_mask(sequences: list[list[int]], pad_id: int = 0) -> dict[str, Tensor]:
    """Right-pad to the longest sequence; the labels are the inputs (the model shifts them), -100 on pads."""
    length = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(sequences), length, dtype=torch.long)
    labels = torch.full((len(sequences), length), IGNORE_INDEX, dtype=torch.long)
    for row, ids in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.tensor(ids)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class LineData(L.LightningDataModule):
    """One line of a text per sequence: the package's bundled poems, or a file of yours.

    Args:
        text: A file name bundled with the package (``poems.txt``) or a path.
        batch_size: Sequences per micro-batch.
        model_name: The tokenizer's checkpoint; ``None``: UTF-8 bytes (the tiny model's vocabulary).
        max_length: Tokens per sequence at most.
        val_lines: Lines held out for validation.
    """

    def __init__(
        self,
        text: str = "poems.txt",
        batch_size: int = 4,
        model_name: str | None = None,
        max_length: int = 64,
        val_lines: int = 8,
    ) -> None:
        super().__init__()
        self.batch_size, self.val_lines = batch_size, val_lines
        lines = Path(text).read_text().splitlines() if Path(text).is_file() else load_lines(text)
        if model_name is None:
            encoded = [[byte + 1 for byte in line.encode()] for line in lines if line.strip()]
            self.pad_id = 0
        else:
            tokenizer = AutoTokenizer.from_pretrained(model_name)
            encoded = [tokenizer(line)["input_ids"] for line in lines if line.strip()]
            self.pad_id = tokenizer.pad_token_id or tokenizer.eos_token_id or 0
        self.sequences = [ids[:max_length] for ids in encoded if len(ids) > 1]

    def collate(self, sequences: list[list[int]]) -> dict[str, Tensor]:
        return pad_and_mask(sequences, self.pad_id)

    def train_dataloader(self) -> DataLoader[Any]:
        # it saves its position: a resume continues with the next micro-batch, not the epoch's first
        train = self.sequences[self.val_lines :]
        return StatefulDataLoader(train, batch_size=self.batch_size, shuffle=True, collate_fn=self.collate)  # type: ignore[arg-type]

    def val_dataloader(self) -> DataLoader[Any]:
        val = self.sequences[: self.val_lines]
        return DataLoader(val, batch_size=self.batch_size, collate_fn=self.collate)  # type: ignore[arg-type]


class CausalLM(L.LightningModule):
    """A Hugging Face causal LM, trained on ``model(**batch).loss`` (a mean over the predicted tokens).

    Args:
        model_name: A checkpoint (``"gpt2"``); ``None``: a tiny random GPT-2 over bytes, made from a seed.
        lr: The peak learning rate of AdamW (``lr_schedule`` warms it up and decays it by tokens).
        weight_decay: AdamW's.
    """

    def __init__(self, model_name: str | None = None, lr: float = 1e-3, weight_decay: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        if model_name is None:
            config = GPT2Config(
                vocab_size=BYTES + 1,
                n_positions=128,
                n_embd=64,
                n_layer=2,
                n_head=2,
                bos_token_id=0,
                eos_token_id=0,
                resid_pdrop=0.0,  # no dropout: the run can be checked against a plain loop (the tests do)
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                loss_type="ForCausalLM",
            )
            self.model: Any = GPT2LMHeadModel(config)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_name)
        self.lr, self.weight_decay = lr, weight_decay

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss: Tensor = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss, batch_size=len(batch["input_ids"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)


def accumulation() -> GradientAccumulationCallback:
    """The callback of the recipe (``examples/lm_finetune.yaml`` writes the same)."""
    return GradientAccumulationCallback(
        {0: 2, "4k": 4},  # K by tokens consumed: 2, then 4
        schedule_unit="items",
        scaling="weighted",
        item_count_fn=count_predicted_tokens,  # HF shifts the labels: count what is predicted
        lr_scaling="sqrt",  # the learning rate times sqrt(K / 2)
        lr_schedule=TokenSchedule(total="12k", warmup="2k", decay="cosine", final=0.1),
        noise_scale=True,
        max_grad_norm=1.0,
    )


def trainer(root: Path, *callbacks: L.Callback, **options: Any) -> L.Trainer:
    """A Trainer that logs to TensorBoard under ``root`` and saves a checkpoint when the run is stopped.

    Its checkpoints go to ``root/lm_finetune/checkpoints`` (the YAML twin's to ``logs/lm_finetune_yaml/``:
    neither resumes from the other's finished run).
    """
    checkpoints = root / "lm_finetune" / "checkpoints"
    return L.Trainer(
        **{
            "max_epochs": 6,
            "log_every_n_steps": 5,
            "accelerator": "cpu",
            "enable_progress_bar": False,
            **options,
        },
        logger=TensorBoardLogger(root, name="lm_finetune"),
        callbacks=[
            accumulation(),
            # SIGTERM (Lightning turns it into an exception after the current micro-batch) or a crash: save
            # the open window too, under a name the resume command can find
            OnExceptionCheckpoint(checkpoints, filename="preempted"),
            ModelCheckpoint(checkpoints, save_last=True),
            *callbacks,
        ],
    )


def main(argv: list[str] | None = None, *callbacks: L.Callback) -> L.Trainer:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_name", default=None, help="a Hugging Face checkpoint (default: tiny random)")
    parser.add_argument("--ckpt_path", default="last", help="resume from it (default: the newest, if any)")
    parser.add_argument("--root", default="logs", help="where logs and checkpoints go")
    parser.add_argument("--max_epochs", type=int, default=6)
    args = parser.parse_args(argv)
    fit = trainer(Path(args.root), *callbacks, max_epochs=args.max_epochs)
    module, data = CausalLM(args.model_name), LineData(model_name=args.model_name)
    fit.fit(module, datamodule=data, ckpt_path=args.ckpt_path)
    if fit.is_global_zero:
        callback = next(c for c in fit.callbacks if isinstance(c, GradientAccumulationCallback))
        print(callback.summary(), flush=True)
    return fit


if __name__ == "__main__":
    main()
