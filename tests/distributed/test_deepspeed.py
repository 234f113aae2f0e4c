"""DeepSpeed (ZeRO 0-3) through ``Trainer.fit``: every window the step of one big batch of its micro-batches.

Each test spawns processes (``tests/deepspeed_run.py``: DeepSpeed on CPU, gloo) and runs several fits in
them; the references are plain PyTorch, one SGD step per window over the window's rows as one batch.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_gradacc.lr_schedule import TokenSchedule
from tests import helpers as h
from tests.deepspeed_run import Scenario, run

pytestmark = [
    pytest.mark.slow,  # spawns processes
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None,
        reason='DeepSpeed is not installed (pip install -e ".[deepspeed]" with DS_BUILD_OPS=0)',
    ),
]


def diff(result: dict[str, Any], reference: torch.nn.Module) -> float:
    assert "error" not in result, result.get("error")
    state = result["state"]
    return max((state[name] - p.detach()).abs().max().item() for name, p in reference.named_parameters())


def reference(
    windows: list[list[int]], *, samples: int = 20, world: int = 1, **kwargs: Any
) -> torch.nn.Module:
    data = h.regression_data(samples)
    return h.big_batch_reference(h.regression_net(), data, 4 * world, windows, h.mse, **kwargs)


# 20 rows: 5 micro-batches of 4 per epoch; K=2 over 2 epochs: windows of 2, 2 and 1 in each epoch
TAILS = h.windows(5, 2, epochs=2)


def test_zero_stages_are_exact_with_an_epochs_partial_last_window_where_the_built_in_is_off(
    tmp_path: Path,
) -> None:
    scenarios = [
        Scenario(callback=None, trainer_k=2, stage=2),  # Lightning's built-in: the negative control
        Scenario(callback={"accumulation_steps": 2}, stage=0),
        Scenario(callback={"accumulation_steps": 2}, stage=1),
        Scenario(callback={"accumulation_steps": 2, "max_grad_norm": 0.5}, stage=2),
        Scenario(callback={"accumulation_steps": 2, "scaling": "sum"}, stage=2, scheduler=True),
    ]
    built_in, zero0, zero1, clipped, summed = run(scenarios, tmp_path)
    exact = reference(TAILS)
    # the built-in divides every loss twice (Lightning by K, DeepSpeed by its steps) and carries the
    # epoch's last micro-batch into the next epoch: its steps and Lightning's disagree
    assert diff(built_in, exact) > 0.05
    assert built_in["global_step"] != built_in["engine_steps"]
    for result in (zero0, zero1):
        assert diff(result, exact) < 1e-6
        assert result["global_step"] == result["engine_steps"] == len(TAILS)
    assert diff(clipped, reference(TAILS, max_grad_norm=0.5)) < 1e-6
    halved = [0.5**i for i in range(len(TAILS))]  # the scheduler's factor at each step
    assert diff(summed, reference(TAILS, sum_of_means=True, lr_factors=halved)) < 1e-6
    # the LR scheduler steps once per real step (x0.5 each), read at every batch's end
    steps_before = [sum(len(w) for w in TAILS[: i + 1]) for i in range(len(TAILS))]
    assert [summed["lrs"][n - 1] for n in steps_before] == [0.1 * 0.5 ** (i + 1) for i in range(len(TAILS))]
    metrics = summed["metrics"]
    assert metrics["grad_accum/windows"] == len(TAILS)
    assert metrics["grad_accum/micro_batches_last_step"] == 1  # the epoch's tail
    assert metrics["grad_accum/items_last_step"] == 4
    assert metrics["grad_accum/accumulation_steps"] == 2  # K, not the tail's length
    # what DeepSpeed does not show is not logged: its clipping, the loss, the norm where it computes none
    assert "grad_accum/clipped_steps" not in metrics and "grad_accum/window_loss" not in metrics
    assert "grad_accum/last_grad_norm" not in zero0["metrics"]  # ZeRO-0 in fp32 keeps no norm
    assert clipped["metrics"]["grad_accum/last_grad_norm"] > 0.5  # ZeRO-2's, before its clipping


def test_schedules_and_a_target_batch_size_are_exact_under_zero_2(tmp_path: Path) -> None:
    keyed = {0: 2, 2: 3}
    scenarios = [
        Scenario(callback={"accumulation_steps": keyed, "schedule_unit": "steps"}, samples=40),
        Scenario(callback={"accumulation_steps": {0: 2, 1: 3}}),  # by epoch
        Scenario(callback={"target_batch_size": 8}),  # K = 8 / 4 = 2
    ]
    by_steps, by_epoch, target = run(scenarios, tmp_path)
    windows = [w for w, _ in h.keyed_windows(keyed, 10, epochs=2, unit="steps")]
    assert diff(by_steps, reference(windows, samples=40)) < 1e-6
    assert by_steps["global_step"] == by_steps["engine_steps"] == len(windows)
    epoch_windows = h.windows(5, lambda epoch: (2, 3)[epoch], epochs=2)
    assert diff(by_epoch, reference(epoch_windows)) < 1e-6
    assert by_epoch["global_step"] == by_epoch["engine_steps"] == len(epoch_windows)
    assert diff(target, reference(TAILS)) < 1e-6


def test_lr_scaling_and_a_token_schedule_follow_the_window_s_k_under_every_zero_stage(tmp_path: Path) -> None:
    """The factor goes around the engine's step: ZeRO-1/2 step torch's optimizer once per parameter group
    inside theirs, ZeRO-0 in fp32 steps torch's itself; the scheduler's learning rate comes back after."""
    keyed = {0: 2, 2: 3}
    scaled = {"accumulation_steps": keyed, "schedule_unit": "steps", "lr_scaling": "linear"}
    token_lr = {"accumulation_steps": 2, "lr_schedule": TokenSchedule(total=40, warmup=8, final=0.5)}
    scenarios = [
        Scenario(callback=scaled, stage=2, samples=40),
        Scenario(callback=scaled, stage=1, samples=40),
        Scenario(callback=scaled, stage=0, samples=40),
        Scenario(callback=token_lr, stage=2, samples=40, epochs=1),
    ]
    zero2, zero1, zero0, scheduled = run(scenarios, tmp_path)
    keyed_windows = h.keyed_windows(keyed, 10, epochs=2, unit="steps")
    factors = [k / 2 for _, k in keyed_windows]  # linear: K over the first window's K
    exact = reference([w for w, _ in keyed_windows], samples=40, lr_factors=factors)
    unscaled = reference([w for w, _ in keyed_windows], samples=40)
    for result in (zero2, zero1, zero0):
        assert diff(result, exact) < 1e-6
        assert result["global_step"] == result["engine_steps"] == len(keyed_windows)
        assert result["lrs"][-1] == 0.1  # the scheduler's value, restored after each step
    assert diff(zero2, unscaled) > 1e-3  # the factor took effect
    windows = h.windows(10, 2)
    schedule = TokenSchedule(total=40, warmup=8, final=0.5)
    items_before = [8.0 * i for i in range(len(windows))]  # 2 micro-batches of 4 items per window
    token_factors = [schedule.factor(items) for items in items_before]
    assert diff(scheduled, reference(windows, samples=40, lr_factors=token_factors)) < 1e-6
    assert diff(scheduled, reference(windows, samples=40)) > 1e-3


def test_a_resume_from_a_window_end_is_exact_and_from_inside_one_steps_its_rest(tmp_path: Path) -> None:
    scenarios = [
        Scenario(callback={"accumulation_steps": 2}, stage=0, resume_after=3),  # a window's end, mid-epoch
        Scenario(callback={"accumulation_steps": 2}, stage=2, resume_after=3),
        Scenario(callback={"accumulation_steps": 2}, stage=2, resume_after=4),  # the epoch's end
        Scenario(callback={"accumulation_steps": 2}, stage=2, resume_after=2),  # inside the window [2, 3]
    ]
    *exact, inside = run(scenarios, tmp_path)
    for result in exact:
        assert diff(result, reference(TAILS)) < 1e-6
        assert result["global_step"] == result["engine_steps"] == len(TAILS)
        assert result["metrics"]["grad_accum/total_micro_batches"] == 10  # the counters were restored
    # DeepSpeed's checkpoint holds no accumulated gradient: micro-batch 2 is lost, 3 steps alone (warned)
    assert diff(inside, reference([[0, 1], [3], [4], *TAILS[3:]])) < 1e-6
    assert inside["global_step"] == inside["engine_steps"] == len(TAILS)


def test_bf16_mixed_is_within_bf16_rounding_where_the_built_in_is_off(tmp_path: Path) -> None:
    bf16 = {"precision": "bf16-mixed"}
    skip = {"accumulation_steps": 2, "overflow": "skip"}
    ours, built_in, chosen = run(
        [
            Scenario(callback={"accumulation_steps": 2}, trainer=bf16),
            Scenario(trainer_k=2, trainer=bf16),
            Scenario(callback=skip, trainer=bf16, epochs=1),
        ],
        tmp_path,
    )
    # DeepSpeed's bf16 casts the model to bfloat16 (8 bits of mantissa): 2.7e-3 from the fp32 reference
    # measured, where the built-in (doubled division, carried tail) is 5.8e-1 off
    assert diff(ours, reference(TAILS)) < 5e-3
    assert diff(built_in, reference(TAILS)) > 0.05
    # overflow left at its default asks for nothing: no warning that bf16 cannot skip (one set does warn)
    assert not [w for w in ours["warnings"] if "overflow" in w]
    assert [w for w in chosen["warnings"] if "`overflow='skip'` takes effect under DeepSpeed only" in w]
    assert ours["global_step"] == ours["engine_steps"] == len(TAILS)


def test_settings_deepspeed_cannot_honour_are_refused_before_training(tmp_path: Path) -> None:
    refused = [
        ({"accumulation_steps": "auto"}, "noise_scale=True or accumulation_steps='auto'"),
        ({"clip_mode": "micro_batch", "max_grad_norm": 1.0, "accumulation_dtype": "float32"}, "clip_mode="),
        ({"accumulation_dtype": "float64"}, "accumulation_dtype='float64'"),
        ({"clip_value": 0.1}, "clip_value=0.1"),
        ({"overflow": "raise"}, "overflow='raise'"),
    ]
    scenarios = [Scenario(callback={"accumulation_steps": 2, **kwargs}, epochs=1) for kwargs, _ in refused]
    results = run(scenarios, tmp_path)
    for (_, setting), result in zip(refused, results, strict=False):
        assert result["error"].startswith("RuntimeError"), result["error"]
        assert f"GradientAccumulationCallback({setting}" in result["error"]
        assert "cannot take effect under DeepSpeed" in result["error"]


STEPS_1_THEN_2 = {"accumulation_steps": {0: 1, 2: 2}, "schedule_unit": "steps"}


def test_two_ranks_are_exact_with_partial_windows_clipping_and_lr_scaling(tmp_path: Path) -> None:
    scenarios = [
        Scenario(callback={"accumulation_steps": 2, "max_grad_norm": 0.5}, stage=2, samples=40),
        Scenario(callback={"accumulation_steps": 2}, stage=0, samples=40),
        Scenario(callback={**STEPS_1_THEN_2, "lr_scaling": "sqrt"}, stage=2, samples=40),
    ]
    clipped, zero0, scaled = run(scenarios, tmp_path, world=2)
    keyed = h.keyed_windows({0: 1, 2: 2}, 5, epochs=2, unit="steps")
    assert diff(clipped, reference(TAILS, samples=40, world=2, max_grad_norm=0.5)) < 1e-6
    assert diff(zero0, reference(TAILS, samples=40, world=2)) < 1e-6
    assert clipped["global_step"] == clipped["engine_steps"] == len(TAILS)
    assert clipped["metrics"]["grad_accum/items_last_step"] == 8  # the tail: 4 items on each rank
    sqrt_k = [k**0.5 for _, k in keyed]  # "sqrt": the square root of K over the first window's K (1)
    assert diff(scaled, reference([w for w, _ in keyed], samples=40, world=2, lr_factors=sqrt_k)) < 1e-6


def test_a_window_cut_short_is_discarded_under_every_zero_stage(tmp_path: Path) -> None:
    """An epoch ended inside a window (``on_train_batch_start`` returned -1) or a ``None`` batch where it
    should end: the window never steps, and none of its gradient reaches the next one (ZeRO-2 keeps it in
    partitions that ``zero_grad`` does not clear, and must be told to forget them)."""
    k2, k3 = {"accumulation_steps": 2}, {"accumulation_steps": 3}
    scenarios = [
        Scenario(callback=k2, stage=2, stop_epoch_at=3),  # epoch 0: [0, 1] steps, [2] is cut
        Scenario(callback=k3, stage=2, stop_epoch_at=4),  # epoch 0: [0, 1, 2] steps, [3] is cut
        Scenario(callback=k2, stage=2, none_at=1),  # batch 1 is None: [0] is cut at batch 2
        Scenario(callback=k2, stage=1, stop_epoch_at=3),
        Scenario(callback=k2, stage=0, stop_epoch_at=3),
    ]
    k2_stop, k3_stop, k2_none, zero1, zero0 = run(scenarios, tmp_path)
    assert any("never reached its optimizer step" in w for w in k2_stop["warnings"])
    stopped = [[0, 1], *h.windows(5, 2)]
    for result in (k2_stop, zero1, zero0):
        assert diff(result, reference(stopped)) < 1e-6
        assert result["global_step"] == result["engine_steps"] == len(stopped)
    assert diff(k3_stop, reference([[0, 1, 2], *h.windows(5, 3)])) < 1e-6
    none_windows = [[2, 3], [4], *h.windows(5, 2)]
    assert diff(k2_none, reference(none_windows)) < 1e-6
    assert k2_none["global_step"] == k2_none["engine_steps"] == len(none_windows)


def test_a_window_cut_short_on_two_ranks_and_lightning_pytorch_s_namespace(tmp_path: Path) -> None:
    cut = Scenario(callback={"accumulation_steps": 2}, stage=2, stop_epoch_at=3, samples=40)
    lit = Scenario(callback={"accumulation_steps": 2}, stage=2, samples=40, namespace="lightning.pytorch")
    two_ranks, lightning_pytorch = run([cut, lit], tmp_path, world=2)
    assert diff(two_ranks, reference([[0, 1], *h.windows(5, 2)], samples=40, world=2)) < 1e-6
    assert diff(lightning_pytorch, reference(TAILS, samples=40, world=2)) < 1e-6
    assert lightning_pytorch["global_step"] == lightning_pytorch["engine_steps"] == len(TAILS)


def test_zero_3_is_exact_with_partial_windows_a_keyed_k_clipping_lr_scaling_cut_windows_and_resumes(
    tmp_path: Path,
) -> None:
    """ZeRO-3 partitions the parameters too; the engine's window is driven as under ZeRO 0-2 (torch's SGD)."""
    keyed = {0: 2, 2: 3}
    scaled = {"accumulation_steps": keyed, "schedule_unit": "steps", "lr_scaling": "linear"}
    k2 = {"accumulation_steps": 2}
    scenarios = [
        Scenario(callback=None, trainer_k=2, stage=3),  # the built-in: the negative control
        Scenario(callback=k2, stage=3),
        Scenario(callback={**k2, "max_grad_norm": 0.5}, stage=3),
        Scenario(callback=scaled, stage=3, samples=40),
        Scenario(callback=k2, stage=3, stop_epoch_at=3),  # epoch 0: [0, 1] steps, [2] is cut
        Scenario(callback=k2, stage=3, resume_after=2),  # inside the window [2, 3]
    ]
    built_in, fixed, clipped, keyed_run, cut, inside = run(scenarios, tmp_path)
    assert diff(built_in, reference(TAILS)) > 0.05
    assert diff(fixed, reference(TAILS)) < 1e-6
    assert fixed["global_step"] == fixed["engine_steps"] == len(TAILS)
    assert fixed["metrics"]["grad_accum/num_parameters"] == 57  # the whole tensors', not the partitions'
    assert diff(clipped, reference(TAILS, max_grad_norm=0.5)) < 1e-6
    windows = h.keyed_windows(keyed, 10, epochs=2, unit="steps")
    factors = [k / 2 for _, k in windows]
    assert diff(keyed_run, reference([w for w, _ in windows], samples=40, lr_factors=factors)) < 1e-6
    assert keyed_run["global_step"] == keyed_run["engine_steps"] == len(windows)
    stopped = [[0, 1], *h.windows(5, 2)]
    assert diff(cut, reference(stopped)) < 1e-6
    assert cut["global_step"] == cut["engine_steps"] == len(stopped)
    assert diff(inside, reference([[0, 1], [3], [4], *TAILS[3:]])) < 1e-6


def test_zero_3_on_two_ranks_is_exact_with_partial_windows_and_clipping(tmp_path: Path) -> None:
    scenarios = [
        Scenario(callback={"accumulation_steps": 2, "max_grad_norm": 0.5}, stage=3, samples=40),
        Scenario(callback=STEPS_1_THEN_2, stage=3, samples=40),
    ]
    clipped, keyed_run = run(scenarios, tmp_path, world=2)
    assert diff(clipped, reference(TAILS, samples=40, world=2, max_grad_norm=0.5)) < 1e-6
    assert clipped["global_step"] == clipped["engine_steps"] == len(TAILS)
    windows = [w for w, _ in h.keyed_windows({0: 1, 2: 2}, 5, epochs=2, unit="steps")]
    assert diff(keyed_run, reference(windows, samples=40, world=2)) < 1e-6


# 20 sequences of 1-9 real tokens: 10 micro-batches of 2 per rank and epoch; K=3: windows of 3, 3, 3 and 1
TOKEN_WINDOWS = h.windows(10, 3, epochs=2)
WEIGHTED = {"accumulation_steps": 3, "scaling": "weighted", "item_count_fn": h.count_tokens}


def token_reference(windows: list[list[int]], *, samples: int = 20, world: int = 1, **kwargs: Any) -> Any:
    """The big batch: the mean over every real token of the window's sequences on all ranks."""
    data = h.token_data(samples)
    return h.big_batch_reference(h.token_net(), data, 2 * world, windows, h.token_loss, lr=0.5, **kwargs)


def rank_total_reference(windows: list[list[int]], *, samples: int, world: int) -> torch.nn.Module:
    """The weighting without the rank total: each rank's token mean over its own rows, averaged over ranks."""
    data, net = h.token_data(samples), h.token_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    for window in windows:
        optimizer.zero_grad()
        for rank in range(world):  # `ordered_loader`: rank r's micro-batch b is rows r + R * (2b, 2b + 1)
            rows = torch.tensor([rank + world * (2 * b + i) for b in window for i in (0, 1)])
            (h.token_loss(net, *(t[rows] for t in data.tensors)) / world).backward()
        optimizer.step()
    return net


def test_token_weighting_reads_each_window_ahead_on_every_zero_stage(tmp_path: Path) -> None:
    """Each window's batches are read ahead and counted before its first backward (the engine keeps no
    ``.grad`` to rescale): with a partial last window, clipping, and a resume inside a window."""
    tokens = {"task": "tokens", "lr": 0.5}
    scenarios = [
        Scenario(callback=None, trainer_k=3, stage=2, **tokens),  # the built-in: the negative control
        Scenario(callback={"accumulation_steps": 3}, stage=2, **tokens),  # "mean": the weighting's control
        *(Scenario(callback=WEIGHTED, stage=stage, **tokens) for stage in (0, 1, 2, 3)),
        Scenario(callback={**WEIGHTED, "max_grad_norm": 0.5}, stage=3, **tokens),
        Scenario(callback=WEIGHTED, stage=2, resume_after=4, **tokens),  # inside the window [3, 4, 5]
    ]
    built_in, mean, *stages, clipped, inside = run(scenarios, tmp_path)
    exact = token_reference(TOKEN_WINDOWS)
    assert diff(built_in, exact) > 0.05
    assert diff(mean, exact) > 1e-2
    for result in stages:
        assert diff(result, exact) < 1e-6
        assert result["global_step"] == result["engine_steps"] == len(TOKEN_WINDOWS)
        # the tail window [9]: its real tokens, from the total read ahead
        labels = h.token_data(20).tensors[1][18:20]
        assert result["metrics"]["grad_accum/items_last_step"] == int((labels != h.IGNORE_INDEX).sum())
    assert diff(clipped, token_reference(TOKEN_WINDOWS, max_grad_norm=0.5)) < 1e-6
    # DeepSpeed saves no accumulated gradient: 3 and 4 are lost, 5 steps alone, weighted over its own tokens
    resumed = [[0, 1, 2], [5], *TOKEN_WINDOWS[2:]]
    assert diff(inside, token_reference(resumed)) < 1e-6
    assert inside["global_step"] == inside["engine_steps"] == len(TOKEN_WINDOWS)


def test_token_weighting_on_two_ranks_weighs_by_the_total_over_the_ranks(tmp_path: Path) -> None:
    tokens = {"task": "tokens", "lr": 0.5, "samples": 40}
    scenarios = [Scenario(callback=WEIGHTED, stage=stage, **tokens) for stage in (0, 2, 3)]
    results = run(scenarios, tmp_path, world=2)
    exact = token_reference(TOKEN_WINDOWS, samples=40, world=2)
    local = rank_total_reference(TOKEN_WINDOWS, samples=40, world=2)
    for result in results:
        assert diff(result, exact) < 1e-6
        assert diff(result, local) > 1e-3  # a count over one rank only is off: the oracle tells them apart
        assert result["global_step"] == result["engine_steps"] == len(TOKEN_WINDOWS)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_a_hugging_face_causal_lm_is_weighted_by_its_predicted_tokens_on_zero_2_and_3(tmp_path: Path) -> None:
    """GPT-2 shifts its labels inside: the predicted tokens weigh each micro-batch; ``count_tokens`` (one
    token too many per sequence) is the negative control."""
    from lightning_gradacc.counters import count_predicted_tokens, count_tokens
    from tests.callback import test_hf_causal_lm as lm

    weighted = {"accumulation_steps": lm.K, "scaling": "weighted", "item_count_fn": count_predicted_tokens}
    lm_run = {"task": "gpt2", "lr": lm.LR, "epochs": lm.EPOCHS}
    zero2, zero3, miscounted = run(
        [
            Scenario(callback=weighted, stage=2, **lm_run),
            Scenario(callback=weighted, stage=3, **lm_run),
            Scenario(callback={**weighted, "item_count_fn": count_tokens}, stage=2, **lm_run),
        ],
        tmp_path,
    )
    exact = lm.big_batch_reference()
    for result in (zero2, zero3):
        assert diff(result, exact) < 1e-6
        assert result["global_step"] == result["engine_steps"] == 3 * lm.EPOCHS
    assert diff(miscounted, exact) > 1e-3


@h.cuda_only
def test_on_a_gpu_with_the_unmodified_strategy_fp32_is_exact_and_fp16_within_its_rounding(
    tmp_path: Path,
) -> None:
    fp16 = {"precision": "16-mixed"}
    fp32, ours, built_in = run(
        [
            Scenario(callback={"accumulation_steps": 2}),
            Scenario(callback={"accumulation_steps": 2, "max_grad_norm": 0.5}, trainer=fp16),
            Scenario(trainer_k=2, trainer=fp16),
        ],
        tmp_path,
        device="cuda",
    )
    assert diff(fp32, reference(TAILS)) < 1e-5  # CUDA's float32 kernels round differently from the CPU's
    assert diff(ours, reference(TAILS, max_grad_norm=0.5)) < 5e-3  # fp16's 11-bit mantissa
    assert diff(built_in, reference(TAILS)) > 0.05
    assert ours["global_step"] == ours["engine_steps"] == len(TAILS)
