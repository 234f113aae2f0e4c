"""A Hugging Face causal LM trained through Lightning equals one big batch per window.

``GPT2LMHeadModel(labels=...)`` shifts the labels inside the model: position t predicts label t + 1, so
the first label of every sequence is never a target and the loss is a mean over ``labels[:, 1:]``. The
item count of ``scaling="weighted"`` must count those predicted tokens (``count_predicted_tokens``);
``count_tokens`` counts one token too many per sequence and weights the micro-batches wrongly.

The reference is plain PyTorch: per window, ``model(**big_batch).loss.backward()`` on the window's
sequences concatenated (right-padded to the longest), then one SGD step.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_gradacc import GradientAccumulationCallback
from lightning_gradacc.counters import IGNORE_INDEX, TokenCounter, count_predicted_tokens, count_tokens
from tests import helpers as h

VOCAB = 64
BATCH = 2  # sequences per micro-batch
NUM_SEQUENCES = 20  # 10 micro-batches: windows of 4, 4 and 2 (a partial window) per epoch
K = 4
EPOCHS = 2
LR = 0.5
# Measured max |parameter - reference|: 6.0e-8 (float32 rounding) counting the predicted tokens, 1.0e-2
# with `count_tokens`, 7.4e-2 with Lightning's `accumulate_grad_batches=4`.
TOLERANCE = 1e-6


@functools.cache
def _initial_model() -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        loss_type="ForCausalLM",
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def tiny_gpt2() -> GPT2LMHeadModel:
    """A random 2-layer GPT-2 without dropout, the same weights on every call."""
    return copy.deepcopy(_initial_model())


def sequences() -> list[Tensor]:
    """Token sequences of 2 to 12 tokens: micro-batches hold very different numbers of predicted tokens."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 13, (NUM_SEQUENCES,), generator=generator)
    return [torch.randint(0, VOCAB, (int(n),), generator=generator) for n in lengths]


def collate(batch: list[Tensor], ignore_index: int = IGNORE_INDEX) -> dict[str, Tensor]:
    """Right-pad to the longest sequence; labels are the inputs (HF shifts them), ``ignore_index`` pads."""
    length = max(len(ids) for ids in batch)
    input_ids = torch.zeros(len(batch), length, dtype=torch.long)
    attention_mask = torch.zeros(len(batch), length, dtype=torch.long)
    labels = torch.full((len(batch), length), ignore_index, dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, : len(ids)] = ids
        attention_mask[row, : len(ids)] = 1
        labels[row, : len(ids)] = ids
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def hf_loss(model: GPT2LMHeadModel, batch: dict[str, Tensor], ignore_index: int) -> Tensor:
    # HF's loss takes `ignore_index` as a keyword; -100 is its default.
    extra = {} if ignore_index == IGNORE_INDEX else {"ignore_index": ignore_index}
    loss: Tensor = model(**batch, **extra).loss
    return loss


class CausalLMModule(pl.LightningModule):
    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        super().__init__()
        self.model = tiny_gpt2()
        self.ignore_index = ignore_index

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return hf_loss(self.model, batch, self.ignore_index)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=LR)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(
            sequences(),  # type: ignore[arg-type]
            batch_size=BATCH,
            collate_fn=functools.partial(collate, ignore_index=self.ignore_index),
        )


@functools.cache
def big_batch_reference(
    ignore_index: int = IGNORE_INDEX, windows: tuple[tuple[int, ...], ...] | None = None
) -> GPT2LMHeadModel:
    """Per window (K micro-batches by default, else ``windows``), HF's loss of its rows, one SGD step."""
    model = tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = sequences()
    for window in windows or h.windows(NUM_SEQUENCES // BATCH, K, epochs=EPOCHS):
        rows = [data[b * BATCH + i] for b in window for i in range(BATCH)]
        optimizer.zero_grad()
        hf_loss(model, collate(rows, ignore_index), ignore_index).backward()
        optimizer.step()
    return model


def fit(
    item_count_fn: Callable[[Any], Any], ignore_index: int = IGNORE_INDEX
) -> tuple[CausalLMModule, GradientAccumulationCallback]:
    module = CausalLMModule(ignore_index)
    callback = GradientAccumulationCallback(K, scaling="weighted", item_count_fn=item_count_fn)
    h.trainer(callbacks=[callback], max_epochs=EPOCHS).fit(module)
    return module, callback


def test_hf_loss_is_the_mean_over_the_predicted_tokens() -> None:
    """The convention itself: HF's loss times `count_predicted_tokens` is the sum over labels[:, 1:]."""
    model = tiny_gpt2()
    batch = collate(sequences()[:BATCH])
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    summed = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1), reduction="sum"
    )
    loss = model(**batch).loss
    torch.testing.assert_close(loss * count_predicted_tokens(batch), summed)
    assert count_tokens(batch) - count_predicted_tokens(batch) == BATCH  # one first label per sequence


@pytest.mark.parametrize(
    "counter", [count_predicted_tokens, TokenCounter(shift=True)], ids=["count_predicted_tokens", "shift"]
)
def test_counting_predicted_tokens_equals_the_big_batch(counter: Callable[[Any], Any]) -> None:
    module, callback = fit(counter)
    assert h.max_abs_diff(module.model, big_batch_reference()) <= TOLERANCE
    assert callback.stats.windows == 3 * EPOCHS
    data = sequences()
    last_window = data[8 * BATCH :]  # micro-batches 8 and 9
    assert callback.stats.items_last_step == sum(len(ids) - 1 for ids in last_window)


def test_a_budget_of_predicted_tokens_steps_the_big_batch_of_each_window() -> None:
    """Steps of at least 24 predicted tokens: windows of 2, 3, 2, 2 and 1 micro-batches (the epoch's tail)."""
    data = sequences()
    counts = [count_predicted_tokens(collate(data[b * BATCH : (b + 1) * BATCH])) for b in range(10)]
    assert [int(count) for count in counts] == [19, 6, 13, 6, 16, 15, 9, 16, 17, 22]
    module = CausalLMModule()
    callback = GradientAccumulationCallback(
        items_per_step=24, scaling="weighted", item_count_fn=count_predicted_tokens
    )
    trainer = h.trainer(callbacks=[callback], max_epochs=EPOCHS)
    trainer.fit(module)
    windows = ((0, 1), (2, 3, 4), (5, 6), (7, 8), (9,))
    assert trainer.global_step == len(windows) * EPOCHS
    expected = big_batch_reference(windows=windows * EPOCHS)
    assert h.max_abs_diff(module.model, expected) <= TOLERANCE  # measured: 1.2e-7
    assert callback.items_consumed == sum(counts) * EPOCHS
    # the control: K=3 windows of the same micro-batches are other big batches (1.0e-1 off)
    assert (
        h.max_abs_diff(
            module.model, big_batch_reference(windows=((0, 1, 2), (3, 4, 5), (6, 7, 8), (9,)) * EPOCHS)
        )
        > 1e-3
    )


def test_each_sequence_as_its_own_piece_equals_the_big_batch() -> None:
    """``piece_size=1``: every sequence its own forward and backward (padded to its batch's longest), its
    loss HF's mean over its predicted tokens, weighted by their share of the batch's: the same windows."""
    module = CausalLMModule()
    callback = GradientAccumulationCallback(
        K, scaling="weighted", item_count_fn=count_predicted_tokens, piece_size=1
    )
    h.trainer(callbacks=[callback], max_epochs=EPOCHS).fit(module)
    assert h.max_abs_diff(module.model, big_batch_reference()) <= TOLERANCE
    assert callback.stats.total_micro_batches == NUM_SEQUENCES // BATCH * EPOCHS


def test_count_tokens_is_off_for_a_model_that_shifts_its_labels() -> None:
    """Why the shifted counter exists: counting every label weights the micro-batches wrongly."""
    module, _ = fit(count_tokens)
    assert h.max_abs_diff(module.model, big_batch_reference()) > 1e-3


def test_custom_ignore_index_with_shift() -> None:
    ignore_index = -1
    module, _ = fit(TokenCounter(ignore_index=ignore_index, shift=True), ignore_index)
    assert h.max_abs_diff(module.model, big_batch_reference(ignore_index)) <= TOLERANCE


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


class FusedAdamWModule(CausalLMModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return adamw(self.model.parameters())


@functools.cache
def adamw_reference() -> GPT2LMHeadModel:
    reference = tiny_gpt2()
    optimizer = adamw(reference.parameters())
    data = sequences()
    for window in h.windows(NUM_SEQUENCES // BATCH, K, epochs=EPOCHS):
        rows = [data[b * BATCH + i] for b in window for i in range(BATCH)]
        optimizer.zero_grad()
        hf_loss(reference, collate(rows), IGNORE_INDEX).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        optimizer.step()
    return reference


@pytest.mark.parametrize(
    "counter", [count_predicted_tokens, count_tokens], ids=["predicted", "wrong_counter"]
)
def test_fused_adamw_with_clipping_equals_the_big_batch_decided_on_the_device(counter: Any) -> None:
    """The language-model user's setup: AdamW(fused=True), clipping, token weighting, all on the device."""
    module = FusedAdamWModule()
    callback = GradientAccumulationCallback(K, scaling="weighted", item_count_fn=counter, max_grad_norm=0.5)
    h.trainer(callbacks=[callback], max_epochs=EPOCHS, log_every_n_steps=100).fit(module)
    assert callback.accumulator is not None and callback.accumulator.device_step is not None
    difference = h.max_abs_diff(module.model, adamw_reference())
    # Adam divides by sqrt(v): the float32 rounding of near-zero gradient elements (micro- vs big-batch
    # sums) grows to 2.2e-5 here, 3.7e-5 on the host path with a non-fused AdamW
    if counter is count_predicted_tokens:
        assert difference < 5e-5
        assert callback.stats.clipped_steps == 3 * EPOCHS
    else:  # one token too many per sequence: the window's tokens weighted wrongly
        assert difference > 1e-3


# ------------------------------------------------- a token-keyed warmup resumed from inside its windows

WARMUP = {0: 1, 50: 2, 150: 4}  # predicted tokens consumed -> K


class ResumableCausalLM(CausalLMModule):
    """The causal LM with SGD and torchdata's `StatefulDataLoader` (it resumes mid-epoch)."""

    def train_dataloader(self) -> DataLoader[Any]:
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(sequences(), batch_size=BATCH, collate_fn=collate)  # type: ignore[arg-type]


def warmup_windows() -> list[tuple[list[int], int]]:
    """The warmup's windows (micro-batch indices per epoch) with their K, counting predicted tokens."""
    data = sequences()

    def tokens(b: int) -> float:
        return float(count_predicted_tokens(collate(data[b * BATCH : (b + 1) * BATCH])))

    return h.keyed_windows(WARMUP, NUM_SEQUENCES // BATCH, epochs=EPOCHS, unit="items", items=tokens)


@functools.cache
def warmup_reference() -> GPT2LMHeadModel:
    """One SGD step per window on its big batch, with lr x sqrt(K / 1)."""
    model = tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = sequences()
    for window, k in warmup_windows():
        rows = [data[b * BATCH + i] for b in window for i in range(BATCH)]
        optimizer.zero_grad()
        hf_loss(model, collate(rows), IGNORE_INDEX).backward()
        optimizer.param_groups[0]["lr"] = LR * k**0.5
        optimizer.step()
    return model


def _save_points() -> list[int]:
    """Global micro-batches inside a window: the first window of K=2, of K=4, and the next window of 4."""
    per_epoch, epoch, starts = NUM_SEQUENCES // BATCH, -1, []
    for window, k in warmup_windows():
        epoch += window[0] == 0
        starts.append((epoch * per_epoch + window[0], len(window), k))
    first = {k: next(start for start, _, kk in starts if kk == k) for k in (2, 4)}
    later = next(start for start, length, _ in starts if start > first[4] and length == 4)
    return [first[2], first[4] + 1, later + 2]


@pytest.mark.parametrize("at", _save_points())
def test_a_token_keyed_warmup_resumes_exactly_from_inside_a_window(tmp_path: Any, at: int) -> None:
    """The language-model user's warmup (`count_predicted_tokens`, `lr_scaling="sqrt"`), preempted inside a
    window at three points and resumed from the checkpoint: the big batch of every window, with its K."""

    def callback() -> GradientAccumulationCallback:
        return GradientAccumulationCallback(
            WARMUP,
            schedule_unit="items",
            scaling="weighted",
            item_count_fn=count_predicted_tokens,
            lr_scaling="sqrt",
        )

    path = tmp_path / "mid.ckpt"
    h.preempt(ResumableCausalLM(), [callback()], at, path, max_epochs=EPOCHS)
    resumed = ResumableCausalLM()
    h.trainer(callbacks=[callback()], max_epochs=EPOCHS).fit(resumed, ckpt_path=path)
    assert {k for _, k in warmup_windows()} == {1, 2, 4}
    assert h.max_abs_diff(resumed.model, warmup_reference()) <= TOLERANCE
