"""Cutting one loader batch into pieces along its first dimension (the items), for ``piece_size``.

The default splitter walks tensors, mappings (``dict``, Hugging Face's ``BatchEncoding``), lists and tuples
(named ones too): every tensor with a first dimension is cut into views, a 0-d tensor or a non-tensor
leaf (a string, a number, ``None``) goes to every piece. What it cannot cut safely it refuses, naming the
type, so that a user ``split_fn(batch, size) -> list`` takes over: tensors that disagree on their first
dimension, a list of as many non-tensors as there are items (per item, or not?), tensors inside anything
else the batch walk of :func:`~lightning_gradacc.counters.tensors` goes through (a dataclass, another
sequence), which it could not rebuild, or no tensor at all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor

from .counters import tensors

# what every refusal of the default splitter ends with
_USE_SPLIT_FN = (
    "pass `split_fn=` (a function `(batch, size) -> list of pieces`) to `GradientAccumulationCallback`"
)

# ``split_fn(batch, size)``: the batch as pieces of at most ``size`` items each, in order.
SplitFn = Callable[[Any, int], Sequence[Any]]


class UnsplittableBatch(TypeError):
    """The default splitter cannot cut this batch into pieces (the message says why; pass ``split_fn``)."""


def batch_length(batch: Any) -> int:
    """The items of ``batch``: the first dimension its tensors share.

    Example:
        >>> import torch
        >>> batch_length({"input_ids": torch.zeros(6, 3), "labels": torch.zeros(6, 3), "step": 1})
        6
    """
    lengths = {tensor.shape[0] for tensor in tensors(batch) if tensor.dim() > 0}
    if not lengths:
        raise UnsplittableBatch(
            f"A batch of type {type(batch).__name__} has no tensor with a first dimension to cut into pieces:"
            f" {_USE_SPLIT_FN}."
        )
    if len(lengths) > 1:
        raise UnsplittableBatch(
            f"The tensors of a batch of type {type(batch).__name__} disagree on their first dimension"
            f" ({sorted(lengths)}), so it is not clear which one counts the items: {_USE_SPLIT_FN}."
        )
    return lengths.pop()


def items_or(fallback: Callable[[Any], int]) -> Callable[[Any], int]:
    """:func:`batch_length`, or ``fallback`` for a batch it cannot read (a user ``split_fn``'s pieces)."""

    def length(batch: Any) -> int:
        try:
            return batch_length(batch)
        except UnsplittableBatch:
            return fallback(batch)

    return length


def split_batch(batch: Any, size: int) -> list[Any]:
    """``batch`` as consecutive pieces of at most ``size`` items (views of its tensors: no copy).

    Example:
        >>> import torch
        >>> x, y = torch.arange(5.0), torch.arange(5)
        >>> [len(piece[0]) for piece in split_batch((x, y), 2)]
        [2, 2, 1]
        >>> split_batch({"x": x, "name": "demo"}, 3)[1]["name"]
        'demo'
    """
    length = batch_length(batch)
    count = -(-length // size)
    return [_cut(batch, start, min(start + size, length), length) for start in range(0, size * count, size)]


def _cut(value: Any, start: int, stop: int, length: int) -> Any:
    if isinstance(value, Tensor):
        return value[start:stop] if value.dim() > 0 else value
    if isinstance(value, Mapping):
        items = {key: _cut(item, start, stop, length) for key, item in value.items()}
        return _rebuild_mapping(value, items)
    if isinstance(value, (list, tuple)):
        if value and length > 1 and len(value) == length and not any(_holds_tensor(v) for v in value):
            raise UnsplittableBatch(
                f"A batch holds a {type(value).__name__} of {len(value)} non-tensor values, as many as its"
                f" items: the default splitter cannot tell whether they are per item; {_USE_SPLIT_FN}."
            )
        cut = [_cut(item, start, stop, length) for item in value]
        if isinstance(value, tuple) and type(value) is not tuple:  # a named tuple: fields as arguments
            return type(value)(*cut)
        return type(value)(cut)
    if _holds_tensor(value):  # counted by the walk, but not rebuilt here: its tensors would go whole
        raise UnsplittableBatch(
            f"A batch holds tensors inside a {type(value).__name__}, which the default splitter cannot"
            f" rebuild; {_USE_SPLIT_FN}."
        )
    return value


def _rebuild_mapping(original: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """The same kind of mapping (``BatchEncoding`` keeps its class), else a plain ``dict``."""
    kind: Any = type(original)
    try:
        return kind(items)
    except TypeError:
        return items


def _holds_tensor(value: Any) -> bool:
    return next(tensors(value), None) is not None


def check_split_fn(split_fn: Any) -> SplitFn | None:
    """``split_fn`` if callable (or ``None``), else a ``TypeError`` naming the argument."""
    if split_fn is not None and not callable(split_fn):
        raise TypeError(
            "Expected argument `split_fn` to be a function `(batch, size) -> list of pieces` or None, but"
            f" got {split_fn!r}."
        )
    return split_fn  # type: ignore[no-any-return]


def pieces_of(batch: Any, size: int, split_fn: SplitFn | None) -> list[Any]:
    """``batch`` in pieces of at most ``size`` items, by ``split_fn`` where given.

    What a ``split_fn`` returns is checked where its items can be read (every tensor agreeing on its first
    dimension): every piece holds at most ``size`` items and together they hold the batch's. A piece too
    large would run out of memory again (``"auto"`` would halve forever); an item dropped or repeated would
    change the gradient silently. Where the tensors disagree (images per item beside the items), the
    runner checks instead that a piece cut again after an error is smaller.

    Example:
        >>> import torch
        >>> pieces_of(torch.zeros(5), 2, lambda batch, size: [batch])
        Traceback (most recent call last):
        ...
        ValueError: `split_fn` must return pieces of at most 2 items ...
    """
    if split_fn is None:
        return split_batch(batch, size)
    pieces = list(split_fn(batch, size))
    if not pieces:
        raise ValueError(f"`split_fn` returned no piece for a batch of type {type(batch).__name__}.")
    try:
        lengths = [batch_length(piece) for piece in pieces]
        total = batch_length(batch)
    except UnsplittableBatch:  # the items cannot be read unambiguously: the runner checks the pieces shrink
        return pieces
    if max(lengths) > size or sum(lengths) != total:
        raise ValueError(
            f"`split_fn` must return pieces of at most {size} items that together hold the batch's {total},"
            f" in order, but for a batch of type {type(batch).__name__} it returned pieces of {lengths}"
            " items. Cut the batch into consecutive pieces of at most `size` items (`size` is its second"
            " argument)."
        )
    return pieces


__all__ = [
    "SplitFn",
    "UnsplittableBatch",
    "batch_length",
    "check_split_fn",
    "items_or",
    "pieces_of",
    "split_batch",
]
