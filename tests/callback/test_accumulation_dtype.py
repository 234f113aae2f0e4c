"""`accumulation_dtype="float32"` with bf16 parameters through `Trainer.fit`: each gradient goes into its
fp32 buffer inside the backward, so at most one parameter's bf16 gradient is alive at a time, and the
parameters after fit are bitwise those of a plain loop that adds each micro-batch's bf16 `.grad` into fp32
buffers after its backward."""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h

K = 4
BATCH = 2
BF16 = torch.bfloat16


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


class LiveGradients:
    """The bytes of `.grad` alive over all parameters each time autograd has just accumulated one."""

    def __init__(self) -> None:
        self.params: list[Tensor] = []
        self.peak = 0
        self.handles: list[Any] = []

    def watch(self, params: list[Tensor]) -> None:
        self.params = params
        self.handles = [p.register_post_accumulate_grad_hook(self) for p in params]

    def __call__(self, param: Tensor) -> None:
        self.peak = max(self.peak, sum(p.grad.nbytes for p in self.params if p.grad is not None))


class Bf16Module(pl.LightningModule):
    def __init__(self, data: TensorDataset) -> None:
        super().__init__()
        self.net = _net()
        self.data = data
        self.live = LiveGradients()
        self.grad_after_backward: list[bool] = []

    def on_fit_start(self) -> None:
        # before the callback builds its accumulator (`on_train_start`): this hook runs first, and sees
        # each gradient as autograd left it
        self.live.watch(list(self.parameters()))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_after_backward(self) -> None:
        self.grad_after_backward.append(any(p.grad is not None for p in self.parameters()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=BATCH, shuffle=False)


def _oracle(data: TensorDataset, micro_batches: int) -> nn.Module:
    """Today's sum: each micro-batch's bf16 `.grad` (of the loss over K, as Lightning divides it) added into
    fp32 buffers after its backward, the first copied; once per window cast to bf16 and stepped."""
    net = _net().to(BF16)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x_all, y_all = (t.to(BF16) for t in data.tensors)
    buffers: list[Tensor] = []
    for index in range(micro_batches):
        rows = slice(index * BATCH, (index + 1) * BATCH)
        (nn.functional.mse_loss(net(x_all[rows]), y_all[rows]) / K).backward()
        for position, param in enumerate(net.parameters()):
            assert param.grad is not None
            if index % K == 0:
                if len(buffers) <= position:
                    buffers.append(param.grad.float())
                else:
                    buffers[position].copy_(param.grad)
            else:
                buffers[position].add_(param.grad)
            param.grad = None
        if index % K == K - 1:
            for param, buffer in zip(net.parameters(), buffers, strict=True):
                param.grad = buffer.to(BF16)  # the mean: (1/K per loss) x K/K, exactly 1
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return net


@pytest.mark.parametrize("in_backward", [True, False])
def test_bf16_gradients_go_into_fp32_buffers_inside_the_backward(in_backward: bool) -> None:
    micro_batches = 2 * K
    data = h.regression_data(micro_batches * BATCH)
    module = Bf16Module(data)
    callback = GradientAccumulationCallback(K, accumulation_dtype="float32")
    callback._accumulate_in_backward = in_backward  # the after-backward path, kept where hooks cannot be
    h.fit(module, callback, precision="bf16-true")
    params = list(module.parameters())
    largest = max(p.grad.nbytes for p in params if p.grad is not None)  # type: ignore[union-attr]
    every = sum(p.numel() * p.element_size() for p in params)
    assert all(p.dtype == BF16 for p in params) and (largest, every) == (2048, 2562)
    # one parameter's gradient at a time, not the micro-batch's all
    assert module.live.peak == (largest if in_backward else every)
    # either way the module's `on_after_backward` (after the callback's) finds `.grad` moved to the buffers
    assert module.grad_after_backward == [False] * micro_batches
    reference = _oracle(data, micro_batches)
    for got, expected in zip(module.net.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got, expected)
    assert callback.stats.windows == 2 and callback.stats.buffer_bytes == 2 * every


class SecondBranchInTheFirstWindow(h.RegressionModule):
    """`net(x)` always, plus `extra(x)` in the first window's micro-batches only: `extra` has a gradient in
    window 0 and none afterwards. Adam over both (a gradient of zeros would still move it by momentum)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        torch.manual_seed(1)
        self.extra = nn.Linear(5, 1)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        out = self.net(x)
        if batch_idx < K:
            out = out + self.extra(x)
        return nn.functional.mse_loss(out, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


@pytest.mark.parametrize("in_backward", [True, False])
def test_a_parameter_without_gradient_in_a_window_gets_none_from_the_buffers(in_backward: bool) -> None:
    """The buffer of `extra` still holds window 0's sum when windows 1 and 2 close: it must not be written
    into `.grad` again. Oracle: plain PyTorch, one Adam step per window on its big batch, `extra` without a
    gradient (so untouched by Adam) after the first window."""
    data = h.regression_data(40)
    module = SecondBranchInTheFirstWindow(data=data, lr=0.01)
    callback = GradientAccumulationCallback(K, accumulation_dtype="float64")
    callback._accumulate_in_backward = in_backward
    h.fit(module, callback)
    torch.manual_seed(0)
    net = h.regression_net()
    torch.manual_seed(1)
    extra = nn.Linear(5, 1)
    optimizer = torch.optim.Adam([*net.parameters(), *extra.parameters()], lr=0.01)
    x, y = data.tensors
    for index, window in enumerate(h.windows(10, K)):
        rows = slice(window[0] * 4, (window[-1] + 1) * 4)
        out = net(x[rows]) + (extra(x[rows]) if index == 0 else 0.0)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(out, y[rows]).backward()
        optimizer.step()
    assert h.max_abs_diff(module.net, net) < 1e-6
    assert h.max_abs_diff(module.extra, extra) < 1e-6
    assert {float(s["step"]) for p, s in module.trainer.optimizers[0].state.items() if p.dim() == 2} == {
        1.0,
        3.0,
    }  # `extra.weight` stepped once, `net`'s weights three times
