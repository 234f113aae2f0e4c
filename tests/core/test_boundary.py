"""The boundary's stateless math: ``clip_grads_`` and ``decide`` against plain torch.

``clip_grads_`` against ``torch.nn.utils`` clipping (of the total norm and per parameter, any norm type and
mix of dtypes) with a tolerance close to the real rounding error; ``decide`` on the host and on the device
alike.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

from lightning_gradacc.core.accumulator import GradAccumulator
from lightning_gradacc.core.boundary import clip_grads_, decide, measure
from tests.helpers import (
    BF16,
    F16,
    F32,
    F64,
    INF,
    NORM_TYPES,
    RTOL,
    SHAPES,
    assert_same,
    random_grads,
    torch_clip_each,
)


def torch_clip(
    grads: list[Tensor], max_norm: float | None, norm_type: float, foreach: bool | None = None
) -> tuple[Tensor, list[Tensor]]:
    """``torch.nn.utils``: ``get_total_norm`` then ``clip_grads_with_norm_`` on clones of ``grads``."""
    params = []
    for grad in grads:
        param = nn.Parameter(torch.zeros_like(grad))
        param.grad = grad.clone()
        params.append(param)
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type, foreach=foreach)
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=foreach)
    return total, [p.grad for p in params]


# -------------------------------------------------------------------------------- clipping against torch


DTYPE_SETS = {
    "fp32": [F32] * 5,
    "fp64": [F64] * 5,
    "fp32+fp64": [F32, F64, F32, F64, F32, F32],
}


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("dtypes", list(DTYPE_SETS), ids=list(DTYPE_SETS))
@pytest.mark.parametrize("ratio", [0.3, 3.0], ids=["clips", "no-clip"])
@pytest.mark.parametrize("scale", [1.0, 1e-4], ids=["unit", "tiny"])  # tiny: the eps of 1e-6 matters
def test_clip_grads_equals_torch(norm_type: float, dtypes: str, ratio: float, scale: float) -> None:
    grads = random_grads(DTYPE_SETS[dtypes], seed=len(dtypes) + NORM_TYPES.index(norm_type), scale=scale)
    max_norm = ratio * float(torch.nn.utils.get_total_norm(grads, norm_type))
    expected_norm, expected = torch_clip(grads, max_norm, norm_type)
    mine = [g.clone() for g in grads]
    norm = clip_grads_(mine, max_norm, norm_type)
    assert_same(norm, expected_norm)
    for got, want in zip(mine, expected, strict=True):
        assert_same(got, want)
    if ratio > 1:  # under the limit: untouched, bit for bit
        for got, grad in zip(mine, grads, strict=True):
            assert torch.equal(got, grad)
    else:
        final = float(torch.nn.utils.get_total_norm(mine, norm_type))
        assert final == pytest.approx(max_norm * float(norm) / (float(norm) + 1e-6), rel=1e-5)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize(
    "dtypes",
    [[F16] * 5, [BF16] * 5, [F16, F32, BF16, F64, F32]],
    ids=["fp16", "bf16", "fp16+fp32+bf16+fp64"],
)
def test_clip_grads_half_precision_equals_torch_in_float32(norm_type: float, dtypes: list) -> None:
    """fp16/bf16 norms are computed in float32: torch on float32 copies, rounded once to the dtype."""
    grads = random_grads(dtypes, seed=7 + NORM_TYPES.index(norm_type))
    widened = [g.float() if g.dtype in (F16, BF16) else g for g in grads]
    max_norm = 0.3 * float(torch.nn.utils.get_total_norm(widened, norm_type))
    expected_norm, expected = torch_clip(widened, max_norm, norm_type)
    mine = [g.clone() for g in grads]
    norm = clip_grads_(mine, max_norm, norm_type)
    assert norm.dtype == expected_norm.dtype
    assert_same(norm, expected_norm)
    for got, want, grad in zip(mine, expected, grads, strict=True):
        assert got.dtype == grad.dtype
        assert_same(got, want.to(grad.dtype), rtol=RTOL.get(grad.dtype, 0.0))  # exact for fp16/bf16
    # and within the half-precision rounding of torch's own clipping of the fp16/bf16 tensors
    # (torch rounds the norms of fp16/bf16 tensors to their dtype: its coefficient is that coarse)
    tolerance = 1.6e-2 if BF16 in dtypes else 2e-3
    torch_norm, torch_grads = torch_clip(grads, max_norm, norm_type)
    assert float(norm) == pytest.approx(float(torch_norm), rel=tolerance / 2)
    for got, want in zip(mine, torch_grads, strict=True):
        torch.testing.assert_close(got.double(), want.double(), rtol=tolerance, atol=0.0)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, INF])
@pytest.mark.parametrize(
    "factor", [0.25, 1 / 3, torch.tensor(1 / 3, dtype=F64)], ids=["1/4", "1/3", "tensor"]
)
@pytest.mark.parametrize("ratio", [0.3, 3.0, None], ids=["clips", "no-clip", "no-max-norm"])
@pytest.mark.parametrize("dtypes", [[F32, F64, F32, F32], [F64] * 4], ids=["fp32+fp64", "fp64"])
def test_clip_grads_with_factor_equals_scale_then_torch(norm_type: float, factor, ratio, dtypes) -> None:
    """``factor=f`` is ``g * f`` then torch's clipping."""
    grads = random_grads(dtypes, seed=11)
    scaled = [g * float(factor) for g in grads]
    max_norm = None if ratio is None else ratio * float(torch.nn.utils.get_total_norm(scaled, norm_type))
    mine = [g.clone() for g in grads]
    norm = clip_grads_(mine, max_norm, norm_type, factor=factor)
    expected_norm, expected = torch_clip(scaled, max_norm, norm_type)
    # The oracle rounds the products g * f before its norm, clip_grads_ multiplies the norm by f: equal
    # for a power of two, else within the precision of the narrowest dtype (which sets the coefficient).
    exact = factor == 0.25
    rtol = 0.0 if exact else 2 * RTOL[F32 if F32 in dtypes else F64]
    assert_same(norm, expected_norm, rtol=rtol)
    for got, want in zip(mine, expected, strict=True):
        assert_same(got, want, rtol=rtol if ratio == 0.3 else 0.0)  # unclipped: g * f, bit for bit


def test_clip_grads_empty_and_none() -> None:
    assert float(clip_grads_([], 1.0)) == 0.0
    grads = [torch.tensor([3.0]), None, torch.tensor([4.0])]
    assert float(clip_grads_(grads, 1.0)) == 5.0  # type: ignore[arg-type]
    assert grads[0].item() == pytest.approx(0.6, rel=1e-6) and grads[2].item() == pytest.approx(0.8, rel=1e-6)


def test_clip_grads_nonfinite_norm_like_torch() -> None:
    """A non-finite gradient: torch's clip multiplies by nan (or 0 for inf): so does clip_grads_."""
    for bad in (math.nan, INF):
        grads = [torch.tensor([1.0, bad]), torch.tensor([2.0])]
        expected_norm, expected = torch_clip(grads, 1.0, 2.0)
        mine = [g.clone() for g in grads]
        norm = clip_grads_(mine, 1.0)
        assert_same(norm, expected_norm)
        for got, want in zip(mine, expected, strict=True):
            assert_same(got, want)


# -------------------------------------------------------------------------------- per-parameter clipping


@pytest.mark.parametrize("norm_type", [1.0, 2.0, INF])
@pytest.mark.parametrize("dtypes", [[F32] * 6, [F64] * 6], ids=["fp32", "fp64"])
@pytest.mark.parametrize("factor", [1.0, 0.25])
def test_clip_scope_parameter_equals_torch_tensor_by_tensor(norm_type: float, dtypes, factor) -> None:
    generator = torch.Generator().manual_seed(21)
    scales = [0.01, 10.0, 1.0, 0.1, 5.0, 0.5]  # some tensors above the limit, some under it
    grads = [
        (torch.randn(SHAPES[i % len(SHAPES)], generator=generator, dtype=F64) * s).to(d)
        for i, (s, d) in enumerate(zip(scales, dtypes, strict=True))
    ]
    max_norm = 1.0
    own = [float(torch.linalg.vector_norm(g * factor, norm_type)) for g in grads]
    assert min(own) < max_norm < max(own)  # the test needs both kinds
    expected = torch_clip_each([g * factor for g in grads], max_norm, norm_type)
    mine = [g.clone() for g in grads]
    norm = clip_grads_(mine, max_norm, norm_type, factor=factor, clip_scope="parameter")
    assert_same(norm, torch.nn.utils.get_total_norm([g * factor for g in grads], norm_type))
    for got, want, grad, size in zip(mine, expected, grads, own, strict=True):
        assert_same(got, want)
        if size <= max_norm:
            assert torch.equal(got, grad * factor)
        else:
            assert float(torch.linalg.vector_norm(got, norm_type)) == pytest.approx(max_norm, rel=1e-5)


def test_decide_clip_scope_parameter_decision() -> None:
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([0.3, 0.4]), torch.tensor([6.0, 8.0])]
    norms = measure(grads, 2.0, device=torch.device("cpu"), per_tensor=True)
    decision = decide(norms, 0.5, max_norm=1.0, clip_scope="parameter")
    assert float(decision.norm) == pytest.approx(0.5 * math.sqrt(25 + 0.25 + 100), rel=1e-6)
    assert bool(decision.finite) and bool(decision.clipped)
    multipliers = [float(m) for m in decision.multiplier]  # type: ignore[union-attr]
    assert multipliers == pytest.approx([0.5 / (2.5 + 1e-6), 0.5, 0.5 / (5 + 1e-6)], rel=1e-6)
    small = decide(
        measure(grads[1:2], 2.0, device=torch.device("cpu"), per_tensor=True),
        0.5,
        max_norm=1.0,
        clip_scope="parameter",
    )
    assert not bool(small.clipped)
    with pytest.raises(ValueError, match="per_tensor"):
        decide(5.0, max_norm=1.0, clip_scope="parameter")


def test_clip_scope_parameter_float64_after_float32_keeps_float64_precision() -> None:
    grads = random_grads([F32, F64, F32, F64], seed=4, scale=10.0)
    expected = torch_clip_each(grads, 1.0)
    mine = [g.clone() for g in grads]
    clip_grads_(mine, 1.0, clip_scope="parameter")
    for got, want in zip(mine, expected, strict=True):
        assert_same(got, want)


def test_clip_scope_parameter_large_float64_norm_is_clipped_not_zeroed() -> None:
    grads = [torch.ones(3), torch.full((2,), 1e39, dtype=F64)]
    expected = torch_clip_each(grads, 1.0)
    mine = [g.clone() for g in grads]
    clip_grads_(mine, 1.0, clip_scope="parameter")
    assert_same(mine[1], expected[1])


# ------------------------------------------------------------------ decide on the host and on the device


DECIDE_CASES = [
    # (total, factor, max_norm, clip_value, largest)
    (10.0, 0.5, 1.0, None, None),
    (10.0, 0.5, 100.0, None, None),
    (3.0, 0.25, None, None, None),
    (7.0, 1 / 3, 2.0, 0.1, 4.0),
    (7.0, 1 / 3, 2.0, 10.0, 4.0),
    (7.0, 1.0, None, 1.0, 0.5),
    (0.0, 1.0, 1.0, None, None),
    (math.nan, 0.5, 1.0, None, None),
    (math.inf, 0.5, 1.0, None, None),
    (math.nan, 0.5, None, 1.0, math.nan),
]


@pytest.mark.parametrize("case", DECIDE_CASES, ids=[str(c) for c in DECIDE_CASES])
def test_decide_host_and_device_agree(case: tuple) -> None:
    total, factor, max_norm, clip_value, largest = case
    host = decide(total, factor, max_norm=max_norm, clip_value=clip_value, largest_element=largest)
    device = decide(
        torch.tensor(total, dtype=F64),
        torch.tensor(factor, dtype=F64),
        max_norm=max_norm,
        clip_value=clip_value,
        largest_element=None if largest is None else torch.tensor(largest, dtype=F64),
    )
    assert isinstance(host.norm, float) and isinstance(host.finite, bool) and isinstance(host.clipped, bool)
    assert isinstance(device.norm, Tensor) and device.finite.dtype == torch.bool
    # the oracle: numbers written out
    norm = total * factor
    finite = math.isfinite(norm)
    coefficient = 1.0 if max_norm is None else min(max_norm / (norm + 1e-6), 1.0)
    if math.isnan(norm) and max_norm is not None:
        coefficient = math.nan
    multiplier = coefficient * factor
    clipped = finite and (
        (max_norm is not None and coefficient < 1.0)
        or (clip_value is not None and largest * multiplier > clip_value)
    )
    for decision in (host, device):
        assert float(decision.norm) == pytest.approx(norm, rel=1e-15, nan_ok=True)
        assert bool(decision.finite) is finite
        assert bool(decision.clipped) is clipped
        assert float(decision.multiplier) == pytest.approx(multiplier, rel=1e-15, nan_ok=True)


def test_decide_nan_and_inf_norms_are_not_finite() -> None:
    for value in (math.nan, INF, -INF):
        for norm in (value, torch.tensor(value), torch.tensor(value, dtype=F64)):
            decision = decide(norm, 0.5, max_norm=1.0)
            assert not bool(decision.finite) and not bool(decision.clipped)
    assert bool(decide(torch.tensor(3.0), 0.5).finite)


def test_decide_device_dtypes_float32_norm_float64_factor() -> None:
    decision = decide(torch.tensor(10.0), torch.tensor(0.5, dtype=F64), max_norm=1.0)
    assert decision.norm.dtype == F32  # type: ignore[union-attr]
    assert float(decision.multiplier) == pytest.approx(0.5 / (5.0 + 1e-6), rel=1e-7)


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
