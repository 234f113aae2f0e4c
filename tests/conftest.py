"""Checks that hold for every test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_process_group_in_pytests_process() -> Iterator[None]:
    """Distributed work runs in child processes: a process group left in pytest's own process would keep
    gloo's threads alive into its exit (see ``helpers.exit_together``) and leak into the next tests."""
    yield
    assert not (dist.is_available() and dist.is_initialized()), "a test left a process group in pytest"
