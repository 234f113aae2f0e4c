"""GradAccumulator: the math of one accumulation window, for any training loop.

A window is the run of micro-batches between two optimizer steps. Micro-batch gradients add up in
``.grad`` as autograd does (no extra memory); at the boundary :meth:`GradAccumulator.finalize` turns the
sum into the gradient of one big batch (mean over the micro-batches actually run, sum, or
item-weighted across micro-batches and data-parallel ranks), detects non-finite values and clips, in
one fused pass, and says whether the optimizer should step.

Host syncs: none while accumulating; at most one per optimizer step, and only when a decision needs it
(``overflow="skip"`` or ``"raise"``). Counters live in a small device tensor until :attr:`stats` is read.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import astuple, dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn.parameter import is_lazy

from ..stats import AccumulationStats
from .buffers import GradBuffers
from .errors import GradientOverflowError
from .kernels import GroupKey, clamp_, non_finite_names, scale_, total_norm
from .memory import WindowPeakMemory
from .tally import InvalidCount, WindowTally, WindowTotals
from .validation import AccumulationSettings, check_item_count, check_positive_int
from .window_state import WINDOW_STATE_VERSION, check_window_state

_STATE_VERSION = 1
# The device ledger of value-dependent statistics. Counters are summed over steps, the rest overwritten.
_LEDGER_FIELDS = (
    "overflow_count",
    "skipped_steps",
    "clip_count",
    "empty_windows",
    "last_grad_norm",
    "max_grad_norm_seen",
    "items_last_step",
    "window_loss",
)
_COUNTERS = ("overflow_count", "skipped_steps", "clip_count", "empty_windows")
_OPTIONAL_FIELDS = {"empty_windows": 0.0}  # absent from states saved by 0.1.0


AllReduce = Callable[[Tensor], Tensor]


def _default_world() -> tuple[int, AllReduce | None]:
    """World size and a sum all-reduce from ``torch.distributed`` when a process group is running."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 1, None

    def all_reduce_sum(tensor: Tensor) -> Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    return dist.get_world_size(), all_reduce_sum


@dataclass(frozen=True)
class ItemCount:
    """One micro-batch's item count, checked, and the factor its loss is multiplied by before ``backward``.

    Made by :meth:`GradAccumulator.weigh`; an invalid count has weight 0 and is reported at the boundary.
    """

    items: float | Tensor | None
    weight: float | Tensor
    problem: str | None = None
    check: InvalidCount | None = None


class GradAccumulator:
    """Exact gradient accumulation over micro-batches, in place in ``.grad``.

    Args:
        parameters: The parameters the optimizer steps, or ``named_parameters()`` (names appear in error
            messages). Every one is tracked, frozen ones too: whichever holds a gradient at the boundary is
            normalized, counted in the norm, clipped and checked (so a layer unfrozen later is handled).
            :meth:`track` follows a changed set (e.g. a parameter group added to the optimizer).
        accumulation_steps: Micro-batches per window (K). :attr:`window_full` turns true after K records;
            a shorter window (end of an epoch) may be finalized at any time.
        scaling: ``"mean"`` (alias ``"average"``): mean over the micro-batches run; ``"sum"``;
            ``"weighted"`` (alias ``"dynamic"``): weighted by the items of each micro-batch, over ranks.
        max_grad_norm: Clip the total norm of the final gradient to this value, once per step.
        norm_type: Order of the norm (any ``p > 0`` or ``inf``), for clipping and statistics.
        clip_value: Clamp every element of the final gradient to ``[-clip_value, clip_value]``.
        overflow: What to do with a non-finite gradient: ``"skip"`` the step (gradients set to None,
            so torch optimizers change neither parameters nor state), ``"raise"``
            :class:`GradientOverflowError`, ``"ignore"`` (count only), or ``"skip_micro_batch"``: drop
            just the micro-batch whose gradient is not finite (its items do not count) and keep the
            window (needs ``accumulation_dtype``).
        world_size: Data-parallel ranks whose gradients are averaged at the last backward (as DDP does).
            ``None``: taken from ``torch.distributed`` when initialized, else 1.
        all_reduce: Sums a small tensor over ranks in place and returns it; used once per step when
            ``world_size > 1``. ``None``: ``torch.distributed.all_reduce``, which must then be initialized
            with ``world_size`` ranks.
        foreach: ``None`` or ``True`` use fused ``torch._foreach_*`` kernels; ``False`` a per-tensor loop.
        accumulation_dtype: Accumulate in buffers of this dtype (e.g. ``"float32"`` for bf16 parameters)
            instead of ``.grad``; costs exactly the buffers' memory and one fused pass per micro-batch.
        clip_mode: ``"step"`` clips the window's final gradient; ``"micro_batch"`` clips each
            micro-batch's own gradient to ``max_grad_norm`` before it is added (needs buffers).

    Example:
        A complete loop with 10 micro-batches and K=4: windows of 4, 4 and a partial window of 2, each
        normalized by the micro-batches it really had.

        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Linear(3, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> accumulator = GradAccumulator(model.named_parameters(), accumulation_steps=4, max_grad_norm=1.0)
        >>> batches = [(torch.randn(8, 3), torch.randn(8, 1)) for _ in range(10)]
        >>> for index, (x, y) in enumerate(batches):
        ...     loss = torch.nn.functional.mse_loss(model(x), y)
        ...     accumulator.backward(loss, items=len(x))
        ...     if accumulator.window_full or index == len(batches) - 1:
        ...         if accumulator.finalize():
        ...             optimizer.step()
        ...         optimizer.zero_grad()
        >>> stats = accumulator.stats
        >>> stats.optimizer_steps, stats.micro_batches_last_step, stats.items_last_step
        (3, 2, 16.0)
    """

    def __init__(
        self,
        parameters: Iterable[Tensor] | Iterable[tuple[str, Tensor]],
        accumulation_steps: int = 1,
        *,
        scaling: str = "mean",
        max_grad_norm: float | None = None,
        norm_type: float = 2.0,
        clip_value: float | None = None,
        overflow: str = "skip",
        world_size: int | None = None,
        all_reduce: AllReduce | None = None,
        foreach: bool | None = None,
        accumulation_dtype: str | torch.dtype | None = None,
        clip_mode: str = "step",
    ) -> None:
        self._accumulation_steps = check_positive_int("accumulation_steps", accumulation_steps)
        self.settings = AccumulationSettings.checked(
            scaling=scaling,
            max_grad_norm=max_grad_norm,
            norm_type=norm_type,
            clip_value=clip_value,
            overflow=overflow,
            accumulation_dtype=accumulation_dtype,
            clip_mode=clip_mode,
        )
        if world_size is not None:
            check_positive_int("world_size", world_size)
            if world_size > 1 and all_reduce is None and _default_world()[0] != world_size:
                raise ValueError(
                    f"Argument `world_size={world_size}` needs `all_reduce=` (a function that sums a tensor"
                    " over ranks in place) or an initialized `torch.distributed` process group of"
                    f" {world_size} ranks; without either the window's counts could not be summed over ranks."
                )
        self._world_size = world_size
        self._all_reduce = all_reduce
        self.foreach = foreach
        self._named = self._named_list(parameters)
        self.device = self._named[0][1].device
        self._buffers = (
            GradBuffers(self._named, self.settings.accumulation_dtype, foreach)
            if self.settings.accumulation_dtype is not None
            else None
        )
        if (
            self._buffers is not None
            and self.settings.overflow != "skip_micro_batch"
            and self.settings.clip_mode == "step"
        ):
            dtype = self.settings.accumulation_dtype
            same = all(param.dtype == dtype for _, param in self._named)
            if same:
                warnings.warn(
                    f"`accumulation_dtype={dtype}` changes nothing: the parameters are already {dtype}"
                    " (e.g. 'bf16-mixed' keeps float32 weights). Leave it unset to save the buffers' memory.",
                    stacklevel=2,
                )
        self._grad_groups = self._layout(None)
        self._buffer_groups = self._layout(self.settings.accumulation_dtype)
        self._ledger_dtype = torch.float32 if self.device.type == "mps" else torch.float64
        self._tally = WindowTally(self.device, self._ledger_dtype)
        self._memory = WindowPeakMemory(self.device)
        # The reference count of scaling="weighted": losses are weighted by items / reference, so that their
        # gradients keep the magnitude of a mean's (raw counts overflow fp16). The first micro-batch's count
        # (its mean over ranks) for the first window, then the mean count per micro-batch of the window
        # before; constant inside a window and the same on every rank.
        self._reference_count: float | Tensor | None = None
        # Lifetime counters kept on the host (they never depend on tensor values).
        self._optimizer_steps = 0
        self._total_micro_batches = 0
        self._micro_batches_last_step = 0
        self._peak_memory_bytes = 0
        # Value-dependent counters: a device tensor, mirrored on the host after each sync.
        self._ledger: Tensor | None = None
        self._host_ledger: list[float] = [0.0] * len(_LEDGER_FIELDS)
        self._host_ledger_fresh = True
        self._open_window()

    def _layout(self, dtype: torch.dtype | None) -> dict[GroupKey, list[int]]:
        """Parameter indices grouped by (device, dtype of the gradient or buffer), computed once."""
        layout: dict[GroupKey, list[int]] = {}
        for index, (_, param) in enumerate(self._named):
            layout.setdefault((param.device, dtype or param.dtype), []).append(index)
        return layout

    @staticmethod
    def _named_list(parameters: Iterable[Tensor] | Iterable[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
        named: list[tuple[str, Tensor]] = []
        for index, entry in enumerate(parameters):
            name, param = entry if isinstance(entry, tuple) else (f"param_{index}", entry)
            if not isinstance(param, Tensor):
                raise TypeError(
                    f"Expected argument `parameters` to hold tensors, but got {type(param).__name__}."
                )
            named.append((name, param))
        if not named:
            raise ValueError("Expected argument `parameters` to hold at least one parameter.")
        return named

    def track(self, parameters: Iterable[Tensor] | Iterable[tuple[str, Tensor]]) -> None:
        """Follow a new set of parameters, e.g. after a parameter group was added to the optimizer.

        Gradients (and buffers) of parameters still tracked are kept, so this may be called inside a window.
        """
        named = self._named_list(parameters)
        if self._buffers is not None:
            self._buffers.retrack(named)
        self._named = named
        self._grad_groups = self._layout(None)
        self._buffer_groups = self._layout(self.settings.accumulation_dtype)

    # ----------------------------------------------------------------------------------------- window

    def _open_window(self) -> None:
        self._micro_batches = 0
        self._tally.clear()
        self._dropped: Tensor | None = None  # micro-batches dropped by "skip_micro_batch" (device)
        self._micro_clips: Tensor | None = None  # micro-batches clipped by clip_mode="micro_batch"
        self._flushed = False  # buffers written to .grad for a synchronizing backward
        if self._buffers is not None:
            self._buffers.discard()
        self._memory.start()

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per window (K). It can change only between windows."""
        return self._accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value: int) -> None:
        check_positive_int("accumulation_steps", value)
        if value != self._accumulation_steps and self._micro_batches:
            raise RuntimeError(
                f"Cannot change `accumulation_steps` from {self._accumulation_steps} to {value} inside an"
                f" open window ({self._micro_batches} micro-batches recorded). Change it after `finalize()`."
            )
        self._accumulation_steps = value

    @property
    def current_step(self) -> int:
        """Micro-batches recorded in the open window."""
        return self._micro_batches

    @property
    def window_full(self) -> bool:
        """Whether K micro-batches have been recorded, so the window should be finalized."""
        return self._micro_batches >= self._accumulation_steps

    @property
    def parameters(self) -> list[Tensor]:
        """The parameters tracked."""
        return [param for _, param in self._named]

    def weigh(
        self,
        items: Any,
        *,
        loss_dtype: torch.dtype | None = None,
        label: str | None = None,
        error: str | None = None,
    ) -> ItemCount:
        """Check one micro-batch's item count and compute the factor its loss must be multiplied by.

        Never raises for a bad count and never syncs: an invalid count (negative, not finite, not a number,
        missing under ``"weighted"``) gets weight 0 and is raised by :meth:`finalize`, after the window's
        counts were summed over ranks, so that every rank raises together. Under data parallelism the first
        call for ``"weighted"`` all-reduces the count once (every rank must make it, as Lightning does).

        A micro-batch with 0 items contributes nothing as long as its loss has a finite gradient:
        ``cross_entropy(..., ignore_index=-100)`` over only ignored labels gives zeros, but a hand-written
        masked mean must divide by ``mask.sum().clamp(min=1)``, or its ``nan`` makes the window non-finite.

        Args:
            items: Samples or tokens in the micro-batch: a number >= 0 or a real scalar tensor; ``None``
                when unknown (allowed except for ``"weighted"``).
            loss_dtype: The loss's dtype: a weight for a fp16/bf16 loss is rounded to it first, so that the
                boundary divides by exactly the weights that were applied.
            label: How an error names this count, e.g. "the item count of batch 7".
            error: A problem the caller found already (e.g. the count could not be inferred).

        Example:
            >>> accumulator = GradAccumulator([torch.zeros(1, requires_grad=True)], scaling="weighted")
            >>> accumulator.weigh(8).weight, accumulator.weigh(4).weight  # relative to the first count
            (1.0, 0.5)
        """
        weighted = self.settings.scaling == "weighted"
        if type(items) is int and items >= 0 and error is None and not weighted:  # the common case, quickly
            return ItemCount(float(items), 1.0)
        label = label or f"the item count of micro-batch {self._micro_batches} of the window"
        value: float | Tensor | None = None
        problem = error
        check: InvalidCount | None = None
        if problem is None and items is None and weighted:
            problem = f"{label} is missing: `scaling='weighted'` needs the item count of every micro-batch"
        elif problem is None and items is not None:
            try:
                value = check_item_count(items, label)
            except (TypeError, ValueError) as exc:
                problem = str(exc)
        if isinstance(value, Tensor):
            valid = (value >= 0) & (value < math.inf)  # nan fails both
            check = InvalidCount(~valid, value, label)
            if weighted:
                value = torch.where(valid, self._scalar(value), 0.0)
        if problem is not None:
            value = 0.0
        if not weighted:
            return ItemCount(value, 1.0, problem, check)
        assert value is not None
        weight = value / self._reference(value)
        if loss_dtype is not None and loss_dtype.is_floating_point and loss_dtype.itemsize < 4:
            weight = (
                weight.to(loss_dtype)
                if isinstance(weight, Tensor)
                else float(torch.tensor(weight, dtype=loss_dtype))  # a CPU op: no device sync
            )
        return ItemCount(value, weight, problem, check)

    def _reference(self, first: float | Tensor) -> float | Tensor:
        """The reference count of ``"weighted"`` for the open window (at least 1)."""
        if self._reference_count is None:
            world_size, all_reduce = self._world()
            if world_size > 1 and all_reduce is not None:  # one small collective, once
                total = all_reduce(self._scalar(first).clone().reshape(1)).reshape(())
                self._reference_count = (total / world_size).clamp(min=1.0)
            elif isinstance(first, Tensor):
                self._reference_count = self._scalar(first).clamp(min=1.0)
            else:
                self._reference_count = max(float(first), 1.0)
        return self._reference_count

    def loss_weight(self, items: Any) -> float | Tensor:
        """The factor a micro-batch's loss must be multiplied by before ``backward`` (1 unless weighted).

        For ``scaling="weighted"`` it is ``items / reference``, the reference being a typical count (the first
        micro-batch's in the first window, then the mean of the window before): the loss is a mean over its
        items, so the weighted sum over micro-batches, divided by the sum of the weights at the boundary, is
        the mean over every item of the window. See :meth:`weigh`.

        Example:
            >>> GradAccumulator([torch.zeros(1, requires_grad=True)], scaling="weighted").loss_weight(7)
            1.0
        """
        return self.weigh(items).weight

    def backward(self, loss: Tensor, items: Any = None) -> None:
        """Back-propagate one micro-batch's loss (a mean over its items) with its weight; record it."""
        count = self.weigh(items, loss_dtype=loss.dtype)
        weight = count.weight
        weighted = loss * weight if isinstance(weight, Tensor) or weight != 1.0 else loss
        weighted.backward()  # type: ignore[no-untyped-call]
        self.record(count, loss.detach())

    def record(
        self,
        items: ItemCount | Any = None,
        loss: Tensor | float | None = None,
        *,
        grad_scale: float | Tensor = 1.0,
        reevaluation: bool = False,
    ) -> None:
        """Count a micro-batch whose gradient has been added to ``.grad`` (and move it to the buffers).

        The backward pass must have used ``loss * loss_weight(items)``. Never syncs with the device, never
        raises for a bad item count: :meth:`finalize` does (see :meth:`weigh`).

        Args:
            items: The micro-batch's :class:`ItemCount` from :meth:`weigh`, or its raw item count (a number
                or a scalar tensor). Required for ``"weighted"``; elsewhere used for statistics (an invalid
                count is an error there too).
            loss: The micro-batch's unweighted loss, for ``window_loss`` in the statistics (in any units
                that :meth:`finalize`'s ``loss_scale`` turns into the loss; it is only kept, not copied).
            grad_scale: The factor the loss was multiplied by besides :meth:`loss_weight` (Lightning's
                1/K, times the AMP scale under a GradScaler); used by ``clip_mode="micro_batch"``.
            reevaluation: The same micro-batch evaluated again for the same step (an optimizer such as
                LBFGS calls its closure several times): not counted in ``total_micro_batches``.
        """
        count = items if isinstance(items, ItemCount) else self.weigh(items)
        if count.problem is not None:
            self._tally.problems.append(count.problem)
        if count.check is not None:
            self._tally.checks.append(count.check)
        keep = self._absorb(count, grad_scale) if self._buffers is not None and not self._flushed else None
        weight = count.weight if self.settings.scaling == "weighted" else None
        self._tally.add(count.items, loss, keep, weight)
        self._micro_batches += 1
        if not reevaluation:
            self._total_micro_batches += 1

    def _absorb(self, count: ItemCount, grad_scale: float | Tensor) -> Tensor | None:
        """Move this micro-batch's ``.grad`` into the buffers; returns whether it was kept (or None)."""
        assert self._buffers is not None
        keep: Tensor | None = None
        multiplier: Tensor | None = None
        if self.settings.overflow == "skip_micro_batch" or self.settings.clip_mode == "micro_batch":
            grads = [param.grad for _, param in self._named if param.grad is not None]
            norm = total_norm(grads, self.settings.norm_type, device=self.device, foreach=self.foreach)
            finite = torch.isfinite(norm)
            if self.settings.overflow == "skip_micro_batch":
                bad = (~finite).to(self._ledger_dtype)
                world_size, all_reduce = self._world()
                if world_size > 1 and all_reduce is not None:  # every rank drops the same micro-batch
                    bad = all_reduce(bad.reshape(1)).reshape(())
                keep = bad == 0
                self._dropped = (
                    bad.clamp(max=1) if self._dropped is None else self._dropped + bad.clamp(max=1)
                )
            if self.settings.clip_mode == "micro_batch":
                assert self.settings.max_grad_norm is not None
                # undo the loss's weight and scale; a weight of 0 leaves a zero gradient, nothing to clip
                factor = (self._scalar(count.weight).to(norm.dtype) * grad_scale).abs().clamp(min=1e-30)
                own_norm = norm / factor
                coefficient = torch.clamp(self.settings.max_grad_norm / (own_norm + 1e-6), max=1.0)
                clipped = ((coefficient < 1.0) & finite).to(self._ledger_dtype)
                self._micro_clips = clipped if self._micro_clips is None else self._micro_clips + clipped
                multiplier = torch.where(finite, coefficient, 1.0)
        self._buffers.absorb(keep, multiplier)
        return keep

    def flush_to_grad(self) -> None:
        """Write the buffered window into ``.grad`` so that the next backward adds to it.

        Call it before the backward that DDP synchronizes (its all-reduce then carries the whole window:
        one gradient all-reduce per step, as without buffers) or that a GradScaler unscales and checks.
        That micro-batch is then not checked on its own: a non-finite gradient in it makes the whole
        window non-finite. Without buffers this does nothing.
        """
        if self._buffers is not None and not self._flushed:
            self._buffers.write_to_grads()
            self._flushed = True

    # ---------------------------------------------------------------------------------------- boundary

    def _world(self) -> tuple[int, AllReduce | None]:
        if self._world_size is None:
            return _default_world()
        if self._world_size > 1 and self._all_reduce is None:
            world_size, all_reduce = _default_world()
            if all_reduce is None or world_size != self._world_size:
                raise RuntimeError(
                    f"`GradAccumulator(world_size={self._world_size})` has no `all_reduce` and no"
                    f" `torch.distributed` process group of {self._world_size} ranks is running (found"
                    f" {world_size}): the window cannot be summed over ranks."
                )
            return world_size, all_reduce
        return self._world_size, self._all_reduce

    def _scalar(self, value: Tensor | float) -> Tensor:
        """A scalar on the ledger device, created by a fill kernel (no host-to-device copy)."""
        if isinstance(value, Tensor):
            if value.dtype == self._ledger_dtype and value.device == self.device and value.dim() == 0:
                return value
            return value.to(device=self.device, dtype=self._ledger_dtype, non_blocking=True).reshape(())
        return torch.full((), float(value), dtype=self._ledger_dtype, device=self.device)

    def finalize(
        self,
        *,
        grad_scale: float = 1.0,
        overflow_handled_externally: bool = False,
        loss_scale: float | Tensor = 1.0,
        reevaluation: bool = False,
    ) -> bool:
        """Turn the window's summed gradients into the final gradient, in place; close the window.

        Args:
            grad_scale: The factor every micro-batch's loss was multiplied by besides
                :meth:`loss_weight` (Lightning divides each loss by K: pass ``1 / K``).
            overflow_handled_externally: A ``GradScaler`` will skip the step itself when the gradient is
                not finite: count the overflow and the skip, but neither drop gradients nor raise.
            loss_scale: Factor from the recorded losses to the real loss (Lightning records L / K times
                the AMP scale: pass K / scale).
            reevaluation: The window just finalized, evaluated again for the same step (LBFGS's closure):
                the statistics of the step are updated but no counter advances.

        Returns:
            Whether the optimizer should step. ``False`` for a skipped non-finite window and for an empty
            one (no micro-batch recorded, or ``"weighted"`` with 0 items in total); their gradients have
            been set to ``None``, so torch optimizers leave parameters and state unchanged.

        Raises:
            GradientOverflowError: ``overflow="raise"`` and the gradient is not finite.
            ValueError: an item count of the window, on this rank or another, was invalid.
        """
        if self._micro_batches == 0:
            return self._close_empty(reevaluation)
        from_buffers = self._buffers is not None and self._buffers.holds_window and not self._flushed
        sources: list[Tensor | None]
        if from_buffers:
            assert self._buffers is not None
            sources, layout = self._buffers.window(), self._buffer_groups
        else:
            sources, layout = [param.grad for _, param in self._named], self._grad_groups
        if not from_buffers:  # buffers are dense by construction
            for (name, _), tensor in zip(self._named, sources, strict=True):
                if tensor is not None and tensor.is_sparse:
                    raise TypeError(f"Sparse gradients are not supported (parameter `{name}`).")
        grads = {
            key: [t for i in indices if (t := sources[i]) is not None] for key, indices in layout.items()
        }
        world_size, all_reduce = self._world()

        totals = self._window_totals(world_size, all_reduce)
        factor = self._normalization(totals.weights, grad_scale, world_size)
        self._rebase_reference(totals.items, world_size)
        raw_norm = total_norm(grads, self.settings.norm_type, device=self.device, foreach=self.foreach)
        norm = raw_norm.to(self._ledger_dtype) * factor
        finite = torch.isfinite(norm)
        live = finite
        if self._dropped is not None:  # every micro-batch dropped: nothing to step with
            live = finite & (self._dropped < self._micro_batches)
        has_items: Tensor | bool = True
        if self.settings.scaling == "weighted":
            weights = totals.weights
            has_items = weights > 0 if isinstance(weights, Tensor) else bool(weights > 0)
        multiplier: Tensor | float = factor
        clipped = torch.zeros((), dtype=torch.bool, device=self.device)
        if self.settings.max_grad_norm is not None:
            coefficient = torch.clamp(self.settings.max_grad_norm / (norm + 1e-6), max=1.0)
            clipped = coefficient < 1.0
            multiplier = coefficient * factor
        if self.settings.clip_value is not None:
            raw_max = (
                raw_norm
                if self.settings.norm_type == math.inf
                else total_norm(grads, math.inf, device=self.device, foreach=self.foreach)
            )
            clipped = clipped | (raw_max.to(self._ledger_dtype) * multiplier > self.settings.clip_value)
        clipped = clipped & finite

        nonfinite = (~finite).to(self._ledger_dtype)
        skips = overflow_handled_externally or self.settings.overflow in ("skip", "skip_micro_batch")
        overflows = nonfinite if self._dropped is None else nonfinite + self._dropped
        skipped = (~live & has_items).to(self._ledger_dtype) if skips else torch.zeros_like(nonfinite)
        empty = ~has_items if isinstance(has_items, Tensor) else float(not has_items)
        if self._micro_clips is not None:
            clipped = clipped | (self._micro_clips > 0)
        loss_sum, loss_weight = totals.loss_sum, totals.loss_weight
        self._update_ledger(
            count=not reevaluation,
            overflow_count=overflows,
            skipped_steps=skipped,
            clip_count=clipped,
            empty_windows=empty,
            last_grad_norm=norm,
            items_last_step=totals.items,
            window_loss=loss_sum / loss_weight * loss_scale
            if isinstance(loss_weight, Tensor) or loss_weight
            else math.nan,
        )
        self._micro_batches_last_step = self._micro_batches
        step = self._optimizer_steps
        if not reevaluation:
            self._optimizer_steps += 1
        self._peak_memory_bytes = self._memory.read()
        try:
            decides = not overflow_handled_externally and self.settings.overflow in (
                "skip",
                "raise",
                "skip_micro_batch",
            )
            flags = (live if decides else True, has_items, totals.bad_items)
            if any(isinstance(flag, Tensor) for flag in flags):  # the one host sync of this step
                keeps_step, has_any, bad = self._sync(*flags)
            else:
                keeps_step, has_any, bad = (float(flag) for flag in flags)
            if bad:
                raise ValueError(self._invalid_count_message(int(bad)))
            if not (keeps_step and has_any):
                if has_any and self.settings.overflow == "raise" and not overflow_handled_externally:
                    named = [(n, t) for (n, _), t in zip(self._named, sources, strict=True) if t is not None]
                    raise GradientOverflowError(step, non_finite_names(named))
                for _, param in self._named:
                    param.grad = None
                return False
            scale_(grads, multiplier, foreach=self.foreach)
            if self.settings.clip_value is not None:
                clamp_(grads, self.settings.clip_value, foreach=self.foreach)
            if from_buffers:
                assert self._buffers is not None
                self._buffers.write_to_grads()  # one rounding to the parameters' dtype, at the end
            return True
        finally:
            self._open_window()

    def _rebase_reference(self, items: Tensor | float, world_size: int) -> None:
        """Set the next window's reference to this window's mean count per micro-batch and rank.

        No collective: ``items`` is already summed over ranks. A window without items keeps the reference.
        """
        if self.settings.scaling != "weighted" or self._reference_count is None:
            return
        mean = items / (self._micro_batches * world_size)
        if isinstance(mean, Tensor):
            self._reference_count = torch.where(
                mean > 0, mean.clamp(min=1.0), self._scalar(self._reference_count)
            )
        elif mean > 0:
            self._reference_count = max(mean, 1.0)

    def _close_empty(self, reevaluation: bool) -> bool:
        """Close a window in which no micro-batch was recorded: no step (counted in ``empty_windows``)."""
        for _, param in self._named:  # e.g. stale gradients of an earlier window: nothing to step with
            param.grad = None
        self._update_ledger(
            count=not reevaluation,
            overflow_count=0.0,
            skipped_steps=0.0,
            clip_count=0.0,
            empty_windows=1.0,
            last_grad_norm=0.0,
            items_last_step=0.0,
            window_loss=math.nan,
        )
        self._micro_batches_last_step = 0
        if not reevaluation:
            self._optimizer_steps += 1
        self._peak_memory_bytes = self._memory.read()
        self._open_window()
        return False

    def _invalid_count_message(self, count: int) -> str:
        found = self._tally.invalid_counts()
        where = "; ".join(problem.rstrip(".") for problem in found) if found else "on another rank"
        return (
            f"{count} invalid item count(s) in this window: {where}. An item count must be a finite number"
            " >= 0 (a micro-batch with 0 items weighs nothing); check `item_count_fn` or the `items` given."
        )

    def step(self, optimizer: torch.optim.Optimizer, *, force: bool = False) -> bool:
        """Finalize and step ``optimizer`` when the window is full (or ``force``), then zero gradients.

        Returns:
            Whether the optimizer stepped.
        """
        if not (self.window_full or (force and self._micro_batches)):
            return False
        stepped = self.finalize()
        if stepped:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return stepped

    def _window_totals(self, world_size: int, all_reduce: AllReduce | None) -> WindowTotals:
        """The window's totals, summed over ranks (one small all-reduce)."""
        totals = self._tally.totals()
        if world_size == 1 or all_reduce is None:
            return totals
        packed = torch.stack([self._scalar(value) for value in astuple(totals)])
        return WindowTotals(*all_reduce(packed).unbind())

    def _normalization(self, weights: Tensor | float, grad_scale: float, world_size: int) -> Tensor | float:
        """The factor that turns ``.grad`` into the contract's gradient (see ARCHITECTURE.md section 2)."""
        if self.settings.scaling == "mean":
            if self._dropped is not None:
                return 1.0 / ((self._micro_batches - self._dropped).clamp(min=1) * grad_scale)
            return 1.0 / (self._micro_batches * grad_scale)
        if self.settings.scaling == "sum":
            return 1.0 / grad_scale
        # weighted: .grad holds (1/R) * sum_r sum_i w_ri g_ri * grad_scale after DDP's averaging, where
        # w = items / reference; dividing by sum w gives sum n g / sum n. A window without items never steps.
        if isinstance(weights, Tensor):
            return world_size / (grad_scale * torch.where(weights > 0, weights, 1.0))
        return world_size / (grad_scale * (weights if weights > 0 else 1.0))

    def _update_ledger(self, *, count: bool, **step: Tensor | float) -> None:
        """Fold one step into the device ledger in a few kernels.

        Counters add up, the largest norm is kept, the rest is overwritten; ``count=False`` (a re-evaluation)
        advances no counter.
        """
        if self._ledger is None:
            self._ledger = torch.tensor(self._host_ledger, dtype=self._ledger_dtype, device=self.device)
            self._counters_mask = torch.tensor(
                [name in _COUNTERS for name in _LEDGER_FIELDS], device=self.device
            )
            self._maximum_mask = torch.tensor(
                [name == "max_grad_norm_seen" for name in _LEDGER_FIELDS], device=self.device
            )
        norm = self._scalar(step["last_grad_norm"])
        step = {
            **step,
            "last_grad_norm": norm,
            "max_grad_norm_seen": torch.where(torch.isfinite(norm), norm, 0.0),
        }
        if not count:
            step.update(dict.fromkeys(_COUNTERS, 0.0))
        this_step = torch.stack([self._scalar(step[name]) for name in _LEDGER_FIELDS])
        # select, never multiply by a mask: a nan norm of an earlier step must not leak into other fields
        folded = torch.where(self._counters_mask, self._ledger + this_step, this_step)
        self._ledger = torch.where(self._maximum_mask, torch.maximum(folded, self._ledger), folded)
        self._host_ledger_fresh = False

    def _sync(self, *flags: Tensor | float | bool) -> list[float]:
        """Copy the ledger (and ``flags``) to the host in one device sync.

        Returns:
            The flags' values.
        """
        if self._ledger is None or (self._host_ledger_fresh and not flags):
            return [float(flag) for flag in flags]
        packed = (
            torch.cat([self._ledger, torch.stack([self._scalar(flag) for flag in flags])])
            if flags
            else self._ledger
        )
        values = [float(v) for v in packed.tolist()]
        self._host_ledger = values[: len(_LEDGER_FIELDS)]
        self._host_ledger_fresh = True
        return values[len(_LEDGER_FIELDS) :]

    # -------------------------------------------------------------------------------------- reporting

    @property
    def stats(self) -> AccumulationStats:
        """A frozen snapshot of the statistics (syncs once if a step happened since the last read)."""
        self._sync()
        ledger = dict(zip(_LEDGER_FIELDS, self._host_ledger, strict=True))
        return AccumulationStats(
            accumulation_steps=self._accumulation_steps,
            current_step=self._micro_batches,
            optimizer_steps=self._optimizer_steps,
            total_micro_batches=self._total_micro_batches,
            skipped_steps=int(ledger["skipped_steps"]),
            overflow_count=int(ledger["overflow_count"]),
            clip_count=int(ledger["clip_count"]),
            empty_windows=int(ledger["empty_windows"]),
            last_grad_norm=ledger["last_grad_norm"],
            max_grad_norm_seen=ledger["max_grad_norm_seen"],
            items_last_step=ledger["items_last_step"],
            micro_batches_last_step=self._micro_batches_last_step,
            num_parameters=sum(
                param.numel() for _, param in self._named if param.requires_grad and not is_lazy(param)
            ),
            buffer_bytes=self._buffers.nbytes if self._buffers is not None else 0,
            peak_memory_bytes=self._peak_memory_bytes,
        )

    @property
    def window_loss(self) -> float:
        """Item-weighted mean loss of the last window, over ranks (``nan`` if no loss was recorded)."""
        self._sync()
        return self._host_ledger[_LEDGER_FIELDS.index("window_loss")]

    def reset(self, *, set_grads_to_none: bool = True) -> None:
        """Discard the open window (its buffers, and its gradients by default); lifetime counters are kept."""
        self._open_window()
        if set_grads_to_none:
            for _, param in self._named:
                param.grad = None

    def state_dict(self) -> dict[str, Any]:
        """Counters as plain numbers (loadable with ``torch.load(weights_only=True)``)."""
        self._sync()
        state: dict[str, Any] = {
            "version": _STATE_VERSION,
            "accumulation_steps": self._accumulation_steps,
            "optimizer_steps": self._optimizer_steps,
            "total_micro_batches": self._total_micro_batches,
            "micro_batches_last_step": self._micro_batches_last_step,
            "peak_memory_bytes": self._peak_memory_bytes,
        }
        for name, value in zip(_LEDGER_FIELDS, self._host_ledger, strict=True):
            state[name] = int(value) if name in _COUNTERS else value
        return state

    # ---------------------------------------------------------------------------------- open window

    def window_state_dict(self) -> dict[str, Any] | None:
        """The open window (its summed gradients and counters), or ``None`` between windows.

        Under data parallelism the rank-dependent parts (gradients, items, losses) are summed over ranks:
        a collective, so every rank must call it (Lightning does, when it saves a checkpoint). Loaded on
        the first rank, with the other ranks starting from zero, the sum continues exactly, because the
        all-reduce at the end of the window is linear. Syncs with the device (checkpoint time only).
        """
        if self._micro_batches == 0:
            return None
        world_size, all_reduce = self._world()

        def summed(tensor: Tensor) -> Tensor:
            return all_reduce(tensor.clone()) if world_size > 1 and all_reduce is not None else tensor

        in_buffers = self._buffers is not None and not self._flushed
        sums = self._buffers.window() if in_buffers and self._buffers is not None else None
        tensors: dict[str, Tensor] = {}
        for index, (name, param) in enumerate(self._named):
            tensor = sums[index] if sums is not None else param.grad
            if tensor is None and not param.requires_grad:  # frozen: nothing to save (the same on every rank)
                continue
            dtype = self._buffers.dtype if in_buffers and self._buffers is not None else param.dtype
            local = tensor.detach() if tensor is not None else torch.zeros_like(param, dtype=dtype)
            tensors[name] = summed(local).cpu()
        totals = self._tally.totals()
        micro_clips = self._micro_clips if self._micro_clips is not None else 0.0
        counters = torch.stack([self._scalar(value) for value in (*astuple(totals), micro_clips)])
        items, weights, loss_sum, loss_weight, bad_items, micro_clips = summed(counters).tolist()
        reference = self._reference_count
        return {
            "version": WINDOW_STATE_VERSION,
            "kind": "buffers" if in_buffers else "grads",
            "world_size": world_size,
            "micro_batches": self._micro_batches,
            "dropped": float(self._dropped) if self._dropped is not None else None,  # the same on every rank
            "items": items,
            "weights": weights,
            "reference_count": float(reference) if reference is not None else None,
            "loss_sum": loss_sum,
            "loss_weight": loss_weight,
            "micro_clips": micro_clips,
            "bad_items": bad_items,
            "tensors": tensors,
        }

    def load_window_state_dict(
        self, state: Mapping[str, Any], *, primary: bool = True, rescale: float = 1.0
    ) -> None:
        """Re-open a window saved by :meth:`window_state_dict`; nothing changes if it does not fit.

        Args:
            state: The saved window.
            primary: Whether this rank takes the saved sums (rank 0); the other ranks start from zero.
            rescale: Factor for the saved gradients, e.g. new AMP scale / old, or old K / new K.
        """
        kind = "buffers" if self._buffers is not None else "grads"
        expected = {
            name: (param.shape, self._buffers.dtype if self._buffers is not None else param.dtype)
            for name, param in self._named
        }
        world_size, _ = self._world()
        check_window_state(state, expected, kind, world_size)
        self._open_window()
        for _, param in self._named:
            param.grad = None
        saved_tensors = state["tensors"]
        saved: list[Tensor | None] = [
            None
            if name not in saved_tensors
            else saved_tensors[name].to(param.device) * rescale
            if primary
            else torch.zeros_like(param, dtype=expected[name][1])
            for name, param in self._named
        ]
        if primary:
            self._tally.host_items = float(state["items"])
            # format 1 weighted by raw counts: its weights are its items, relative to a reference of 1
            self._tally.host_weights = float(state.get("weights", state["items"]))
            self._tally.host_loss_sum = float(state["loss_sum"]) * rescale  # in the gradients' units
            self._tally.host_loss_weight = float(state["loss_weight"])
            if state["micro_clips"]:
                self._micro_clips = self._scalar(state["micro_clips"])
            self._tally.host_bad = float(state["bad_items"])
        if self.settings.scaling == "weighted":
            reference = state.get("reference_count", 1.0)
            self._reference_count = float(reference) if reference is not None else None
        if self._buffers is not None:
            self._buffers.load(saved)
        else:
            for (_, param), tensor in zip(self._named, saved, strict=True):
                param.grad = tensor
        if state.get("dropped") is not None:
            self._dropped = self._scalar(state["dropped"])
        self._micro_batches = int(state["micro_batches"])

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore counters saved by :meth:`state_dict`; nothing changes if ``state`` does not fit."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"Cannot load accumulator state of version {state.get('version')!r};"
                f" expected {_STATE_VERSION}."
            )
        required = [name for name in _LEDGER_FIELDS if name not in _OPTIONAL_FIELDS]
        missing = [key for key in (*required, "optimizer_steps", "total_micro_batches") if key not in state]
        if missing:
            raise ValueError(f"Accumulator state is missing {missing}.")
        self._optimizer_steps = int(state["optimizer_steps"])
        self._total_micro_batches = int(state["total_micro_batches"])
        self._micro_batches_last_step = int(state.get("micro_batches_last_step", 0))
        self._peak_memory_bytes = int(state.get("peak_memory_bytes", 0))
        self._host_ledger = [
            float(state.get(name, _OPTIONAL_FIELDS.get(name, 0.0))) for name in _LEDGER_FIELDS
        ]
        self._host_ledger_fresh = True
        self._ledger = None
