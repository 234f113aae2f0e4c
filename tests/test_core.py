"""The torch-only core in a plain PyTorch loop, against big-batch references."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from lightning_gradacc import GradAccumulator, GradientAccumulationCallback, GradientOverflowError
from tests import helpers as h
from tests.syncs import SyncCounter

BATCH = 4


def run_plain_loop(
    accumulator_kwargs: dict, k: int, num_batches: int = 10, nan_at: tuple[int, ...] = ()
) -> tuple[nn.Module, GradAccumulator]:
    data = h.regression_data(num_batches * BATCH)
    net = h.regression_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    accumulator = GradAccumulator(net.named_parameters(), k, **accumulator_kwargs)
    x_all, y_all = data.tensors
    for index in range(num_batches):
        x, y = x_all[index * BATCH : (index + 1) * BATCH], y_all[index * BATCH : (index + 1) * BATCH]
        loss = h.mse(net, x, y)
        if index in nan_at:
            loss = loss * math.nan
        accumulator.backward(loss, items=len(x))
        accumulator.step(optimizer, force=index == num_batches - 1)
    return net, accumulator


@pytest.mark.parametrize("scaling", ["mean", "average", "sum"])
@pytest.mark.parametrize("k", [1, 3, 4, 10])
def test_plain_loop_matches_big_batch(scaling: str, k: int) -> None:
    net, accumulator = run_plain_loop({"scaling": scaling}, k)
    reference = h.big_batch_reference(
        h.regression_net(),
        h.regression_data(40),
        BATCH,
        h.windows(10, k),
        h.mse,
        sum_of_means=scaling == "sum",
    )
    assert h.max_abs_diff(net, reference) < 1e-6
    assert accumulator.stats.windows == math.ceil(10 / k)
    assert accumulator.stats.micro_batches_last_step == (10 % k or k)


def test_weighted_variable_tokens_matches_big_batch() -> None:
    data = h.token_data()
    net = h.token_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    accumulator = GradAccumulator(net.parameters(), 4, scaling="weighted")
    inputs, labels = data.tensors
    num_batches = len(data) // 2
    for index in range(num_batches):
        batch = (inputs[2 * index : 2 * index + 2], labels[2 * index : 2 * index + 2])
        accumulator.backward(h.token_loss(net, *batch), items=h.count_tokens(batch))
        accumulator.step(optimizer, force=index == num_batches - 1)
    reference = h.big_batch_reference(h.token_net(), data, 2, h.windows(num_batches, 4), h.token_loss, lr=0.5)
    assert h.max_abs_diff(net, reference) < 1e-6
    last_rows = labels[2 * 8 :]
    assert accumulator.stats.items_last_step == int((last_rows != h.IGNORE_INDEX).sum())


def test_clipping_matches_torch_clip_on_the_big_batch() -> None:
    net, accumulator = run_plain_loop({"max_grad_norm": 0.5}, 4)
    reference = h.big_batch_reference(
        h.regression_net(), h.regression_data(40), BATCH, h.windows(10, 4), h.mse, max_grad_norm=0.5
    )
    assert h.max_abs_diff(net, reference) < 1e-6
    assert accumulator.stats.clipped_steps == 3  # every window's norm is above 0.5
    assert accumulator.stats.last_grad_norm > 0.5


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.5, math.inf])
def test_reported_norm_is_the_norm_of_the_final_gradient(norm_type: float) -> None:
    net = nn.Linear(4, 3)
    accumulator = GradAccumulator(net.parameters(), 2, norm_type=norm_type)
    for _ in range(2):
        accumulator.backward(net(torch.randn(5, 4)).pow(2).mean(), items=5)
    assert accumulator.finalize()
    expected = torch.nn.utils.get_total_norm([p.grad for p in net.parameters()], norm_type)
    assert accumulator.stats.last_grad_norm == pytest.approx(float(expected), rel=1e-6)


def test_clip_value_clamps_the_final_gradient_and_counts() -> None:
    net = nn.Linear(4, 1)
    accumulator = GradAccumulator(net.parameters(), 1, clip_value=1e-3)
    accumulator.backward(net(torch.randn(8, 4)).pow(2).mean() * 100)
    assert accumulator.finalize()
    assert max(float(p.grad.abs().max()) for p in net.parameters()) == pytest.approx(1e-3)
    assert accumulator.stats.clipped_steps == 1
    net.zero_grad()
    accumulator.backward(net(torch.zeros(8, 4)).sum() * 0)  # zero gradient: nothing to clamp
    accumulator.finalize()
    assert accumulator.stats.clipped_steps == 1


@pytest.mark.parametrize("bad_micro_batch", [0, 5, 9])
def test_skip_policy_drops_exactly_the_bad_window(bad_micro_batch: int) -> None:
    net, accumulator = run_plain_loop({"overflow": "skip"}, 4, nan_at=(bad_micro_batch,))
    bad_window = bad_micro_batch // 4
    reference = h.big_batch_reference(
        h.regression_net(), h.regression_data(40), BATCH, h.windows(10, 4), h.mse, skip_windows=[bad_window]
    )
    assert h.max_abs_diff(net, reference) < 1e-6
    stats = accumulator.stats
    assert (stats.skipped_steps, stats.non_finite_windows, stats.windows) == (1, 1, 3)
    assert all(torch.isfinite(p).all() for p in net.parameters())


def test_raise_policy_names_the_parameters_and_the_step() -> None:
    with pytest.raises(GradientOverflowError, match=r"optimizer step 1 in `0.weight`, `0.bias`") as error:
        run_plain_loop({"overflow": "raise"}, 4, nan_at=(6,))
    assert error.value.step == 1
    assert error.value.parameter_names == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_ignore_policy_counts_and_steps() -> None:
    net, accumulator = run_plain_loop({"overflow": "ignore"}, 4, nan_at=(9,))
    assert (accumulator.stats.non_finite_windows, accumulator.stats.skipped_steps) == (1, 0)
    assert not all(torch.isfinite(p).all() for p in net.parameters())


def test_foreach_and_per_tensor_paths_agree() -> None:
    fused, _ = run_plain_loop({"max_grad_norm": 0.5, "clip_value": 0.05, "foreach": True}, 4)
    looped, _ = run_plain_loop({"max_grad_norm": 0.5, "clip_value": 0.05, "foreach": False}, 4)
    assert h.max_abs_diff(fused, looped) < 1e-7


def test_no_host_sync_while_accumulating_and_one_per_step() -> None:
    net = h.regression_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    accumulator = GradAccumulator(net.parameters(), 4, scaling="weighted", max_grad_norm=1.0)
    x, y = h.regression_data(16).tensors
    counter = SyncCounter()
    with counter.patched():
        for index in range(4):
            loss = h.mse(net, x[index * 4 : index * 4 + 4], y[index * 4 : index * 4 + 4])
            items = torch.tensor(4)
            with counter.counting():
                accumulator.backward(loss, items=items)
        assert counter.calls == []
        with counter.counting():
            assert accumulator.finalize()
            optimizer.step()
            _ = accumulator.stats  # already on the host: no second sync
        assert counter.calls == ["tolist"]


def test_statistics_announced_at_the_boundary_ride_in_its_one_sync() -> None:
    net = h.regression_net()
    x, y = h.regression_data(16).tensors
    counter = SyncCounter()
    losses = []
    with counter.patched():
        for read in (False, True):
            accumulator = GradAccumulator(net.parameters(), 4)
            for index in range(4):
                loss = h.mse(net, x[index * 4 : index * 4 + 4], y[index * 4 : index * 4 + 4])
                losses.append(float(loss))
                accumulator.backward(loss, items=4)
            counter.calls.clear()
            with counter.counting():
                assert accumulator.finalize(read_statistics=read)
                window_loss = accumulator.window_loss
            assert len(counter.calls) == (1 if read else 2)  # the decision, then the loss when read late
            assert window_loss == pytest.approx(sum(losses[-4:]) / 4, rel=1e-6)
            net.zero_grad()


def test_ignore_policy_does_not_sync_at_the_boundary() -> None:
    net = nn.Linear(3, 1)
    accumulator = GradAccumulator(net.parameters(), 2, overflow="ignore", max_grad_norm=1.0)
    counter = SyncCounter()
    with counter.patched(), counter.counting():
        for _ in range(2):
            accumulator.backward(net(torch.randn(4, 3)).sum(), items=4)
        accumulator.finalize()
    assert counter.calls == []
    assert accumulator.stats.windows == 1


def test_tensor_item_count_is_checked_at_the_boundary() -> None:
    net = nn.Linear(3, 1)
    accumulator = GradAccumulator(net.parameters(), 2, scaling="weighted")
    accumulator.backward(net(torch.randn(4, 3)).sum(), items=torch.tensor(4))
    accumulator.record(accumulator.weigh(torch.tensor(-2), label="the item count of batch 7"))
    with pytest.raises(ValueError, match=r"the item count of batch 7 is -2\b"):
        accumulator.finalize()


@pytest.mark.parametrize(
    ("items", "match"),
    [
        (-3, "finite number >= 0, but got -3"),
        (float("nan"), "finite number >= 0, but got nan"),
        (float("inf"), "finite number >= 0, but got inf"),
        (True, "number >= 0, but got True"),
        ("4", "number >= 0, but got '4'"),
        (torch.tensor([1, 2]), r"shape \(2,\)"),
        (torch.tensor(True), "dtype torch.bool"),
        (torch.tensor(float("nan")), "is nan"),
        (torch.tensor(-1.5), "is -1.5"),
    ],
)
def test_bad_item_counts_raise_at_the_boundary_naming_the_micro_batch(items: object, match: str) -> None:
    param = torch.zeros(1, requires_grad=True)
    accumulator = GradAccumulator([param], 2, scaling="weighted")
    accumulator.record(4)
    accumulator.record(items)  # recorded with weight 0: the error comes once the window is summed
    with pytest.raises(ValueError, match=f"micro-batch 1 of the window.*{match}"):
        accumulator.finalize()
    # the error belongs to that window only: the next one steps (an accumulator is never poisoned)
    param.grad = torch.ones(1)
    accumulator.record(4)
    assert accumulator.finalize()
    assert accumulator.stats.windows == 2


@pytest.mark.parametrize("items", [0, 2.5, np.int64(3), np.float32(1.5), np.array(2), torch.tensor(2.5)])
def test_any_finite_count_of_at_least_zero_is_an_item_count(items: object) -> None:
    param = torch.zeros(1, requires_grad=True)
    accumulator = GradAccumulator([param], 2, scaling="weighted")
    param.grad = torch.ones(1)
    accumulator.record(4)
    accumulator.record(items)
    assert accumulator.finalize()
    assert accumulator.stats.items_last_step == 4 + float(items)


def test_weighted_needs_items() -> None:
    accumulator = GradAccumulator([torch.zeros(1, requires_grad=True)], scaling="weighted")
    accumulator.record()
    with pytest.raises(ValueError, match="is missing: `scaling='weighted'` needs the item count"):
        accumulator.finalize()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"accumulation_steps": 0}, ValueError, "`accumulation_steps` to be a positive int, but got 0"),
        ({"accumulation_steps": 2.0}, TypeError, "`accumulation_steps` to be a positive int, but got 2.0"),
        ({"accumulation_steps": True}, TypeError, "`accumulation_steps` to be a positive int, but got True"),
        ({"scaling": "median"}, ValueError, "`scaling` to be one of .* but got 'median'"),
        ({"overflow": "retry"}, ValueError, "`overflow` to be one of .* but got 'retry'"),
        ({"max_grad_norm": 0.0}, ValueError, "`max_grad_norm` to be a positive float or None, but got 0.0"),
        (
            {"max_grad_norm": math.nan},
            ValueError,
            "`max_grad_norm` to be a positive float or None, but got nan",
        ),
        ({"clip_value": -1}, ValueError, "`clip_value` to be a positive float or None, but got -1"),
        ({"norm_type": 0}, ValueError, "`norm_type` to be a float > 0 or inf, but got 0"),
        ({"world_size": 0}, ValueError, "`world_size` to be a positive int, but got 0"),
    ],
)
def test_invalid_core_arguments(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        GradAccumulator([torch.zeros(1, requires_grad=True)], **kwargs)


def test_no_parameters_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one parameter"):
        GradAccumulator([])


def test_k_cannot_change_inside_a_window() -> None:
    param = torch.zeros(1, requires_grad=True)
    accumulator = GradAccumulator([param], 4)
    accumulator.record()
    with pytest.raises(RuntimeError, match="inside an open window"):
        accumulator.accumulation_steps = 2
    accumulator.reset()
    accumulator.accumulation_steps = 2
    assert accumulator.stats.accumulation_steps == 2


def test_an_empty_window_takes_no_step_and_is_counted() -> None:
    param = torch.zeros(1, requires_grad=True)
    param.grad = torch.ones(1)  # stale: nothing of it belongs to this window
    accumulator = GradAccumulator([param])
    assert not accumulator.finalize()
    assert param.grad is None
    stats = accumulator.stats
    assert (stats.empty_windows, stats.windows, stats.skipped_steps) == (1, 1, 0)


def test_state_dict_round_trip_keeps_counters(tmp_path: object) -> None:
    _, accumulator = run_plain_loop({"max_grad_norm": 0.5}, 4, nan_at=(1,))
    path = f"{tmp_path}/state.pt"
    torch.save(accumulator.state_dict(), path)
    restored = GradAccumulator([torch.zeros(1, requires_grad=True)], 4)
    restored.load_state_dict(torch.load(path, weights_only=True))
    # the process's memory peak is read when asked (it grows on its own): not compared
    assert dataclasses.replace(restored.stats, peak_memory_bytes=0) == dataclasses.replace(
        accumulator.stats, num_parameters=1, peak_memory_bytes=0
    )
    with pytest.raises(ValueError, match="version 99"):
        restored.load_state_dict({"version": 99})


def test_reset_discards_the_window_and_keeps_lifetime_counters() -> None:
    _, accumulator = run_plain_loop({}, 4)
    net = nn.Linear(2, 1)
    accumulator = GradAccumulator(net.parameters(), 4)
    accumulator.backward(net(torch.ones(1, 2)).sum())
    accumulator.reset()
    assert accumulator.window.micro_batches == 0
    assert all(p.grad is None for p in net.parameters())
    assert accumulator.stats.total_micro_batches == 1


def test_core_imports_without_lightning() -> None:
    code = textwrap.dedent(
        """
        import sys
        import lightning_gradacc.core
        from lightning_gradacc import GradAccumulator, AccumulationStats
        loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('pytorch_lightning', 'lightning'))
        assert not loaded, loaded
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sparse_gradients_are_refused_with_the_parameter_name() -> None:
    embedding = nn.Embedding(5, 2, sparse=True)
    accumulator = GradAccumulator(embedding.named_parameters(), 1)
    accumulator.backward(embedding(torch.tensor([1, 3])).sum())
    with pytest.raises(TypeError, match="Sparse gradients are not supported \\(parameter `weight`\\)"):
        accumulator.finalize()


def test_a_bad_count_on_another_rank_raises_on_this_rank_too() -> None:
    """The decision is taken on the window's totals summed over ranks, so no rank is left waiting."""

    def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() == 5:  # the window's totals: the other rank adds 4 items and 1 invalid count
            tensor += torch.tensor([4.0, 1.0, 0.0, 0.0, 1.0], dtype=tensor.dtype)
        else:  # the reference count: the other rank's first count is the same
            tensor *= 2
        return tensor

    param = torch.zeros(1, requires_grad=True)
    accumulator = GradAccumulator([param], scaling="weighted", world_size=2, all_reduce=all_reduce)
    param.grad = torch.ones(1)
    accumulator.record(4)
    with pytest.raises(ValueError, match=r"1 invalid item count.* on another rank"):
        accumulator.finalize()


def test_the_sync_counter_sees_each_kind_of_sync() -> None:
    """The counter itself can fail: each call it claims to see, it sees."""
    counter = SyncCounter()
    tensor = torch.ones(3)
    with counter.patched(), counter.counting():
        tensor.sum().item()
        bool(tensor.sum())
        tensor.to("cpu")
        tensor.to(device=torch.device("cpu"), non_blocking=True)  # not counted: non-blocking
        tensor.to(torch.float64)  # not counted: no device
        torch.equal(tensor, tensor)
        tensor.nonzero()
    assert counter.calls == ["item", "__bool__", "to(cpu)", "equal", "nonzero"]


# ------------------------------------------------------------------ found in review of the reshaped core


@pytest.mark.parametrize(
    ("dtype", "value", "norm_type"),
    [
        (torch.float64, 1e154, 2.0),
        (torch.float64, 1e120, 3.0),
        (torch.float32, 1e36, 9.0),
        (torch.float32, 1.3e19, 2.0),
    ],
)
def test_a_norm_beyond_its_dtype_is_non_finite_on_the_host_and_the_device_alike(
    dtype, value, norm_type
) -> None:
    results = []
    for overflow in ("skip", "ignore"):  # decided on the host after the sync / on the device
        params = [nn.Parameter(torch.zeros(3, dtype=dtype)) for _ in range(3)]
        accumulator = GradAccumulator(params, 1, overflow=overflow, norm_type=norm_type)
        for param in params:
            param.grad = torch.full((3,), value, dtype=dtype)
        accumulator.record(3)
        stepped = accumulator.finalize()
        results.append((stepped if overflow == "skip" else None, accumulator.stats.non_finite_windows))
    assert results == [(False, 1), (None, 1)]  # no OverflowError, the same verdict on both paths


def _scaled_loop(
    scaler: torch.amp.GradScaler | None, nan_at: int | None, **options
) -> tuple[nn.Module, list[bool]]:
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    accumulator = GradAccumulator(net.named_parameters(), 2, grad_scaler=scaler, **options)
    x, y = torch.randn(8, 3), torch.randn(8, 2)
    stepped = []
    for index in range(4):
        loss = nn.functional.mse_loss(net(x[index * 2 : index * 2 + 2]), y[index * 2 : index * 2 + 2])
        if index == nan_at:
            loss = loss * math.nan
        accumulator.backward(loss, items=2)
        if accumulator.window_full:
            stepped.append(accumulator.step(optimizer))
    return net, stepped


@pytest.mark.parametrize("options", [{}, {"accumulation_dtype": "float64"}])
def test_step_with_a_grad_scaler_flushes_buffers_and_says_whether_it_stepped(options: dict) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    scaled, stepped = _scaled_loop(scaler, nan_at=1, **options)
    plain, plain_stepped = _scaled_loop(None, nan_at=1, **options)
    assert stepped == plain_stepped == [False, True]  # the scaler skipped the first window itself
    assert h.max_abs_diff(scaled, plain) < 1e-6


def _process_peak() -> int:
    """The kernel's resident-set peak of this process (what a user, `ru_maxrss` or a monitor reads)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")
def test_the_memory_peak_is_read_and_never_reset_for_the_whole_process() -> None:
    """A 128 MiB peak made before the accumulator exists is still the process's peak after a fit with the
    callback logging every step (it used to reset it: a user's own reading fell by the difference)."""
    big = torch.ones(128 * 2**20 // 4)  # touched, then freed
    big.add_(1.0)
    del big
    peak = _process_peak()
    accumulator = GradAccumulator(nn.Linear(3, 1).parameters(), 1)
    assert accumulator.stats.peak_memory_bytes >= peak
    module = h.RegressionModule(h.regression_data(40))
    callback = GradientAccumulationCallback(2)
    h.trainer(callbacks=[callback], logger=h.MetricsRecorder(), log_every_n_steps=1).fit(module)
    assert _process_peak() >= peak
    assert callback.stats.peak_memory_bytes >= peak


def test_a_window_of_an_unreleased_format_is_refused_before_anything_changes() -> None:
    """Formats 1 and 2 (before 0.2, never released) recorded no loss or AMP scale: refused, naming why."""
    net = nn.Linear(2, 1)
    accumulator = GradAccumulator(net.named_parameters(), 2)
    accumulator.loss_scale = 0.5
    net(torch.ones(1, 2)).sum().mul(0.5).backward()
    accumulator.record(1)
    state = accumulator.window_state_dict()
    assert state is not None
    restored_net = nn.Linear(2, 1)
    restored = GradAccumulator(restored_net.named_parameters(), 2)
    restored.loss_scale = 0.5
    old = {key: value for key, value in state.items() if key not in ("loss_scale", "amp_scale")}
    with pytest.raises(ValueError, match="has format version 2; this version of lightning_gradacc reads 3"):
        restored.load_window_state_dict({**old, "version": 2})
    with pytest.raises(ValueError, match=r"is missing \['loss_scale', 'amp_scale'\]"):
        restored.load_window_state_dict(old)
    assert restored_net.weight.grad is None and restored.window.empty
    restored.load_window_state_dict(state)
    assert torch.equal(restored_net.weight.grad, net.weight.grad)


def test_a_grad_scaler_that_never_scaled_is_named_for_what_it_is() -> None:
    """Gradients recorded under an enabled GradScaler that never scaled a loss (a loop that forgot
    `scaler.scale`): the error says so, instead of asking for the scaler class it already is."""
    net = nn.Linear(3, 1)
    accumulator = GradAccumulator(net.parameters(), 1, grad_scaler=torch.amp.GradScaler("cpu"))
    net(torch.ones(2, 3)).sum().backward()
    accumulator.record(2)
    with pytest.raises(RuntimeError, match=r"GradScaler has not scaled a loss yet.*scaler\.scale\(loss\)"):
        accumulator.finalize()


def test_reduce_gradients_averages_the_buffers_over_the_ranks_at_the_window_end() -> None:
    """A second rank whose window sums to zero, simulated by an all-reduce that adds nothing: the window's
    mean over the two ranks is half this rank's, and a parameter no rank has a gradient for stays without
    one."""
    nets = [nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    nets[0][0].requires_grad_(False)
    nets[1][0].requires_grad_(False)
    alone = GradAccumulator(nets[0].parameters(), 2, accumulation_dtype="float64")
    reduced = GradAccumulator(
        nets[1].parameters(),
        2,
        accumulation_dtype="float64",
        world_size=2,
        all_reduce=lambda tensor: tensor,
        reduce_gradients=True,
    )
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    for net, accumulator in zip(nets, (alone, reduced), strict=True):
        for rows in (x[:2], x[2:]):
            accumulator.backward(net(rows).pow(2).mean(), items=len(rows))
        assert accumulator.finalize()
    for mine, theirs in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        assert (mine.grad is None) == (theirs.grad is None)
        if mine.grad is not None:
            assert torch.equal(mine.grad / 2, theirs.grad)
    assert nets[1][0].weight.grad is None
    with pytest.raises(ValueError, match=r"`reduce_gradients=True` .* needs `accumulation_dtype`"):
        GradAccumulator(nets[0].parameters(), 2, world_size=2, all_reduce=lambda t: t, reduce_gradients=True)
