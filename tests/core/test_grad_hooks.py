"""Buffers filled inside the backward (post-accumulate-grad hooks), in plain PyTorch loops.

The window's sum is bitwise the one of buffers filled after the backward; at most one parameter's gradient
is alive at a time; the hooks follow the tracked set, are removed by `remove_hooks`, stay off where a
micro-batch's whole gradient is needed first or where DDP reads `.grad` in the backward.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_gradacc import GradAccumulator
from lightning_gradacc.core import WindowState

BF16 = torch.bfloat16


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).to(BF16)


def _batches(count: int, seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(5, 6, generator=generator).to(BF16), torch.randn(5, 3, generator=generator).to(BF16))
        for _ in range(count)
    ]


def _loss(net: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return nn.functional.mse_loss(net(x).float(), y.float())


class LiveGradients:
    """A post-accumulate-grad hook on every parameter, registered before the accumulator's (so it runs first):
    the bytes of `.grad` alive over all parameters each time one gradient has just been accumulated."""

    def __init__(self, params: list[Tensor]) -> None:
        self.params = params
        self.peak = 0
        self.handles = [p.register_post_accumulate_grad_hook(self) for p in params]

    def __call__(self, param: Tensor) -> None:
        live = sum(p.grad.nbytes for p in self.params if p.grad is not None)
        self.peak = max(self.peak, live)


class SeenInBackward:
    """A post-accumulate-grad hook registered after the accumulator's: whether `.grad` was left in place."""

    def __init__(self, param: Tensor) -> None:
        self.seen: list[bool] = []
        param.register_post_accumulate_grad_hook(lambda p: self.seen.append(p.grad is not None))


def _window(
    accumulator: GradAccumulator, net: nn.Module, batches: list[tuple[Tensor, Tensor]], **kwargs: Any
) -> list[Tensor]:
    for x, y in batches:
        accumulator.backward(_loss(net, x, y), **kwargs)
        assert all(p.grad is None for p in net.parameters())  # between micro-batches: in the buffers
    assert accumulator.finalize()
    grads = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]
    net.zero_grad(set_to_none=True)  # as an optimizer loop does after its step
    return grads


def _after_backward(net: nn.Module, **kwargs: Any) -> GradAccumulator:
    return GradAccumulator(
        net.parameters(), 4, accumulation_dtype="float32", accumulate_in_backward=False, **kwargs
    )


def test_the_window_sum_is_bitwise_the_after_backward_one_and_one_gradient_is_alive_at_a_time() -> None:
    nets = [_net(), _net()]
    probe = LiveGradients(list(nets[0].parameters()))
    hooked = GradAccumulator(nets[0].parameters(), 4, accumulation_dtype="float32")
    assert hooked.accumulates_in_backward
    batches = _batches(8)
    for window in (batches[:4], batches[4:]):  # two windows: the buffers are reused
        got = _window(hooked, nets[0], window)
        expected = _window(_after_backward(nets[1]), nets[1], window)
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)
    largest = max(p.numel() * p.element_size() for p in nets[0].parameters())
    every = sum(p.numel() * p.element_size() for p in nets[0].parameters())
    assert (probe.peak, largest, every) == (512, 512, 870)  # one gradient, not the micro-batch's all


def test_the_sum_equals_fp32_buffers_filled_by_hand_after_each_backward() -> None:
    """The oracle: the bf16 `.grad` of each micro-batch added into fp32 tensors (the first copied), the
    mean over the window's micro-batches, rounded to bf16 once."""
    net, reference = _net(), _net()
    accumulator = GradAccumulator(net.parameters(), 3, accumulation_dtype="float32")
    batches = _batches(3)
    got = _window(accumulator, net, batches)
    sums: list[Tensor] = []
    for index, (x, y) in enumerate(batches):
        _loss(reference, x, y).backward()
        for position, param in enumerate(reference.parameters()):
            assert param.grad is not None
            if index == 0:
                sums.append(param.grad.float())
            else:
                sums[position].add_(param.grad)
            param.grad = None
    for a, total in zip(got, sums, strict=True):
        assert torch.equal(a, (total * (1 / 3)).to(BF16))


def test_a_gradient_from_another_backward_is_taken_with_the_next_micro_batch_as_before() -> None:
    """A `.backward()` outside a micro-batch (hooks disarmed) leaves `.grad` in place; the next micro-batch
    adds to it and takes the sum, as without hooks. `torch.autograd.grad` never touches `.grad`."""
    nets = [_net(), _net()]
    batches = _batches(4)
    accumulators = [
        GradAccumulator(nets[0].parameters(), 4, accumulation_dtype="float32"),
        _after_backward(nets[1]),
    ]
    for net, accumulator in zip(nets, accumulators, strict=True):
        for index, (x, y) in enumerate(batches):
            if index == 1:  # e.g. an auxiliary loss back-propagated in `training_step`
                (_loss(net[:2], x, torch.zeros(5, 16, dtype=BF16)) * 0.1).backward()
                assert net[0].weight.grad is not None and net[4].weight.grad is None
            if index == 2:
                torch.autograd.grad(_loss(net, x, y), list(net.parameters()))
            accumulator.backward(_loss(net, x, y))
        assert accumulator.finalize()
    for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)  # type: ignore[arg-type]


def test_hooks_follow_the_tracked_set_and_unfrozen_parameters() -> None:
    net = _net()
    first, last = net[0].weight, net[4].weight
    accumulator = GradAccumulator([first], 2, accumulation_dtype="float32")
    untracked = SeenInBackward(last)
    x, y = _batches(1)[0]
    accumulator.backward(_loss(net, x, y))
    assert untracked.seen == [True]  # not tracked: not taken
    accumulator.track([first, last])
    tracked = SeenInBackward(last)  # registered after the accumulator's new hook
    accumulator.backward(_loss(net, x, y))
    assert tracked.seen == [False]
    assert accumulator.finalize()
    accumulator.track([last])
    before = SeenInBackward(first)
    net.zero_grad(set_to_none=True)
    accumulator.backward(_loss(net, x, y))
    assert before.seen == [True]  # left the tracked set: its hook is gone
    accumulator.reset()
    net.zero_grad(set_to_none=True)

    frozen = nn.Linear(3, 3).to(BF16).requires_grad_(False)
    accumulator = GradAccumulator(frozen.parameters(), 2, accumulation_dtype="float32")
    frozen.requires_grad_(True)  # unfrozen inside the window: taken after the backward until the next one
    seen = SeenInBackward(frozen.weight)
    inputs = torch.ones(2, 3, dtype=BF16)
    accumulator.backward(frozen(inputs).float().sum())
    assert seen.seen == [True] and frozen.weight.grad is None
    accumulator.backward(frozen(inputs).float().sum())
    assert accumulator.finalize()
    seen = SeenInBackward(frozen.weight)  # after the hook the next window registers
    accumulator.backward(frozen(inputs).float().sum())
    assert seen.seen == [False]


def _hook_count(params: Any) -> int:
    return sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in params)


def test_remove_hooks_removes_them_and_reset_disarms_them() -> None:
    net = _net()
    accumulator = GradAccumulator(net.parameters(), 2, accumulation_dtype="float32")
    assert _hook_count(net.parameters()) == 6
    x, y = _batches(1)[0]
    accumulator.begin_micro_batch(_loss(net, x, y)).backward()
    accumulator.reset()  # between a backward and its record: the window and its gradients are dropped
    seen = SeenInBackward(net[0].weight)
    _loss(net, x, y).backward()  # outside a micro-batch: hooks disarmed
    assert seen.seen == [True]
    accumulator.remove_hooks()
    assert _hook_count(net.parameters()) == 1  # the test's own
    del accumulator
    other = GradAccumulator(net.parameters(), 2, accumulation_dtype="float32")
    del other  # a dropped accumulator's hooks go with it
    assert _hook_count(net.parameters()) == 1


@pytest.mark.parametrize(
    "settings",
    [
        {"overflow": "skip_micro_batch"},
        {"clip_mode": "micro_batch", "max_grad_norm": 1.0},
        {"accumulate_in_backward": False},
    ],
)
def test_per_micro_batch_modes_keep_the_after_backward_path(settings: dict[str, Any]) -> None:
    """A micro-batch's whole gradient is checked or clipped before it is added: no hook takes it."""
    net = _net()
    accumulator = GradAccumulator(net.parameters(), 2, accumulation_dtype="float32", **settings)
    assert not accumulator.accumulates_in_backward
    assert _hook_count(net.parameters()) == 0
    seen = SeenInBackward(net[0].weight)
    x, y = _batches(1)[0]
    accumulator.backward(_loss(net, x, y))
    assert seen.seen == [True] and net[0].weight.grad is None


def _two_ranks(net: nn.Module, **kwargs: Any) -> GradAccumulator:
    """Rank 0 of two, whose other rank adds nothing (an all-reduce that returns its input)."""
    return GradAccumulator(
        net.parameters(), 3, world_size=2, all_reduce=lambda t: t, accumulation_dtype="float32", **kwargs
    )


@pytest.mark.parametrize("reduce_gradients", [False, True])
def test_under_data_parallelism_the_synchronized_backward_leaves_grad_alone(reduce_gradients: bool) -> None:
    """DDP reads `.grad` after the hook: the window's last backward (flushed into `.grad` first) runs with
    the hooks off. With `reduce_gradients` no backward synchronizes (every one under `no_sync()`): all are
    taken inside the backward, and the core averages the buffers at the end."""
    nets = [_net(), _net()]
    batches = _batches(3)
    hooked = _two_ranks(nets[0], reduce_gradients=reduce_gradients)
    seen = SeenInBackward(nets[0][0].weight)
    after = _two_ranks(nets[1], reduce_gradients=reduce_gradients, accumulate_in_backward=False)
    for net, accumulator in zip(nets, (hooked, after), strict=True):
        for index, (x, y) in enumerate(batches):
            accumulator.begin_micro_batch(_loss(net, x, y)).backward()
            accumulator.end_micro_batch()
            flushed = index == 2 and not reduce_gradients
            assert accumulator.window.state is (WindowState.FLUSHED if flushed else WindowState.IN_BUFFERS)
        assert accumulator.finalize()
    assert seen.seen == [False, False, reduce_gradients is False]
    for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)  # type: ignore[arg-type]


def test_a_grad_scaler_gets_the_window_in_grad_after_its_last_micro_batch() -> None:
    nets = [_net(), _net()]
    batches = _batches(2)
    for net, in_backward in zip(nets, (True, False), strict=True):
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        accumulator = GradAccumulator(
            net.parameters(),
            2,
            grad_scaler=scaler,
            accumulation_dtype="float32",
            accumulate_in_backward=in_backward,
        )
        for index, (x, y) in enumerate(batches):
            accumulator.backward(_loss(net, x, y))
            assert (net[0].weight.grad is not None) == (index == 1)  # flushed for the scaler's unscale_
    for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)  # type: ignore[arg-type]


def test_record_without_begin_takes_the_gradient_after_the_backward() -> None:
    """`loss.backward()` then `record()`: the hooks were not armed; `begin_backward()` arms them."""
    net = _net()
    accumulator = GradAccumulator(net.parameters(), 3, accumulation_dtype="float32")
    seen = SeenInBackward(net[0].weight)
    x, y = _batches(1)[0]
    _loss(net, x, y).backward()
    accumulator.record()
    accumulator.begin_backward()
    _loss(net, x, y).backward()
    accumulator.record()
    assert seen.seen == [True, False]


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_a_backward_with_create_graph_keeps_the_buffers_out_of_the_graph() -> None:
    net = _net()
    accumulator = GradAccumulator(net.parameters(), 2, accumulation_dtype="float32")
    x, y = _batches(1)[0]
    accumulator.begin_backward()
    _loss(net, x, y).backward(create_graph=True)
    accumulator.record()
    sums = accumulator.gradients
    assert len(sums) == 6 and not any(sums[name].requires_grad for name in sums)


def test_a_window_saved_in_its_middle_resumes_exactly() -> None:
    nets = [_net(), _net()]
    batches = _batches(4)
    whole = GradAccumulator(nets[0].parameters(), 4, accumulation_dtype="float32")
    expected = _window(whole, nets[0], batches)
    first = GradAccumulator(nets[1].parameters(), 4, accumulation_dtype="float32")
    for x, y in batches[:2]:
        first.backward(_loss(nets[1], x, y))
    saved = first.window_state_dict()
    first.remove_hooks()
    second = GradAccumulator(nets[1].parameters(), 4, accumulation_dtype="float32")
    assert saved is not None
    second.load_window_state_dict(saved)
    for x, y in batches[2:]:
        second.backward(_loss(nets[1], x, y))
    assert second.finalize()
    for a, b in zip(expected, nets[1].parameters(), strict=True):
        assert torch.equal(a, b.grad)  # type: ignore[arg-type]
    second.remove_hooks()
