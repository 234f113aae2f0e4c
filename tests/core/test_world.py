"""The data-parallel world: more than one rank needs a way to sum over them."""

from __future__ import annotations

import pytest
import torch

from lightning_gradacc import GradAccumulator


def test_core_world_size_without_all_reduce_or_process_group_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"`world_size=2` needs `all_reduce=`"):
        GradAccumulator([torch.zeros(1, requires_grad=True)], world_size=2, scaling="weighted")
