"""DeviceStep and ``GradAccumulator.step`` with fused optimizers: the decision stays on the device.

Oracle: the same plain loop with the host decision (a non-fused optimizer, or ``on_device=False``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gradacc.core import GradAccumulator
from lightning_gradacc.core.torch_internals import DeviceStep, disarm, skips_on_device
from tests.syncs import SyncCounter


def params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(3))]


def test_only_fused_optimizers_skip_on_the_device() -> None:
    assert skips_on_device(torch.optim.AdamW(params(), fused=True))
    assert skips_on_device(torch.optim.SGD(params(), lr=0.1, fused=True))
    # fused SGD creates its momentum buffers uninitialized in a first step even if it skips it
    momentum = torch.optim.SGD(weight := params(), lr=0.1, momentum=0.9, fused=True)
    assert not skips_on_device(momentum)
    weight[0].grad = torch.ones(3)
    momentum.step()
    assert skips_on_device(momentum)
    assert not skips_on_device(torch.optim.Adam(params()))
    assert not skips_on_device(torch.optim.Adam(params(), foreach=True))
    with pytest.raises(RuntimeError, match="Adam does not read `found_inf`"):
        DeviceStep(torch.tensor(0.0)).arm(torch.optim.Adam(params()))


def test_an_armed_step_is_disarmed_after_one_step_and_cannot_be_armed_twice() -> None:
    weight = params()
    optimizer = torch.optim.Adam(weight, lr=1.0, fused=True)
    weight[0].grad = torch.ones(3)
    DeviceStep(torch.tensor(1.0)).arm(optimizer)
    with pytest.raises(RuntimeError, match="already carries"):
        DeviceStep(torch.tensor(0.0)).arm(optimizer)
    optimizer.step()  # skipped: found_inf
    assert not hasattr(optimizer, "found_inf") and not hasattr(optimizer, "grad_scale")
    assert torch.equal(weight[0].detach(), torch.zeros(3)) and float(optimizer.state[weight[0]]["step"]) == 0
    assert not optimizer._optimizer_step_post_hooks  # the one-shot hook is gone after its step
    DeviceStep(torch.tensor(0.0), torch.tensor(2.0)).arm(optimizer)
    disarm(optimizer)  # e.g. the step never came (an exception)
    assert not optimizer._optimizer_step_post_hooks  # nothing of this package stays on the optimizer
    optimizer.step()  # an ordinary step now
    assert float(optimizer.state[weight[0]]["step"]) == 1


def loop(
    optimizer_name: str, on_device: bool | None, *, nan_window: int | None = 1, **settings: object
) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    kind, _, fused = optimizer_name.partition("_")
    optimizer: torch.optim.Optimizer
    if kind == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=bool(fused) or None)
    else:  # SGD sees a wrong multiplier (Adam is nearly blind to the gradient's scale)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=bool(fused) or None)
    accumulator = GradAccumulator(model.named_parameters(), 3, **settings)  # type: ignore[arg-type]
    data = torch.Generator().manual_seed(1)
    for index in range(12):
        x, y = torch.randn(5, 4, generator=data), torch.randn(5, 1, generator=data)
        loss = nn.functional.mse_loss(model(x), y)
        if nan_window is not None and index == 3 * nan_window + 1:
            loss = loss * float("nan")
        accumulator.backward(loss, items=len(x))
        accumulator.step(optimizer, on_device=on_device)
    return model


@pytest.mark.parametrize(
    "settings",
    [{}, {"max_grad_norm": 0.1}, {"max_grad_norm": 0.1, "clip_scope": "parameter"}, {"clip_value": 0.01}],
)
@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_a_fused_step_on_the_device_equals_the_host_decision(kind: str, settings: dict[str, object]) -> None:
    expected = loop(kind, None, **settings)  # host decision, the nan window skipped
    actual = loop(f"{kind}_fused", None, **settings)
    for a, e in zip(actual.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=2e-7)


def test_the_plain_loop_step_reads_nothing_back_with_a_fused_optimizer() -> None:
    counter = SyncCounter()
    with counter.patched(), counter.counting():
        loop("adam_fused", None, max_grad_norm=0.1)
    assert counter.calls == []
    with counter.patched(), counter.counting():
        loop("adam_fused", False, max_grad_norm=0.1)  # the host decision: one read per step
    assert len(counter.calls) == 4


def test_on_device_is_refused_where_the_host_must_decide() -> None:
    weight = params()
    accumulator = GradAccumulator(weight, overflow="raise")
    with pytest.raises(ValueError, match="overflow='raise'"):
        accumulator.finalize(on_device=True)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="a GradScaler"):
        GradAccumulator(weight, grad_scaler=scaler).finalize(on_device=True)
