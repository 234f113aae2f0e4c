"""The fused kernels against elementwise torch, and their ``foreach`` contract (the same as torch's).

One ``torch._foreach_*`` call per device and dtype group; ``foreach`` behaves as in
``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.utils._foreach_utils import _device_has_foreach_support

from lightning_gradacc.core.boundary import clip_grads_
from lightning_gradacc.core.kernels import clamp_, combine_norms, scale_, tensor_norms, use_foreach
from tests.helpers import BF16, F16, F32, F64, NORM_TYPES, RTOL, assert_same, random_grads

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
