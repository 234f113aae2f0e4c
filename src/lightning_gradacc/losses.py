"""The losses each normalization's contract asks for, computed from per-token losses.

A step is the big batch of its micro-batches only if each micro-batch's loss keeps one contract, the one
its scaling mode assumes (``docs/normalizations.md``):

* token mean (``scaling="weighted"``, ``item_count_fn=count_tokens``): the mean over the micro-batch's
  target tokens (:func:`token_mean`, what ``cross_entropy(..., ignore_index=-100)`` returns);
* sequence mean (``scaling="weighted"``, ``item_count_fn=count_sequences``): the mean over the
  micro-batch's sequences of each sequence's mean over its target tokens (:func:`sequence_mean`);
* a constant normaliser (``scaling="constant"``): the sum over the micro-batch's target tokens divided
  by a number fixed for the whole step (:func:`constant_normalized`), the same on every rank.

Each takes ``token_losses`` (one loss per position, e.g. ``cross_entropy(..., reduction="none")``, or a
policy-gradient term per token) and the labels whose ``ignore_index`` marks the positions that count for
nothing. Nothing here reads the host.

Example:
    >>> import torch
    >>> losses = torch.tensor([[1.0, 3.0, 0.0], [5.0, 0.0, 0.0]])
    >>> labels = torch.tensor([[1, 1, -100], [1, -100, -100]])
    >>> token_mean(losses, labels), sequence_mean(losses, labels), constant_normalized(losses, labels, 10)
    (tensor(3.), tensor(3.5000), tensor(0.9000))
"""

from __future__ import annotations

import torch
from torch import Tensor

from .counters import IGNORE_INDEX, segment_index


def _targets(token_losses: Tensor, labels: Tensor, ignore_index: int) -> Tensor:
    if token_losses.shape != labels.shape:
        raise ValueError(
            f"Expected `token_losses` of the labels' shape {tuple(labels.shape)}, but got"
            f" {tuple(token_losses.shape)}."
        )
    return labels != ignore_index


def token_mean(token_losses: Tensor, labels: Tensor, *, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """The mean over the target tokens (0 where there is none): the loss ``count_tokens`` weighs."""
    kept = _targets(token_losses, labels, ignore_index)
    total = torch.where(kept, token_losses, 0.0).sum()
    return total / kept.sum().clamp(min=1)


def sequence_mean(
    token_losses: Tensor,
    labels: Tensor,
    *,
    position_ids: Tensor | None = None,
    segment_ids: Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """The mean over sequences of each one's mean over its target tokens: the loss ``count_sequences`` weighs.

    Rows are sequences; sequences packed into a row are told apart as :class:`~lightning_gradacc.counters.
    SequenceCounter` tells them (``position_ids`` restarting at 0, or ``segment_ids`` changing). A sequence
    with no target token counts for nothing; with none at all the loss is 0.

    Example:
        >>> import torch
        >>> losses, labels = torch.tensor([[1.0, 3.0, 5.0, 7.0]]), torch.tensor([[0, 0, 0, 0]])
        >>> sequence_mean(losses, labels)  # one sequence
        tensor(4.)
        >>> sequence_mean(losses, labels, position_ids=torch.tensor([[0, 0, 1, 2]]))  # (1 + 5) / 2
        tensor(3.)
    """
    kept = _targets(token_losses, labels, ignore_index)
    index = segment_index(labels.shape, position_ids, segment_ids).reshape(-1)
    flat_kept = kept.reshape(-1)
    values = torch.where(flat_kept, token_losses.reshape(-1), 0.0)
    sums = torch.zeros(index.numel(), dtype=values.dtype, device=values.device).index_add(0, index, values)
    counts = torch.zeros(index.numel(), dtype=values.dtype, device=values.device)
    counts = counts.index_add(0, index, flat_kept.to(values.dtype))
    present = counts > 0
    means = torch.where(present, sums / counts.clamp(min=1), 0.0)
    return means.sum() / present.sum().clamp(min=1)


def constant_normalized(
    token_losses: Tensor, labels: Tensor, normalizer: float, *, ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """The sum over the target tokens divided by ``normalizer``, a number fixed for the whole step.

    The loss ``scaling="constant"`` adds over micro-batches and ranks (Dr. GRPO's constant, or the most
    tokens a step may hold): it needs no count, so it is exact on every strategy.
    """
    if not normalizer > 0:
        raise ValueError(f"Expected argument `normalizer` to be a number > 0, but got {normalizer!r}.")
    kept = _targets(token_losses, labels, ignore_index)
    return torch.where(kept, token_losses, 0.0).sum() / normalizer


__all__ = ["constant_normalized", "sequence_mean", "token_mean"]
