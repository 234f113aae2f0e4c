"""The summary printed at the end of a fit: the effective batch and the noise scale, with their units."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl

from lightning_gradacc import AccumulationStats, GradientAccumulationCallback
from tests import helpers as h


def test_the_summary_shows_a_full_step_beside_the_last_partial_one() -> None:
    """Token windows: the last is partial; the summary's effective batch is the last full window's."""
    data = h.token_data(24)  # 12 micro-batches of 2 sequences; K=5: windows 5, 5, 2
    callback = GradientAccumulationCallback(5, scaling="weighted", item_count_fn=h.count_tokens)
    h.trainer(callbacks=[callback]).fit(h.TokenModule(data))
    labels = data.tensors[1]
    full = int((labels[10:20] != h.IGNORE_INDEX).sum())  # window 1: micro-batches 5-9
    last = int((labels[20:] != h.IGNORE_INDEX).sum())
    assert (callback.stats.items_last_full_step, callback.stats.items_last_step) == (full, last)
    row = next(line for line in callback.summary().splitlines() if line.startswith("effective batch"))
    assert row.endswith(f"{full} in the last full step (K micro-batches); {last} in the last step (2 of 5)")


@pytest.mark.parametrize(
    ("noise_scale", "items", "expected"),
    [
        (-3.0, 100.0, "no usable estimate yet (not positive)"),
        (12.5, 0.0, "12.5 micro-batches (averaged over recent steps)"),
        (1234.5, 100.0, "1,234.5 items (averaged over recent steps)"),
    ],
)
def test_the_summary_gives_the_noise_scale_its_unit_or_says_it_has_none(
    noise_scale: float, items: float, expected: str
) -> None:
    from lightning_gradacc.reporting import format_summary

    stats = AccumulationStats(noise_scale=noise_scale, items_last_step=items, items_last_full_step=items)
    row = next(line for line in format_summary(stats, 0.5, None).splitlines() if "noise scale" in line)
    assert row.endswith(expected)


@pytest.mark.parametrize(
    ("noise", "items", "expected"),
    [
        (1000.0, 128.0, "well below the gradient noise scale (1,000 items): a larger batch"),
        (50.0, 128.0, "well above the gradient noise scale (50 items): each step uses more items"),
        (100.0, 128.0, "close to the gradient noise scale (100 items)"),
        (-3.0, 128.0, "no usable estimate yet"),
        (12.5, 0.0, "12.5 micro-batches (no item counts were known"),
    ],
)
def test_the_summary_says_which_side_of_the_noise_scale_the_run_is_on(
    noise: float, items: float, expected: str
) -> None:
    from lightning_gradacc import AccumulationStats
    from lightning_gradacc.reporting import format_summary, noise_sentence

    stats = AccumulationStats(items_last_step=items, noise_scale=noise)
    assert expected in (noise_sentence(stats) or "")
    assert expected in format_summary(stats, 0.5, None)
    assert noise_sentence(AccumulationStats()) is None  # not measured: nothing said


# ------------------------------------------------------------------- callback_metrics between logging steps


class _Module(h.RegressionModule):
    """`h.RegressionModule` that records `grad_accum/windows` from `callback_metrics` after every batch."""

    def __init__(self, optimizer: str) -> None:
        super().__init__(h.regression_data(24), optimizer=optimizer)
        self.seen: list[float | None] = []

    def on_train_batch_end(self, *args: object) -> None:
        value = self.trainer.callback_metrics.get("grad_accum/windows")
        self.seen.append(None if value is None else float(value))


def test_a_short_run_ends_with_its_statistics_in_callback_metrics() -> None:
    """`log_every_n_steps=50` and 6 steps: no logging step, and nothing monitors a statistic, so none is read
    during the fit (a read costs about 0.3 ms); the fit's end puts the last ones into `callback_metrics`."""
    module = _Module("sgd")
    h.fit(module, GradientAccumulationCallback(2), log_every_n_steps=50, max_epochs=2)
    assert set(module.seen) == {None}
    assert float(module.trainer.callback_metrics["grad_accum/windows"]) == 6


def test_a_monitored_statistic_is_read_every_step_also_where_the_step_was_decided_on_the_device(
    tmp_path: object,
) -> None:
    """A callback that monitors a statistic gets it at every step, as from `self.log`: here
    `ModelCheckpoint(monitor="grad_accum/window_loss")` in a run shorter than `log_every_n_steps`, with a
    fused optimizer that decides on the device (then a host read per step)."""
    module = _Module("adam_fused")
    checkpoint = pl.callbacks.ModelCheckpoint(
        dirpath=str(tmp_path), monitor="grad_accum/window_loss", every_n_train_steps=1, save_top_k=1
    )
    h.fit(
        module,
        GradientAccumulationCallback(2),
        checkpoint,
        log_every_n_steps=50,
        max_epochs=2,
        enable_checkpointing=True,
    )
    assert module.seen[1::2] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert checkpoint.best_model_score is not None and float(checkpoint.best_model_score) > 0
