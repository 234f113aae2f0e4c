"""The callback under Lightning's sharded strategies on 2 CPU processes, against the big batch.

``ModelParallelStrategy`` (FSDP2 via ``fully_shard``) and ``FSDPStrategy`` (FSDP1).

``model_parallel_run.py`` (next to this file) trains (the strategy re-runs that script for its second rank)
and records which samples every micro-batch held; the oracle takes one plain-PyTorch step per window on
those samples of both ranks as one batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_gradacc import GradAccumulator
from tests.distributed import model_parallel_run as run
from tests.helpers import run_script

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


@pytest.fixture(
    scope="module",
    params=[
        "model_parallel",
        "fsdp",
        pytest.param(
            "fsdp_cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(torch.cuda.device_count() < 2, reason="Lightning's FSDP on 2 GPUs"),
            ],
        ),
    ],
)
def trained(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    return run_script(HERE / "model_parallel_run.py", tmp_path_factory.mktemp(request.param), request.param)


def _windows(out: Path, name: str, drop: int | None = None) -> list[list[int]]:
    """The samples of each window, both ranks together (windows of K micro-batches, restarting each epoch);
    without the micro-batches of index ``drop`` in their epoch."""
    # the samples of each training step, as micro-batches of 2 (pieces record their samples apart)
    steps = [torch.load(out / f"{name}-seen-{rank}.pt") for rank in range(2)]
    flat = [[i for step in seen for i in step] for seen in steps]
    per_rank = [[rows[j : j + 2] for j in range(0, len(rows), 2)] for rows in flat]
    per_epoch = len(per_rank[0]) // 2
    windows: list[list[int]] = []
    for epoch in range(2):
        for start in range(0, per_epoch, run.K):
            window = range(epoch * per_epoch + start, epoch * per_epoch + min(start + run.K, per_epoch))
            kept = [b for b in window if b - epoch * per_epoch != drop]
            windows.append([i for seen in per_rank for b in kept for i in seen[b]])
    return windows


def _reference(
    windows: list[list[int]], options: dict[str, Any], skip: tuple[int, ...] = (), adam: bool = False
) -> dict:
    model = run.net()
    optimizer: torch.optim.Optimizer = (
        torch.optim.Adam(model.parameters(), lr=0.05) if adam else torch.optim.SGD(model.parameters(), lr=0.5)
    )
    _, x, y = run.data().tensors
    for index, rows in enumerate(windows):
        optimizer.zero_grad()
        samples = torch.tensor(rows)
        loss = (
            run.weighted_loss(model(x[rows]), y[rows], samples)
            if options.get("scaling") == "weighted"
            else nn.functional.mse_loss(model(x[rows]), y[rows])
        )
        loss.backward()
        if index in skip:
            continue
        if "max_grad_norm" in options:
            per_parameter = options.get("clip_scope") == "parameter"
            for group in [[p] for p in model.parameters()] if per_parameter else [list(model.parameters())]:
                torch.nn.utils.clip_grad_norm_(group, options["max_grad_norm"])
        optimizer.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "name",
    [
        "mean",
        "clip",
        "clip_parameter",
        "weighted",
        "buffers",
        "window_end",
        "window_end_clip",
        "weighted_pieces",
        "window_end_pieces",
    ],
)
def test_sharded_windows_equal_the_big_batch(trained: Path, name: str) -> None:
    full, counts, global_step, _ = torch.load(trained / f"{name}.pt")
    windows = _windows(trained, name)
    assert [len(w) for w in windows] == [16, 8, 16, 8]  # 4 and 2 micro-batches of 2 samples, 2 ranks
    expected = _reference(windows, run.SCENARIOS[name])
    assert max(float((full[n] - expected[n]).abs().max()) for n in expected) < 1e-6
    assert counts[:3] == (4, 0, 0) and global_step == 4
    if "max_grad_norm" in run.SCENARIOS[name]:
        assert counts[3] > 0
        assert max(float((expected[n] - _reference(windows, {})[n]).abs().max()) for n in expected) > 1e-3


def test_a_step_keyed_schedule_under_sharding_equals_the_big_batch_of_each_window(trained: Path) -> None:
    """K changes mid-epoch (2, then 4 micro-batches): each window, clipped, is one step on its samples."""
    full, counts, global_step, _ = torch.load(trained / "step_schedule.pt")
    per_rank = [torch.load(trained / f"step_schedule-seen-{rank}.pt") for rank in range(2)]
    bounds = [(0, 2), (2, 6), (6, 10), (10, 12)]  # micro-batch indices over both epochs: 2 | 4 || 4 | 2
    windows = [[i for seen in per_rank for b in range(*span) for i in seen[b]] for span in bounds]
    expected = _reference(windows, run.SCENARIOS["step_schedule"])
    assert max(float((full[n] - expected[n]).abs().max()) for n in expected) < 1e-6
    assert counts[0] == 4 and global_step == 4


def test_an_item_budget_under_sharding_closes_each_window_as_its_big_batch(trained: Path) -> None:
    """Windows close where the items of both ranks' micro-batches reach 17; each epoch's end closes one."""
    full, counts, global_step, _ = torch.load(trained / "weighted_budget.pt")
    per_rank = [torch.load(trained / f"weighted_budget-seen-{rank}.pt") for rank in range(2)]
    per_epoch = len(per_rank[0]) // 2
    windows: list[list[int]] = []
    for epoch in range(2):
        window: list[int] = []
        for b in range(epoch * per_epoch, (epoch + 1) * per_epoch):
            window += [i for seen in per_rank for i in seen[b]]
            if float(run.sample_weights(torch.tensor(window)).sum()) >= 17:
                windows.append(window)
                window = []
        if window:
            windows.append(window)
    assert len({len(w) for w in windows}) > 1  # the data decides where windows end
    expected = _reference(windows, run.SCENARIOS["weighted_budget"])
    assert max(float((full[n] - expected[n]).abs().max()) for n in expected) < 1e-6
    assert counts[0] == global_step == len(windows)


def test_a_non_finite_micro_batch_on_one_rank_skips_on_both(trained: Path) -> None:
    full, counts, _, _ = torch.load(trained / "nan_on_one_rank.pt")
    windows = _windows(trained, "nan_on_one_rank")
    expected = _reference(windows, {}, skip=(0, 2))  # rank 1's batch 1 of each epoch was nan
    assert max(float((full[n] - expected[n]).abs().max()) for n in expected) < 1e-6
    assert counts[:3] == (4, 2, 2)


def test_a_fused_optimizer_skips_the_non_finite_windows_and_clips_the_others_on_the_device(
    trained: Path,
) -> None:
    full, counts, _, _ = torch.load(trained / "fused_nan_clip.pt")
    windows = _windows(trained, "fused_nan_clip")
    # rank 1's batch 1 of each epoch was nan
    expected = _reference(windows, {"max_grad_norm": 0.05}, skip=(0, 2), adam=True)
    assert max(float((full[n] - expected[n]).abs().max()) for n in expected) < 1e-6
    assert counts == (4, 2, 2, 2)  # windows, skipped, non-finite, clipped


def test_a_non_finite_last_micro_batch_is_dropped_alone(trained: Path) -> None:
    """Rank 1's micro-batch 3 (the last of each epoch's first window) is nan: micro-batch 3 is left out on
    both ranks and the other three step (it used to skip the whole window)."""
    full, counts, global_step, _ = torch.load(trained / "skip_last_micro_batch.pt")
    windows = _windows(trained, "skip_last_micro_batch", drop=3)
    assert [len(w) for w in windows] == [12, 8, 12, 8]
    expected = _reference(windows, {})
    assert max(float((full[n] - expected[n]).abs().max()) for n in expected) < 1e-6
    assert counts[:3] == (4, 0, 0) and global_step == 4


def test_a_save_inside_a_window_held_unsynced_is_refused(trained: Path) -> None:
    for rank in range(2):
        message = (trained / f"unsynced-save-{rank}.txt").read_text()
        assert "held unsynced inside FSDP" in message and "cannot be saved in the middle" in message
    if trained.name.startswith("model_parallel"):  # FSDP2 names what it holds back
        assert "Held back: net.0.weight, net.0.bias, net.2.weight, net.2.bias." in message


def test_replicas_at_window_end_without_hsdp_says_why_it_does_nothing(trained: Path) -> None:
    if not trained.name.startswith("model_parallel"):
        pytest.skip("FSDP2 (ModelParallelStrategy) only")
    message = (trained / "replicas_without_hsdp.txt").read_text()
    assert message == (
        "`sharded_reduction='replicas_at_window_end'` has no effect: no module is sharded over an HSDP mesh"
        " (a replicate and a shard dimension), so there is no all-reduce across replicas to defer. Use"
        " 'window_end' to defer the reduce-scatter."
    )


def test_window_end_reduces_once_per_window(trained: Path) -> None:
    """12 micro-batches per rank in 4 windows; FSDP reduce-scatters once per backward, per FSDP module
    group (each `fully_shard` call or wrapper of the model: 2 layers + the root's leftovers)."""
    every = torch.load(trained / "mean.pt")[3][0]
    once = torch.load(trained / "window_end.pt")[3][0]
    assert every > 0 and once > 0
    assert every == 3 * once  # 12 backwards against 4
    # pieces of one sample: 24 backwards, reduced in each (the default) or in the window's last piece only
    assert torch.load(trained / "weighted_pieces.pt")[3][0] == 2 * every
    assert torch.load(trained / "window_end_pieces.pt")[3][0] == once


@pytest.mark.parametrize("name", list(run.HSDP_SCENARIOS))
def test_hsdp_windows_equal_the_big_batch(trained: Path, name: str) -> None:
    """2 replicas of 1 shard: the norm is combined over the shard dimension only (over both ranks it would
    be sqrt(2) too large and clip otherwise)."""
    if not trained.name.startswith("model_parallel"):
        pytest.skip("FSDP2 (ModelParallelStrategy) only")
    full, counts, global_step, _ = torch.load(trained / f"{name}.pt")
    windows = _windows(trained, name)
    expected = _reference(windows, run.HSDP_SCENARIOS[name])
    assert max(float((full[n] - expected[n]).abs().max()) for n in expected) < 1e-6
    assert counts[:3] == (4, 0, 0) and global_step == 4 and counts[3] > 0


def test_replicas_at_window_end_all_reduces_once_per_window(trained: Path) -> None:
    """The all-reduces across replicas: one per backward and FSDP module with parameters (2 layers), 12
    backwards against 4; the callback's own (counts, once per step) are the same in both runs."""
    if not trained.name.startswith("model_parallel"):
        pytest.skip("FSDP2 (ModelParallelStrategy) only")
    every = torch.load(trained / "hsdp.pt")[3][1]
    once = torch.load(trained / "hsdp_replicas_at_window_end.pt")[3][1]
    assert every - once == 2 * (12 - 4)


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_resume_from_a_checkpoint_inside_a_window_is_exact(trained: Path, state_dict_type: str) -> None:
    """A Lightning checkpoint saved after window 2's first micro-batch holds the open window; the fit resumed
    from it ends where the uninterrupted one did (without the window restored it ends 1e-2 away).
    "sharded": a distributed checkpoint (one shard file per rank plus rank 0's metadata, which holds the
    callback's state); "full": one file (FSDPStrategy's default)."""
    path = trained / f"mid-window-{state_dict_type}.ckpt"
    if not path.exists():
        assert state_dict_type == "full" and not trained.name.startswith("fsdp_cuda")
        pytest.skip("full checkpoints: Lightning's FSDP on GPUs (ModelParallelStrategy saves sharded ones)")
    checkpoint = torch.load(path / "meta.pt" if path.is_dir() else path, weights_only=False)
    state = next(v for k, v in checkpoint["callbacks"].items() if "GradientAccumulation" in k)
    assert state["window"]["micro_batches"] == 1 and len(state["window"]["sharded"]) == 4
    (uninterrupted, resumed), global_step = torch.load(trained / f"resume-{state_dict_type}.pt")
    assert global_step == 4
    assert max(float((resumed[n] - uninterrupted[n]).abs().max()) for n in uninterrupted) < 1e-6


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("micro_batch_window_end", "check each micro-batch's reduced gradient, but with `sharded_reduction="),
        (
            "buffers_window_end",
            "`accumulation_dtype=torch.float64` cannot take effect with `sharded_reduction=",
        ),
        ("replicas_at_window_end", "FSDP1 (`FSDPStrategy`) cannot defer the all-reduce across replicas"),
        ("lightning_norm_clip", "pass `GradientAccumulationCallback(max_grad_norm=0.05)`: it clips"),
        ("auto", "`noise_scale=True` is not supported with FSDP1's flat parameters"),
    ],
)
def test_refused_at_train_start(trained: Path, name: str, expected: str) -> None:
    if trained.name.startswith("model_parallel") and name not in (
        "micro_batch_window_end",
        "buffers_window_end",
    ):
        pytest.skip("FSDP1 only")
    for rank in range(2):
        assert expected in (trained / f"refused-{name}-{rank}.txt").read_text()


def test_an_auto_run_under_fsdp2_replays_as_fixed_windows(trained: Path) -> None:
    """K chosen by "auto" from the noise scale measured on FSDP2's unsharded gradients: both ranks step the
    same windows (K=1, then the rule's), each, clipped, one step on both ranks' samples as one batch."""
    if not trained.name.startswith("model_parallel"):
        pytest.skip("FSDP2 (ModelParallelStrategy) only")
    full, counts, global_step, _ = torch.load(trained / "auto.pt")
    steps = [torch.load(trained / f"auto-steps-{rank}.pt") for rank in range(2)]
    per_rank = [torch.load(trained / f"auto-seen-{rank}.pt") for rank in range(2)]
    assert steps[0] == steps[1]
    bounds, start = [], 0
    for index, step in enumerate(steps[0]):
        if step != (steps[0][index - 1] if index else 0):  # micro-batch `index` ended a window
            bounds.append((start, index + 1))
            start = index + 1
    assert start == len(steps[0])  # every window stepped
    assert steps[0][0] == 1 and len({end - begin for begin, end in bounds}) >= 2, bounds
    windows = [[i for seen in per_rank for b in range(*span) for i in seen[b]] for span in bounds]
    expected = _reference(windows, run.FSDP2_SCENARIOS["auto"])
    assert max(float((full[n] - expected[n]).abs().max()) for n in expected) < 1e-6
    assert counts[0] == global_step == len(windows)
    # the estimates the rule read: those of one process holding both ranks' micro-batches in its window
    _, x, y = run.data().tensors
    model = run.net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    estimates = torch.load(trained / "auto-estimates.pt")
    assert len(estimates) == len(windows)
    for (begin, end), found in zip(bounds, estimates, strict=True):
        micro_batches = [seen[b] for seen in per_rank for b in range(begin, end)]
        accumulator = GradAccumulator(
            model.named_parameters(), len(micro_batches), noise_scale=True, max_grad_norm=0.05
        )
        for rows in micro_batches:
            accumulator.backward(nn.functional.mse_loss(model(x[rows]), y[rows]), items=len(rows))
        accumulator.step(optimizer)
        accumulator.remove_hooks()
        wanted = (accumulator.stats.grad_sq_norm_estimate, accumulator.stats.trace_sigma_estimate)
        assert found == pytest.approx(wanted, rel=1e-5), (found, wanted)
