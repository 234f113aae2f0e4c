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
from dataclasses import astuple
from typing import Any

import torch
from torch import Tensor

from ..stats import AccumulationStats
from .buffers import GradBuffers
from .errors import GradientOverflowError
from .kernels import GroupKey, clamp_, non_finite_names, scale_, total_norm
from .memory import WindowPeakMemory
from .tally import WindowTally, WindowTotals
from .validation import AccumulationSettings, check_item_count, check_positive_int
from .window_state import WINDOW_STATE_VERSION, check_window_state

_STATE_VERSION = 1
# Positions in the device ledger. Counters are summed, the rest overwritten at every step.
_LEDGER_FIELDS = (
    "overflow_count",
    "skipped_steps",
    "clip_count",
    "last_grad_norm",
    "max_grad_norm_seen",
    "items_last_step",
    "window_loss",
    "bad_item_counts",
)
_OVERFLOW, _SKIPPED, _CLIPPED, _NORM, _MAX_NORM, _ITEMS, _LOSS, _BAD_ITEMS = range(len(_LEDGER_FIELDS))
_INT_FIELDS = {"overflow_count", "skipped_steps", "clip_count", "items_last_step", "bad_item_counts"}

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


class GradAccumulator:
    """Exact gradient accumulation over micro-batches, in place in ``.grad``.

    Args:
        parameters: The model's parameters, or ``named_parameters()`` (names appear in error messages).
            Only those with ``requires_grad`` are tracked.
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
            ``world_size > 1``. ``None``: ``torch.distributed.all_reduce``.
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
        (3, 2, 16)
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
        self._world_size = world_size
        self._all_reduce = all_reduce
        self.foreach = foreach
        self._named = self._trainable(parameters)
        if not self._named:
            raise ValueError(
                "Expected argument `parameters` to hold at least one parameter with requires_grad."
            )
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
    def _trainable(parameters: Iterable[Tensor] | Iterable[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
        named: list[tuple[str, Tensor]] = []
        for index, entry in enumerate(parameters):
            name, param = entry if isinstance(entry, tuple) else (f"param_{index}", entry)
            if not isinstance(param, Tensor):
                raise TypeError(
                    f"Expected argument `parameters` to hold tensors, but got {type(param).__name__}."
                )
            if param.requires_grad:
                named.append((name, param))
        return named

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
        """The trainable parameters tracked."""
        return [param for _, param in self._named]

    def loss_weight(self, items: int | Tensor | None) -> int | Tensor:
        """The factor a micro-batch's loss must be multiplied by before ``backward``.

        ``items`` for ``scaling="weighted"`` (the loss is a mean over its items, so this makes it their
        sum), else 1.

        Example:
            >>> GradAccumulator([torch.zeros(1, requires_grad=True)], scaling="weighted").loss_weight(7)
            7
        """
        if self.settings.scaling != "weighted":
            return 1
        if items is None:
            raise ValueError("`scaling='weighted'` needs the item count of every micro-batch (`items=`).")
        return check_item_count(items, "argument `items`")

    def backward(self, loss: Tensor, items: int | Tensor | None = None) -> None:
        """Back-propagate one micro-batch's loss (a mean over its items) with its weight; record it."""
        weight = self.loss_weight(items)
        weighted = loss * weight if not isinstance(weight, int) or weight != 1 else loss
        weighted.backward()  # type: ignore[no-untyped-call]
        self.record(items, loss.detach())

    def record(
        self,
        items: int | Tensor | None = None,
        loss: Tensor | float | None = None,
        *,
        grad_scale: float | Tensor = 1.0,
    ) -> None:
        """Count a micro-batch whose gradient has been added to ``.grad`` (and move it to the buffers).

        The backward pass must have used ``loss * loss_weight(items)``. Never syncs with the device.

        Args:
            items: Samples or tokens in the micro-batch (int or integer scalar tensor). Required for
                ``"weighted"``; elsewhere only used for statistics.
            loss: The micro-batch's unweighted loss, for ``window_loss`` in the statistics (in any units
                that :meth:`finalize`'s ``loss_scale`` turns into the loss; it is only kept, not copied).
            grad_scale: The factor the loss was multiplied by besides :meth:`loss_weight` (Lightning's
                1/K, times the AMP scale under a GradScaler); used by ``clip_mode="micro_batch"``.
        """
        if items is not None:
            items = check_item_count(items, "argument `items`")
        elif self.settings.scaling == "weighted":
            raise ValueError("`scaling='weighted'` needs the item count of every micro-batch (`items=`).")
        keep = self._absorb(items, grad_scale) if self._buffers is not None and not self._flushed else None
        self._tally.add(items, loss, keep)
        self._micro_batches += 1
        self._total_micro_batches += 1

    def _absorb(self, items: int | Tensor | None, grad_scale: float | Tensor) -> Tensor | None:
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
                weight = self.loss_weight(items)
                own_norm = norm / (self._scalar(weight).to(norm.dtype) * grad_scale).abs()
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
        if self._world_size is not None:
            return self._world_size, self._all_reduce
        return _default_world()

    def _scalar(self, value: Tensor | float) -> Tensor:
        """A scalar on the ledger device, created by a fill kernel (no host-to-device copy)."""
        if isinstance(value, Tensor):
            if value.dtype == self._ledger_dtype and value.device == self.device:
                return value
            return value.to(device=self.device, dtype=self._ledger_dtype, non_blocking=True)
        return torch.full((), float(value), dtype=self._ledger_dtype, device=self.device)

    def finalize(
        self,
        *,
        grad_scale: float = 1.0,
        overflow_handled_externally: bool = False,
        loss_scale: float | Tensor = 1.0,
    ) -> bool:
        """Turn the window's summed gradients into the final gradient, in place; close the window.

        Args:
            grad_scale: The factor every micro-batch's loss was multiplied by besides
                :meth:`loss_weight` (Lightning divides each loss by K: pass ``1 / K``).
            overflow_handled_externally: A ``GradScaler`` will skip the step itself when the gradient is
                not finite: count the overflow and the skip, but neither drop gradients nor raise.
            loss_scale: Factor from the recorded losses to the real loss (Lightning records L / K times
                the AMP scale: pass K / scale).

        Returns:
            Whether the optimizer should step. ``False`` only for a skipped non-finite window, whose
            gradients have been set to ``None``.

        Raises:
            GradientOverflowError: ``overflow="raise"`` and the gradient is not finite.
        """
        if self._micro_batches == 0:
            raise RuntimeError("`finalize()` was called, but no micro-batch was recorded in this window.")
        from_buffers = self._buffers is not None and self._buffers.holds_window and not self._flushed
        sources: list[Tensor | None]
        if from_buffers:
            assert self._buffers is not None
            sources, layout = list(self._buffers.tensors), self._buffer_groups
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
        items, loss_sum, loss_weight = totals.items, totals.loss_sum, totals.loss_weight
        factor = self._normalization(items, grad_scale, world_size)
        raw_norm = total_norm(grads, self.settings.norm_type, device=self.device, foreach=self.foreach)
        norm = raw_norm.to(self._ledger_dtype) * factor
        finite = torch.isfinite(norm)
        steppable = finite
        if self._dropped is not None:  # every micro-batch dropped: nothing to step with
            steppable = finite & (self._dropped < self._micro_batches)
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
        not_steppable = (~steppable).to(self._ledger_dtype)
        if self._micro_clips is not None:
            clipped = clipped | (self._micro_clips > 0)
        self._update_ledger(
            nonfinite=overflows,
            skipped=not_steppable if skips else torch.zeros_like(nonfinite),
            clipped=clipped.to(self._ledger_dtype),
            norm=norm,
            items=items,
            window_loss=loss_sum / loss_weight * loss_scale
            if isinstance(loss_weight, Tensor) or loss_weight
            else math.nan,
            bad_items=totals.bad_items,
        )
        self._micro_batches_last_step = self._micro_batches
        step = self._optimizer_steps
        self._optimizer_steps += 1
        self._peak_memory_bytes = self._memory.read()
        try:
            decides = not overflow_handled_externally and self.settings.overflow in (
                "skip",
                "raise",
                "skip_micro_batch",
            )
            # The one host sync of this step, and only where a decision needs it.
            if decides and not self._sync(steppable):
                if self.settings.overflow == "raise":
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

    def _normalization(self, items: Tensor | float, grad_scale: float, world_size: int) -> Tensor | float:
        """The factor that turns ``.grad`` into the contract's gradient (see ARCHITECTURE.md section 2)."""
        if self.settings.scaling == "mean":
            if self._dropped is not None:
                return 1.0 / ((self._micro_batches - self._dropped).clamp(min=1) * grad_scale)
            return 1.0 / (self._micro_batches * grad_scale)
        if self.settings.scaling == "sum":
            return 1.0 / grad_scale
        # weighted: .grad holds (1/R) * sum_r sum_i n_ri g_ri * grad_scale after DDP's averaging
        if isinstance(items, Tensor):
            return world_size / (grad_scale * items.clamp(min=1))
        return world_size / (grad_scale * max(items, 1.0))

    def _update_ledger(self, **step: Tensor | float) -> None:
        if self._ledger is None:
            if any(self._host_ledger):
                self._ledger = torch.tensor(self._host_ledger, dtype=self._ledger_dtype, device=self.device)
            else:
                self._ledger = torch.zeros(len(_LEDGER_FIELDS), dtype=self._ledger_dtype, device=self.device)
        old = self._ledger
        values = {key: self._scalar(value) for key, value in step.items()}
        finite_norm = torch.where(torch.isfinite(values["norm"]), values["norm"], 0.0)
        self._ledger = torch.stack(
            [
                old[_OVERFLOW] + values["nonfinite"],
                old[_SKIPPED] + values["skipped"],
                old[_CLIPPED] + values["clipped"],
                values["norm"],
                torch.maximum(old[_MAX_NORM], finite_norm),
                values["items"],
                values["window_loss"],
                old[_BAD_ITEMS] + values["bad_items"],
            ]
        )
        self._host_ledger_fresh = False

    def _sync(self, flag: Tensor | None = None) -> bool:
        """Copy the ledger (and ``flag``) to the host in one device sync; check the recorded item counts.

        Returns:
            ``bool(flag)``, or True without a flag.
        """
        if (self._host_ledger_fresh and flag is None) or self._ledger is None:
            return True
        packed = (
            self._ledger
            if flag is None
            else torch.cat([self._ledger, flag.reshape(1).to(self._ledger.dtype)])
        )
        values = [float(v) for v in packed.tolist()]
        self._host_ledger = values[: len(_LEDGER_FIELDS)]
        self._host_ledger_fresh = True
        if self._host_ledger[_BAD_ITEMS]:
            raise ValueError(
                "An item count given as a tensor was not a positive integer (a micro-batch with 0 or fewer"
                " items). Check `item_count_fn` or the `items` passed to `record()`."
            )
        return flag is None or bool(values[-1])

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
            last_grad_norm=ledger["last_grad_norm"],
            max_grad_norm_seen=ledger["max_grad_norm_seen"],
            items_last_step=int(ledger["items_last_step"]),
            micro_batches_last_step=self._micro_batches_last_step,
            num_parameters=sum(param.numel() for _, param in self._named),
            buffer_bytes=self._buffers.nbytes if self._buffers is not None else 0,
            peak_memory_bytes=self._peak_memory_bytes,
        )

    @property
    def window_loss(self) -> float:
        """Item-weighted mean loss of the last window, over ranks (``nan`` if no loss was recorded)."""
        self._sync()
        return self._host_ledger[_LOSS]

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
            state[name] = int(value) if name in _INT_FIELDS else value
        return state

    # ---------------------------------------------------------------------------------- open window

    def _window_tensors(self) -> tuple[str, list[Tensor | None]]:
        """Where the open window's sum lives now, one entry per tracked parameter."""
        if self._buffers is not None and self._buffers.holds_window and not self._flushed:
            return "buffers", list(self._buffers.tensors)
        return "grads", [param.grad for _, param in self._named]

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

        kind, sums = self._window_tensors()
        tensors: dict[str, Tensor] = {}
        for (name, param), tensor in zip(self._named, sums, strict=True):
            dtype = self._buffers.dtype if kind == "buffers" and self._buffers is not None else param.dtype
            local = tensor.detach() if tensor is not None else torch.zeros_like(param, dtype=dtype)
            tensors[name] = summed(local).cpu()
        totals = self._tally.totals()
        micro_clips = self._micro_clips if self._micro_clips is not None else 0.0
        counters = torch.stack([self._scalar(value) for value in (*astuple(totals), micro_clips)])
        items, loss_sum, loss_weight, bad_items, micro_clips = summed(counters).tolist()
        return {
            "version": WINDOW_STATE_VERSION,
            "kind": kind,
            "world_size": world_size,
            "micro_batches": self._micro_batches,
            "dropped": float(self._dropped) if self._dropped is not None else None,  # the same on every rank
            "items": items,
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
        if primary:
            saved = [state["tensors"][name].to(param.device) * rescale for name, param in self._named]
            self._tally.host_items = round(state["items"])
            self._tally.host_loss_sum = (
                float(state["loss_sum"]) * rescale
            )  # losses are in the gradients' units
            self._tally.host_loss_weight = float(state["loss_weight"])
            if state["micro_clips"]:
                self._micro_clips = self._scalar(state["micro_clips"])
            if state["bad_items"]:
                self._tally.unchecked_items.append(torch.zeros((), dtype=torch.int64, device=self.device))
        else:
            saved = [torch.zeros_like(param, dtype=expected[name][1]) for name, param in self._named]
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
        missing = [
            key for key in (*_LEDGER_FIELDS, "optimizer_steps", "total_micro_batches") if key not in state
        ]
        if missing:
            raise ValueError(f"Accumulator state is missing {missing}.")
        self._optimizer_steps = int(state["optimizer_steps"])
        self._total_micro_batches = int(state["total_micro_batches"])
        self._micro_batches_last_step = int(state.get("micro_batches_last_step", 0))
        self._peak_memory_bytes = int(state.get("peak_memory_bytes", 0))
        self._host_ledger = [float(state[name]) for name in _LEDGER_FIELDS]
        self._host_ledger_fresh = True
        self._ledger = None
