"""Exact resume from a checkpoint taken in the middle of an accumulation window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import OnExceptionCheckpoint

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h
from tests.helpers import preempt

EPOCHS = 2  # 10 micro-batches of 4 per epoch; with K=4: windows 4, 4, 2


def make_callback(scaling: str, **kwargs: Any) -> GradientAccumulationCallback:
    return GradientAccumulationCallback(4, scaling=scaling, **kwargs)


def module(optimizer: str, **kwargs: Any) -> h.RegressionModule:
    # 38 samples: the last micro-batch of each epoch has 2, so "weighted" differs from "mean"
    lr = 0.01 if optimizer == "adam" else 0.1
    return h.RegressionModule(h.regression_data(38), optimizer=optimizer, lr=lr, resumable=True, **kwargs)


def uninterrupted(optimizer: str, scaling: str, **kwargs: Any) -> h.RegressionModule:
    model = module(optimizer)
    h.trainer(callbacks=[make_callback(scaling, **kwargs)], max_epochs=EPOCHS).fit(model)
    return model


def interrupted_and_resumed(
    tmp_path: Path, at: int, optimizer: str, scaling: str, **kwargs: Any
) -> tuple[h.RegressionModule, GradientAccumulationCallback]:
    path = tmp_path / "mid_window.ckpt"
    preempt(module(optimizer), [make_callback(scaling, **kwargs)], at, path)
    resumed = module(optimizer)
    callback = make_callback(scaling, **kwargs)
    h.trainer(callbacks=[callback], max_epochs=EPOCHS).fit(resumed, ckpt_path=path)
    return resumed, callback


@pytest.mark.parametrize("at", [4, 5, 6, 7, 13])  # every position of a K=4 window, and one in epoch 2
@pytest.mark.parametrize(("optimizer", "scaling"), [("sgd", "mean"), ("adam", "weighted")])
def test_resume_mid_window_equals_the_uninterrupted_run(
    tmp_path: Path, at: int, optimizer: str, scaling: str
) -> None:
    expected = uninterrupted(optimizer, scaling)
    resumed, callback = interrupted_and_resumed(tmp_path, at, optimizer, scaling)
    assert h.max_abs_diff(resumed.net, expected.net) <= 1e-6
    assert callback.stats.windows == 6
    assert callback.stats.total_micro_batches == 20
    assert callback.stats.items_seen == 38 * EPOCHS  # every sample of both epochs, once (a sum: saved)


@pytest.mark.parametrize("at", [1, 6])
def test_resume_mid_window_with_fp32_buffers(tmp_path: Path, at: int) -> None:
    kwargs = {"accumulation_dtype": "float64", "overflow": "skip_micro_batch"}
    expected = uninterrupted("sgd", "weighted", **kwargs)
    resumed, _ = interrupted_and_resumed(tmp_path, at, "sgd", "weighted", **kwargs)
    assert h.max_abs_diff(resumed.net, expected.net) <= 1e-6


def test_builtin_loses_the_open_window(tmp_path: Path) -> None:
    """What this fixes: Lightning's own accumulation forgets the gradients of the open window."""
    path = tmp_path / "builtin.ckpt"
    expected = module("sgd")
    h.trainer(accumulate_grad_batches=4, max_epochs=EPOCHS).fit(expected)
    preempt(module("sgd"), [], 6, path, accumulate_grad_batches=4)
    resumed = module("sgd")
    h.trainer(accumulate_grad_batches=4, max_epochs=EPOCHS).fit(resumed, ckpt_path=path)
    assert h.max_abs_diff(resumed.net, expected.net) > 1e-3


def test_state_loads_with_weights_only(tmp_path: Path) -> None:
    path = tmp_path / "mid.ckpt"
    preempt(module("sgd"), [make_callback("mean")], 5, path)
    checkpoint = torch.load(path, weights_only=True)
    (state,) = [v for k, v in checkpoint["callbacks"].items() if "GradientAccumulationCallback" in k]
    window = state["window"]
    assert window["micro_batches"] == 2  # micro-batches 4 and 5 of the second window
    assert window["items"] == 8
    assert set(window["tensors"]) == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
    assert state["accumulator"]["windows"] == 1


def test_crash_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    expected = uninterrupted("sgd", "mean")

    class Crash(pl.Callback):
        def on_train_batch_start(
            self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int
        ) -> None:
            if trainer.fit_loop.total_batch_idx == 6:
                raise RuntimeError("simulated crash")

    first = module("sgd")
    crash_saver = OnExceptionCheckpoint(dirpath=tmp_path, filename="crash")
    with pytest.raises(RuntimeError, match="simulated crash"):
        callbacks = [make_callback("mean"), Crash(), crash_saver]
        h.trainer(callbacks=callbacks, max_epochs=EPOCHS, enable_checkpointing=True).fit(first)
    resumed = module("sgd")
    h.trainer(callbacks=[make_callback("mean")], max_epochs=EPOCHS).fit(
        resumed, ckpt_path=tmp_path / "crash.ckpt"
    )
    assert h.max_abs_diff(resumed.net, expected.net) <= 1e-6


def test_epoch_schedule_k_is_right_after_a_mid_epoch_resume(tmp_path: Path) -> None:
    schedule = {0: 2, 1: 4}
    expected = module("sgd")
    h.trainer(callbacks=[GradientAccumulationCallback(schedule)], max_epochs=EPOCHS).fit(expected)
    path = tmp_path / "epoch1.ckpt"
    preempt(module("sgd"), [GradientAccumulationCallback(schedule)], 12, path)
    resumed = module("sgd")
    callback = GradientAccumulationCallback(schedule)
    trainer = h.trainer(callbacks=[callback], max_epochs=EPOCHS)
    trainer.fit(resumed, ckpt_path=path)
    assert trainer.accumulate_grad_batches == 4
    assert h.max_abs_diff(resumed.net, expected.net) <= 1e-6


def test_checkpoint_from_builtin_accumulation_loads(tmp_path: Path) -> None:
    path = tmp_path / "builtin.ckpt"
    trainer = h.trainer(accumulate_grad_batches=4, max_epochs=1)
    trainer.fit(module("sgd"))
    trainer.save_checkpoint(path)
    callback = make_callback("mean")
    h.trainer(callbacks=[callback], max_epochs=2).fit(module("sgd"), ckpt_path=path)
    assert callback.stats.windows == 3


def _tamper(path: Path, change: Any) -> Path:
    checkpoint = torch.load(path, weights_only=True)
    (key,) = [k for k in checkpoint["callbacks"] if "GradientAccumulationCallback" in k]
    change(checkpoint["callbacks"][key])
    out = path.with_name("tampered.ckpt")
    torch.save(checkpoint, out)
    return out


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda s: s["window"]["tensors"].update(extra=torch.zeros(1)), "unknown parameter `extra`"),
        (
            lambda s: s["window"]["tensors"].update({"net.0.bias": torch.zeros(3)}),
            r"`net.0.bias` is \(\(3,\), torch.float32\), but the parameter needs \(\(8,\), torch.float32\)",
        ),
        (
            lambda s: s["window"]["tensors"].update({"net.0.bias": torch.zeros(8, dtype=torch.float64)}),
            "`net.0.bias` is .*float64.*needs.*float32",
        ),
        (lambda s: s["window"].update(version=99), "format version 99"),
        (lambda s: s["window"].update(world_size=2), "accumulated on 2 rank"),
        (lambda s: s["window"].update(kind="buffers"), "accumulated in accumulation buffers"),
        (lambda s: s["accumulator"].update(version=7), "accumulator state has format version 7"),
    ],
)
def test_mismatched_pending_window_is_rejected_and_nothing_changes(
    tmp_path: Path, change: Any, match: str
) -> None:
    path = tmp_path / "mid.ckpt"
    preempt(module("sgd"), [make_callback("mean")], 5, path)
    tampered = _tamper(path, change)
    resumed = module("sgd")
    resumed.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
    before = [p.detach().clone() for p in resumed.parameters()]
    with pytest.raises(ValueError, match=match):
        h.trainer(callbacks=[make_callback("mean")], max_epochs=EPOCHS).fit(resumed, ckpt_path=tampered)
    assert all(torch.equal(a, b) for a, b in zip(before, resumed.parameters(), strict=True))
    assert all(p.grad is None for p in resumed.parameters())


def test_pending_window_is_restored_with_a_plain_dataloader(tmp_path: Path) -> None:
    """Without a resumable loader Lightning restarts the epoch's data (and warns); the window comes back."""
    path = tmp_path / "plain.ckpt"
    preempt(h.RegressionModule(h.regression_data(38)), [make_callback("mean")], 5, path)
    saved = torch.load(path, weights_only=True)
    (state,) = [v for k, v in saved["callbacks"].items() if "GradientAccumulationCallback" in k]
    seen: dict[str, Any] = {}

    class Probe(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            accumulator = callback.accumulator
            seen["current_step"] = accumulator.window.micro_batches if accumulator is not None else None
            seen["grads"] = {n: p.grad.clone() for n, p in pl_module.named_parameters()}

    callback = make_callback("mean")
    with pytest.warns(UserWarning, match="dataloader is not resumable"):
        h.trainer(callbacks=[callback, Probe()], max_epochs=EPOCHS).fit(
            h.RegressionModule(h.regression_data(38)), ckpt_path=path
        )
    assert seen["current_step"] == 2
    for name, tensor in state["window"]["tensors"].items():
        assert torch.equal(seen["grads"][name], tensor)


def test_resume_mid_window_under_16_mixed(tmp_path: Path) -> None:
    plugin = h.amp_plugin
    expected = module("sgd")
    h.trainer(callbacks=[make_callback("mean")], plugins=[plugin()], max_epochs=EPOCHS).fit(expected)
    path = tmp_path / "amp.ckpt"
    preempt(module("sgd"), [make_callback("mean")], 6, path, plugins=[plugin()])
    resumed = module("sgd")
    h.trainer(callbacks=[make_callback("mean")], plugins=[plugin()], max_epochs=EPOCHS).fit(
        resumed, ckpt_path=path
    )
    assert h.max_abs_diff(resumed.net, expected.net) <= 1e-6


class Validated(h.RegressionModule):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(h.regression_data(8, seed=1), batch_size=4)


def test_model_checkpoint_after_validation_inside_a_window_resumes_exactly(tmp_path: Path) -> None:
    """`ModelCheckpoint(monitor=...)` saves after a validation that falls inside a window: open windows."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    def validated() -> Validated:
        return Validated(h.regression_data(38), resumable=True)

    options = {"max_epochs": EPOCHS, "val_check_interval": 3, "num_sanity_val_steps": 0}
    expected = validated()
    h.trainer(callbacks=[make_callback("weighted")], **options).fit(expected)
    saver = ModelCheckpoint(
        dirpath=tmp_path, monitor="val_loss", save_top_k=-1, filename="{epoch}-{step}-{val_loss}"
    )
    h.trainer(callbacks=[make_callback("weighted"), saver], enable_checkpointing=True, **options).fit(
        validated()
    )
    saved = sorted(tmp_path.glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    open_windows = set()
    for path in saved:
        state = torch.load(path, weights_only=True)["callbacks"]["GradientAccumulationCallback"]
        if state["window"] is not None:
            open_windows.add(state["window"]["micro_batches"])
        resumed = validated()
        h.trainer(callbacks=[make_callback("weighted")], **options).fit(resumed, ckpt_path=path)
        assert h.max_abs_diff(resumed.net, expected.net) <= 1e-6, path.name
    assert open_windows == {1, 2, 3}  # validation after batches 2, 5 and 8 of windows of 4, 4, 2


def test_resume_with_a_larger_k_continues_the_open_window(tmp_path: Path) -> None:
    """Saved at micro-batch 5 with K=4 (window 4-5 open), resumed with K=8: the window grows to 4-7 (the
    saved sum, made with loss/4, is brought to loss/8), then windows of 8 and the rest."""
    path = tmp_path / "k4.ckpt"
    preempt(module("sgd"), [make_callback("weighted")], 5, path)
    resumed, recorder = module("sgd"), h.MetricsRecorder()
    callback = GradientAccumulationCallback(8, scaling="weighted")
    h.trainer(callbacks=[callback], max_epochs=EPOCHS, logger=recorder, log_every_n_steps=1).fit(
        resumed, ckpt_path=path
    )
    windows = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], list(range(8)), [8, 9]]
    losses: list[float] = []  # each window's loss over all its samples, before its step
    assert h.max_abs_diff(resumed.net, h.regression_reference(windows, num_samples=38, losses=losses)) < 1e-6
    # the logged loss of the grown window: its saved half (made with loss/4) counts as much as the rest
    logged = [loss for _, loss in recorder.series("grad_accum/window_loss")]
    assert logged == pytest.approx(losses[1:], rel=1e-5)


def test_resume_with_a_smaller_k_discards_the_saved_window_with_a_warning(tmp_path: Path) -> None:
    """With K=2, Lightning starts a new window at micro-batch 6, so the saved window (4-5) never steps."""
    path = tmp_path / "k4.ckpt"
    preempt(module("sgd"), [make_callback("weighted")], 5, path)
    resumed = module("sgd")
    with pytest.warns(UserWarning, match="never reached its optimizer step"):
        h.trainer(callbacks=[GradientAccumulationCallback(2, scaling="weighted")], max_epochs=EPOCHS).fit(
            resumed, ckpt_path=path
        )
    windows = [[0, 1, 2, 3], [6, 7], [8, 9], *h.windows(10, 2)]
    assert h.max_abs_diff(resumed.net, h.regression_reference(windows, num_samples=38)) < 1e-6


class NoneEndsAWindow(h.RegressionModule):
    """`training_step` returns None for the last batch of the first epoch's second window (batch 7)."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return None if (self.current_epoch, batch_idx) == (0, 7) else loss


def test_resume_under_16_mixed_where_the_window_s_last_batch_returns_none(tmp_path: Path) -> None:
    """The resumed fit's first step closes the restored window without any backward: the GradScaler has
    scaled nothing yet in this fit (its loaded scale waits in `_init_scale`), and the callback unscales and
    steps the window itself. It used to fail in `unscale_` ("_scale is None")."""

    def fresh() -> h.RegressionModule:
        return NoneEndsAWindow(h.regression_data(38), resumable=True)

    expected = fresh()
    h.trainer(callbacks=[make_callback("mean")], plugins=[h.amp_plugin()], max_epochs=EPOCHS).fit(expected)
    path = tmp_path / "amp.ckpt"
    preempt(fresh(), [make_callback("mean")], 6, path, plugins=[h.amp_plugin()])  # window: 4, 5, 6
    resumed = fresh()
    callback = make_callback("mean")
    h.trainer(callbacks=[callback], plugins=[h.amp_plugin()], max_epochs=EPOCHS).fit(resumed, ckpt_path=path)
    assert h.max_abs_diff(resumed.net, expected.net) <= 1e-6
    assert callback.stats.windows == 6


class FailsAfterTheLastBackward(pl.Callback):
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.fit_loop.epoch_loop.batch_idx == 7:  # the last micro-batch of window 1
            raise RuntimeError("failed after the backward")


def test_a_window_saved_after_its_flush_into_grad_stays_a_buffered_window(tmp_path: Path) -> None:
    """Under a GradScaler the buffers go into `.grad` after the window's last backward; an exception right
    after it is saved by `OnExceptionCheckpoint`: the window is saved as buffers (it was labelled as `.grad`
    and then refused by the same run's settings), with a warning that such a mid-batch save cannot resume
    exactly."""
    kwargs: dict[str, Any] = {"accumulation_dtype": "float64"}
    saver = OnExceptionCheckpoint(dirpath=tmp_path, filename="crash")
    trainer = h.trainer(
        callbacks=[make_callback("mean", **kwargs), FailsAfterTheLastBackward(), saver],
        plugins=[h.amp_plugin()],
        enable_checkpointing=True,
    )
    with (
        pytest.raises(RuntimeError, match="failed after the backward"),
        pytest.warns(UserWarning, match="after a micro-batch's backward but before its batch ended"),
    ):
        trainer.fit(module("sgd"))
    checkpoint = torch.load(tmp_path / "crash.ckpt", weights_only=True)
    (state,) = [v for k, v in checkpoint["callbacks"].items() if "GradientAccumulationCallback" in k]
    assert (state["window"]["kind"], state["window"]["micro_batches"]) == ("buffers", 4)
    assert all(t.dtype == torch.float64 for t in state["window"]["tensors"].values())
    resumed = h.trainer(callbacks=[make_callback("mean", **kwargs)], plugins=[h.amp_plugin()])
    resumed.fit(module("sgd"), ckpt_path=tmp_path / "crash.ckpt")  # loads (not an exact resume: warned)


@pytest.mark.parametrize("at", [3, 7, 9, 13])  # window ends: inside epoch 1, its last batch, in epoch 2
def test_a_weighted_resume_from_a_window_end_is_the_uninterrupted_run_bit_for_bit(
    tmp_path: Path, at: int
) -> None:
    """The weights of "weighted" are relative to a reference count that the windows rebase: saved between
    windows too, a resume from a window's end goes on with the same weights, so the same floats (0.0 apart,
    as from inside a window; not saved, 1.8e-7 to 6.9e-7 apart)."""
    expected = uninterrupted("adam", "weighted")
    resumed, _ = interrupted_and_resumed(tmp_path, at, "adam", "weighted")
    assert h.max_abs_diff(resumed.net, expected.net) == 0.0


def test_a_fit_resumed_from_a_finished_run_says_that_it_trains_nothing(tmp_path: Path) -> None:
    """Lightning trains nothing when the checkpoint's run already reached `max_epochs`: the callback says so,
    and its statistics are the checkpoint's (not 0 windows)."""
    first, callback = module("sgd"), make_callback("mean")
    trainer = h.trainer(callbacks=[callback], max_epochs=EPOCHS)
    trainer.fit(first)
    trainer.save_checkpoint(tmp_path / "finished.ckpt")
    again = make_callback("mean")
    with pytest.warns(UserWarning, match=r"Nothing was trained: the checkpoint's run is finished \(epoch 2"):
        h.trainer(callbacks=[again], max_epochs=EPOCHS).fit(
            module("sgd"), ckpt_path=tmp_path / "finished.ckpt"
        )
    assert (again.stats.windows, again.stats.total_micro_batches) == (6, 20)
    assert "optimizer steps taken        6 of 6 windows" in again.summary()
