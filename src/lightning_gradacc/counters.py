"""Ready ``item_count_fn`` counters for ``scaling="weighted"``, usable as import paths in YAML.

Each returns the number of items a micro-batch's loss is a mean over. Tensor results stay on the
device: counting never syncs with the host.

Which token counter fits depends on where the labels are shifted. A loss computed on labels that are
already aligned with the logits (``cross_entropy(logits, labels)``) averages over every label that is not
ignored: :func:`count_tokens`. A model that shifts its labels inside (Hugging Face ``*ForCausalLM`` with
``labels=``: position t predicts label t + 1) never predicts the first label of each sequence:
:func:`count_predicted_tokens` counts ``labels[..., 1:]``.

Example:
    >>> import torch
    >>> batch = {"input_ids": torch.zeros(2, 3), "labels": torch.tensor([[1, 2, -100], [3, -100, -100]])}
    >>> count_tokens(batch)
    tensor(3)
    >>> count_predicted_tokens(batch)
    tensor(1)
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


def _labels(batch: Any, counter: str) -> Tensor:
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            raise KeyError(
                f"`{counter}` expects a 'labels' entry in a mapping batch, got keys {list(batch)}."
            )
        labels = batch["labels"]
    elif isinstance(batch, Sequence) and batch:
        labels = batch[-1]
    else:
        labels = batch
    if not isinstance(labels, Tensor):
        raise TypeError(f"`{counter}` expects the labels to be a tensor, got {type(labels).__name__}.")
    return labels


def _count(batch: Any, ignore_index: int, shift: bool, counter: str) -> Tensor:
    labels = _labels(batch, counter)
    if shift:
        if labels.dim() == 0:
            raise ValueError(
                f"`{counter}` shifts the labels along their last dimension, but they are a scalar."
            )
        # The model predicts label t + 1 from position t: the first label of each sequence is never a target.
        labels = labels[..., 1:]
    return (labels != ignore_index).sum()


def count_tokens(batch: Any) -> Tensor:
    """Tokens whose label is not ``-100`` (PyTorch's and Hugging Face's ignore index).

    For a loss over labels already aligned with the logits, e.g. ``cross_entropy(logits, labels)`` on
    labels the data pipeline shifted. For a model that shifts the labels itself (Hugging Face causal LMs)
    use :func:`count_predicted_tokens`.

    The labels are ``batch["labels"]`` for a mapping, else the last element of a tuple/list batch.
    """
    return _count(batch, IGNORE_INDEX, False, "count_tokens")


def count_predicted_tokens(batch: Any) -> Tensor:
    """Tokens a model that shifts its labels inside predicts: ``labels[..., 1:]`` that are not ``-100``.

    A Hugging Face causal LM called with ``labels=`` (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ...)
    predicts label t + 1 from position t and averages its loss over those targets: the first label of
    every sequence is never predicted. :func:`count_tokens` would count it and give each sequence one token
    too many, which makes ``scaling="weighted"`` overweight micro-batches of many short sequences.

    The labels are ``batch["labels"]`` for a mapping, else the last element of a tuple/list batch, and are
    shifted along their last dimension (sequences are rows).

    Args:
        batch: The micro-batch, e.g. ``{"input_ids": ..., "attention_mask": ..., "labels": ...}``.

    Returns:
        The number of predicted tokens, a scalar tensor on the labels' device (no host sync).

    Example:
        >>> import torch
        >>> labels = torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100]])  # 3 and 2 real tokens
        >>> count_predicted_tokens({"input_ids": labels.clamp(min=0), "labels": labels})
        tensor(3)
        >>> count_tokens({"labels": labels})
        tensor(5)
    """
    return _count(batch, IGNORE_INDEX, True, "count_predicted_tokens")


class TokenCounter:
    """Count tokens whose label is not ``ignore_index`` (for a padding label other than ``-100``).

    Args:
        ignore_index: The label value of padding positions.
        shift: Count ``labels[..., 1:]`` only, for a model that shifts its labels inside (as
            :func:`count_predicted_tokens`); ``False`` counts every label (as :func:`count_tokens`).

    Example:
        >>> import torch
        >>> TokenCounter(ignore_index=0)((torch.zeros(2), torch.tensor([[5, 0], [7, 8]])))
        tensor(3)
        >>> TokenCounter(ignore_index=0, shift=True)((torch.zeros(2), torch.tensor([[5, 0], [7, 8]])))
        tensor(1)
    """

    def __init__(self, ignore_index: int = IGNORE_INDEX, shift: bool = False) -> None:
        self.ignore_index = ignore_index
        self.shift = shift

    def __call__(self, batch: Any) -> Tensor:
        """Count the non-ignored labels of ``batch`` (see :func:`count_tokens` for where labels are found)."""
        return _count(batch, self.ignore_index, self.shift, "TokenCounter")

    def __repr__(self) -> str:
        return f"TokenCounter(ignore_index={self.ignore_index}, shift={self.shift})"
