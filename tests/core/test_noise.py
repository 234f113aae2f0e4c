"""The noise scale's pieces in plain loops: the estimate, its averages and hooks, what must not bias it.

The estimate by hand; what must not bias it: the norm type, the AMP scale, other passes through the hooks,
fp16 gradients, windows that cannot be measured.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from lightning_gradacc import GradAccumulator
from lightning_gradacc.core.noise import TOTALS, NoiseScale, estimate
from tests import helpers as h
from tests.helpers import cuda_only, noise_data, noise_loss, noise_net


def test_the_estimate_of_two_micro_batches_by_hand() -> None:
    """Micro-batches of 1 item with gradients 1 and 3 (mean 2): S = 5, |G_W|² = 4, β_S = 1, β_W = 1/2."""
    assert estimate(10.0, 2.0, 2.0, 4.0, 0.5) == (3.0, 2.0)
    g, t = estimate(torch.tensor(10.0), torch.tensor(2.0), torch.tensor(2.0), torch.tensor(4.0), 0.5)
    assert (float(g), float(t)) == (3.0, 2.0)  # device scalars: the same arithmetic, no sync


@pytest.mark.parametrize("count", [1.0, torch.tensor(1.0)])
def test_a_window_of_one_micro_batch_gives_no_estimate(count: Any) -> None:
    g, t = estimate(4.0 if isinstance(count, float) else torch.tensor(4.0), 1.0, count, 4.0, 1.0)
    assert math.isnan(float(g)) and math.isnan(float(t))


def test_the_averages_skip_windows_without_an_estimate() -> None:
    noise = NoiseScale(0.5, torch.device("cpu"), torch.float64)
    first = noise.update(dict(zip(TOTALS, [10.0, 2.0, 2.0, 2.0, 2.0, 0.0], strict=True)), 4.0, items=2.0)
    assert (first.grad_sq_norm, first.trace_sigma, first.noise_scale) == (3.0, 2.0, 2.0 / 3.0)
    nothing = noise.update(
        dict(zip(TOTALS, [4.0, 1.0, 1.0, 1.0, 1.0, 0.0], strict=True)), 4.0, items=1.0
    )  # one micro-batch
    assert math.isnan(nothing.grad_sq_norm) and nothing.noise_scale == 2.0 / 3.0
    noise.load_state_dict(noise.state_dict())
    assert noise.noise_scale() == 2.0 / 3.0


def test_the_hook_sees_each_micro_batch_and_undoes_its_scales() -> None:
    """The incoming gradient carries the item weight and the loss scale: |g|² comes out unscaled."""
    weight = nn.Parameter(torch.zeros(2))
    accumulator = GradAccumulator([weight], 2, scaling="weighted", noise_scale=True)
    accumulator.loss_scale = 0.25
    for items, gradient in ((2, torch.tensor([1.0, 0.0])), (6, torch.tensor([0.0, 2.0]))):
        loss = (weight * gradient).sum()
        count = accumulator.weigh(items)
        count.weigh_loss(loss * accumulator.loss_scale).backward()
        accumulator.record(count)
    accumulator.finalize()
    stats = accumulator.stats
    # S = (2·1 + 6·4)/8 = 3.25, G_W = (2·g1 + 6·g2)/8 = (0.25, 1.5): |G_W|² = 2.3125; β_S = 2/8, β_W = 1/8
    trace = (3.25 - 2.3125) / (2 / 8 - 1 / 8)
    assert stats.trace_sigma_estimate == pytest.approx(trace, rel=1e-6)
    assert stats.grad_sq_norm_estimate == pytest.approx(2.3125 - trace / 8, rel=1e-6)
    accumulator.remove_hooks()
    (weight * 2).sum().backward()  # no hook left: nothing pending
    assert accumulator._noise is not None and not accumulator._noise._parts


def test_measuring_one_window_in_three_hooks_only_those() -> None:
    net = noise_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    accumulator = GradAccumulator(net.parameters(), 2, noise_scale=True, noise_scale_every=3)
    x, y = noise_data().tensors
    measured, hooked = [], []
    for window in range(7):
        noise = accumulator._noise
        assert noise is not None
        hooked.append(noise.watching)
        for index in range(2):
            rows = slice(8 * (2 * window + index), 8 * (2 * window + index + 1))
            accumulator.backward(noise_loss(net, x[rows], y[rows]), items=8)
        accumulator.step(optimizer)
        measured.append(math.isfinite(accumulator.stats.trace_sigma_estimate))
    assert hooked == measured == [True, False, False, True, False, False, True]
    accumulator.remove_hooks()
    assert not accumulator._noise.watching  # type: ignore[union-attr]


def test_a_dropped_accumulator_takes_its_hooks_along() -> None:
    import gc

    net = noise_net()
    accumulator = GradAccumulator(net.parameters(), 2, noise_scale=True)
    assert all(p._backward_hooks for p in net.parameters())
    del accumulator
    gc.collect()
    assert not any(p._backward_hooks for p in net.parameters())


@cuda_only
@pytest.mark.parametrize("amp", [False, True])
def test_noise_scale_records_micro_batches_without_a_host_sync_on_cuda(amp: bool) -> None:
    """The noise-scale hooks and their recording run inside every backward: no sync there, also under a
    GradScaler (its scale is a device tensor, the counts host numbers)."""
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).cuda()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cuda") if amp else None
    accumulator = GradAccumulator(net.parameters(), 4, noise_scale=True, grad_scaler=scaler)
    generator = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(3):
        for index in range(4):
            x = torch.randn(8, 64, device="cuda", generator=generator)
            loss = net(x).pow(2).mean()
            torch.cuda.set_sync_debug_mode("error" if index < 3 else "default")
            try:
                accumulator.backward(loss, items=8)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        accumulator.step(optimizer)
    assert math.isfinite(accumulator.stats.trace_sigma_estimate)
    accumulator.remove_hooks()


# ----------------------------------------------------------------------- what must not bias the estimate


def _plain_estimates(options: dict[str, Any], windows: int = 3, **run: Any) -> list[float]:
    """Per-window |G|² and tr Σ, one after the other, of a plain loop over fixed micro-batches of 8 rows
    (K=2, learning rate 0)."""
    net = noise_net()
    if run.get("dtype") is not None:
        net = net.to(run["dtype"])
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    accumulator = GradAccumulator(net.named_parameters(), 2, noise_scale=True, **options)
    x, y = noise_data().tensors
    found = []
    for window in range(windows):
        for index in range(2):
            rows = slice(8 * (2 * window + index), 8 * (2 * window + index + 1))
            if run.get("penalty"):  # a gradient penalty's extra pass (weight 0: the same gradient)
                loss = noise_loss(net, x[rows], y[rows])
                grads = torch.autograd.grad(loss, list(net.parameters()), create_graph=True)
                loss = loss + 0.0 * sum(g.pow(2).sum() for g in grads)
            else:
                loss = noise_loss(net, x[rows].to(net.weight.dtype), y[rows].to(net.weight.dtype))
            items = run.get("items", lambda w, i: 8)(window, index)
            accumulator.backward(loss, items=items)
        accumulator.step(optimizer)
        stats = accumulator.stats
        found += [stats.grad_sq_norm_estimate, stats.trace_sigma_estimate]
    accumulator.remove_hooks()
    return found


def test_the_estimate_uses_the_l2_norm_whatever_norm_clips() -> None:
    """|G_W| is the L2 norm of the window's gradient even when `norm_type` (for clipping and the logged
    norm) is 1 or inf; otherwise the estimate is silently wrong."""
    reference = _plain_estimates({})
    for norm_type in (1.0, math.inf):
        for overflow in ("skip", "ignore"):  # the host-decided and the device-decided boundary
            found = _plain_estimates({"norm_type": norm_type, "overflow": overflow})
            assert found == pytest.approx(reference, rel=2e-6)  # fp32 norms: 5e-7 apart (1 or inf: 40%)


def test_the_amp_scale_is_divided_out() -> None:
    """Under a GradScaler every incoming gradient carries its scale (here 1024, a device tensor: the
    recording takes the no-sync tensor path); the estimates are those of the unscaled run."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    found = _plain_estimates({"grad_scaler": scaler})
    assert found == pytest.approx(_plain_estimates({}), rel=1e-6)


def test_another_pass_through_the_hooks_is_not_taken_for_the_micro_batch() -> None:
    """`torch.autograd.grad` on the parameters inside the step (a gradient penalty) fires the hooks too."""
    assert _plain_estimates({}, penalty=True) == pytest.approx(_plain_estimates({}), rel=1e-6)


def test_fp16_gradients_are_measured_in_fp32() -> None:
    weight = nn.Parameter(torch.zeros(1000, dtype=torch.float16))
    noise = NoiseScale(0.9, torch.device("cpu"), torch.float64)
    noise.watch([weight])
    noise.begin_backward()
    (weight * 3000.0).sum().backward()  # a norm of ~94,868: inf in fp16
    assert math.isfinite(float(noise._parts[0])) and float(noise._parts[0]) == pytest.approx(
        94868.3, rel=1e-4
    )
    noise.remove_hooks()


@pytest.mark.parametrize(
    ("why", "items"),
    [
        (
            "a micro-batch of 0 items under 'mean' (its gradient is 0, not a mean)",
            lambda w, i: 0 if w == 1 else 8,
        ),
        ("counts known for some micro-batches only", lambda w, i: None if (w, i) == (1, 1) else 8),
    ],
)
def test_a_window_that_cannot_be_measured_gives_no_estimate(why: str, items: Any) -> None:
    found = _plain_estimates({}, items=items)
    assert all(math.isfinite(v) for v in found[:2] + found[4:]), why
    assert all(math.isnan(v) for v in found[2:4]), why


def test_a_window_saved_without_its_norms_gives_no_estimate_and_the_next_one_does() -> None:
    """Micro-batches restored from an older checkpoint (its window saved without the noise scale's totals)
    have no recorded norms: with them in the window's gradient but not in its counts the estimate would be
    biased, so the window is not measured."""
    net = noise_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    accumulator = GradAccumulator(net.named_parameters(), 3, noise_scale=True)
    x, y = noise_data().tensors
    batches = [(x[8 * i : 8 * (i + 1)], y[8 * i : 8 * (i + 1)]) for i in range(6)]
    accumulator.backward(noise_loss(net, *batches[0]), items=8)
    saved = accumulator.window_state_dict()
    assert saved is not None
    del saved["noise"]
    accumulator.remove_hooks()
    resumed = GradAccumulator(net.named_parameters(), 3, noise_scale=True)
    resumed.load_window_state_dict(saved)
    for batch in batches[1:3]:  # two new micro-batches: enough for an estimate, were it not restored
        resumed.backward(noise_loss(net, *batch), items=8)
    resumed.step(optimizer)
    assert math.isnan(resumed.stats.trace_sigma_estimate)
    for batch in batches[3:]:
        resumed.backward(noise_loss(net, *batch), items=8)
    resumed.step(optimizer)
    assert math.isfinite(resumed.stats.trace_sigma_estimate)
    resumed.remove_hooks()


def test_a_layer_unfrozen_inside_a_window_makes_it_unmeasured() -> None:
    net = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1))
    net[0].requires_grad_(False)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    accumulator = GradAccumulator(net.named_parameters(), 2, noise_scale=True)
    x, y = noise_data().tensors
    accumulator.backward(noise_loss(net, x[:8], y[:8]), items=8)
    net[0].requires_grad_(True)  # its first micro-batch had no hook on the layer
    accumulator.backward(noise_loss(net, x[8:16], y[8:16]), items=8)
    accumulator.step(optimizer)
    assert math.isnan(accumulator.stats.trace_sigma_estimate)
    for rows in (slice(16, 24), slice(24, 32)):
        accumulator.backward(noise_loss(net, x[rows], y[rows]), items=8)
    accumulator.step(optimizer)
    assert math.isfinite(accumulator.stats.trace_sigma_estimate)  # hooked from the next window on
    accumulator.remove_hooks()


def test_a_set_changed_after_a_backward_leaves_that_window_unmeasured() -> None:
    """Tracked after the window's first backward ran (its norms were taken on the old set): no estimate."""
    net = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1))
    net[0].requires_grad_(False)
    accumulator = GradAccumulator(net.named_parameters(), 2, noise_scale=True)
    x, y = h.regression_data(32).tensors
    accumulator.begin_backward()
    nn.functional.mse_loss(net(x[:8]), y[:8]).backward()
    net[0].requires_grad_(True)
    accumulator.track(net.named_parameters())  # as the callback does after a backward
    accumulator.record(8)
    accumulator.backward(nn.functional.mse_loss(net(x[8:16]), y[8:16]), items=8)
    accumulator.finalize()
    assert math.isnan(accumulator.stats.trace_sigma_estimate)
    accumulator.remove_hooks()


@pytest.mark.parametrize("items", [8, torch.tensor(8.0)], ids=["host_count", "device_count"])
def test_a_window_restored_from_its_saved_state_gives_the_uninterrupted_estimate(items: Any) -> None:
    """Saved after the first of two micro-batches (the window's totals with it), loaded into a new
    accumulator: the window's estimates and the averages are those of the run that was not interrupted
    (they used to be lost: a restored window gave no estimate, and the averages drifted apart)."""
    x, y = noise_data().tensors

    def run(interrupt: bool) -> list[float]:
        net = noise_net()
        accumulator = GradAccumulator(net.named_parameters(), 2, noise_scale=True, scaling="weighted")
        found = []
        for window in range(2):
            for index in range(2):
                rows = slice(8 * (2 * window + index), 8 * (2 * window + index + 1))
                accumulator.backward(noise_loss(net, x[rows], y[rows]), items=items)
                if interrupt and (window, index) == (1, 0):
                    saved, window_saved = accumulator.state_dict(), accumulator.window_state_dict()
                    accumulator.remove_hooks()
                    accumulator = GradAccumulator(
                        net.named_parameters(), 2, noise_scale=True, scaling="weighted"
                    )
                    accumulator.load_state_dict(saved)
                    assert window_saved is not None and "noise" in window_saved
                    accumulator.load_window_state_dict(window_saved)
            accumulator.step(torch.optim.SGD(net.parameters(), lr=0.0))
            stats = accumulator.stats
            found += [stats.grad_sq_norm_estimate, stats.trace_sigma_estimate, stats.noise_scale]
        accumulator.remove_hooks()
        return found

    whole, resumed = run(False), run(True)
    assert all(math.isfinite(value) for value in resumed)
    assert resumed == pytest.approx(whole, rel=1e-12)
