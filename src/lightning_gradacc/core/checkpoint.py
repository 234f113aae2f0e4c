"""The checkpoint formats: one version number for everything this package saves, and the window check.

``FORMAT_VERSION`` stamps the accumulator's counters, the open window and the callback's state alike.
History: 1 (0.1: counters under their first names; the window's weights as raw item counts), 2 (the
window's weights relative to a reference count, frozen parameters left out), 3 (statistics named for what
they count; the window carries its loss scale and AMP scale). Every reader accepts the older numbers.

The saved window holds its summed gradients (``.grad`` or the buffers) and its counters. Loading it is
all-or-nothing: every check runs before anything is modified, and the first mismatch is named.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)


def check_window_state(
    state: Mapping[str, Any],
    expected: Mapping[str, tuple[torch.Size, torch.dtype]],
    kind: str,
    world_size: int,
) -> None:
    """Raise ``ValueError`` naming the first way ``state`` does not fit the model and the accumulator.

    Args:
        state: A dict saved by ``GradAccumulator.window_state_dict``.
        expected: Shape and dtype of the tensor each tracked parameter name needs. A parameter the state
            has no tensor for had no gradient in the window.
        kind: ``"grads"`` or ``"buffers"``: where the accumulator keeps the window's sum now.
        world_size: Ranks now.

    Example:
        >>> check_window_state(
        ...     {"version": 3, "kind": "grads", "world_size": 1, "micro_batches": 2,
        ...      "tensors": {"w": torch.zeros(3)}},
        ...     {"w": (torch.Size([3]), torch.float32)}, "grads", 1)
    """
    version = state.get("version")
    if version not in READABLE_VERSIONS:
        raise ValueError(
            f"The checkpoint's pending accumulation window has format version {version!r}; this version of"
            f" lightning_gradacc reads {' and '.join(map(str, READABLE_VERSIONS))}."
        )
    if state.get("kind") != kind:
        where = {"grads": "`.grad` (no accumulation_dtype)", "buffers": "accumulation buffers"}
        saved = where.get(str(state.get("kind")), repr(state.get("kind")))
        raise ValueError(
            f"The checkpoint's pending window was accumulated in {saved}, but this run accumulates in"
            f" {where[kind]}. Resume with the same `accumulation_dtype`."
        )
    if state.get("world_size") != world_size:
        raise ValueError(
            f"The checkpoint's pending window was accumulated on {state.get('world_size')} rank(s), but this"
            f" run has {world_size}. Resume with the same number of ranks, or from a checkpoint taken at the"
            " end of a window."
        )
    tensors = state.get("tensors")
    if not isinstance(tensors, Mapping):
        raise ValueError("The checkpoint's pending window has no `tensors`.")
    for name, tensor in tensors.items():
        if name not in expected:
            raise ValueError(
                f"The checkpoint's pending window has a gradient for unknown parameter `{name}`."
            )
        shape, dtype = expected[name]
        if not isinstance(tensor, torch.Tensor) or tensor.shape != shape or tensor.dtype != dtype:
            found = (tuple(tensor.shape), tensor.dtype) if isinstance(tensor, torch.Tensor) else type(tensor)
            raise ValueError(
                f"The checkpoint's pending gradient of `{name}` is {found}, but the parameter needs"
                f" {(tuple(shape), dtype)}."
            )
