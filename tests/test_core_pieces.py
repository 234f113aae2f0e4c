"""Oracle and behaviour tests of the core's pieces: boundary, kernels, window, store, ledger, stats.

Every numeric check compares with plain torch (``torch.nn.utils`` clipping, autograd on the big batch,
``torch.func``) with a tolerance close to the real rounding error; the state machines are checked state by
state.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._foreach_utils import _device_has_foreach_support

from lightning_gradacc.core import ledger as ledger_module
from lightning_gradacc.core.accumulator import GradAccumulator
from lightning_gradacc.core.boundary import clip_grads_, decide, measure
from lightning_gradacc.core.checkpoint import FORMAT_VERSION
from lightning_gradacc.core.kernels import clamp_, combine_norms, scale_, tensor_norms, use_foreach
from lightning_gradacc.core.ledger import COUNTERS, NAMES, STATISTICS, UNMEASURED, Ledger
from lightning_gradacc.core.stats import AccumulationStats
from lightning_gradacc.core.window import Window, WindowClosedError, WindowState

INF = math.inf
NORM_TYPES = [1.0, 2.0, 3.5, INF]
SHAPES = [(3, 4), (7,), (2, 3, 5), (), (16,)]
F32, F64, F16, BF16 = torch.float32, torch.float64, torch.float16, torch.bfloat16
# tolerance of a value computed in a dtype, relative to the exact one (a few units in the last place)
RTOL = {F32: 1e-6, F64: 1e-12}


def random_grads(dtypes: list[torch.dtype], seed: int, scale: float = 1.0) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [SHAPES[i % len(SHAPES)] for i in range(len(dtypes))]
    return [
        (torch.randn(shape, generator=generator, dtype=F64) * scale).to(dtype)
        for shape, dtype in zip(shapes, dtypes, strict=True)
    ]


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


def torch_clip_each(grads: list[Tensor], max_norm: float, norm_type: float = 2.0) -> list[Tensor]:
    """``torch.nn.utils.clip_grad_norm_([g], max_norm)`` applied tensor by tensor."""
    clipped = []
    for grad in grads:
        param = nn.Parameter(torch.zeros_like(grad))
        param.grad = grad.clone()
        torch.nn.utils.clip_grad_norm_([param], max_norm, norm_type)
        clipped.append(param.grad)
    return clipped


def assert_same(actual: Tensor, expected: Tensor, rtol: float | None = None) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    rtol = RTOL.get(expected.dtype, 0.0) if rtol is None else rtol
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=0.0, equal_nan=True)


# ------------------------------------------------------------------------ 1. boundary vs torch clipping

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


# ------------------------------------------------------------------------------------ 2. foreach contract

UNSUPPORTED = torch.device("meta")


def test_meta_device_has_no_foreach_support_in_torch() -> None:
    """The device the foreach tests below use: torch itself says it has no foreach kernels."""
    assert not _device_has_foreach_support(UNSUPPORTED)
    assert _device_has_foreach_support(torch.device("cpu"))


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_foreach_none_true_false_agree_on_cpu(norm_type: float) -> None:
    grads = random_grads([F32, F64, F32, F16, F32, BF16], seed=3)
    results = []
    for foreach in (None, True, False):
        mine = [g.clone() for g in grads]
        norm = clip_grads_(mine, 0.5, norm_type, foreach=foreach)
        results.append((norm, mine))
    for norm, mine in results[1:]:
        assert_same(norm, results[0][0])
        for got, want in zip(mine, results[0][1], strict=True):
            assert_same(got, want, rtol=RTOL.get(want.dtype, 0.0))
    # and per-parameter clipping and clamping likewise
    outs = []
    for foreach in (None, True, False):
        mine = [g.clone() for g in grads]
        clip_grads_(mine, 0.5, norm_type, clip_scope="parameter", clip_value=0.1, foreach=foreach)
        outs.append(mine)
    for mine in outs[1:]:
        for got, want in zip(mine, outs[0], strict=True):
            assert_same(got, want, rtol=RTOL.get(want.dtype, 0.0))


@pytest.mark.parametrize("foreach", [None, True, False])
def test_foreach_kernels_are_used_as_asked_on_cpu(monkeypatch: pytest.MonkeyPatch, foreach) -> None:
    calls: list[str] = []
    for name in ("_foreach_norm", "_foreach_mul_", "_foreach_clamp_min_", "_foreach_clamp_max_"):
        original = getattr(torch, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch, name, spy)
    grads = [torch.randn(3), torch.randn(4, dtype=F64)]
    clip_grads_(grads, 0.1, foreach=foreach, clip_value=0.01)
    if foreach is False:
        assert calls == []
    else:
        assert {"_foreach_norm", "_foreach_mul_", "_foreach_clamp_min_", "_foreach_clamp_max_"} <= set(calls)


def test_use_foreach_contract() -> None:
    cpu = [torch.zeros(2)]
    meta = [torch.zeros(2, device=UNSUPPORTED)]
    assert use_foreach(None, torch.device("cpu"), cpu) is True
    assert use_foreach(True, torch.device("cpu"), cpu) is True
    assert use_foreach(False, torch.device("cpu"), cpu) is False
    assert use_foreach(None, UNSUPPORTED, meta) is False  # falls back silently
    assert use_foreach(False, UNSUPPORTED, meta) is False
    with pytest.raises(RuntimeError, match="foreach=True was passed"):
        use_foreach(True, UNSUPPORTED, meta)


def test_foreach_true_raises_on_unsupported_device_as_torch_does() -> None:
    def meta_grads() -> list[Tensor]:
        return [torch.ones(3, device=UNSUPPORTED), torch.ones(2, device=UNSUPPORTED)]

    param = nn.Parameter(torch.zeros(3, device=UNSUPPORTED))
    param.grad = torch.ones(3, device=UNSUPPORTED)
    with pytest.raises(RuntimeError, match="foreach=True was passed"):  # torch's own contract
        torch.nn.utils.clip_grad_norm_([param], 1.0, foreach=True)
    with pytest.raises(RuntimeError, match="foreach=True was passed"):
        clip_grads_(meta_grads(), 1.0, foreach=True)
    for call in (
        lambda: tensor_norms(meta_grads(), 2.0, device=UNSUPPORTED, foreach=True),
        lambda: scale_(meta_grads(), 0.5, foreach=True),
        lambda: scale_(meta_grads(), [torch.tensor(0.5)] * 2, foreach=True),
        lambda: clamp_(meta_grads(), 0.5, foreach=True),
    ):
        with pytest.raises(RuntimeError, match="foreach=True was passed"):
            call()
    # foreach=None (and False) fall back to a loop: no raise
    for foreach in (None, False):
        norm = clip_grads_(meta_grads(), 1.0, foreach=foreach, clip_value=0.5)
        assert norm.device == UNSUPPORTED
        clip_grads_(meta_grads(), 1.0, clip_scope="parameter", foreach=foreach)
        tensor_norms(meta_grads(), 2.0, device=UNSUPPORTED, foreach=foreach)


def test_tensor_norms_and_combine_norms_equal_torch() -> None:
    grads = random_grads([F32, F64, F16, BF16, F32], seed=5)
    for norm_type in NORM_TYPES:
        norms = tensor_norms(grads, norm_type, device=torch.device("cpu"))
        # in group order: float32 first (two of them), then float64, float16, bfloat16
        order = [0, 4, 1, 2, 3]
        for index, norm in zip(order, norms, strict=True):
            grad = grads[index]
            wide = grad.double() if grad.dtype == F64 else grad.float()
            assert norm.dtype == wide.dtype
            assert_same(norm, torch.linalg.vector_norm(wide, norm_type))
        widened = [g.float() if g.dtype in (F16, BF16) else g for g in grads]
        expected = torch.nn.utils.get_total_norm(widened, norm_type)
        assert_same(combine_norms(norms, norm_type, device=torch.device("cpu")), expected)


def test_scale_and_clamp_equal_elementwise_ops() -> None:
    grads = random_grads([F32, F32, F64], seed=9)
    for factor in (0.5, torch.tensor(0.3), torch.tensor(0.3, dtype=F64)):
        mine = [g.clone() for g in grads]
        scale_(mine, factor)
        for got, grad in zip(mine, grads, strict=True):
            wide = (
                factor.to(grad.dtype if grad.dtype == F64 else F32) if isinstance(factor, Tensor) else factor
            )
            assert torch.equal(got, grad * wide)
    mine = [g.clone() for g in grads]
    clamp_(mine, 0.2)
    for got, grad in zip(mine, grads, strict=True):
        assert torch.equal(got, grad.clamp(-0.2, 0.2))


def test_scale_per_tensor_factors_in_one_group() -> None:
    grads = random_grads([F32] * 4, seed=10)
    factors = [torch.tensor(f) for f in (0.5, 2.0, 0.1, 1.0)]
    for foreach in (None, False):
        mine = [g.clone() for g in grads]
        scale_(mine, factors, foreach=foreach)
        for got, grad, factor in zip(mine, grads, factors, strict=True):
            assert torch.equal(got, grad * factor)


def test_scale_per_tensor_factors_grouped_mapping() -> None:
    """Given the grouping (as the boundary does), factors follow the groups' order."""
    a, b, c = torch.ones(2), torch.ones(3, dtype=F64), torch.ones(1)
    groups = {(a.device, F32): [a, c], (b.device, F64): [b]}
    scale_(groups, [torch.tensor(2.0), torch.tensor(3.0), torch.tensor(5.0)])
    assert a.tolist() == [2.0, 2.0] and c.tolist() == [3.0] and b.tolist() == [5.0] * 3


def test_scale_per_tensor_factors_flat_mixed_list_follow_the_tensors() -> None:
    tensors = [torch.ones(2), torch.ones(2, dtype=F64), torch.ones(2)]
    scale_(tensors, [torch.tensor(2.0), torch.tensor(3.0), torch.tensor(5.0)])
    assert [t.tolist() for t in tensors] == [[2.0, 2.0], [3.0, 3.0], [5.0, 5.0]]


# ------------------------------------------------------------------------------- 3. per-parameter clipping


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


def test_clip_scope_parameter_needs_max_grad_norm() -> None:
    weight = nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="clip_scope"):
        GradAccumulator([weight], 2, clip_scope="parameter")
    with pytest.raises(ValueError, match="clip_scope"):
        GradAccumulator([weight], 2, max_grad_norm=1.0, clip_scope="tensor")


# -------------------------------------------------------------------------------- 4. decide host / device

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


# ----------------------------------------------------------------------------------- 5. window states


def _window(buffered: bool) -> Window:
    return Window(buffered=buffered, loss_scale=0.5, device=torch.device("cpu"), dtype=F64)


def test_window_unbuffered_states() -> None:
    window = _window(buffered=False)
    assert window.state is WindowState.EMPTY and window.empty and window.loss_scale == 0.5
    assert not window.new_gradients_to_buffers
    window.record_micro_batch(in_buffers=False)
    window.record_micro_batch(in_buffers=False)
    assert window.state is WindowState.IN_GRAD and window.micro_batches == 2 and not window.empty
    assert not window.sums_in_buffers
    with pytest.raises(RuntimeError, match="nothing to flush"):
        window.flush()
    with pytest.raises(RuntimeError, match="went to the buffers"):
        window.record_micro_batch(in_buffers=True)
    assert window.micro_batches == 2
    window.close()
    assert window.state is WindowState.CLOSED
    for action in (
        lambda: window.record_micro_batch(in_buffers=False),
        window.close,
        window.flush,
        lambda: window.restored(in_buffers=False, micro_batches=1),
        lambda: window.new_gradients_to_buffers,
    ):
        with pytest.raises(WindowClosedError, match="closed"):
            action()
    assert window.micro_batches == 2
    assert issubclass(WindowClosedError, RuntimeError)


def test_window_buffered_states() -> None:
    window = _window(buffered=True)
    assert window.new_gradients_to_buffers
    window.record_micro_batch(in_buffers=True)
    assert window.state is WindowState.IN_BUFFERS and window.sums_in_buffers
    with pytest.raises(RuntimeError, match=r"went to \.grad"):
        window.record_micro_batch(in_buffers=False)
    assert window.flush() is True
    assert window.state is WindowState.FLUSHED and not window.sums_in_buffers
    assert window.flush() is False
    assert window.flush() is False
    assert not window.new_gradients_to_buffers
    window.record_micro_batch(in_buffers=False)  # the last backward adds to .grad
    assert window.state is WindowState.FLUSHED and window.micro_batches == 2
    with pytest.raises(RuntimeError):
        window.record_micro_batch(in_buffers=True)


def test_window_empty_flush_and_restore() -> None:
    window = _window(buffered=True)
    assert window.flush() is False  # nothing buffered yet
    assert window.state is WindowState.FLUSHED
    fresh = _window(buffered=True)
    fresh.restored(in_buffers=True, micro_batches=3)
    assert fresh.state is WindowState.IN_BUFFERS and fresh.micro_batches == 3
    with pytest.raises(RuntimeError, match="empty window"):
        fresh.restored(in_buffers=True, micro_batches=1)
    assert fresh.micro_batches == 3
    plain = _window(buffered=False)
    plain.restored(in_buffers=False, micro_batches=2)
    assert plain.state is WindowState.IN_GRAD


def _linear_accumulator(**kwargs) -> tuple[nn.Linear, GradAccumulator]:
    torch.manual_seed(1)
    model = nn.Linear(3, 2)
    return model, GradAccumulator(model.named_parameters(), 2, **kwargs)


def _backward(model: nn.Module, accumulator: GradAccumulator, scale: float = 1.0) -> None:
    x = torch.randn(4, model.in_features)
    accumulator.backward(model(x).pow(2).mean() * scale, items=4)


@pytest.mark.parametrize("buffered", [False, True])
def test_accumulator_windows_follow_each_other(buffered: bool) -> None:
    model, accumulator = _linear_accumulator(accumulation_dtype="float64" if buffered else None)
    first = accumulator.window
    assert first.state is WindowState.EMPTY and accumulator.window is first
    _backward(model, accumulator)
    assert first.state is (WindowState.IN_BUFFERS if buffered else WindowState.IN_GRAD)
    if buffered:
        accumulator.flush_to_grad()
        assert first.state is WindowState.FLUSHED
    _backward(model, accumulator)
    assert accumulator.finalize()
    second = accumulator.window
    assert second is not first and second.state is WindowState.EMPTY and second.micro_batches == 0
    assert first.state is WindowState.CLOSED
    with pytest.raises(WindowClosedError):
        first.record_micro_batch(in_buffers=False)
    _backward(model, accumulator)
    accumulator.reset()
    third = accumulator.window
    assert third is not second and second.state is WindowState.CLOSED and third.state is WindowState.EMPTY
    assert accumulator.finalize() is False  # empty window: no step, a new one again
    assert accumulator.window is not third and third.state is WindowState.CLOSED


def test_loss_scale_told_only_while_the_window_is_empty() -> None:
    model, accumulator = _linear_accumulator()
    assert accumulator.loss_scale == 1.0
    accumulator.loss_scale = 0.5
    assert accumulator.loss_scale == 0.5 and accumulator.window.loss_scale == 0.5
    _backward(model, accumulator, scale=0.5)
    with pytest.raises(RuntimeError, match="loss_scale"):
        accumulator.loss_scale = 0.25
    assert accumulator.loss_scale == 0.5 and accumulator.window.loss_scale == 0.5
    accumulator.loss_scale = 0.5  # the same value: fine
    accumulator.finalize()
    assert accumulator.window.loss_scale == 0.5  # the next window keeps it
    accumulator.loss_scale = 2
    assert accumulator.loss_scale == 2.0 and isinstance(accumulator.loss_scale, float)
    for bad in (0, 0.0, -1, -0.5, math.nan, INF, -INF, True, False, "1", None, torch.tensor(1.0)):
        with pytest.raises(ValueError, match="loss_scale"):
            accumulator.loss_scale = bad
    assert accumulator.loss_scale == 2.0


@pytest.mark.parametrize("scaling", ["mean", "sum"])
def test_loss_scale_is_divided_out(scaling: str) -> None:
    """Losses scaled by 1/K with loss_scale=1/K give the gradient of unscaled losses with loss_scale=1."""
    grads, losses = [], []
    for loss_scale in (1.0, 0.25):
        torch.manual_seed(3)
        model = nn.Linear(3, 2)
        accumulator = GradAccumulator(model.named_parameters(), 4, scaling=scaling)
        accumulator.loss_scale = loss_scale
        for _ in range(4):
            _backward(model, accumulator, scale=loss_scale)
        assert accumulator.finalize()
        grads.append([p.grad.clone() for p in model.parameters()])
        losses.append(accumulator.window_loss)
    for got, want in zip(grads[1], grads[0], strict=True):
        assert torch.equal(got, want)  # powers of two: exact
    assert losses[1] == losses[0] and math.isfinite(losses[0])  # the loss statistic is unscaled too


# -------------------------------------------------------------------------------- 6. gradient store


class TwoLayer(nn.Module):
    def __init__(self, dtype: torch.dtype = F32) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.first = nn.Linear(4, 5)  # initialized in float32: the same values for every dtype
        self.second = nn.Linear(5, 2)
        self.unused = nn.Parameter(torch.zeros(3))
        self.to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(torch.tanh(self.first(x)))


USED = ["first.weight", "first.bias", "second.weight", "second.bias"]


def _micro_batches(sizes: list[int], dtype: torch.dtype = F32) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(sum(sizes))
    return [
        (torch.randn(n, 4, generator=generator).to(dtype), torch.randn(n, 2, generator=generator).to(dtype))
        for n in sizes
    ]


def _func_grads(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    params = {name: p.detach() for name, p in model.named_parameters() if name in USED}

    def loss(params: dict[str, Tensor]) -> Tensor:
        return nn.functional.mse_loss(functional_call(model, params, (x,)), y)

    return torch.func.grad(loss)(params)


def _accumulate(model: TwoLayer, sizes: list[int], how: str, **kwargs) -> GradAccumulator:
    accumulator = GradAccumulator(model.named_parameters(), len(sizes), **kwargs)
    for x, y in _micro_batches(sizes, model.first.weight.dtype):
        if how == "backward":
            accumulator.backward(nn.functional.mse_loss(model(x), y), items=len(x))
        else:
            accumulator.gradients.add(_func_grads(model, x, y), items=len(x))
    return accumulator


SIZES = {"mean": [8, 8, 8, 8], "weighted": [8, 4, 16, 8]}  # weighted: weights 1, 1/2, 2, 1 (exact)


@pytest.mark.parametrize("scaling", ["mean", "weighted", "sum"])
@pytest.mark.parametrize("accumulation_dtype", [None, "float64"])
def test_store_add_equals_backward(scaling: str, accumulation_dtype) -> None:
    results = []
    for how in ("backward", "add"):
        model = TwoLayer()
        accumulator = _accumulate(
            model,
            SIZES.get(scaling, [8, 8, 8, 8]),
            how,
            scaling=scaling,
            accumulation_dtype=accumulation_dtype,
        )
        assert accumulator.window.micro_batches == 4
        assert set(accumulator.gradients) == set(USED)
        sums = {name: tensor.clone() for name, tensor in accumulator.gradients.items()}
        assert accumulator.finalize()
        stats = accumulator.stats
        results.append((sums, {n: p.grad for n, p in model.named_parameters()}, stats))
    (sums_b, grads_b, stats_b), (sums_a, grads_a, stats_a) = results
    for name in USED:
        assert torch.equal(sums_a[name], sums_b[name]), name
        assert grads_a[name] is not None and torch.equal(grads_a[name], grads_b[name]), name
    assert grads_a["unused"] is None and grads_b["unused"] is None
    assert stats_a.items_last_step == stats_b.items_last_step == sum(SIZES.get(scaling, [8] * 4))
    assert stats_a.last_grad_norm == stats_b.last_grad_norm
    assert stats_a.total_micro_batches == 4


def test_store_add_with_unequal_weights_equals_backward() -> None:
    """Weights that are not powers of two: the two paths round differently, within float32 precision."""
    sizes = [3, 7, 5, 2]
    grads = []
    for how in ("backward", "add"):
        model = TwoLayer()
        accumulator = _accumulate(model, sizes, how, scaling="weighted")
        accumulator.finalize()
        grads.append([model.get_parameter(name).grad for name in USED])
    # and both equal the big batch's mean gradient
    model = TwoLayer(F64)
    batches = _micro_batches(sizes, F64)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    nn.functional.mse_loss(model(x), y).backward()
    for got_add, got_backward, name in zip(grads[1], grads[0], USED, strict=True):
        torch.testing.assert_close(got_add, got_backward, rtol=2e-6, atol=1e-7)
        big = model.get_parameter(name).grad.float()
        torch.testing.assert_close(got_add, big, rtol=2e-6, atol=1e-7)


def test_store_mean_equals_big_batch_mean_gradient() -> None:
    model = TwoLayer(F64)
    sizes = [6, 6, 6]
    accumulator = _accumulate(model, sizes, "add")
    assert accumulator.finalize()
    reference = TwoLayer(F64)
    batches = _micro_batches(sizes, F64)
    nn.functional.mse_loss(
        reference(torch.cat([b[0] for b in batches])), torch.cat([b[1] for b in batches])
    ).backward()
    for name in USED:
        torch.testing.assert_close(
            model.get_parameter(name).grad, reference.get_parameter(name).grad, rtol=1e-12, atol=1e-15
        )


def test_store_mapping_interface() -> None:
    model = TwoLayer()
    accumulator = GradAccumulator(model.named_parameters(), 2)
    store = accumulator.gradients
    assert len(store) == 0 and list(store) == [] and "first.weight" not in store
    assert store.get("first.weight") is None and store.get("nope") is None
    with pytest.raises(KeyError, match="no gradient in the open window"):
        store["first.weight"]
    with pytest.raises(KeyError, match="not a tracked parameter"):
        store["nope"]
    x, y = _micro_batches([4])[0]
    nn.functional.mse_loss(model(x), y).backward()
    assert len(accumulator.gradients) == 0  # not recorded yet: the window is still empty
    accumulator.record(4)
    store = accumulator.gradients
    assert set(store) == set(USED) and len(store) == 4 and "unused" not in store and "first.bias" in store
    assert torch.equal(store["first.bias"], model.first.bias.grad)
    assert torch.equal(store.get("second.weight"), model.second.weight.grad)
    assert store.get("unused") is None
    assert set(dict(store.items())) == set(USED)


def _snapshot(accumulator: GradAccumulator) -> tuple:
    return (
        accumulator.window.micro_batches,
        accumulator.window.state,
        accumulator.stats.total_micro_batches,
        {name: tensor.clone() for name, tensor in accumulator.gradients.items()},
    )


def _assert_snapshot_equal(before: tuple, after: tuple) -> None:
    assert before[:3] == after[:3]
    assert set(before[3]) == set(after[3])
    for name, tensor in before[3].items():
        assert torch.equal(tensor, after[3][name]), name


@pytest.mark.parametrize("accumulation_dtype", [None, "float64"])
def test_store_add_rejects_bad_gradients_and_leaves_the_window(accumulation_dtype) -> None:
    sizes = [8, 8, 8]
    model = TwoLayer()
    accumulator = GradAccumulator(model.named_parameters(), 3, accumulation_dtype=accumulation_dtype)
    batches = _micro_batches(sizes)
    accumulator.gradients.add(_func_grads(model, *batches[0]), items=8)
    good = _func_grads(model, *batches[1])
    bad_inputs = [
        ({**good, "first.bias": torch.zeros(4)}, ValueError, "first.bias"),  # shape
        ({**good, "first.bias": torch.zeros(5, dtype=F64)}, ValueError, "first.bias"),  # dtype
        ({**good, "second.weight": torch.zeros(2, 5, dtype=F16)}, ValueError, "second.weight"),
        ({**good, "nope": torch.zeros(5)}, KeyError, "nope"),  # unknown name, after valid ones
        ({**good, "first.bias": [0.0] * 5}, ValueError, "first.bias"),  # not a tensor
        ({**good, "first.bias": torch.zeros(5).to_sparse()}, ValueError, "sparse"),
    ]
    for gradients, error, match in bad_inputs:
        before = _snapshot(accumulator)
        with pytest.raises(error, match=match):
            accumulator.gradients.add(gradients, items=8)
        _assert_snapshot_equal(before, _snapshot(accumulator))
    # the failed calls left nothing behind: the window finishes as if they never happened
    accumulator.gradients.add(good, items=8)
    accumulator.gradients.add(_func_grads(model, *batches[2]), items=8)
    assert accumulator.finalize()
    reference = TwoLayer()
    oracle = _accumulate(reference, sizes, "backward", accumulation_dtype=accumulation_dtype)
    oracle.finalize()
    for name in USED:
        assert torch.equal(model.get_parameter(name).grad, reference.get_parameter(name).grad), name


def test_store_add_records_items_and_loss_like_backward() -> None:
    sizes = [3, 7, 5]
    model = TwoLayer()
    accumulator = GradAccumulator(model.named_parameters(), 3, scaling="weighted")
    accumulator.loss_scale = 0.5  # the given gradients and losses are of the unscaled mean loss
    losses = []
    for x, y in _micro_batches(sizes):
        loss = nn.functional.mse_loss(model(x), y).detach()
        losses.append(float(loss))
        accumulator.gradients.add(_func_grads(model, x, y), items=len(x), loss=loss)
    assert accumulator.finalize()
    assert accumulator.stats.items_last_step == sum(sizes)
    expected = sum(n * v for n, v in zip(sizes, losses, strict=True)) / sum(sizes)
    assert accumulator.window_loss == pytest.approx(expected, rel=1e-6)
    reference = TwoLayer(F64)
    batches = _micro_batches(sizes, F64)
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    nn.functional.mse_loss(reference(x), y).backward()
    for name in USED:
        want = reference.get_parameter(name).grad.float()
        torch.testing.assert_close(model.get_parameter(name).grad, want, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("accumulation_dtype", [None, "float64"])
def test_store_remove(accumulation_dtype) -> None:
    model = TwoLayer()
    accumulator = _accumulate(model, [8, 8], "backward", accumulation_dtype=accumulation_dtype)
    expected = accumulator.gradients["first.bias"].clone()
    kept = {name: accumulator.gradients[name].clone() for name in USED}
    removed = accumulator.gradients.remove("first.bias")
    assert torch.equal(removed, expected)
    assert "first.bias" not in accumulator.gradients and len(accumulator.gradients) == 3
    with pytest.raises(KeyError):
        accumulator.gradients.remove("first.bias")
    with pytest.raises(KeyError):
        accumulator.gradients.remove("unused")
    assert torch.equal(removed, expected)  # not overwritten by anything above
    assert accumulator.window.micro_batches == 2
    assert accumulator.finalize()
    assert model.first.bias.grad is None
    for name in ("first.weight", "second.weight", "second.bias"):
        grad = model.get_parameter(name).grad
        want = (kept[name] / 2).to(grad.dtype)
        assert torch.equal(grad, want), name
    # the next window: the removed parameter takes part again
    for x, y in _micro_batches([8, 8]):
        accumulator.backward(nn.functional.mse_loss(model(x), y), items=8)
    assert "first.bias" in accumulator.gradients


# ------------------------------------------------------------------------------------------- 7. ledger


def _oracle_fold(state: dict, window: dict, count: bool) -> None:
    folds = {s.name: s.fold for s in STATISTICS}
    values = {k: float(v) for k, v in window.items()}
    if "last_grad_norm" in values:
        values["max_grad_norm_seen"] = values["last_grad_norm"]
    for name, value in values.items():
        fold = folds[name]
        if fold == "sum":
            if count:
                state[name] += value
        elif fold == "max":
            if math.isfinite(value) and value > state[name]:
                state[name] = value
        else:
            state[name] = value


def _assert_ledger(values: dict, oracle: dict) -> None:
    assert set(values) == set(oracle)
    for name, want in oracle.items():
        got = values[name]
        assert (math.isnan(got) and math.isnan(want)) or got == want, (name, got, want)


@pytest.mark.parametrize("seed", range(4))
def test_ledger_folds_host_and_device_values_in_any_order(seed: int) -> None:
    rng = random.Random(seed)
    ledger = Ledger(F64)
    oracle = dict.fromkeys(NAMES, 0.0) | dict.fromkeys(UNMEASURED, math.nan)  # nan: nothing measured yet
    _assert_ledger(ledger.values(), oracle)
    for _ in range(40):
        window: dict = {}
        for statistic in STATISTICS:
            if statistic.name == "max_grad_norm_seen" or rng.random() < 0.2:
                continue
            if statistic.fold == "sum":
                value = float(rng.randint(0, 2))
            else:
                value = rng.choice([rng.uniform(0, 10), rng.uniform(0, 10), math.nan, INF])
            on_device = rng.random() < 0.5
            window[statistic.name] = torch.tensor(value, dtype=rng.choice([F32, F64])) if on_device else value
        count = rng.random() < 0.8
        ledger.fold(window, count=count)
        _oracle_fold(oracle, {k: float(v) for k, v in window.items()}, count)
        if rng.random() < 0.2:
            _assert_ledger(ledger.values(), oracle)
            assert ledger.fresh
    _assert_ledger(ledger.values(), oracle)
    _assert_ledger(ledger.state_dict(), oracle)


def test_ledger_last_follows_fold_order_across_host_and_device() -> None:
    ledger = Ledger(F64)
    ledger.fold({"last_grad_norm": torch.tensor(5.0), "skipped_steps": torch.tensor(1.0)})
    assert not ledger.fresh
    ledger.fold({"last_grad_norm": 3.0, "skipped_steps": 1.0})  # host values after a pending device row
    ledger.fold({"items_last_step": torch.tensor(7.0)})
    values = ledger.values()
    assert values["last_grad_norm"] == 3.0 and values["max_grad_norm_seen"] == 5.0
    assert values["skipped_steps"] == 2.0 and values["items_last_step"] == 7.0
    assert ledger.fresh


def test_ledger_non_finite_norm_is_last_but_not_max() -> None:
    for value in (math.nan, INF, torch.tensor(math.nan), torch.tensor(INF)):
        ledger = Ledger(F64)
        ledger.fold({"last_grad_norm": 2.0})
        ledger.fold({"last_grad_norm": value})
        values = ledger.values()
        assert not math.isfinite(values["last_grad_norm"])
        assert values["max_grad_norm_seen"] == 2.0
    ledger = Ledger(F64)
    ledger.fold({"last_grad_norm": torch.tensor(math.nan)})
    assert ledger.values()["max_grad_norm_seen"] == 0.0


def test_ledger_count_false_leaves_counters() -> None:
    for device in (False, True):
        ledger = Ledger(F64)

        def value(v: float, _device: bool = device):
            return torch.tensor(v, dtype=F64) if _device else v

        ledger.fold({name: value(1.0) for name in COUNTERS} | {"last_grad_norm": value(1.0)})
        ledger.fold(
            {name: value(5.0) for name in COUNTERS}
            | {"last_grad_norm": value(4.0), "items_last_step": value(9.0), "window_loss": value(0.5)},
            count=False,
        )
        values = ledger.values()
        assert all(values[name] == 1.0 for name in COUNTERS)
        assert values["last_grad_norm"] == 4.0 and values["max_grad_norm_seen"] == 4.0
        assert values["items_last_step"] == 9.0 and values["window_loss"] == 0.5


def test_ledger_syncs_every_max_pending_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ledger_module, "MAX_PENDING", 3)
    syncs = []
    original = Ledger.sync

    def counting_sync(self, *extra):
        syncs.append(len(self._pending))
        return original(self, *extra)

    monkeypatch.setattr(Ledger, "sync", counting_sync)
    ledger = Ledger(F64)
    for index in range(7):
        ledger.fold({"clipped_steps": torch.tensor(1.0), "last_grad_norm": torch.tensor(float(index))})
        assert ledger.fresh == ((index + 1) % 3 == 0), index
    assert syncs == [3, 3]
    values = ledger.values()
    assert values["clipped_steps"] == 7.0 and values["last_grad_norm"] == 6.0
    assert values["max_grad_norm_seen"] == 6.0


def test_ledger_sync_returns_extra_values_and_folds() -> None:
    ledger = Ledger(F64)
    assert ledger.sync(torch.tensor(2.5)) == [2.5]
    ledger.fold({"skipped_steps": torch.tensor(1.0)})
    assert ledger.sync(torch.tensor(1.5), torch.tensor(3, dtype=torch.int64)) == [1.5, 3.0]
    assert ledger.fresh and ledger.values()["skipped_steps"] == 1.0


def test_ledger_load_state_dict_takes_known_names_and_starts_the_others_afresh() -> None:
    ledger = Ledger(F64)
    ledger.fold({"dropped_micro_batches": torch.tensor(4.0)})  # pending: dropped by the load
    ledger.load_state_dict(
        {
            "non_finite_windows": 3,
            "clipped_steps": 2,
            "skipped_steps": 1,
            "other": 5.0,
            "last_grad_norm": 1.5,
            "max_grad_norm_seen": 2.5,
        }
    )
    values = ledger.values()
    assert values["non_finite_windows"] == 3.0 and values["clipped_steps"] == 2.0
    assert values["skipped_steps"] == 1.0 and values["dropped_micro_batches"] == 0.0
    assert values["empty_windows"] == 0.0 and math.isnan(values["window_loss"])
    assert values["last_grad_norm"] == 1.5 and values["max_grad_norm_seen"] == 2.5
    assert set(values) == set(NAMES)
    ledger.load_state_dict(dict(values, window_loss=0.25))
    assert ledger.values() == dict(values, window_loss=0.25)


def test_ledger_deferred_last_values_are_computed_once_when_read() -> None:
    calls: list[str] = []

    def deferred(name: str, value):
        def compute():
            calls.append(name)
            return value

        return compute

    ledger = Ledger(F64)
    ledger.fold({"window_loss": deferred("first", 1.0), "skipped_steps": 1.0})
    ledger.fold({"window_loss": deferred("second", torch.tensor(2.0)), "skipped_steps": torch.tensor(1.0)})
    assert calls == []  # superseded before any read: "first" is never computed
    assert ledger.values(deferred=False)["skipped_steps"] == 2.0 and calls == []
    assert ledger.values()["window_loss"] == 2.0 and calls == ["second"]
    assert ledger.values()["window_loss"] == 2.0 and calls == ["second"]  # once
    # a deferred value after a pending device value of the same statistic wins, and vice versa
    ledger.fold({"window_loss": torch.tensor(3.0)})
    ledger.fold({"window_loss": deferred("third", 4.0)})
    assert ledger.values()["window_loss"] == 4.0
    ledger.fold({"window_loss": deferred("fourth", 5.0)})
    ledger.fold({"window_loss": torch.tensor(6.0)})
    assert ledger.values()["window_loss"] == 6.0 and "fourth" not in calls
    ledger.fold({"window_loss": deferred("fifth", 7.0)})
    ledger.load_state_dict({"window_loss": 0.5})
    assert ledger.values()["window_loss"] == 0.5 and "fifth" not in calls


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
        for x, y in _micro_batches(sizes):
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


# ------------------------------------------------------------------------------------ 8. saved states

SAVED_STATE = {
    "version": FORMAT_VERSION,
    "accumulation_steps": 4,
    "windows": 12,
    "total_micro_batches": 45,
    "micro_batches_last_step": 3,
    "peak_memory_bytes": 12345,
    "non_finite_windows": 2.0,
    "dropped_micro_batches": 3.0,
    "skipped_steps": 2.0,
    "clipped_steps": 5.0,
    "empty_windows": 1.0,
    "last_grad_norm": 0.75,
    "max_grad_norm_seen": 3.5,
    "items_last_step": 24.0,
    "window_loss": 0.125,
}


def test_accumulator_loads_its_saved_state_and_counts_on() -> None:
    model, accumulator = _linear_accumulator()
    accumulator.load_state_dict(SAVED_STATE)
    assert accumulator.state_dict()["peak_memory_bytes"] == 12345  # restored (re-measured when read)
    stats = accumulator.stats
    assert stats.windows == 12 and stats.total_micro_batches == 45 and stats.micro_batches_last_step == 3
    assert (stats.non_finite_windows, stats.dropped_micro_batches, stats.skipped_steps) == (2, 3, 2)
    assert (stats.clipped_steps, stats.empty_windows, stats.steps_taken) == (5, 1, 12 - 2 - 1)
    assert stats.last_grad_norm == 0.75 and stats.max_grad_norm_seen == 3.5 and stats.items_last_step == 24.0
    assert accumulator.window_loss == 0.125
    assert all(isinstance(getattr(stats, name), int) for name in COUNTERS)
    _, other = _linear_accumulator()
    other.load_state_dict(accumulator.state_dict())
    assert _without_peak(other.stats) == _without_peak(stats)
    _backward(model, accumulator)
    _backward(model, accumulator)
    accumulator.finalize()
    assert accumulator.stats.windows == 13 and accumulator.stats.total_micro_batches == 47


def _without_peak(stats: AccumulationStats) -> AccumulationStats:
    """The statistics but the process's memory peak, which grows on its own (it is read when asked)."""
    return dataclasses.replace(stats, peak_memory_bytes=0)


def test_accumulator_load_state_rejects_bad_states_and_changes_nothing() -> None:
    """Formats 1 and 2 were never released: only the current one loads, and a refusal names the version."""
    model, accumulator = _linear_accumulator()
    _backward(model, accumulator)
    _backward(model, accumulator)
    accumulator.finalize()
    before = accumulator.stats
    for bad in (
        dict(SAVED_STATE, version=FORMAT_VERSION + 1),
        {k: v for k, v in SAVED_STATE.items() if k != "version"},
        {k: v for k, v in SAVED_STATE.items() if k != "windows"},
        dict(SAVED_STATE, version=1),
        dict(SAVED_STATE, version=2),
        dict(SAVED_STATE, version=str(FORMAT_VERSION)),
        {k: v for k, v in SAVED_STATE.items() if k != "skipped_steps"},
    ):
        with pytest.raises(ValueError, match=r"version|missing"):
            accumulator.load_state_dict(bad)
        assert _without_peak(accumulator.stats) == _without_peak(before)


def test_accumulator_load_state_with_a_bad_value_changes_nothing() -> None:
    _, accumulator = _linear_accumulator()
    before = accumulator.stats
    for bad in (
        dict(SAVED_STATE, total_micro_batches="x"),
        dict(SAVED_STATE, skipped_steps="x"),
        dict(SAVED_STATE, clipped_steps=None),
    ):
        with pytest.raises((ValueError, TypeError)):
            accumulator.load_state_dict(bad)
        assert _without_peak(accumulator.stats) == _without_peak(before)


# ------------------------------------------------------------------------------------- 9. statistics


def test_stats_of_a_run_with_skipped_and_empty_windows() -> None:
    model, accumulator = _linear_accumulator(max_grad_norm=1e-3)
    _backward(model, accumulator)
    _backward(model, accumulator)
    assert accumulator.finalize()  # stepped and clipped
    _backward(model, accumulator, scale=math.nan)
    _backward(model, accumulator)
    assert not accumulator.finalize()  # not finite: skipped
    assert model.weight.grad is None
    assert not accumulator.finalize()  # empty
    _backward(model, accumulator)
    stats = accumulator.stats
    assert (stats.windows, stats.skipped_steps, stats.empty_windows, stats.non_finite_windows) == (3, 1, 1, 1)
    assert stats.steps_taken == 1 == stats.windows - stats.skipped_steps - stats.empty_windows
    assert stats.clipped_steps == 1 and stats.open_window_micro_batches == 1
    assert accumulator.window.micro_batches == 1
    assert stats.as_dict()["steps_taken"] == 1
