"""GradientScale: the loss scale times the AMP scale, read without a sync, saved and rescaled."""

from __future__ import annotations

import pytest
import torch

from lightning_gradacc.core.gradient_scale import GradientScale


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
