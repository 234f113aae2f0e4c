"""WindowGradients (``accumulator.gradients``): gradients added by name, as a backward would add them.

Gradients from ``torch.func`` equal a backward's and the big batch's, bad ones are refused before anything
changes; the mapping interface and ``remove``.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call

from lightning_gradacc.core.accumulator import GradAccumulator
from tests.helpers import F16, F64, TwoLayer, two_layer_batches

USED = ["first.weight", "first.bias", "second.weight", "second.bias"]


def _func_grads(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    params = {name: p.detach() for name, p in model.named_parameters() if name in USED}

    def loss(params: dict[str, Tensor]) -> Tensor:
        return nn.functional.mse_loss(functional_call(model, params, (x,)), y)

    return torch.func.grad(loss)(params)


def _accumulate(model: TwoLayer, sizes: list[int], how: str, **kwargs) -> GradAccumulator:
    accumulator = GradAccumulator(model.named_parameters(), len(sizes), **kwargs)
    for x, y in two_layer_batches(sizes, model.first.weight.dtype):
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
    batches = two_layer_batches(sizes, F64)
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
    batches = two_layer_batches(sizes, F64)
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
    x, y = two_layer_batches([4])[0]
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
    batches = two_layer_batches(sizes)
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
    for x, y in two_layer_batches(sizes):
        loss = nn.functional.mse_loss(model(x), y).detach()
        losses.append(float(loss))
        accumulator.gradients.add(_func_grads(model, x, y), items=len(x), loss=loss)
    assert accumulator.finalize()
    assert accumulator.stats.items_last_step == sum(sizes)
    expected = sum(n * v for n, v in zip(sizes, losses, strict=True)) / sum(sizes)
    assert accumulator.window_loss == pytest.approx(expected, rel=1e-6)
    reference = TwoLayer(F64)
    batches = two_layer_batches(sizes, F64)
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
    for x, y in two_layer_batches([8, 8]):
        accumulator.backward(nn.functional.mse_loss(model(x), y), items=8)
    assert "first.bias" in accumulator.gradients
