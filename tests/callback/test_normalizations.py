"""Each normalization steps the big batch of its window however the window is cut (one process).

Token mean, sequence mean (packed rows told apart by ``position_ids``) and a constant normaliser, each as
the loss of its contract (``lightning_gradacc.losses``) with the callback's settings for it: micro-batches
of 1, 2 and 8 rows, padded and packed rows, one-row pieces, a short last window; each against the
plain-PyTorch big batch of the window's sequences (``tests/normalization_cases.py``). Two ranks run in
``tests/distributed/test_normalizations.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pytorch_lightning.callbacks import EMAWeightAveraging
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from lightning_gradacc import GradientAccumulationCallback, estimated_stepping_batches
from lightning_gradacc.counters import count_tokens
from tests import helpers as h
from tests import normalization_cases as cases

ROWS = 40  # windows of 16 rows: 16, 16 and a short 8
PER_WINDOW = 16


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("normalization", list(cases.NORMALIZATIONS))
@pytest.mark.parametrize("micro_batch", [1, 2, 8])
def test_the_window_is_its_big_batch_whatever_the_micro_batch(
    normalization: str, packed: bool, micro_batch: int
) -> None:
    data = cases.make_sequences(ROWS, packed=packed)
    module = cases.SequenceModule(data, normalization, micro_batch)
    callback = GradientAccumulationCallback(PER_WINDOW // micro_batch, **cases.settings(normalization))
    h.fit(module, callback)
    expected = cases.big_batch(data, cases.row_windows(ROWS, PER_WINDOW), normalization)
    assert cases.difference(module.net, expected) < 1e-6


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("normalization", list(cases.NORMALIZATIONS))
def test_pieces_of_one_row_step_the_same_big_batch(normalization: str, packed: bool) -> None:
    data = cases.make_sequences(ROWS, packed=packed)
    module = cases.SequenceModule(data, normalization, 8)
    callback = GradientAccumulationCallback(2, piece_size=1, **cases.settings(normalization))
    h.fit(module, callback)
    expected = cases.big_batch(data, cases.row_windows(ROWS, PER_WINDOW), normalization)
    assert cases.difference(module.net, expected) < 1e-6


@pytest.mark.parametrize(
    ("normalization", "wrong"),
    [("token_mean", "mean"), ("sequence_mean", "token_mean"), ("constant", "mean")],
)
def test_another_mode_misses_the_big_batch(normalization: str, wrong: str) -> None:
    """The negative controls: the loss of one contract under another mode's settings is off.

    (``"sum"`` equals ``"constant"`` on one rank; two ranks tell them apart.)
    """
    data = cases.make_sequences(ROWS, packed=True)
    module = cases.SequenceModule(data, normalization, 2)
    settings = {"scaling": wrong} if wrong in ("mean", "sum") else cases.settings(wrong)
    h.fit(module, GradientAccumulationCallback(PER_WINDOW // 2, **settings))
    expected = cases.big_batch(data, cases.row_windows(ROWS, PER_WINDOW), normalization)
    assert cases.difference(module.net, expected) > 1e-3


# ------------------------------------------------------------------------------------- item budgets


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("normalization", list(cases.NORMALIZATIONS))
@pytest.mark.parametrize("micro_batch", [1, 2, 8])
def test_an_item_budget_closes_each_window_as_its_big_batch(
    normalization: str, packed: bool, micro_batch: int
) -> None:
    """Windows close at the first micro-batch whose items reach the budget, over 2 epochs (tails closed)."""
    data = cases.make_sequences(ROWS, packed=packed)
    budget = cases.BUDGETS[normalization]
    module = cases.SequenceModule(data, normalization, micro_batch)
    callback = GradientAccumulationCallback(**cases.budget_settings(normalization, budget))
    trainer = h.fit(module, callback, max_epochs=2)
    windows = cases.budget_windows(data, micro_batch, normalization, budget, epochs=2)
    assert trainer.global_step == len(windows)
    assert cases.difference(module.net, cases.big_batch(data, windows, normalization)) < 1e-6


@pytest.mark.parametrize("micro_batch", [1, 2])
def test_a_token_budget_steps_the_big_batch_of_sequence_means(micro_batch: int) -> None:
    """``budget_count_fn``: steps of about 30 tokens, each the mean over its sequences (an RL recipe)."""
    data = cases.make_sequences(ROWS, packed=True)
    module = cases.SequenceModule(data, "sequence_mean", micro_batch)
    settings = {**cases.settings("sequence_mean"), "items_per_step": 30, "budget_count_fn": count_tokens}
    callback = GradientAccumulationCallback(**settings)
    trainer = h.fit(module, callback, max_epochs=2)
    windows = cases.budget_windows(data, micro_batch, "sequence_mean", 30, epochs=2, counts="tokens")
    assert trainer.global_step == len(windows)
    assert cases.difference(module.net, cases.big_batch(data, windows, "sequence_mean")) < 1e-6
    assert callback.items_consumed == 2 * int((data.labels != cases.IGNORE).sum())  # tokens, not sequences
    # the control: the budget counted in sequences (the weights' count) closes other windows
    in_sequences = cases.budget_windows(data, micro_batch, "sequence_mean", 30, epochs=2, counts="sequences")
    assert cases.difference(module.net, cases.big_batch(data, in_sequences, "sequence_mean")) > 1e-3


def test_the_steps_of_a_token_budget_over_samples_are_not_estimated_as_samples() -> None:
    """Weighted by samples, closed on tokens: the steps follow the tokens, so only a bound is given."""
    data = cases.make_sequences(ROWS, packed=False)
    callback = GradientAccumulationCallback(items_per_step=30, budget_count_fn=count_tokens)
    trainer = h.fit(cases.SequenceModule(data, "token_mean", 2), callback)
    with pytest.raises(ValueError, match="`item_count_fn` or `budget_count_fn` counts them"):
        estimated_stepping_batches(trainer)
    assert estimated_stepping_batches(trainer, most=True) == ROWS // 2  # one step per micro-batch
    assert trainer.global_step == len(cases.budget_windows(data, 2, "token_mean", 30))


def test_a_budget_counter_without_a_budget_or_beside_an_unused_item_counter_is_refused() -> None:
    with pytest.raises(ValueError, match="`budget_count_fn` counts what `items_per_step` closes"):
        GradientAccumulationCallback(4, budget_count_fn=count_tokens)
    with pytest.raises(TypeError, match="`budget_count_fn` to be callable"):
        GradientAccumulationCallback(items_per_step=10, budget_count_fn=10)
    with pytest.raises(ValueError, match="`item_count_fn` counts nothing here: `budget_count_fn` counts"):
        GradientAccumulationCallback(
            items_per_step=10, scaling="constant", item_count_fn=count_tokens, budget_count_fn=count_tokens
        )


@pytest.mark.parametrize("at", [1, 2, 5, 13])  # inside windows of epoch 1, and one in epoch 2
def test_a_resume_inside_a_budget_window_goes_on_exactly(tmp_path: Path, at: int) -> None:
    data = cases.make_sequences(ROWS, packed=True)
    settings = cases.budget_settings("token_mean", 30)
    path = tmp_path / "mid.ckpt"

    def module() -> cases.SequenceModule:
        return cases.SequenceModule(data, "token_mean", 2, resumable=True)

    h.preempt(module(), [GradientAccumulationCallback(**settings)], at, path)
    resumed = module()
    trainer = h.trainer(callbacks=[GradientAccumulationCallback(**settings)], max_epochs=2)
    trainer.fit(resumed, ckpt_path=path)
    windows = cases.budget_windows(data, 2, "token_mean", 30, epochs=2)
    assert trainer.global_step == len(windows)
    assert cases.difference(resumed.net, cases.big_batch(data, windows, "token_mean")) < 1e-6


class Preempted(cases.SequenceModule):
    """Raises in ``training_step`` of batch ``at`` of its first fit (a preemption the process survives)."""

    def __init__(self, *args: Any, at: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.at: int | None = at

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        if batch_idx == self.at:
            self.at = None
            raise RuntimeError("preempted")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("at", [3, 5])  # each inside a budget window with items counted
def test_a_second_fit_after_one_stopped_inside_a_budget_window_starts_a_window_of_its_own(at: int) -> None:
    """The stopped window is dropped; the next fit's first window counts its own items only."""
    data = cases.make_sequences(ROWS, packed=True)
    module = Preempted(data, "token_mean", 2, at=at)
    callback = GradientAccumulationCallback(**cases.budget_settings("token_mean", 30))
    with pytest.raises(RuntimeError, match="preempted"):
        h.fit(module, callback)
    trainer = h.fit(module, callback)
    windows = cases.budget_windows(data, 2, "token_mean", 30)
    stepped_before = [window for window in windows if max(window) < 2 * at]
    assert len(stepped_before) > 0 and trainer.global_step == len(windows)
    expected = cases.big_batch(data, stepped_before + windows, "token_mean")
    assert cases.difference(module.net, expected) < 1e-6


def test_lightning_s_ema_averages_the_weights_of_each_budget_window_s_step() -> None:
    """``EMAWeightAveraging`` updates after each optimizer step: once per window the budget closes."""
    data = cases.make_sequences(ROWS, packed=True)
    module = cases.SequenceModule(data, "token_mean", 2)
    ema = EMAWeightAveraging(decay=0.5, update_every_n_steps=1)
    h.fit(module, GradientAccumulationCallback(**cases.budget_settings("token_mean", 30)), ema, max_epochs=2)
    reference = cases.net()
    average = AveragedModel(reference, avg_fn=get_ema_avg_fn(0.5), use_buffers=True)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for rows in cases.budget_windows(data, 2, "token_mean", 30, epochs=2):
        optimizer.zero_grad()
        cases.window_loss(reference, data, rows, "token_mean").backward()
        optimizer.step()
        average.update_parameters(reference)
    assert int(ema._average_model.n_averaged) == 18  # windows of two epochs
    assert cases.difference(module.net, average.module) < 1e-6  # the average is the module's at the end


def test_the_budget_windows_items_are_logged_and_the_steps_estimated() -> None:
    data = cases.make_sequences(ROWS, packed=False)
    recorder = h.MetricsRecorder()
    module = cases.SequenceModule(data, "constant", 4)
    callback = GradientAccumulationCallback(scaling="constant", items_per_step=24)  # rows, not tokens
    trainer = h.trainer(callbacks=[callback], logger=recorder, log_every_n_steps=1, max_epochs=2)
    trainer.fit(module)
    windows = cases.row_windows(ROWS, 24) * 2  # 6 micro-batches of 4 rows reach 24; the epoch ends at 16
    assert trainer.global_step == len(windows) == estimated_stepping_batches(trainer) == 4
    logged = [value for _, value in recorder.series("grad_accum/items_last_step")]
    assert logged == [24.0, 16.0, 24.0, 16.0]
    micro_batches = [value for _, value in recorder.series("grad_accum/micro_batches_last_step")]
    assert micro_batches == [6.0, 4.0, 6.0, 4.0]  # micro-batches of 4 rows
    full = [value for _, value in recorder.series("grad_accum/items_last_full_step")]
    assert full == [24.0] * 4  # an epoch's end does not fill a window
    assert cases.difference(module.net, cases.big_batch(data, windows, "constant")) < 1e-6


def test_an_item_budget_refuses_a_negative_count_and_hands_callbacks_the_loss_as_returned() -> None:
    data = cases.make_sequences(ROWS, packed=False)

    class Negative(cases.SequenceModule):
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            pass

    callback = GradientAccumulationCallback(items_per_step=10, scaling="constant", item_count_fn=lambda b: -1)
    with pytest.raises(ValueError, match="item count of batch 0 over the ranks is nan"):
        h.fit(Negative(data, "constant", 2), callback)

    seen: list[tuple[float, float]] = []

    class Returned(cases.SequenceModule):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            self.returned = float(loss)
            return loss

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            seen.append((float(outputs["loss"]), self.returned))

    h.fit(
        Returned(data, "token_mean", 2),
        GradientAccumulationCallback(**cases.budget_settings("token_mean", 30)),
    )
    assert len(seen) == ROWS // 2
    assert all(abs(lightning - returned) <= 1e-6 * returned for lightning, returned in seen)


class Validated(cases.SequenceModule):
    """Validation every 3 batches: inside budget windows (Lightning zeroes for it only where it steps)."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", super().training_step(batch, batch_idx))

    def val_dataloader(self) -> Any:
        return self.train_dataloader()


def test_a_budget_meets_validation_inside_its_windows_and_lightning_s_clipping() -> None:
    data = cases.make_sequences(ROWS, packed=True)
    module = Validated(data, "token_mean", 2)
    settings = cases.budget_settings("token_mean", 30)
    trainer = h.fit(
        module,
        GradientAccumulationCallback(**settings),
        val_check_interval=3,
        limit_val_batches=1,
        gradient_clip_val=0.05,
        max_epochs=2,
    )
    windows = cases.budget_windows(data, 2, "token_mean", 30, epochs=2)
    assert trainer.global_step == len(windows) and any(len(w) % 6 for w in windows)  # windows cut by no 3
    expected = cases.big_batch(data, windows, "token_mean", max_grad_norm=0.05)
    assert cases.difference(module.net, expected) < 1e-6
    assert cases.difference(module.net, cases.big_batch(data, windows, "token_mean")) > 1e-3  # it clipped


def host_tokens(batch: Any) -> int:
    """Target tokens, counted on the host (pieces of 0 are then known before their forward)."""
    return int(count_tokens(batch))


def test_constant_pieces_without_items_still_carry_their_terms() -> None:
    """Rows without a target still add an unlabelled term (a penalty) under "constant": none is dropped."""
    data = cases.make_sequences(16, packed=False)
    data.labels[::3] = cases.IGNORE  # rows 0, 3, 6, ... count 0 tokens

    class Penalized(cases.SequenceModule):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            penalty = self.net(batch["input_ids"]).pow(2).sum() / cases.NORMALIZER  # over every row
            return super().training_step(batch, batch_idx) + 0.01 * penalty

    module = Penalized(data, "constant", 4)
    counted = GradientAccumulationCallback(2, scaling="constant", item_count_fn=host_tokens, piece_size=1)
    h.fit(module, counted)
    reference = cases.net()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for start in (0, 8):  # windows of 2 micro-batches of 4 rows, as one batch of 8
        rows = slice(start, start + 8)
        tokens = cases.token_losses(reference, data.inputs[rows], data.labels[rows]).sum() / cases.NORMALIZER
        penalty = reference(data.inputs[rows]).pow(2).sum() / cases.NORMALIZER
        optimizer.zero_grad()
        (tokens + 0.01 * penalty).backward()
        optimizer.step()
    assert cases.difference(module.net, reference) < 1e-6


def test_the_most_steps_of_a_budget_without_a_loader_batch_size_is_one_per_micro_batch() -> None:
    data = cases.make_sequences(ROWS, packed=False)
    found: list[Any] = []

    class Sampled(cases.SequenceModule):
        def train_dataloader(self) -> Any:  # a batch sampler: the loader has no `batch_size`
            sampler = BatchSampler(SequentialSampler(range(ROWS)), batch_size=2, drop_last=False)
            return DataLoader(cases.Rows(self.data), batch_sampler=sampler)

        def configure_optimizers(self) -> Any:
            found.append(estimated_stepping_batches(self.trainer, most=True))
            with pytest.raises(ValueError, match="no `batch_size`"):
                estimated_stepping_batches(self.trainer)
            return super().configure_optimizers()

    h.fit(Sampled(data, "constant", 2), GradientAccumulationCallback(scaling="constant", items_per_step=6))
    assert found == [ROWS // 2]  # one step per micro-batch at most
