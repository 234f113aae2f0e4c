"""GradAccumulator in a plain PyTorch loop, end to end, against big-batch references.

Scaling, overflow policies, clipping (as torch clips the big batch), host syncs, what a window may not change,
AMP scalers and the window's loss.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_gradacc import GradAccumulator, GradientOverflowError
from lightning_gradacc.core import WindowState
from tests import helpers as h
from tests.helpers import F64, TwoLayer, run_plain_loop, torch_clip_each, two_layer_batches
from tests.syncs import SyncCounter

BATCH = 4


# --------------------------------------------------------------- big-batch oracles and overflow policies


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


# ---------------------------------------------------------------------------------------------- clipping


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


def test_foreach_and_per_tensor_paths_agree() -> None:
    fused, _ = run_plain_loop({"max_grad_norm": 0.5, "clip_value": 0.05, "foreach": True}, 4)
    looped, _ = run_plain_loop({"max_grad_norm": 0.5, "clip_value": 0.05, "foreach": False}, 4)
    assert h.max_abs_diff(fused, looped) < 1e-7


def _mlp(dtype: torch.dtype = F64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).to(dtype)


def _window_data(window: int, k: int, size: int, dtype: torch.dtype, model: nn.Module) -> tuple:
    generator = torch.Generator().manual_seed(100 + window)
    x = torch.randn(k * size, 4, generator=generator, dtype=dtype)
    y = torch.randn(k * size, 2, generator=generator, dtype=dtype) * 3
    if window == 1:  # nearly fitted: every gradient under the limit
        with torch.no_grad():
            y = model(x) + 1e-4 * y
    return x, y


@pytest.mark.parametrize("overflow", ["skip", "ignore"])  # decides on the host / on the device
def test_accumulator_clip_scope_parameter_equals_big_batch_clipped_per_parameter(overflow: str) -> None:
    k, size, max_norm = 4, 5, 0.5
    model = _mlp()
    reference = _mlp()
    accumulator = GradAccumulator(
        model.named_parameters(), k, max_grad_norm=max_norm, clip_scope="parameter", overflow=overflow
    )
    windows_clipped = 0
    for window in range(3):
        x, y = _window_data(window, k, size, F64, reference)
        reference.zero_grad(set_to_none=True)
        nn.functional.mse_loss(reference(x), y).backward()
        mean_grads = [p.grad.clone() for p in reference.parameters()]
        own = [float(g.norm()) for g in mean_grads]
        clips = any(n > max_norm for n in own)
        windows_clipped += clips
        if window == 1:
            assert not clips
        else:
            assert min(own) < max_norm < max(own)
        expected = torch_clip_each(mean_grads, max_norm)
        for i in range(k):
            xs, ys = x[i * size : (i + 1) * size], y[i * size : (i + 1) * size]
            accumulator.backward(nn.functional.mse_loss(model(xs), ys), items=size)
        assert accumulator.finalize()
        for param, want in zip(model.parameters(), expected, strict=True):
            torch.testing.assert_close(param.grad, want, rtol=1e-10, atol=1e-13)
        stats = accumulator.stats
        assert stats.last_grad_norm == pytest.approx(
            float(torch.nn.utils.get_total_norm(mean_grads)), rel=1e-10
        )
        assert stats.clipped_steps == windows_clipped
        model.zero_grad(set_to_none=True)
    assert accumulator.stats.windows == 3 and windows_clipped == 2


# -------------------------------------------------------------------------------------------- host syncs


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
        with counter.counting():  # the statistics, the window loss among them, ride in the step's sync
            assert accumulator.finalize(read_statistics=True)
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


# ----------------------------------------------------------------------------------------------- windows


def test_k_inside_a_window_may_only_stay_beyond_what_the_window_holds() -> None:
    """An item budget's window grows batch by batch; a K the window is already past is refused."""
    param = torch.zeros(1, requires_grad=True)
    accumulator = GradAccumulator([param], 4)
    accumulator.record()
    accumulator.record()
    with pytest.raises(RuntimeError, match="inside an open window of 2 micro-batches"):
        accumulator.accumulation_steps = 2
    accumulator.accumulation_steps = 3  # the window's next micro-batch fills it
    assert not accumulator.window_full
    accumulator.record()
    assert accumulator.window_full
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


def test_reset_discards_the_window_and_keeps_lifetime_counters() -> None:
    _, accumulator = run_plain_loop({}, 4)
    net = nn.Linear(2, 1)
    accumulator = GradAccumulator(net.parameters(), 4)
    accumulator.backward(net(torch.ones(1, 2)).sum())
    accumulator.reset()
    assert accumulator.window.micro_batches == 0
    assert all(p.grad is None for p in net.parameters())
    assert accumulator.stats.total_micro_batches == 1


def test_sparse_gradients_are_refused_with_the_parameter_name() -> None:
    embedding = nn.Embedding(5, 2, sparse=True)
    accumulator = GradAccumulator(embedding.named_parameters(), 1)
    accumulator.backward(embedding(torch.tensor([1, 3])).sum())
    with pytest.raises(TypeError, match="Sparse gradients are not supported \\(parameter `weight`\\)"):
        accumulator.finalize()


# --------------------------------------------------------------------------------------------------- AMP


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


def test_a_grad_scaler_that_never_scaled_is_named_for_what_it_is() -> None:
    """Gradients recorded under an enabled GradScaler that never scaled a loss (a loop that forgot
    `scaler.scale`): the error says so, instead of asking for the scaler class it already is."""
    net = nn.Linear(3, 1)
    accumulator = GradAccumulator(net.parameters(), 1, grad_scaler=torch.amp.GradScaler("cpu"))
    net(torch.ones(2, 3)).sum().backward()
    accumulator.record(2)
    with pytest.raises(RuntimeError, match=r"GradScaler has not scaled a loss yet.*scaler\.scale\(loss\)"):
        accumulator.finalize()


# ------------------------------------------------------------------------------------- the window's loss


@pytest.mark.parametrize("scaling", ["mean", "weighted"])
@pytest.mark.parametrize("overflow", ["skip", "ignore"])
@pytest.mark.parametrize("read_statistics", [False, True])
def test_window_loss_is_the_item_weighted_mean_loss(
    scaling: str, overflow: str, read_statistics: bool
) -> None:
    model = TwoLayer()
    accumulator = GradAccumulator(model.named_parameters(), 4, scaling=scaling, overflow=overflow)
    accumulator.loss_scale = 0.5
    expected = []
    for sizes in ([3, 7, 5, 2], [4, 4, 1, 6]):
        losses = []
        for x, y in two_layer_batches(sizes):
            loss = nn.functional.mse_loss(model(x), y)
            losses.append(float(loss.detach()))
            accumulator.backward(loss * 0.5, items=len(x))
        # item-weighted under every scaling
        expected.append(sum(n * v for n, v in zip(sizes, losses, strict=True)) / sum(sizes))
        accumulator.finalize(read_statistics=read_statistics)
        if len(expected) == 1:
            assert accumulator.stats.windows == 1  # reading the snapshot does not need the loss
    assert accumulator.window_loss == pytest.approx(expected[1], rel=1e-6)
    assert accumulator.window_loss != pytest.approx(expected[0], rel=1e-3)
    accumulator.finalize()  # an empty window has no loss
    assert math.isnan(accumulator.window_loss)


# ------------------------------------------------------------------ one micro-batch, two calls


def _two_call_data(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator)) for _ in range(n)
    ]


def _two_call_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 1)


def test_two_calls_around_a_backward_equal_the_big_batch() -> None:
    """Oracle: two windows of 3 micro-batches (unequal sizes, "weighted"), each one SGD step on the
    concatenated batch in plain PyTorch."""
    data = [(x[: 2 + i % 3], y[: 2 + i % 3]) for i, (x, y) in enumerate(_two_call_data())]
    net, reference = _two_call_net(), _two_call_net()
    accumulator = GradAccumulator(net.named_parameters(), 3, scaling="weighted")
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in data:
        loss = nn.functional.mse_loss(net(x), y)
        accumulator.begin_micro_batch(loss, items=len(x)).backward()
        accumulator.end_micro_batch()
        accumulator.step(optimizer)
    big_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for start in (0, 3):
        x = torch.cat([x for x, _ in data[start : start + 3]])
        y = torch.cat([y for _, y in data[start : start + 3]])
        nn.functional.mse_loss(reference(x), y).backward()
        big_optimizer.step()
        big_optimizer.zero_grad()
    for mine, theirs in zip(net.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-7)


def test_in_place_weighs_the_loss_itself_and_records_it_unweighted() -> None:
    net = _two_call_net()
    accumulator = GradAccumulator(net.parameters(), 2, scaling="weighted")
    (x, y), (x2, y2) = _two_call_data(2)
    first = nn.functional.mse_loss(net(x), y)
    accumulator.begin_micro_batch(first, items=4).backward()
    accumulator.end_micro_batch()
    loss = nn.functional.mse_loss(net(x2[:2]), y2[:2])
    unweighted = float(loss)
    returned = accumulator.begin_micro_batch(loss, items=2, in_place=True)
    assert returned is loss and float(loss) == pytest.approx(unweighted / 2)  # weight 2 / reference 4
    returned.backward()
    accumulator.end_micro_batch()
    accumulator.finalize(read_statistics=True)
    expected = (4 * float(first) + 2 * unweighted) / 6  # the window loss is item-weighted, unweighted losses
    assert accumulator.window_loss == pytest.approx(expected, rel=1e-6)


def test_the_calls_must_pair() -> None:
    net = _two_call_net()
    accumulator = GradAccumulator(net.parameters(), 2)
    with pytest.raises(RuntimeError, match="`end_micro_batch` was called without `begin_micro_batch`"):
        accumulator.end_micro_batch()
    x, y = _two_call_data(1)[0]
    accumulator.begin_micro_batch(nn.functional.mse_loss(net(x), y))
    with pytest.raises(RuntimeError, match="`begin_micro_batch` was called twice"):
        accumulator.begin_micro_batch(nn.functional.mse_loss(net(x), y))
    accumulator.reset()  # a discarded window forgets the micro-batch begun
    accumulator.begin_micro_batch(nn.functional.mse_loss(net(x), y)).backward()
    accumulator.end_micro_batch()
    assert accumulator.window.micro_batches == 1


def _two_rank_accumulator(net: nn.Module, **kwargs: object) -> GradAccumulator:
    """Rank 0 of two, whose other rank adds nothing (an all-reduce that returns its input)."""
    return GradAccumulator(
        net.parameters(), 3, world_size=2, all_reduce=lambda t: t, accumulation_dtype="float64", **kwargs
    )


@pytest.mark.parametrize("last", [None, True])
def test_the_last_micro_batch_under_data_parallelism_writes_the_buffers_into_grad_first(
    last: bool | None,
) -> None:
    """DDP's all-reduce of the window's last backward then carries the whole window: before that backward
    `.grad` already holds the buffered sum. `last=None` means the K-th micro-batch; a shorter last window
    says `last=True`."""
    net = _two_call_net()
    accumulator = _two_rank_accumulator(net)
    data = _two_call_data(3)[: 3 if last is None else 2]
    for index, (x, y) in enumerate(data):
        is_last = index == len(data) - 1
        loss = nn.functional.mse_loss(net(x), y)
        weighted = accumulator.begin_micro_batch(loss, last=last if is_last else None)
        state = accumulator.window.state
        assert state is (
            WindowState.FLUSHED if is_last else WindowState.IN_BUFFERS if index else WindowState.EMPTY
        )
        assert (net.weight.grad is not None) == is_last  # the buffered sum, in .grad before the backward
        weighted.backward()
        accumulator.end_micro_batch()


def test_the_per_micro_batch_checks_keep_the_last_micro_batch_in_the_buffers() -> None:
    """With `clip_mode="micro_batch"` each micro-batch, the last too, is clipped on its own: no flush
    before its backward (data parallelism then uses `reduce_gradients`)."""
    net = _two_call_net()
    accumulator = _two_rank_accumulator(net, clip_mode="micro_batch", max_grad_norm=0.1)
    for x, y in _two_call_data(3):
        accumulator.begin_micro_batch(nn.functional.mse_loss(net(x), y)).backward()
        accumulator.end_micro_batch()
        assert accumulator.window.state is WindowState.IN_BUFFERS


def test_under_a_grad_scaler_the_last_micro_batch_leaves_the_window_in_grad() -> None:
    """The scaler unscales and checks `.grad`: after the window's last micro-batch its sum is there."""
    net = _two_call_net()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    accumulator = GradAccumulator(net.parameters(), 2, grad_scaler=scaler, accumulation_dtype="float64")
    for index, (x, y) in enumerate(_two_call_data(2)):
        accumulator.backward(nn.functional.mse_loss(net(x), y))
        expected = WindowState.FLUSHED if index == 1 else WindowState.IN_BUFFERS
        assert accumulator.window.state is expected
