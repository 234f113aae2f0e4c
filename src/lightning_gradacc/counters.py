"""Ready ``item_count_fn`` counters for ``scaling="weighted"``, usable as import paths in YAML.

Each returns the number of items a micro-batch's loss is a mean over. Tensor results stay on the
device: counting never syncs with the host.

Example:
    >>> import torch
    >>> batch = {"input_ids": torch.zeros(2, 3), "labels": torch.tensor([[1, 2, -100], [3, -100, -100]])}
    >>> count_tokens(batch)
    tensor(3)
    >>> count_samples(batch)
    2
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

IGNORE_INDEX = -100


def _first_tensor(batch: Any) -> Tensor | None:
    if isinstance(batch, Tensor):
        return batch
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, type({}.values()))):
        return None
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None


def count_samples(batch: Any) -> int:
    """Samples in a batch: the length of its first tensor (a tensor, a sequence or a mapping of them)."""
    tensor = _first_tensor(batch)
    if tensor is None or tensor.dim() == 0:
        raise ValueError(
            f"`count_samples` found no batched tensor in a batch of type {type(batch).__name__}."
        )
    return len(tensor)


def _labels(batch: Any) -> Tensor:
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            raise KeyError(
                f"`count_tokens` expects a 'labels' entry in a mapping batch, got keys {list(batch)}."
            )
        labels = batch["labels"]
    elif isinstance(batch, Sequence) and batch:
        labels = batch[-1]
    else:
        labels = batch
    if not isinstance(labels, Tensor):
        raise TypeError(f"`count_tokens` expects the labels to be a tensor, got {type(labels).__name__}.")
    return labels


def count_tokens(batch: Any) -> Tensor:
    """Tokens whose label is not ``-100`` (PyTorch's and Hugging Face's ignore index).

    The labels are ``batch["labels"]`` for a mapping, else the last element of a tuple/list batch.
    """
    return (_labels(batch) != IGNORE_INDEX).sum()


class TokenCounter:
    """Count tokens whose label is not ``ignore_index`` (for a padding label other than ``-100``).

    Args:
        ignore_index: The label value of padding positions.

    Example:
        >>> import torch
        >>> TokenCounter(ignore_index=0)((torch.zeros(2), torch.tensor([[5, 0], [7, 8]])))
        tensor(3)
    """

    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        self.ignore_index = ignore_index

    def __call__(self, batch: Any) -> Tensor:
        """Count the non-ignored labels of ``batch`` (see :func:`count_tokens` for where labels are found)."""
        return (_labels(batch) != self.ignore_index).sum()
