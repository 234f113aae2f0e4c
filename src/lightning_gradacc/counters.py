"""How many items a micro-batch holds: ready ``item_count_fn`` counters, and the callback's own counts.

The ready counters for ``scaling="weighted"`` (usable as import paths in YAML) each return the number of
items a micro-batch's loss is a mean over. Tensor results stay on the device: counting never syncs with
the host. Without an ``item_count_fn`` the callback counts with :func:`unambiguous_batch_size`
(``"weighted"``) or the batch size Lightning infers (the statistics only). Each walks through a batch with
:func:`tensors`, except where Lightning's own inference is the point.

Which token counter fits depends on where the labels are shifted. A loss computed on labels that are
already aligned with the logits (``cross_entropy(logits, labels)``) averages over every label that is not
ignored: :func:`count_tokens`. A model that shifts its labels inside (Hugging Face ``*ForCausalLM`` with
``labels=``: position t predicts label t + 1) never predicts the first label of each sequence:
:func:`count_predicted_tokens` counts ``labels[..., 1:]``.

A loss that is a mean of per-sequence means (each sequence counts once, however long) is weighted by the
sequences it averages over: :func:`count_sequences`, which finds the sequences packed into one row by
where ``position_ids`` restart at 0 (or where ``segment_ids`` change);
:func:`lightning_gradacc.losses.sequence_mean` is the loss that counts them the same way.

Example:
    >>> import torch
    >>> batch = {"input_ids": torch.zeros(2, 3), "labels": torch.tensor([[1, 2, -100], [3, -100, -100]])}
    >>> count_tokens(batch)
    tensor(3)
    >>> count_predicted_tokens(batch)
    tensor(1)
    >>> count_samples(batch)
    2
    >>> count_sequences(batch)
    tensor(2)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

IGNORE_INDEX = -100


# The callback's default counts live here rather than in a module of their own: `unambiguous_batch_size` is
# itself a counter (the default of "weighted"), and all of them share one walk through the batch.
def tensors(batch: Any) -> Iterator[Tensor]:
    """Every tensor in a batch, in order: through mappings, sequences (namedtuples too) and dataclasses.

    The one walk of this module. It goes through any ``Sequence`` but a string, so that both walks it
    replaced (lists and tuples only; sequences but no dataclasses) still find every tensor they found.

    Example:
        >>> import torch
        >>> [t.shape for t in tensors({"x": torch.zeros(2, 3), "y": [torch.zeros(2), "text"]})]
        [torch.Size([2, 3]), torch.Size([2])]
    """
    if isinstance(batch, Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from tensors(value)
    elif isinstance(batch, Sequence) and not isinstance(batch, (str, bytes, bytearray)):
        for value in batch:
            yield from tensors(value)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for field in dataclasses.fields(batch):
            yield from tensors(getattr(batch, field.name))


def count_samples(batch: Any) -> int:
    """Samples in a batch: the length of its first tensor (a tensor, a sequence or a mapping of them)."""
    tensor = next(tensors(batch), None)
    if tensor is None or tensor.dim() == 0:
        raise ValueError(
            f"`count_samples` found no batched tensor in a batch of type {type(batch).__name__}."
        )
    return len(tensor)


def unambiguous_batch_size(batch: Any) -> int:
    """The batch size, when every tensor of the batch agrees on it; else ``ValueError`` saying why.

    Lightning's inference takes the first tensor it finds, which silently gives 1 for a batch that starts
    with a scalar (e.g. a namedtuple whose first field is a sequence length). ``scaling="weighted"`` weights
    every micro-batch by this number, so a guess is not good enough.

    Example:
        >>> import torch
        >>> unambiguous_batch_size((torch.zeros(4, 3), torch.zeros(4)))
        4
    """
    sizes: set[int] = set()
    for tensor in tensors(batch):
        if tensor.dim() == 0:
            raise ValueError("it holds a 0-dimensional tensor, which has no batch dimension")
        sizes.add(len(tensor))
    if not sizes:
        raise ValueError(f"it holds no tensor ({type(batch).__name__})")
    if len(sizes) > 1:
        raise ValueError(f"its tensors disagree on the first dimension ({sorted(sizes)})")
    return sizes.pop()


def first_tensor_length(batch: Any) -> int | None:
    """The length of the first tensor of a tensor, ``(inputs, targets)`` or dict batch; ``None`` otherwise.

    Lightning's inference gives the same number for these batches, without its walk through the batch
    (about 10 µs): this runs on every micro-batch.

    Example:
        >>> import torch
        >>> first_tensor_length((torch.zeros(4, 3), torch.zeros(4))), first_tensor_length("text")
        (4, None)
    """
    first = batch
    if isinstance(batch, (list, tuple)) and batch:
        first = batch[0]
    elif isinstance(batch, dict) and batch:
        first = next(iter(batch.values()))
    if isinstance(first, Tensor):
        shape = first.shape  # `len(tensor)` is a Python-level call; the shape is not
        if shape:
            return shape[0]
    return None


def check_item_count_fn(
    item_count_fn: Any,
    *,
    weighted: bool,
    scaling: str,
    pieces: bool = False,
    budget: bool = False,
    budget_counter: bool = False,
) -> None:
    """Refuse an ``item_count_fn`` that is not callable, or one that counts for nothing.

    It weights micro-batches (``scaling="weighted"``), the pieces of a batch (``piece_size``), and counts
    what an item budget closes windows on (``items_per_step``).

    Args:
        item_count_fn: The callback's argument (``None``: none given).
        weighted: Whether the scaling is ``"weighted"`` (aliases resolved).
        scaling: The ``scaling`` argument as given, for the message.
        pieces: Whether batches may run in pieces (``piece_size``).
        budget: Whether an item budget closes the windows on this counter's items (``items_per_step``).
        budget_counter: Whether ``budget_count_fn`` counts the budget's items instead, for the message.
    """
    if item_count_fn is None:
        return
    if not callable(item_count_fn):
        raise TypeError(
            f"Expected argument `item_count_fn` to be callable (batch -> number), but got {item_count_fn!r}."
        )
    if not weighted and not pieces and not budget and budget_counter:
        raise ValueError(
            "Argument `item_count_fn` counts nothing here: `budget_count_fn` counts what `items_per_step`"
            f" closes windows on, and scaling={scaling!r} weighs nothing by items. Remove `item_count_fn`,"
            " or set `scaling='weighted'` to weigh the micro-batches by its count."
        )
    if not weighted and not pieces and not budget:
        raise ValueError(
            "Argument `item_count_fn` is only used with `scaling='weighted'`, `piece_size` or"
            f" `items_per_step`, but got scaling={scaling!r} and neither of the others. Set"
            " `scaling='weighted'` or remove `item_count_fn`."
        )


def check_budget_count_fn(budget_count_fn: Any, *, budget: bool) -> None:
    """Refuse a ``budget_count_fn`` that is not callable, or one given without an item budget.

    Example:
        >>> check_budget_count_fn(None, budget=False)
        >>> check_budget_count_fn(len, budget=False)
        Traceback (most recent call last):
        ...
        ValueError: Argument `budget_count_fn` counts what `items_per_step` closes windows on, but ...
    """
    if budget_count_fn is None:
        return
    if not callable(budget_count_fn):
        raise TypeError(
            "Expected argument `budget_count_fn` to be callable (batch -> number), but got"
            f" {budget_count_fn!r}."
        )
    if not budget:
        raise ValueError(
            "Argument `budget_count_fn` counts what `items_per_step` closes windows on, but `items_per_step`"
            " is not set. Set `items_per_step` or remove `budget_count_fn` (`item_count_fn` counts what the"
            " micro-batches are weighted by)."
        )


class MicroBatchCount(NamedTuple):
    """A micro-batch's item count as the callback takes it (:func:`count_micro_batch`)."""

    items: Any  # a number or a tensor; None: unknown
    label: str  # how the core's messages name the count
    error: str | None = None  # under "weighted": why `items` is unknown (raised at the window's end)
    warning: str | None = None  # otherwise: that Lightning's inference failed (only statistics miss it)


def count_micro_batch(
    batch: Any,
    batch_idx: int,
    item_count_fn: Callable[[Any], Any] | None,
    weighted: bool,
    extract_batch_size: Callable[[Any], int],
    check_labels: bool = False,
) -> MicroBatchCount:
    """The callback's item count of a micro-batch: ``item_count_fn``, else the batch size.

    Under ``scaling="weighted"`` the batch size must be unambiguous: an ambiguous one is returned as an
    error for the core, which raises it at the window's end, on every rank together. Otherwise the count
    only feeds the statistics and is the batch size Lightning infers: the first tensor's length for common
    batches (:func:`first_tensor_length`; an int >= 0 the core takes as it is, so no message will name it
    and its label is constant), else ``extract_batch_size``.

    Args:
        batch: The micro-batch.
        batch_idx: Its index, for the messages.
        item_count_fn: The user's counter, or ``None``; what it raises propagates.
        weighted: Whether the scaling is ``"weighted"``.
        extract_batch_size: Lightning's inference, for batches the fast path does not cover.
        check_labels: Under ``"weighted"`` without ``item_count_fn``, warn if the labels hold ``-100``
            (:func:`ignored_labels_warning`: a host read, once).

    Example:
        >>> import torch
        >>> count_micro_batch((torch.zeros(4, 3), torch.zeros(4)), 7, None, True, len)
        MicroBatchCount(items=4, label='the batch size of batch 7', error=None, warning=None)
    """
    if item_count_fn is not None:
        return MicroBatchCount(
            item_count_fn(batch), f"the item count of batch {batch_idx} (from `item_count_fn`)"
        )
    if not weighted:
        size = first_tensor_length(batch)
        if size is not None:
            return MicroBatchCount(size, "the batch size")
    label = f"the batch size of batch {batch_idx}"
    if weighted:
        try:
            warning = ignored_labels_warning(batch) if check_labels else None
            return MicroBatchCount(unambiguous_batch_size(batch), label, warning=warning)
        except ValueError as error:
            return MicroBatchCount(
                None,
                label,
                error=(
                    f"`scaling='weighted'` needs the item count of every batch, but the batch size of batch"
                    f" {batch_idx} is ambiguous: {error}. Pass `item_count_fn=` (batch -> number of items)"
                ),
            )
    try:
        return MicroBatchCount(extract_batch_size(batch), label)
    except Exception as error:
        return MicroBatchCount(
            None,
            label,
            warning=(
                f"Could not infer the batch size of batch {batch_idx} ({error}); the `items_last_step`"
                " statistic will not count such batches. Scaling is unaffected."
            ),
        )


def ignored_labels_warning(batch: Any) -> str | None:
    """The warning for ``scaling="weighted"`` without ``item_count_fn`` on a batch whose labels hold ``-100``.

    The labels are ``batch["labels"]`` for a mapping, else the last element of a tuple/list batch, when they
    are an integer tensor. One host read (call it once, on a fit's first batch).

    Example:
        >>> import torch
        >>> batch = {"input_ids": torch.ones(2, 3), "labels": torch.tensor([[1, 2, -100], [3, -100, -100]])}
        >>> ignored_labels_warning(batch)[:60]
        "`scaling='weighted'` without `item_count_fn` weights each mi"
        >>> ignored_labels_warning((torch.ones(2, 3), torch.tensor([0, 1]))) is None
        True
    """
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
    elif isinstance(batch, Sequence) and not isinstance(batch, str) and batch:
        labels = batch[-1]
    else:
        return None
    if not isinstance(labels, Tensor) or labels.is_floating_point() or labels.is_complex():
        return None
    if not bool((labels == IGNORE_INDEX).any()):
        return None
    return (
        "`scaling='weighted'` without `item_count_fn` weights each micro-batch by its batch size, but its"
        f" labels hold {IGNORE_INDEX} (tokens the loss ignores): the step is then not the big batch of its"
        " tokens. Pass `item_count_fn=count_predicted_tokens` for a model that shifts the labels itself"
        " (Hugging Face causal LMs), or `count_tokens` for labels already aligned with the logits"
        " (`from lightning_gradacc.counters import ...`)."
    )


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


def segment_index(
    shape: Sequence[int], position_ids: Tensor | None = None, segment_ids: Tensor | None = None
) -> Tensor:
    """Each position's sequence, numbered over the whole batch: rows, and sequences packed into a row.

    A sequence starts at every row's first position and, in a packed row, where ``position_ids`` restart at 0
    or where ``segment_ids`` change. The numbers run over the flattened batch (at most its size of them);
    computed on the device, without a host read.

    Example:
        >>> import torch
        >>> segment_index((2, 4), position_ids=torch.tensor([[0, 1, 0, 1], [0, 1, 2, 0]]))
        tensor([[0, 0, 1, 1],
                [2, 2, 2, 3]])
        >>> segment_index((1, 4), segment_ids=torch.tensor([[7, 7, 9, 9]])).tolist()
        [[0, 0, 1, 1]]
    """
    given = position_ids if position_ids is not None else segment_ids
    starts = torch.zeros(tuple(shape), dtype=torch.bool, device=given.device if given is not None else None)
    if starts.dim() == 0:
        raise ValueError("The labels are a scalar: sequences need a dimension of positions.")
    starts[..., 0] = True
    if position_ids is not None:
        starts |= position_ids.reshape(starts.shape) == 0
    elif segment_ids is not None:
        segments = segment_ids.reshape(starts.shape)
        starts[..., 1:] |= segments[..., 1:] != segments[..., :-1]
    return starts.reshape(-1).cumsum(0).reshape(starts.shape) - 1


class SequenceCounter:
    """Count the sequences that hold at least one label that is not ``ignore_index``.

    For a loss that is the mean over a micro-batch's sequences of each sequence's mean over its tokens
    (:func:`lightning_gradacc.losses.sequence_mean`): ``scaling="weighted"`` with this counter steps the
    mean over every sequence of the window and the ranks, however the batch is cut. Rows are sequences;
    sequences packed into a row are told apart by ``batch["position_ids"]`` (restarting at 0, as Hugging
    Face's ``DataCollatorWithFlattening`` gives them) or ``batch["segment_ids"]`` in a mapping batch.

    Args:
        ignore_index: The label value of padding positions.
        shift: Count over ``labels[..., 1:]`` (a model that shifts its labels inside).

    Example:
        >>> import torch
        >>> labels = torch.tensor([[5, 6, -100, 7], [-100, -100, -100, -100]])
        >>> SequenceCounter()({"labels": labels})  # the second row has no label
        tensor(1)
        >>> SequenceCounter()({"labels": labels, "position_ids": torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]])})
        tensor(2)
    """

    def __init__(self, ignore_index: int = IGNORE_INDEX, shift: bool = False) -> None:
        self.ignore_index = ignore_index
        self.shift = shift

    def __call__(self, batch: Any) -> Tensor:
        """The sequences of ``batch`` with a label (labels found as :func:`count_tokens` finds them)."""
        labels = _labels(batch, "count_sequences")
        if labels.is_floating_point() or labels.is_complex():  # regression targets: no sequence of tokens
            raise TypeError(f"`count_sequences` expects integer labels (token ids), got {labels.dtype}.")
        position_ids = segment_ids = None
        if isinstance(batch, Mapping):
            position_ids, segment_ids = batch.get("position_ids"), batch.get("segment_ids")
        return sequences_with_labels(labels, self.ignore_index, self.shift, position_ids, segment_ids)

    def __repr__(self) -> str:
        return f"SequenceCounter(ignore_index={self.ignore_index}, shift={self.shift})"


def sequences_with_labels(
    labels: Tensor,
    ignore_index: int = IGNORE_INDEX,
    shift: bool = False,
    position_ids: Tensor | None = None,
    segment_ids: Tensor | None = None,
) -> Tensor:
    """The sequences that hold at least one label not ``ignore_index`` (a device scalar: no host read)."""
    if shift:
        labels = labels[..., 1:]
        position_ids = position_ids[..., 1:] if position_ids is not None else None
        segment_ids = segment_ids[..., 1:] if segment_ids is not None else None
    index = segment_index(labels.shape, position_ids, segment_ids)
    chosen = index[labels != ignore_index]
    hits = torch.zeros(index.numel(), device=labels.device)
    hits.index_add_(0, chosen, torch.ones(chosen.shape, device=labels.device))
    return (hits > 0).sum()


def count_sequences(batch: Any) -> Tensor:
    """Sequences with a label that is not ``-100``, packed ones told apart (see :class:`SequenceCounter`).

    Example:
        >>> import torch
        >>> count_sequences({"labels": torch.tensor([[1, -100], [-100, -100]])})
        tensor(1)
    """
    return SequenceCounter()(batch)
