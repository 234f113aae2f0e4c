"""TrackedParameters: names, groups for fused kernels, layouts, and following a changed set in place."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gradacc.core.parameters import TrackedParameters, named_list


def test_unnamed_parameters_get_names_and_bad_input_is_refused() -> None:
    assert [name for name, _ in named_list([torch.zeros(1), torch.zeros(2)])] == ["param_0", "param_1"]
    with pytest.raises(TypeError, match="hold tensors, but got int"):
        named_list([1])
    with pytest.raises(ValueError, match="at least one parameter"):
        named_list([])


def test_groups_by_gradient_dtype_and_by_buffer_dtype() -> None:
    half = nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    full = nn.Parameter(torch.zeros(3))
    tracked = TrackedParameters([("half", half), ("full", full)], buffer_dtype=torch.float32)
    cpu = torch.device("cpu")
    assert tracked.grad_groups == {(cpu, torch.bfloat16): [0], (cpu, torch.float32): [1]}
    assert tracked.buffer_groups == {(cpu, torch.float32): [0, 1]}
    assert not tracked.sharded and tracked.sharded_names() == set()


def test_local_layout_skips_missing_gradients_and_norms_combine() -> None:
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1))
    tracked = TrackedParameters([("a", a), ("b", b)])
    a.grad = torch.tensor([3.0, 0.0])
    grouped, groups = tracked.local_layout(tracked.grads(), in_buffers=False)
    assert [len(tensors) for tensors in grouped.values()] == [1] and groups is None
    assert float(tracked.micro_batch_norm(2.0)) == 3.0
    b.grad = torch.tensor([4.0])
    assert float(tracked.micro_batch_norm(2.0)) == 5.0


def test_follow_changes_the_set_in_place_for_every_holder() -> None:
    """The buffers, the intake and the store hold the same object: a new set is seen by all of them."""
    first, second = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(5, 2))
    tracked = TrackedParameters([("first", first)])
    holder = tracked
    tracked.follow([("first", first), ("second", second)])
    assert holder.names == ["first", "second"] and holder.index == {"first": 0, "second": 1}
    second.requires_grad_(False)
    assert holder.num_parameters() == 2  # what trains


def test_a_flat_fsdp1_parameter_needs_the_wrapped_model() -> None:
    flat = nn.Parameter(torch.zeros(4))
    flat._fsdp_flattened = True  # type: ignore[attr-defined]  # the mark FSDP1 sets
    with pytest.raises(ValueError, match=r"flattened by `FullyShardedDataParallel`.*fsdp_module="):
        TrackedParameters([("flat", flat)])
