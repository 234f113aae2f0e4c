"""``piece_size``: each loader batch run as pieces with their own backward equals the whole batch.

Out-of-memory errors are injected (there is no GPU here): a forward raises ``torch.OutOfMemoryError``
when its piece holds more items than the module's cap, a backward does so half-way (after the last
layer's gradient was added, before the first layer's), as a real one may. Every oracle is a plain loop
taking one step per window over the window's items as one batch.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor, nn

from lightning_gradacc import GradientAccumulationCallback
from lightning_gradacc.batch_pieces import UnsplittableBatch, split_batch
from tests import helpers as h

OOM = "CUDA out of memory (simulated)"


class _OomInBackward(torch.autograd.Function):
    """Identity whose backward runs out of memory for a piece of more than ``cap`` items."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, cap: int) -> Tensor:  # type: ignore[override]
        ctx.too_big = x.shape[0] > cap
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        if ctx.too_big:
            raise torch.OutOfMemoryError(f"{OOM} in a backward")
        return grad, None


class OomModule(h.RegressionModule):
    """Regression whose passes run out of memory above a cap of items (``cap(batch_index)``: it may change).

    ``ranks``: the ranks that run out (None: all).
    """

    def __init__(
        self,
        data: Any,
        *,
        forward_cap: Callable[[int], int | None] = lambda b: None,
        backward_cap: Callable[[int], int | None] = lambda b: None,
        ranks: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(data, **kwargs)
        self.forward_cap, self.backward_cap, self.ranks = forward_cap, backward_cap, ranks
        self.forwards: list[int] = []  # the items of every forward that ran to its end
        self.ooms = 0  # out-of-memory errors raised
        self.register_buffer("running", torch.zeros(()))  # DDP broadcasts it at a forward after a sync

    def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        here = self.ranks is None or self.global_rank in self.ranks
        cap = self.forward_cap(batch_idx) if here else None
        if cap is not None and len(x) > cap:
            self.ooms += 1
            raise torch.OutOfMemoryError(f"{OOM} in a forward")
        hidden = self.net[0](x)
        cap = self.backward_cap(batch_idx) if here else None
        if cap is not None:
            hidden = _OomInBackward.apply(hidden, cap)
        self.forwards.append(len(x))
        return nn.functional.mse_loss(self.net[2](self.net[1](hidden)), y)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.resumable:  # a batch is consumed once, whatever its pieces
            self.trainer.train_dataloader.consumed += 1


class Cap:
    """Items that fit in batch ``b`` (picklable, for ``ddp_spawn``): ``at[b]``, else the value of the last key
    of ``since`` at or before ``b`` (None: no limit)."""

    def __init__(self, since: dict[int, int] | None = None, at: dict[int, int] | None = None) -> None:
        self.since, self.at = since or {}, at or {}

    def __call__(self, batch: int) -> int | None:
        if batch in self.at:
            return self.at[batch]
        started = [cap for key, cap in sorted(self.since.items()) if key <= batch]
        return started[-1] if started else None


def reference(data: Any, batch_size: int, windows: list[list[int]], **kwargs: Any) -> nn.Module:
    return h.big_batch_reference(h.regression_net(), data, batch_size, windows, h.mse, **kwargs)


def fit(module: Any, callback: Any, **kwargs: Any) -> Any:
    return h.fit(module, callback, **kwargs)


def test_an_int_piece_size_splits_every_batch_and_equals_the_whole_batch() -> None:
    data = h.regression_data(40)  # 5 batches of 8 in pieces of 3, 3, 2; K=2: windows 2, 2, 1
    module = OomModule(data, batch_size=8)
    callback = GradientAccumulationCallback(2, piece_size=3, max_grad_norm=0.5)
    fit(module, callback)
    assert module.forwards == [3, 3, 2] * 5
    expected = reference(data, 8, h.windows(5, 2), max_grad_norm=0.5)
    assert h.max_abs_diff(module.net, expected) < 1e-6
    metrics = callback.metrics()
    assert metrics["grad_accum/piece_size"] == 3 and metrics["grad_accum/oom_retries"] == 0
    assert callback.stats.total_micro_batches == 5  # the loader's batches: pieces are not micro-batches


def test_auto_halves_on_a_forward_oom_and_goes_on_from_the_failed_piece() -> None:
    data = h.regression_data(40)
    # fragmentation: whole batches fit at first, then only 5 items (8 -> 4), later only 3 (4 -> 2)
    module = OomModule(data, batch_size=8, forward_cap=lambda b: None if b < 1 else (5 if b < 3 else 3))
    callback = GradientAccumulationCallback(2, piece_size="auto")
    fit(module, callback)
    assert module.forwards == [8, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2, 2]
    expected = reference(data, 8, h.windows(5, 2))
    assert h.max_abs_diff(module.net, expected) < 1e-6
    metrics = callback.metrics()
    assert metrics["grad_accum/oom_retries"] == 2 and metrics["grad_accum/piece_size"] == 2


def test_auto_redoes_a_batch_after_a_backward_oom_where_its_window_is_safe() -> None:
    data = h.regression_data(48)  # 6 batches of 8; K=3: windows 3, 3
    # batch 3 opens a window (nothing else in .grad); batch 4 is the 2nd of its window: in fp32 buffers
    module = OomModule(data, batch_size=8, backward_cap=lambda b: {3: 4, 4: 2}.get(b, 8))
    callback = GradientAccumulationCallback(3, piece_size="auto", accumulation_dtype="float64")
    fit(module, callback)
    # a redo runs the batch again from its start: batch 3 whole, then 4 + 4; batch 4: 4, then 2 x 4
    assert module.forwards == [8, 8, 8, 8, 4, 4, 4, *[2] * 8]
    expected = reference(data, 8, h.windows(6, 3))
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert callback.metrics()["grad_accum/oom_retries"] == 2


def test_a_backward_oom_with_earlier_gradients_in_grad_raises_with_the_reason() -> None:
    data = h.regression_data(40)
    module = OomModule(data, batch_size=8, backward_cap=lambda b: 4 if b == 1 else 8)
    callback = GradientAccumulationCallback(2, piece_size="auto")
    with pytest.raises(RuntimeError, match=r"Out of memory in a backward.*oom_snapshot=True"):
        fit(module, callback)


def test_a_backward_oom_where_ddp_all_reduces_raises_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """DDP's all-reducing backward (the last piece of a window's last batch) is half done: it cannot rerun.

    Shown on one process, the backward taken for the all-reducing one (two ranks: the same code path)."""
    from lightning_gradacc import piece_runner

    monkeypatch.setattr(piece_runner.PieceRunner, "_syncs", lambda self: True)
    module = OomModule(h.regression_data(40), batch_size=8, backward_cap=lambda b: 4)
    callback = GradientAccumulationCallback(1, piece_size="auto", oom_snapshot=True)
    with pytest.raises(RuntimeError, match=r"backward that DDP synchronizes.*int `piece_size` below 8"):
        fit(module, callback)


def test_oom_snapshot_redoes_a_backward_oom_anywhere() -> None:
    data = h.regression_data(40)
    module = OomModule(data, batch_size=8, backward_cap=lambda b: 4 if b == 1 else 8)
    callback = GradientAccumulationCallback(2, piece_size="auto", oom_snapshot=True, max_grad_norm=0.5)
    fit(module, callback)
    expected = reference(data, 8, h.windows(5, 2), max_grad_norm=0.5)
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert callback.metrics()["grad_accum/oom_retries"] == 1


def test_token_weighted_pieces_of_variable_length_sequences_equal_all_tokens_at_once() -> None:
    data = h.token_data()  # 24 sequences of 1..9 real tokens; batches of 6 in pieces of 4 and 2
    module = h.TokenModule(data, batch_size=6)
    callback = GradientAccumulationCallback(2, scaling="weighted", item_count_fn=h.count_tokens, piece_size=4)
    fit(module, callback)
    expected = h.big_batch_reference(h.token_net(), data, 6, h.windows(4, 2), h.token_loss, lr=0.5)
    assert h.max_abs_diff(module.net, expected) < 1e-6


def test_a_keyed_k_schedule_with_auto_pieces_steps_the_schedule_s_windows() -> None:
    data = h.regression_data(40)  # 10 batches of 4; K=2, then 3 from step 2
    module = OomModule(data, forward_cap=lambda b: None if b < 3 else 3)
    schedule = {0: 2, 2: 3}
    callback = GradientAccumulationCallback(schedule, schedule_unit="steps", piece_size="auto")
    fit(module, callback)
    windows = [window for window, _ in h.keyed_windows(schedule, 10)]
    assert h.max_abs_diff(module.net, reference(data, 4, windows)) < 1e-6
    assert callback.metrics()["grad_accum/oom_retries"] == 1


def test_auto_k_with_pieces_replays_as_fixed_windows_and_measures_each_piece() -> None:
    from lightning_gradacc.k_policies import AutoSettings

    data = h.regression_data(80)  # 20 batches of 4, each in pieces of 2
    module = OomModule(data, forward_cap=lambda b: 3, lr=0.05)
    windows = h.SteppedWindows()
    settings = AutoSettings(patience=1, max_k=8, powers_of_two=False)
    callback = GradientAccumulationCallback("auto", auto=settings, piece_size="auto")
    h.fit(module, callback, windows, max_epochs=4)
    assert max(len(window) for window in windows.windows) > 2  # K moved from its start
    expected = reference(data, 4, windows.windows, lr=0.05)
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert math.isfinite(callback.stats.noise_scale) and callback.stats.noise_scale > 0


def test_a_resume_inside_a_window_after_an_oom_is_exact_and_does_not_run_out_again(tmp_path: Path) -> None:
    data = h.regression_data(40)  # 10 batches of 4 per epoch, K=4; out of memory above 3 items

    def run() -> tuple[OomModule, Any]:
        module = OomModule(data, forward_cap=lambda b: 3, resumable=True)
        return module, GradientAccumulationCallback(4, piece_size="auto")

    path = tmp_path / "mid_window.ckpt"
    h.preempt(*(lambda m, c: (m, [c]))(*run()), 5, path)
    resumed, callback = run()
    h.trainer(callbacks=[callback], max_epochs=2).fit(resumed, ckpt_path=path)
    expected = reference(data, 4, h.windows(10, 4, epochs=2))
    assert h.max_abs_diff(resumed.net, expected) < 1e-6
    assert resumed.ooms == 0 and set(resumed.forwards) == {2}  # the saved size: no new out-of-memory
    assert callback.metrics()["grad_accum/oom_retries"] == 1


def test_16_mixed_pieces_with_a_backward_oom_match_the_big_batch_under_the_same_autocast() -> None:
    data = h.regression_data(40)
    module = OomModule(data, batch_size=8, backward_cap=lambda b: 4 if b == 2 else 8)
    callback = GradientAccumulationCallback(2, piece_size="auto", max_grad_norm=0.5)
    fit(module, callback, plugins=[h.amp_plugin()])
    expected = reference(data, 8, h.windows(5, 2), max_grad_norm=0.5, fp16_autocast=True)
    assert h.max_abs_diff(module.net, expected) < 2e-4  # fp16 rounding: pieces vs the big batch
    assert callback.metrics()["grad_accum/oom_retries"] == 1
    assert callback.stats.skipped_steps == 0


def masked_mean_loss(net: nn.Module, inputs: Tensor, labels: Tensor) -> Tensor:
    """The token mean written by hand (as many training loops do): 0/0 for a piece without tokens."""
    logits = net(inputs).reshape(-1, h.VOCAB)
    mask = labels.reshape(-1) != h.IGNORE_INDEX
    losses = nn.functional.cross_entropy(logits, labels.reshape(-1).clamp(min=0), reduction="none")
    return (losses * mask).sum() / mask.sum()


class MaskedMeanModule(h.TokenModule):
    def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        return masked_mean_loss(self.net, *batch)


@pytest.mark.parametrize("host_counts", [True, False], ids=["host-count", "device-count"])
def test_a_piece_without_tokens_adds_nothing_and_logs_no_nan(host_counts: bool) -> None:
    """Rows 0-1 have no real label (a prompt-only row): with pieces of 2, the first piece has no tokens."""
    data = h.token_data()
    data.tensors[1][:2] = h.IGNORE_INDEX
    counter = (lambda batch: int(h.count_tokens(batch))) if host_counts else h.count_tokens
    # a hand-written mean divides by 0 in its backward too: a host count skips that piece's passes
    module = (MaskedMeanModule if host_counts else h.TokenModule)(data, batch_size=6)
    callback = GradientAccumulationCallback(2, scaling="weighted", item_count_fn=counter, piece_size=2)
    losses: list[float] = []
    h.fit(module, callback, LossRecorder(losses))
    expected = h.big_batch_reference(h.token_net(), data, 6, h.windows(4, 2), h.token_loss, lr=0.5)
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert all(math.isfinite(loss) for loss in losses) and math.isfinite(callback.accumulator.window_loss)
    assert callback.stats.skipped_steps == 0


class LossRecorder(pl.Callback):
    """Each batch's ``outputs["loss"]``; and whether another value of ``outputs`` kept a graph."""

    def __init__(self, losses: list[float]) -> None:
        self.losses, self.graphs = losses, 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))
        self.graphs += sum(getattr(v, "requires_grad", False) for k, v in outputs.items() if k != "loss")


def test_outputs_hold_the_batch_s_loss_and_values_without_a_graph() -> None:
    data = h.regression_data(40)

    class WithPredictions(OomModule):
        def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> Any:
            x, y = batch
            predictions = self.net(x)
            return {"loss": nn.functional.mse_loss(predictions, y), "predictions": predictions}

    module, losses, plain_losses = WithPredictions(data, batch_size=8), [], []
    recorder = LossRecorder(losses)
    h.fit(module, GradientAccumulationCallback(2, piece_size=3), recorder)
    plain_recorder = LossRecorder(plain_losses)
    h.fit(WithPredictions(data, batch_size=8), GradientAccumulationCallback(2), plain_recorder)
    assert losses == pytest.approx(plain_losses, rel=1e-6)  # the whole batch's, not the first piece's
    # Lightning keeps the values it is given; with pieces an error must free every graph: none is kept
    assert recorder.graphs == 0 and plain_recorder.graphs == 5


@pytest.mark.filterwarnings("ignore:`training_step` returned `None`:UserWarning")
def test_a_skipped_batch_under_auto_is_skipped_as_without_pieces() -> None:
    data = h.regression_data(40)

    class Skips(OomModule):
        def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor | None:
            return None if batch_idx == 1 else super().training_step(batch, batch_idx)

    module = Skips(data, batch_size=8)
    fit(module, GradientAccumulationCallback(2, piece_size="auto"))
    windows = [[0], [2, 3], [4]]  # the window of batches 0-1 steps on batch 0 alone
    assert h.max_abs_diff(module.net, reference(data, 8, windows)) < 1e-6


def test_the_hf_style_halving_without_reweighting_fails_the_oracle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: each piece weighted as a whole micro-batch (the size halved, K unchanged)."""
    from lightning_gradacc import piece_runner

    monkeypatch.setattr(piece_runner.PieceRunner, "_share", lambda self, piece, run: 1.0)
    data = h.regression_data(40)
    module = OomModule(data, batch_size=8, forward_cap=lambda b: None if b < 1 else 5)
    fit(module, GradientAccumulationCallback(2, piece_size="auto"))
    expected = reference(data, 8, h.windows(5, 2))
    assert h.max_abs_diff(module.net, expected) > 1e-3


# ------------------------------------------------------------------------------------ splitting


def test_the_default_splitter_cuts_tensors_mappings_and_sequences_on_their_first_dimension() -> None:
    batch = {
        "x": torch.arange(5),
        "pair": (torch.zeros(5, 2), torch.ones(5)),
        "tag": "t",
        "n": torch.tensor(3),
    }
    pieces = split_batch(batch, 2)
    assert [len(p["x"]) for p in pieces] == [2, 2, 1]
    assert pieces[2]["pair"][0].shape == (1, 2) and pieces[1]["tag"] == "t" and pieces[0]["n"] == 3


@dataclasses.dataclass
class Extra:
    """A dataclass the batch walk finds tensors in, which the default splitter cannot rebuild."""

    mask: Tensor


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ({"ids": ["a", "b", "c"], "x": torch.zeros(3)}, "list of 3 non-tensor values"),
        ((torch.zeros(3), torch.zeros(4)), r"disagree on their first dimension \(\[3, 4\]\)"),
        ("text", "type str has no tensor"),
        ({"x": torch.zeros(3), "extra": Extra(torch.zeros(3))}, "tensors inside a Extra, which"),
    ],
)
def test_a_batch_the_default_splitter_cannot_cut_is_refused_by_type(batch: Any, match: str) -> None:
    with pytest.raises(UnsplittableBatch, match=match):
        split_batch(batch, 2)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"piece_size": 0}, ValueError, r"`piece_size` to be None, an int >= 1.*got 0"),
        ({"piece_size": True}, ValueError, "`piece_size`"),
        ({"piece_size": "half"}, ValueError, "'half'"),
        ({"split_fn": lambda b, s: [b]}, ValueError, "`split_fn` has no effect without `piece_size`"),
        ({"piece_size": 2, "split_fn": 3}, TypeError, "`split_fn`"),
        ({"piece_size": 2, "oom_snapshot": True}, ValueError, "only with `piece_size='auto'`"),
    ],
)
def test_bad_piece_arguments_are_refused_at_construction(kwargs: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        GradientAccumulationCallback(2, **kwargs)


def test_a_split_fn_cuts_a_batch_the_default_splitter_cannot() -> None:
    data = h.regression_data(40)

    class Named(OomModule):  # each batch carries a name per item, which the default splitter refuses
        def train_dataloader(self) -> Any:
            x, y = data.tensors
            names = [f"row {i}" for i in range(40)]
            return h.BatchList(
                [{"x": x[i : i + 8], "y": y[i : i + 8], "names": names[i : i + 8]} for i in range(0, 40, 8)]
            )

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            assert len(batch["names"]) == len(batch["x"])
            self.forwards.append(len(batch["x"]))
            return h.mse(self.net, batch["x"], batch["y"])

    def split(batch: dict[str, Any], size: int) -> list[dict[str, Any]]:
        return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, len(batch["x"]), size)]

    for size in (3, "auto"):  # "auto" refuses it at the first batch, before any out-of-memory error
        with pytest.raises(UnsplittableBatch, match="list of 8 non-tensor values"):
            fit(Named(data), GradientAccumulationCallback(2, piece_size=size))
    module = Named(data)
    callback = GradientAccumulationCallback(2, piece_size=3, split_fn=split)
    fit(module, callback)
    assert module.forwards == [3, 3, 2] * 5
    assert h.max_abs_diff(module.net, reference(data, 8, h.windows(5, 2))) < 1e-6
    assert callback.metrics()["grad_accum/piece_size"] == 3


def test_a_hugging_face_batch_encoding_keeps_its_class_in_pieces() -> None:
    transformers = pytest.importorskip("transformers")
    encoding = transformers.BatchEncoding(
        {"input_ids": torch.zeros(5, 3), "attention_mask": torch.ones(5, 3)}
    )
    pieces = split_batch(encoding, 2)
    assert [type(p) for p in pieces] == [transformers.BatchEncoding] * 3
    assert [p["input_ids"].shape[0] for p in pieces] == [2, 2, 1]


def test_auto_pieces_under_fsdp_and_any_size_under_deepspeed_are_refused_before_training() -> None:
    """An int size runs under FSDP1/FSDP2 (exact: ``tests/distributed/test_model_parallel.py``); "auto" is
    refused there (a rank out of memory stops issuing FSDP's collectives), DeepSpeed refuses any size."""
    from types import SimpleNamespace

    from pytorch_lightning.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    module = h.RegressionModule(h.regression_data(8))
    parallel = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    cases: list[tuple[Any, str, Any, str]] = [
        (FSDPStrategy(), "FSDP", "auto", "FSDP all-gathers and reduce-scatters layer by layer"),
        (parallel, r"ModelParallel \(FSDP2\)", "auto", "FSDP all-gathers and reduce-scatters"),
    ]
    if importlib.util.find_spec("deepspeed") is not None:  # Lightning's strategy needs it installed
        cases.append(
            (DeepSpeedStrategy(), "DeepSpeed", 2, "it runs each batch as pieces, each with its own backward")
        )
    for strategy, name, size, why in cases:
        callback = GradientAccumulationCallback(2, piece_size=size)
        trainer = SimpleNamespace(strategy=strategy, callbacks=[callback], world_size=1)
        refused = rf"\(piece_size={size!r}\)` cannot take effect under {name}.*: {why}"
        with pytest.raises(RuntimeError, match=refused):
            callback._verify("configuration", trainer, module)
    for strategy in (FSDPStrategy(), parallel):  # an int size is not refused
        callback = GradientAccumulationCallback(2, piece_size=2)
        callback._verify(
            "configuration", SimpleNamespace(strategy=strategy, callbacks=[callback], world_size=1), module
        )


def test_an_int_size_is_this_run_s_setting_on_resume_and_unsplit_batches_log_their_size(
    tmp_path: Path,
) -> None:
    data = h.regression_data(40)
    path = tmp_path / "mid_window.ckpt"
    h.preempt(OomModule(data, resumable=True), [GradientAccumulationCallback(4, piece_size=3)], 5, path)
    resumed = OomModule(data, resumable=True)
    callback = GradientAccumulationCallback(4, piece_size=8)  # batches of 4 now run whole
    h.trainer(callbacks=[callback], max_epochs=2).fit(resumed, ckpt_path=path)
    assert set(resumed.forwards) == {4}
    assert callback.metrics()["grad_accum/piece_size"] == 4
    assert h.max_abs_diff(resumed.net, reference(data, 4, h.windows(10, 4, epochs=2))) < 1e-6


def test_a_thrashing_allocator_halves_the_size_as_an_error_would() -> None:
    """The CUDA allocator's retries (it freed its cache to fit) grow during batch 1: batch 2 runs halved.

    A new size is announced, naming why."""
    data = h.regression_data(40)
    module = OomModule(data, batch_size=8)
    callback = GradientAccumulationCallback(2, piece_size="auto")
    readings = iter([0, 0, 3, 3, 3, 3])  # at install, then at each batch's end
    assert callback._runner is not None
    callback._runner._allocator_retries = lambda: next(readings)
    with pytest.warns(UserWarning, match=r"allocator had to free its cache.*pieces of at most 4 items"):
        fit(module, callback)
    assert module.forwards == [8, 8, 4, 4, 4, 4, 4, 4]
    assert h.max_abs_diff(module.net, reference(data, 8, h.windows(5, 2))) < 1e-6
    assert callback.metrics()["grad_accum/oom_retries"] == 0


def test_pieces_under_lightning_pytorch_equal_the_whole_batch() -> None:
    data = h.regression_data(40)
    module = h.LitRegressionModule(data, batch_size=8)
    callback = h.accumulation_callback("lightning.pytorch", 2, piece_size="auto")
    forwards: list[int] = []
    net_forward = module.net.forward
    module.net.forward = lambda x: (forwards.append(len(x)), net_forward(x))[1]  # type: ignore[method-assign]

    def capped(batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        if batch_idx >= 1 and len(batch[0]) > 5:
            raise torch.OutOfMemoryError(f"{OOM} in a forward")
        return h.LitRegressionModule.training_step(module, batch, batch_idx)

    module.training_step = capped  # type: ignore[method-assign]
    h.trainer("lightning.pytorch", callbacks=[callback]).fit(module)
    assert forwards == [8, 4, 4, 4, 4, 4, 4, 4, 4]
    assert h.max_abs_diff(module.net, reference(data, 8, h.windows(5, 2))) < 1e-6


def test_bf16_pieces_add_up_in_the_fp32_buffers_as_whole_batches_do() -> None:
    """With an int size each piece's bf16 gradient goes into the fp32 buffers in its backward: the step's
    error against fp32 does not grow with the number of pieces (summed in bf16 it was 3x at 64 pieces)."""
    import copy

    x, y = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)), torch.randn(64, 1)
    torch.manual_seed(1)
    initial = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    exact = h.big_batch_reference(initial, torch.utils.data.TensorDataset(x, y), 64, [[0]], h.mse, lr=1.0)

    def error(piece_size: int | None) -> float:
        module = OomModule(torch.utils.data.TensorDataset(x, y), batch_size=64, lr=1.0)
        module.net = copy.deepcopy(initial).to(torch.bfloat16)
        callback = GradientAccumulationCallback(1, accumulation_dtype="float32", piece_size=piece_size)
        h.fit(module, callback, precision="bf16-true")
        return max(
            float(((p.float() - q).norm() / (q - p0).norm()).detach())
            for p, q, p0 in zip(
                module.net.parameters(), exact.parameters(), initial.parameters(), strict=True
            )
        )

    whole = error(None)
    assert error(1) < 1.1 * whole


def test_what_training_step_logs_in_every_piece_is_its_own() -> None:
    """Each piece's ``self.log`` is ``training_step``'s (the later pieces run inside the backward): over the
    epoch the mean of the pieces, the whole batches' mean for equal pieces."""
    data = h.regression_data(40)

    class Logs(OomModule):
        def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("l", loss, on_step=False, on_epoch=True)
            return loss

    pieces = fit(Logs(data, batch_size=8), GradientAccumulationCallback(2, piece_size=4))
    whole = fit(Logs(data, batch_size=8), GradientAccumulationCallback(2))
    assert set(pieces.callback_metrics) >= {"l"} and "backward.l" not in str(pieces.logged_metrics)
    assert float(pieces.callback_metrics["l"]) == pytest.approx(float(whole.callback_metrics["l"]), rel=1e-5)


def test_a_resume_right_after_a_k_change_with_auto_pieces_steps_the_schedule_s_windows(
    tmp_path: Path,
) -> None:
    """K goes 2 -> 3 at step 2 (the window of batches 4-6); preempted after batch 5, inside it, resumed."""
    data, schedule = h.regression_data(40), {0: 2, 2: 3}

    def run() -> tuple[OomModule, Any]:
        module = OomModule(data, forward_cap=lambda b: 3, resumable=True)
        return module, GradientAccumulationCallback(schedule, schedule_unit="steps", piece_size="auto")

    path = tmp_path / "after_k_change.ckpt"
    module, callback = run()
    h.preempt(module, [callback], 5, path)
    resumed, callback = run()
    h.trainer(callbacks=[callback], max_epochs=2).fit(resumed, ckpt_path=path)
    windows = [window for window, _ in h.keyed_windows(schedule, 10, epochs=2)]
    assert h.max_abs_diff(resumed.net, reference(data, 4, windows)) < 1e-6
    assert resumed.ooms == 0


def test_a_fit_after_one_interrupted_inside_a_window_goes_on_at_the_size_reached() -> None:
    data = h.regression_data(40)
    callback = GradientAccumulationCallback(2, piece_size="auto")
    interrupted = OomModule(data, batch_size=8, forward_cap=lambda b: 5)
    with pytest.raises(RuntimeError, match="boom"):  # after batch 2, the first of its window
        h.fit(interrupted, callback, h.RaiseAfter(2, RuntimeError("boom")))
    module = OomModule(data, batch_size=8, forward_cap=lambda b: 5)
    fit(module, callback)
    assert h.max_abs_diff(module.net, reference(data, 8, h.windows(5, 2))) < 1e-6
    assert module.ooms == 0 and set(module.forwards) == {4}


def test_pieces_with_lightning_s_swa_checkpointing_and_early_stopping_equal_whole_batches(
    tmp_path: Path,
) -> None:
    """The same run with and without pieces (the whole-batch run is the oracle-tested one): SWA from epoch 1,
    a checkpoint every 2 steps and EarlyStopping on the window loss, 3 epochs."""
    from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint, StochasticWeightAveraging

    def run(piece_size: int | None, name: str) -> OomModule:
        module = OomModule(h.regression_data(40), batch_size=8)
        callbacks = [
            GradientAccumulationCallback(2, piece_size=piece_size),
            StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1),
            ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=2, save_top_k=-1),
            EarlyStopping(monitor="grad_accum/window_loss", patience=100, check_on_train_epoch_end=True),
        ]
        h.trainer(callbacks=callbacks, max_epochs=3, enable_checkpointing=True).fit(module)
        return module

    assert h.max_abs_diff(run(3, "pieces").net, run(None, "whole").net) < 1e-6


class RunsOutOnce(OomModule):
    """Runs out of memory once, in the backward of piece ``at[1]`` of batch ``at[0]`` (the first time)."""

    def __init__(self, data: Any, at: tuple[int, int], **kwargs: Any) -> None:
        super().__init__(data, **kwargs)
        self.at, self.piece, self.failed = at, 0, False

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.piece = 0

    def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        fails = (batch_idx, self.piece) == self.at and not self.failed
        self.failed, self.piece = self.failed or fails, self.piece + 1
        if not fails:
            return super().training_step(batch, batch_idx)
        x, y = batch
        hidden = _OomInBackward.apply(self.net[0](x), 0)
        self.forwards.append(len(x))
        return nn.functional.mse_loss(self.net[2](self.net[1](hidden)), y)


class BatchEnds(pl.Callback):
    """After the accumulation callback, at each batch's end: ``outputs["loss"]``, the piece size, the loss."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.piece_sizes: list[int] = []
        self.window_losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
        callback = trainer.callbacks[0]
        self.losses.append(float(outputs["loss"]))
        self.piece_sizes.append(callback.stats.piece_size)
        if trainer.fit_loop.epoch_loop._should_accumulate() is False:
            self.window_losses.append(callback.stats.window_loss)


def test_the_losses_and_the_piece_size_are_the_whole_batch_s_through_a_redone_batch() -> None:
    """Batch 0 runs out in its forward (pieces of 4 after it); batch 1, in the middle of a window of 3,
    runs out in its second piece's backward and is redone from the snapshot in pieces of 2. Each batch's
    ``outputs["loss"]`` is the whole batch's, each window's loss the big batch's (plain PyTorch), and the
    piece size of batch 1 is its redo's (2), not the failed pass's (4)."""
    data = h.regression_data(48)  # 6 batches of 8; K=3: windows 3, 3
    module = RunsOutOnce(data, (1, 1), batch_size=8, forward_cap=Cap(at={0: 5}))
    ends = BatchEnds()
    callback = GradientAccumulationCallback(3, piece_size="auto", oom_snapshot=True)
    with pytest.warns(UserWarning, match="pieces of at most 2 items"):
        h.fit(module, callback, ends)
    window_losses: list[float] = []
    expected = reference(data, 8, h.windows(6, 3), losses=window_losses)
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert module.forwards[:7] == [4, 4, 4, 4, 2, 2, 2]  # batch 0; batch 1: 4, 4 (fails), then 2 x 4
    assert ends.window_losses == pytest.approx(window_losses, rel=1e-6)
    whole = BatchEnds()
    h.fit(OomModule(data, batch_size=8), GradientAccumulationCallback(3), whole)
    assert ends.losses == pytest.approx(whole.losses, rel=1e-6)  # each batch's, once, after a redo too
    assert ends.piece_sizes == [4, 2, 2, 2, 2, 2]
    assert callback.stats.oom_retries == 2


def test_halving_rounds_up_so_that_a_size_that_fits_is_not_skipped() -> None:
    """6 items, 2 fit: 6 -> 3 -> 2 (halving down would go 6 -> 3 -> 1 and run items one by one)."""
    data = h.regression_data(36)  # 6 batches of 6
    module = OomModule(data, batch_size=6, forward_cap=Cap(since={0: 2}))
    callback = GradientAccumulationCallback(2, piece_size="auto")
    with pytest.warns(UserWarning, match="pieces of at most 2 items") as warned:
        fit(module, callback)
    announced = [w for w in warned if "piece_size='auto'" in str(w.message)]
    assert len(announced) == 1  # once per size reached (rank zero), not once per error
    assert module.forwards[-3:] == [2, 2, 2] and callback.stats.piece_size == 2
    assert h.max_abs_diff(module.net, reference(data, 6, h.windows(6, 2))) < 1e-6
    summary = callback.summary()
    assert "2 out-of-memory errors recovered; the last batch's largest piece 2 items" in summary


@pytest.mark.parametrize(
    ("split", "match"),
    [
        (lambda batch, size: [batch], r"pieces of at most 4 items .* it returned pieces of \[8\] items"),
        (lambda batch, size: [(x[:size], y[:size]) for x, y in [batch]], r"batch's 8, .*\[4\] items"),
    ],
    ids=["ignores-the-size", "drops-items"],
)
def test_a_split_fn_whose_pieces_are_too_large_or_lose_items_is_refused_before_any_error(
    split: Any, match: str
) -> None:
    """A ``split_fn`` that ignores its size made "auto" retry forever; one that drops items trained on
    less, silently. Both are refused at the first batch, before any out-of-memory error."""
    module = OomModule(h.regression_data(40), batch_size=8, forward_cap=Cap(since={2: 5}))
    callback = GradientAccumulationCallback(2, piece_size="auto", split_fn=split)
    with pytest.raises(ValueError, match=match):
        fit(module, callback)
    assert module.ooms == 0


@pytest.mark.filterwarnings("ignore:`training_step` returned `None`:UserWarning")
def test_an_empty_window_logs_its_declared_norm_not_the_last_window_s() -> None:
    """Every batch of window 1 returns None: nothing is stepped, and the norm logged for it is 0 (nothing
    measured), where the window before logged its own."""

    class SkipsWindow1(h.RegressionModule):
        def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor | None:
            return None if batch_idx in (2, 3) else super().training_step(batch, batch_idx)

    recorder = h.MetricsRecorder()
    callback = GradientAccumulationCallback(2)
    h.trainer(callbacks=[callback], logger=recorder, log_every_n_steps=1).fit(
        SkipsWindow1(h.regression_data(40))
    )
    norms = [v for _, v in recorder.series("grad_accum/last_grad_norm")]
    empty = [v for _, v in recorder.series("grad_accum/empty_windows")]
    assert empty == [0, 1, 1, 1, 1] and norms[0] > 0 and norms[1] == 0 and norms[2] > 0


def test_a_batch_norm_in_training_mode_is_warned_of_since_pieces_change_its_forward() -> None:
    """BatchNorm normalizes by the statistics of the items of its forward: in pieces of 3 of 6 each piece
    has its own, and the step is not the whole batch's. The user is told at train start, naming it."""
    data = h.regression_data(24)

    def module() -> OomModule:
        bn = OomModule(data, batch_size=6)
        bn.net = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
        return bn

    with pytest.warns(UserWarning, match=r"`net.1` normalizes over the items of its forward \(BatchNorm"):
        pieces = fit(module(), GradientAccumulationCallback(2, piece_size=3))
    whole = fit(module(), GradientAccumulationCallback(2))
    assert h.max_abs_diff(pieces.lightning_module.net, whole.lightning_module.net) > 1e-2  # what it warns of


def test_a_callback_that_ran_pieces_pickles_for_a_later_ddp_spawn_fit() -> None:
    import pickle

    for size in (2, "auto"):
        callback = GradientAccumulationCallback(2, piece_size=size)
        caps = {"forward_cap": Cap(), "backward_cap": Cap()}  # picklable, as a spawned module must be
        fit(OomModule(h.regression_data(40), batch_size=8, **caps), callback)
        restored = pickle.loads(pickle.dumps(callback))  # what `ddp_spawn` does with it
        module = OomModule(h.regression_data(40), batch_size=8, **caps)
        fit(module, restored)
        assert h.max_abs_diff(module.net, reference(h.regression_data(40), 8, h.windows(5, 2))) < 1e-6


def items_of(batch: dict[str, Any]) -> int:
    return len(batch["x"])


def test_a_split_fn_of_items_beside_a_tensor_of_another_length_counts_them_with_item_count_fn() -> None:
    """Items with a variable number of images each, the images first: the tensors disagree on their first
    dimension, so neither the pieces nor the batch can be counted from them (Lightning's inference would read
    the images): refused without `item_count_fn`, exact with it; a split that returns the piece that ran out
    of memory again is stopped (it would halve forever)."""
    data = h.regression_data(40)

    class WithImages(OomModule):
        def train_dataloader(self) -> Any:
            x, y = data.tensors
            return h.BatchList(
                [
                    {"images": torch.zeros(2 * 8 + 1, 3), "x": x[i : i + 8], "y": y[i : i + 8]}
                    for i in range(0, 40, 8)
                ]
            )

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            if self.forward_cap(batch_idx) is not None and len(batch["x"]) > self.forward_cap(batch_idx):
                self.ooms += 1
                raise torch.OutOfMemoryError(f"{OOM} in a forward")
            self.forwards.append(len(batch["x"]))
            return h.mse(self.net, batch["x"], batch["y"])

    def by_items(batch: dict[str, Any], size: int) -> list[dict[str, Any]]:
        n = len(batch["x"])
        return [
            {
                "images": batch["images"][2 * i : 2 * min(i + size, n) + 1],
                "x": batch["x"][i : i + size],
                "y": batch["y"][i : i + size],
            }
            for i in range(0, n, size)
        ]

    with pytest.raises(ValueError, match=r"cannot be counted here.*Pass `item_count_fn`"):
        fit(WithImages(data, batch_size=8), GradientAccumulationCallback(2, piece_size=3, split_fn=by_items))
    module = WithImages(data, batch_size=8)
    fit(module, GradientAccumulationCallback(2, piece_size=3, split_fn=by_items, item_count_fn=items_of))
    assert module.forwards == [3, 3, 2] * 5
    assert h.max_abs_diff(module.net, reference(data, 8, h.windows(5, 2))) < 1e-6
    stuck = WithImages(data, batch_size=8, forward_cap=Cap(since={1: 4}))
    callback = GradientAccumulationCallback(
        2, piece_size="auto", split_fn=lambda batch, size: [batch], item_count_fn=items_of
    )
    with pytest.raises(RuntimeError, match="no smaller one, so halving would not end"):
        fit(stuck, callback)


def test_whole_batches_do_not_warn_of_a_batch_norm() -> None:
    module = OomModule(h.regression_data(24), batch_size=6)
    module.net = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(module, GradientAccumulationCallback(2, piece_size="auto"))
    assert not [w for w in caught if "BatchNorm" in str(w.message)]
