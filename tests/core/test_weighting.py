"""Item counts: any finite number >= 0, checked without a sync, refused at the boundary on every rank.

On the host or the device; a bad or missing one is refused at the window's boundary, naming the micro-batch,
on every rank together.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lightning_gradacc import GradAccumulator
from lightning_gradacc.core.weighting import GradientScale
from lightning_gradacc.core.window import SUMMED


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


def test_a_bad_count_on_another_rank_raises_on_this_rank_too() -> None:
    """The decision is taken on the window's totals summed over ranks, so no rank is left waiting."""

    def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() == len(SUMMED):  # the window's totals: the other rank adds 4 items, 1 invalid count
            other = {"items": 4.0, "weights": 1.0, "bad_items": 1.0}
            tensor += torch.tensor([other.get(name, 0.0) for name in SUMMED], dtype=tensor.dtype)
        else:  # the reference count: the other rank's first count is the same
            tensor *= 2
        return tensor

    param = torch.zeros(1, requires_grad=True)
    accumulator = GradAccumulator([param], scaling="weighted", world_size=2, all_reduce=all_reduce)
    param.grad = torch.ones(1)
    accumulator.record(4)
    with pytest.raises(ValueError, match=r"1 invalid item count.* on another rank"):
        accumulator.finalize()


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "1"])
def test_a_loss_scale_is_a_finite_number_above_zero(bad: object) -> None:
    with pytest.raises(ValueError, match="Expected `loss_scale` to be a finite number > 0"):
        GradientScale(None, loss_scale=bad)  # type: ignore[arg-type]


def test_with_a_grad_scaler_the_value_is_a_device_scalar_and_saved_as_numbers() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scale = GradientScale(scaler, loss_scale=0.25)
    assert scale.state_dict() == {"loss_scale": 0.25, "amp_scale": 8.0}  # before its first scale() too
    scaler.scale(torch.ones(()))  # creates the scale tensor
    value = scale.value()
    assert isinstance(value, torch.Tensor) and float(value) == 2.0


def test_sums_saved_under_other_scales_are_rescaled_to_these() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scale = GradientScale(scaler, loss_scale=0.5)  # K = 2, AMP scale 4: a sum carries 2
    assert scale.rescale_from({"loss_scale": 0.25, "amp_scale": 16.0}) == 0.5  # saved carrying 4


def test_a_scaler_that_never_scaled_says_so() -> None:
    scale = GradientScale(torch.amp.GradScaler("cpu"))
    with pytest.raises(RuntimeError, match="has not scaled a loss yet"):
        scale.value()
