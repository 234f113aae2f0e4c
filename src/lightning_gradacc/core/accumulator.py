"""GradAccumulator: exact gradient accumulation over micro-batches, for any training loop.

Micro-batch gradients add up in ``.grad`` as autograd does (no extra memory), or in wider buffers. At the
boundary :meth:`GradAccumulator.finalize` turns the window's sum into the gradient of one big batch (mean
over the micro-batches actually run, sum, or item-weighted across micro-batches and data-parallel ranks),
detects non-finite values and clips, and says whether the optimizer should step.

The pieces are listed in :mod:`lightning_gradacc.core`; this file wires them together. Per micro-batch
two calls (:meth:`GradAccumulator.begin_micro_batch` before the backward, ``end_micro_batch`` after it);
per window one (:meth:`GradAccumulator.finalize`).

Host syncs: none while accumulating; at the boundary one when a decision needs it (``overflow="skip"``,
``"raise"`` or ``"skip_micro_batch"``, or counts summed over ranks), in which the statistics come along.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from .boundary import Decision, Norms, apply_, decide, normalization
from .buffers import GradBuffers
from .checkpoint import check_open_window, restore_open_window, save_open_window
from .device_step import DeviceStep, disarm, skips_on_device
from .errors import GradientOverflowError
from .grad_hooks import BufferHooks
from .gradient_scale import GradientScale
from .kernels import GroupKey, combine_norms, non_finite_names
from .micro_batch import MicroBatchIntake
from .noise import NoiseScale, NoNoiseScale
from .parameters import NamedParameters, TrackedParameters
from .scalars import Flag, Scalar, as_scalar, both, either, negate
from .statistics import AccumulationStats, RunStatistics
from .store import WindowGradients
from .validation import AccumulationSettings, check_positive_int
from .weighting import ItemCount, ItemWeighting
from .window import LOSS, SUMMED, Measurement, Window, mean_loss
from .world import AllReduce, World


@dataclass(slots=True)
class _Sums:
    """The window's summed gradients: per tracked parameter (``None``: none), and grouped for kernels."""

    sources: list[Tensor | None]
    grouped: dict[GroupKey, list[Tensor]]
    shard_groups: list[Any] | None  # in group order, the process group of each sharded tensor


@dataclass(slots=True)
class _MicroBatch:
    """A micro-batch between :meth:`GradAccumulator.begin_micro_batch` and ``end_micro_batch``."""

    count: ItemCount
    loss: Tensor
    last: bool


def _stacked(scalars: list[Tensor], device: torch.device) -> Tensor:
    """One vector of scalars (empty when there are none)."""
    return torch.stack(scalars) if scalars else torch.zeros(0, device=device)


class GradAccumulator:
    """Exact gradient accumulation over micro-batches, in place in ``.grad``.

    Args:
        parameters: The parameters the optimizer steps, or ``named_parameters()`` (names appear in error
            messages and in :attr:`gradients`). Every one is tracked, frozen ones too: whichever holds a
            gradient at the boundary is normalized, counted in the norm, clipped and checked (so a layer
            unfrozen later is handled). :meth:`track` follows a changed set.
        accumulation_steps: Micro-batches per window (K). :attr:`window_full` turns true after K records;
            a shorter window (end of an epoch) may be finalized at any time.
        scaling: ``"mean"`` (alias ``"average"``): mean over the micro-batches run; ``"sum"``;
            ``"weighted"`` (alias ``"dynamic"``): weighted by the items of each micro-batch, over ranks.
        max_grad_norm: Clip the gradient's norm to this value, once per step.
        norm_type: Order of the norm (any ``p > 0`` or ``inf``), for clipping and statistics.
        clip_scope: ``"global"``: the norm of all gradients together is clipped (as
            ``torch.nn.utils.clip_grad_norm_``); ``"parameter"``: each parameter's gradient whose norm exceeds
            ``max_grad_norm`` is rescaled on its own (the statistics report the global norm).
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
        foreach: As in ``torch.nn.utils.clip_grad_norm_``: ``None`` uses fused ``torch._foreach_*`` kernels
            where supported and loops elsewhere, ``True`` raises where unsupported, ``False`` loops.
        accumulation_dtype: Accumulate in buffers of this dtype (e.g. ``"float32"`` for bf16 parameters)
            instead of ``.grad``; costs exactly the buffers' memory and one pass per micro-batch. Each
            gradient is added into its buffer inside the backward (``accumulate_in_backward``), so that
            ``.grad`` is ``None`` between a micro-batch's backward and the step.
        clip_mode: ``"step"`` clips the window's final gradient; ``"micro_batch"`` clips each
            micro-batch's own gradient to ``max_grad_norm`` before it is added (needs buffers).
        grad_scaler: A ``torch.amp.GradScaler`` that scales every loss before backward, is asked to
            ``unscale_`` the gradients before :meth:`finalize`, and skips non-finite steps itself (the
            accumulator then counts them but neither drops gradients nor raises).
        noise_scale: Estimate the gradient noise scale from each window's micro-batch gradients
            (:attr:`AccumulationStats.noise_scale`; see :mod:`lightning_gradacc.core.noise`). Costs one
            norm kernel per parameter per backward (in a gradient hook: no sync, no gradient kept), a few
            small kernels per micro-batch and six scalars in the boundary's all-reduce. Needs at least 2
            micro-batches per window (over ranks); not with sharded gradients,
            ``overflow="skip_micro_batch"`` or ``clip_mode="micro_batch"``. Without :meth:`backward`, call
            :meth:`begin_backward` before each micro-batch's backward.
        noise_scale_decay: Of the exponential averages of |G|² and tr(Σ) (0.95: about 20 measured steps).
        noise_scale_every: Measure one window in this many (the others cost nothing; the estimates stay
            unbiased, with fewer samples).
        settings: The math settings above, already checked (instead of passing them one by one).
        fsdp_module: The model wrapped by FSDP1 (``FullyShardedDataParallel(use_orig_params=True)``) or
            FSDP2 (``fully_shard``) whose parameters these are. FSDP1's gradients are flat slices of the
            whole, and their norms are combined over each wrapper's shard group: required for such
            parameters. With FSDP2 (whose ``DTensor`` gradients describe themselves) it lets a mid-window
            :meth:`window_state_dict` tell, parameter by parameter, a gradient FSDP2 holds unsynced.
        reduce_gradients: Average the window's buffered sums over the data-parallel ranks when they leave
            the buffers (:meth:`flush_to_grad` or :meth:`finalize`), instead of relying on DDP's backward:
            for DDP with every backward of the window under ``no_sync()``, which the per-micro-batch modes
            need so that the window's last micro-batch is checked and clipped on its own too. Needs
            ``accumulation_dtype``; costs one all-reduce of the buffers per step (not overlapped with the
            backward) and one small host sync to learn which parameters hold a gradient on some rank.
        accumulate_in_backward: With ``accumulation_dtype``, add each parameter's gradient into its buffer
            inside the backward, as soon as autograd has accumulated it (a post-accumulate-grad hook; see
            :mod:`lightning_gradacc.core.grad_hooks`), and release ``.grad``: the peak holds the buffers and
            one parameter's gradient, instead of the buffers and the micro-batch's whole gradient. The sum
            is bitwise the same. Used for the backwards between :meth:`begin_micro_batch` (or
            :meth:`begin_backward`) and :meth:`record` into which buffers take gradients; not with the
            per-micro-batch checks (``overflow="skip_micro_batch"``, ``clip_mode="micro_batch"``: they need
            the micro-batch's whole gradient first) nor with sharded parameters (FSDP's gradients arrive by
            reduce-scatter), where the gradient is moved after the backward. ``False``: always after the
            backward, e.g. for code that reads a micro-batch's ``.grad`` before :meth:`record`, or under
            DDP with ``find_unused_parameters=True`` or ``static_graph=True``, whose reducer marks a
            parameter as used in a ``no_sync()`` backward only when ``.grad`` holds a gradient.

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
        >>> stats.windows, stats.micro_batches_last_step, stats.items_last_step
        (3, 2, 16.0)
    """

    def __init__(
        self,
        parameters: NamedParameters,
        accumulation_steps: int = 1,
        *,
        scaling: str = "mean",
        max_grad_norm: float | None = None,
        norm_type: float = 2.0,
        clip_scope: str = "global",
        clip_value: float | None = None,
        overflow: str = "skip",
        world_size: int | None = None,
        all_reduce: AllReduce | None = None,
        foreach: bool | None = None,
        accumulation_dtype: str | torch.dtype | None = None,
        clip_mode: str = "step",
        noise_scale: bool = False,
        noise_scale_decay: float = 0.95,
        noise_scale_every: int = 1,
        grad_scaler: Any = None,
        settings: AccumulationSettings | None = None,
        fsdp_module: torch.nn.Module | None = None,
        reduce_gradients: bool = False,
        accumulate_in_backward: bool = True,
    ) -> None:
        self._accumulation_steps = check_positive_int("accumulation_steps", accumulation_steps)
        given = dict(
            scaling=scaling,
            max_grad_norm=max_grad_norm,
            norm_type=norm_type,
            clip_scope=clip_scope,
            clip_value=clip_value,
            overflow=overflow,
            accumulation_dtype=accumulation_dtype,
            clip_mode=clip_mode,
            noise_scale=noise_scale,
            noise_scale_decay=noise_scale_decay,
            noise_scale_every=noise_scale_every,
        )
        if settings is None:
            settings = AccumulationSettings.checked(**given)
        elif given != {f.name: f.default for f in fields(AccumulationSettings)}:
            raise ValueError("Pass the math settings either as `settings=` or one by one, not both.")
        self.settings = settings
        self._world = World(world_size, all_reduce)
        self.foreach = foreach
        scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None
        if scaler is not None and settings.overflow == "skip_micro_batch":
            raise ValueError(
                "`overflow='skip_micro_batch'` cannot be combined with a GradScaler: the scaler must see"
                " every overflow to lower its scale."
            )
        self._scale = GradientScale(scaler)
        dtype = settings.accumulation_dtype
        self._tracked = tracked = TrackedParameters(
            parameters, buffer_dtype=dtype, fsdp_module=fsdp_module, foreach=foreach
        )
        self.device = tracked.device
        self._ledger_dtype = torch.float32 if self.device.type == "mps" else torch.float64
        self._buffers = GradBuffers(tracked.named, dtype, foreach) if dtype is not None else None
        self._intake = (
            MicroBatchIntake(tracked, self._buffers, settings, self._scale, self._world, self._ledger_dtype)
            if self._buffers is not None
            else None
        )
        checks_each = self._intake is not None and self._intake.checks
        self._accumulate_in_backward = bool(accumulate_in_backward)
        self._grad_hooks: BufferHooks | None = None  # made by `_watch_backward`, where they can be used
        if dtype is not None and not checks_each and all(param.dtype == dtype for param in tracked.params):
            warnings.warn(
                f"`accumulation_dtype={dtype}` changes nothing: the parameters are already {dtype}"
                " (e.g. 'bf16-mixed' keeps float32 weights). Leave it unset to save the buffers' memory.",
                stacklevel=2,
            )
        self._reduce_gradients = bool(reduce_gradients)
        if reduce_gradients and (dtype is None or tracked.sharded):
            raise ValueError(
                "Argument `reduce_gradients=True` averages the accumulation buffers over ranks: it needs"
                " `accumulation_dtype` and unsharded parameters (FSDP reduces sharded gradients itself),"
                f" but got accumulation_dtype={dtype} with {'sharded' if tracked.sharded else 'plain'}"
                " parameters."
            )
        self._statistics = RunStatistics(self.device, self._ledger_dtype)
        self._noise: NoiseScale | NoNoiseScale = NoNoiseScale()
        if settings.noise_scale:
            if tracked.sharded:
                raise NotImplementedError(
                    "`noise_scale=True` is not supported with sharded (FSDP) parameters yet: their gradients"
                    " reach the shards by reduce-scatter, never through a gradient hook."
                )
            self._noise = NoiseScale(
                settings.noise_scale_decay,
                self.device,
                self._ledger_dtype,
                weighted=settings.scaling == "weighted",
            )
        self._weighting = ItemWeighting(
            settings.scaling == "weighted", self._world, device=self.device, dtype=self._ledger_dtype
        )
        self._pending: _MicroBatch | None = None
        self._window = self._new_window()
        self.device_step: DeviceStep | None = None  # the last `finalize(on_device=True)`'s step tensors
        self._ranks: tuple[int, AllReduce | None] = (1, None)  # the world, resolved at each boundary

    # ------------------------------------------------------------------------------------- parameters

    def track(self, parameters: NamedParameters) -> None:
        """Follow a new set of parameters, e.g. after a parameter group was added to the optimizer.

        Gradients (and buffers) of parameters still tracked are kept, so this may be called inside a window.
        """
        self._tracked.follow(parameters)
        if self._buffers is not None:
            self._buffers.retrack(self._tracked.named)
        self._noise.follow(self.parameters)
        self._watch_backward()

    @property
    def accumulates_in_backward(self) -> bool:
        """Whether buffers take each gradient inside the backward (see ``accumulate_in_backward``)."""
        return (
            self._accumulate_in_backward
            and self._buffers is not None
            and not (self._intake is not None and self._intake.checks)
            and not self._tracked.sharded
        )

    def _watch_backward(self) -> None:
        """Hook the parameters that take their gradient inside the backward, or unhook them all."""
        if not self.accumulates_in_backward:
            if self._grad_hooks is not None:
                self._grad_hooks.remove()
            return
        assert self._buffers is not None
        if self._grad_hooks is None:
            self._grad_hooks = BufferHooks(self._buffers)
        self._grad_hooks.watch()

    def _arm_hooks(self, armed: bool) -> None:
        """Let the hooks take gradients (a micro-batch's backward into the buffers) or not."""
        if self._grad_hooks is not None:
            self._grad_hooks.armed = armed

    @property
    def parameters(self) -> list[Tensor]:
        """The parameters tracked."""
        return self._tracked.params

    # ----------------------------------------------------------------------------------------- window

    def _new_window(self) -> Window:
        if self._buffers is not None:
            self._buffers.discard()
            self._arm_hooks(False)
            self._watch_backward()  # a parameter unfrozen since the last window is hooked now
        if self.settings.noise_scale:  # the noise scale hooks only the windows it measures
            measured = self._statistics.windows % self.settings.noise_scale_every == 0
            self._noise.open_window(measured, self.parameters)
        return Window(buffered=self._buffers is not None, device=self.device, dtype=self._ledger_dtype)

    @property
    def window(self) -> Window:
        """The open window: its state and micro-batches (a new one opens after each close)."""
        return self._window

    @property
    def gradients(self) -> WindowGradients:
        """The open window's summed gradients by parameter name; :meth:`WindowGradients.add` adds more.

        Example:
            >>> weight = torch.nn.Parameter(torch.zeros(2))
            >>> accumulator = GradAccumulator([("weight", weight)], accumulation_steps=2)
            >>> accumulator.gradients.add({"weight": torch.ones(2)})
            >>> list(accumulator.gradients), accumulator.gradients["weight"], accumulator.window.micro_batches
            (['weight'], tensor([1., 1.]), 1)
        """
        return WindowGradients(self, self._tracked, self._buffers, self._scale)

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per window (K). It can change only between windows."""
        return self._accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value: int) -> None:
        check_positive_int("accumulation_steps", value)
        if value != self._accumulation_steps and not self._window.empty:
            raise RuntimeError(
                f"Cannot change `accumulation_steps` from {self._accumulation_steps} to {value} inside an"
                f" open window ({self._window.micro_batches} micro-batches recorded). Change it after"
                " `finalize()`."
            )
        self._accumulation_steps = value

    @property
    def loss_scale(self) -> float:
        """The factor every loss was multiplied by before ``backward``, besides its item weight and AMP scale.

        Lightning divides each loss by K (``1 / K``); a plain loop that back-propagates the loss as it is
        keeps 1. It is told once per window: it can change only while the window is empty.
        """
        return self._scale.loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        value = GradientScale.checked(value)
        if value != self._scale.loss_scale and not self._window.empty:
            raise RuntimeError(
                f"Cannot change `loss_scale` from {self._scale.loss_scale} to {value} inside an open window"
                f" ({self._window.micro_batches} micro-batches recorded): its gradients carry the old one."
            )
        self._scale.loss_scale = value

    @property
    def window_full(self) -> bool:
        """Whether K micro-batches have been recorded, so the window should be finalized."""
        return self._window.micro_batches >= self._accumulation_steps

    # ------------------------------------------------------------------------------------- recording

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
        label = label or f"the item count of micro-batch {self._window.micro_batches} of the window"
        return self._weighting.weigh(items, loss_dtype=loss_dtype, label=label, error=error)

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

    def begin_backward(self) -> None:
        """Say that a micro-batch's backward starts (:meth:`begin_micro_batch` does it for you).

        When you call ``loss.backward()`` and :meth:`record` yourself, call it before the backward: with
        ``noise_scale=True`` gradients of other passes since the last record (``torch.autograd.grad`` for a
        gradient penalty) are then not taken for this micro-batch's, and with buffers each gradient goes
        into its buffer inside the backward (``accumulate_in_backward``) until :meth:`record`. Without it
        the micro-batch's gradient waits in ``.grad`` and :meth:`record` moves it (the same sum).
        """
        self._noise.begin_backward()
        self._arm_hooks(self._window.new_gradients_to_buffers)

    def begin_micro_batch(
        self,
        loss: Tensor,
        items: Any = None,
        *,
        last: bool | None = None,
        label: str | None = None,
        error: str | None = None,
        in_place: bool = False,
    ) -> Tensor:
        """Start one micro-batch: weigh its loss and get the window ready for its backward.

        The first of the two calls per micro-batch (:meth:`backward` makes both around ``backward()``; the
        Lightning callback makes them in ``on_before_backward`` and ``on_after_backward``).

        Args:
            loss: The loss about to be back-propagated (a mean over its items, times ``loss_scale`` and,
                under a ``grad_scaler``, already scaled by it), before its item weight.
            items: The micro-batch's item count (see :meth:`weigh`).
            last: Whether it ends the window (``None``: when it is the K-th). Before the window's last
                backward under data parallelism the buffered sums go into ``.grad``, so that DDP's one
                all-reduce carries the whole window (not with the per-micro-batch checks, which need each
                micro-batch alone: they use ``reduce_gradients``).
            label: How an error names the item count.
            error: A problem the caller found with the item count already.
            in_place: Weigh ``loss`` itself (for a caller that back-propagates that very tensor).

        Returns:
            The weighted loss to back-propagate (``loss`` itself with ``in_place``).
        """
        if self._pending is not None:
            raise RuntimeError(
                "`begin_micro_batch` was called twice without `end_micro_batch` after the backward between."
            )
        self.begin_backward()
        count = self.weigh(items, loss_dtype=loss.dtype, label=label, error=error)
        weighted = self._weighting.weighted
        # recorded as back-propagated, before its weight: a loss about to be weighted in place needs a copy
        recorded = loss.detach().clone() if in_place and weighted else loss.detach()
        to_backward = count.weigh_loss(loss, in_place=in_place) if weighted else loss  # else weight 1
        last = self._window.micro_batches + 1 >= self._accumulation_steps if last is None else last
        self._pending = _MicroBatch(count, recorded, last)
        if last and self._flushes_before_last_backward:
            self.flush_to_grad()  # and the hooks stay off: DDP reads this backward's `.grad`
        return to_backward

    def end_micro_batch(self, *, reevaluation: bool = False) -> None:
        """End the micro-batch begun by :meth:`begin_micro_batch`, after its backward: record it.

        Args:
            reevaluation: The same micro-batch evaluated again for the same step (see :meth:`record`).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError(
                "`end_micro_batch` was called without `begin_micro_batch` before the backward."
            )
        self.record(pending.count, pending.loss, reevaluation=reevaluation)
        if pending.last and self._scale.scaler is not None:
            self.flush_to_grad()  # the scaler unscales and checks `.grad`

    @property
    def uses_last(self) -> bool:
        """Whether :meth:`begin_micro_batch` acts on ``last`` (buffers under DDP, or a GradScaler).

        A caller for which knowing ``last`` costs something may pass ``False`` when this is ``False``.
        """
        return self._flushes_before_last_backward or self._scale.scaler is not None

    @property
    def _flushes_before_last_backward(self) -> bool:
        """Whether DDP's backward all-reduce of the window's last micro-batch should carry the buffers."""
        if self._buffers is None or self._reduce_gradients or self._tracked.sharded:
            return False
        if self._intake is not None and self._intake.checks:  # each micro-batch is checked on its own
            return False
        return self._world.resolve()[0] > 1

    def backward(self, loss: Tensor, items: Any = None, *, last: bool | None = None) -> None:
        """Back-propagate one micro-batch's loss (a mean over its items) with its weight; record it.

        Under a ``grad_scaler`` the loss is scaled by it first.

        Args:
            loss: The micro-batch's loss.
            items: Its item count (see :meth:`weigh`).
            last: Whether it ends the window (``None``: when it is the K-th); see :meth:`begin_micro_batch`.
        """
        if self._scale.scaler is not None:
            loss = self._scale.scaler.scale(loss)
        self.begin_micro_batch(loss, items, last=last).backward()  # type: ignore[no-untyped-call]
        self.end_micro_batch()

    def record(
        self,
        items: ItemCount | Any = None,
        loss: Tensor | float | None = None,
        *,
        reevaluation: bool = False,
    ) -> None:
        """Count a micro-batch whose gradient has been added to ``.grad`` (and move it to the buffers).

        The backward pass must have used ``loss * loss_weight(items) * loss_scale`` (times the AMP scale under
        a ``grad_scaler``). Never syncs with the device, never raises for a bad item count: :meth:`finalize`
        does (see :meth:`weigh`).

        Args:
            items: The micro-batch's :class:`ItemCount` from :meth:`weigh`, or its raw item count (a number
                or a scalar tensor). Required for ``"weighted"``; elsewhere used for statistics (an invalid
                count is an error there too).
            loss: The micro-batch's loss before its item weight, as back-propagated otherwise (times
                ``loss_scale`` and the AMP scale, which the boundary divides out), for ``window_loss``.
            reevaluation: The same micro-batch evaluated again for the same step (an optimizer such as
                LBFGS calls its closure several times): not counted in ``total_micro_batches``.
        """
        self._arm_hooks(False)  # what the hooks took is in the buffers; what they did not, `.grad` holds
        window = self._window
        count = items if isinstance(items, ItemCount) else self.weigh(items)
        if count.problem is not None or count.check is not None:
            window.tally.note(count.problem, count.check)
        to_buffers = window.new_gradients_to_buffers
        keep = self._intake.absorb(window, count) if to_buffers and self._intake is not None else None
        window.tally.record(count.items, loss, keep, count.weight if self._weighting.weighted else None)
        if self.settings.noise_scale:
            self._noise.record_micro_batch(
                count.items, count.weight, self._scale.value, reevaluation=reevaluation
            )
        window.record_micro_batch(in_buffers=to_buffers)
        self._statistics.record_micro_batch(reevaluation=reevaluation)

    def flush_to_grad(self) -> None:
        """Write the buffered window into ``.grad`` so that the next backward adds to it.

        :meth:`begin_micro_batch` calls it before the backward that DDP synchronizes (its all-reduce then
        carries the whole window: one gradient all-reduce per step, as without buffers), and
        :meth:`end_micro_batch` after the window's last micro-batch under a GradScaler, which unscales and
        checks ``.grad``. With ``reduce_gradients`` the sums are averaged over ranks first. Without buffers
        this does nothing.
        """
        if self._buffers is not None and self._window.flush():
            self._average_over_ranks()
            self._buffers.write_to_grads()
        self._arm_hooks(False)  # the sum is in `.grad` now: the next gradients add to it there

    def _average_over_ranks(self) -> None:
        """``reduce_gradients``: the window's buffered sums become their mean over ranks (at its end)."""
        world_size, all_reduce = self._world.resolve()
        if not self._reduce_gradients or all_reduce is None:
            return
        assert self._buffers is not None
        held = torch.tensor([float(h) for h in self._buffers.held], device=self.device)
        anywhere = all_reduce(held).tolist()  # the one host sync: which parameters get a gradient
        self._buffers.average_over_ranks(all_reduce, world_size, [count > 0 for count in anywhere])

    # ---------------------------------------------------------------------------------------- boundary

    @property
    def _decides_on_host(self) -> bool:
        """Whether the step's decision needs a host sync anyway (then every scalar comes along in it)."""
        return self._scale.scaler is None and self.settings.overflow != "ignore"

    def finalize(
        self,
        *,
        reevaluation: bool = False,
        read_statistics: bool = False,
        on_device: bool = False,
        fold_multiplier: bool = False,
    ) -> bool:
        """Turn the window's summed gradients into the final gradient, in place; close the window.

        Five steps: the window's sums, their measurement (norms and totals over ranks: one host copy when a
        decision needs it), the decision (normalization, finiteness, clipping), the accounting
        (statistics; errors for invalid counts and ``overflow="raise"``), and keeping or skipping the step.

        Args:
            reevaluation: The window just finalized, evaluated again for the same step (LBFGS's closure):
                the statistics of the step are updated but no counter advances.
            read_statistics: The statistics will be read before the next window closes (e.g. logged):
                the window loss is then computed now and copied in this step's one sync, instead of in
                a second sync when it is read.
            on_device: Decide on the device, with no host read (for an optimizer that skips a step itself:
                torch's fused ones, see :mod:`~lightning_gradacc.core.device_step`). The window's verdict
                is then :attr:`device_step`'s ``found_inf`` (1.0 for a window the host path would skip:
                not finite, no items, or an invalid item count), which the step must be given. An invalid
                count found on the device raises at the next read of the statistics instead of here. Not
                with ``overflow="raise"`` (it raises at the step) or a ``grad_scaler`` (it skips itself).
            fold_multiplier: With ``on_device``, leave the gradients as summed and hand the multiplier to the
                step as :attr:`device_step`'s ``grad_scale`` (its reciprocal) instead of a separate multiply
                pass. Only where nothing reads ``.grad`` before the step, and only for one multiplier on
                gradients in ``.grad`` (not with ``clip_value``, ``clip_scope="parameter"`` or buffers,
                which are multiplied in their own dtype first): else they are multiplied as usual.

        Returns:
            Whether the optimizer should step. ``False`` for a skipped non-finite window and for an empty
            one (no micro-batch recorded, or ``"weighted"`` with 0 items in total); their gradients have
            been set to ``None``, so torch optimizers leave parameters and state unchanged. With
            ``on_device`` ``True`` unless no micro-batch was recorded: the step skips itself.

        Raises:
            GradientOverflowError: ``overflow="raise"`` and the gradient is not finite.
            ValueError: an item count of the window, on this rank or another, was invalid.
        """
        window = self._window
        self.device_step = None
        self._ranks = self._world.resolve()  # once per boundary: `torch.distributed` asked once
        if on_device:
            self._check_on_device()
        if window.empty:
            return self._close_empty(reevaluation)
        try:
            on_host = self._decides_on_host and not on_device
            sums = self._sums(window)
            measured, norms = self._measure(window, sums, read_statistics, on_host)
            factor, decision = self._decide(window, measured, norms)
            verdict = self._account(window, measured, decision, factor, sums, reevaluation, on_device)
            if verdict is False:
                self._tracked.set_grads_to_none()
                return False
            if verdict is not True:  # a device flag: the step skips itself
                multiplier = decision.multiplier
                if (
                    fold_multiplier
                    and not isinstance(multiplier, list)
                    and not window.sums_in_buffers
                    and self.settings.clip_value is None
                ):  # the step divides by it: no multiply pass here
                    self.device_step = DeviceStep(verdict, self._reciprocal(multiplier))
                    return True
                self.device_step = DeviceStep(verdict)
            apply_(sums.grouped, decision, clip_value=self.settings.clip_value, foreach=self.foreach)
            if window.sums_in_buffers:
                assert self._buffers is not None
                self._buffers.write_to_grads()  # one rounding to the parameters' dtype, at the end
            return True
        finally:
            window.close()
            self._window = self._new_window()

    def _sums(self, window: Window) -> _Sums:
        """The window's sums per tracked parameter, grouped by (device, dtype) as local tensors.

        Sharded gradients (``DTensor``) are replaced by their local shards, worked on in place.
        """
        if window.sums_in_buffers:
            assert self._buffers is not None
            self._average_over_ranks()
            sources = self._buffers.window()  # dense by construction
        else:
            sources = self._tracked.grads()
            for name, tensor in zip(self._tracked.names, sources, strict=True):
                if tensor is not None and tensor.is_sparse:
                    raise TypeError(f"Sparse gradients are not supported (parameter `{name}`).")
        grouped, shard_groups = self._tracked.local_layout(sources, in_buffers=window.sums_in_buffers)
        return _Sums(sources, grouped, shard_groups)

    def _measure(
        self, window: Window, sums: _Sums, read_statistics: bool, on_host: bool
    ) -> tuple[Measurement, Norms]:
        """Norms and totals of the window over ranks, as host numbers or device scalars.

        On the host after the step's one sync when the decision is made there (everything else the step
        needs comes along in it); device scalars otherwise.
        """
        settings, tracked = self.settings, self._tracked
        measured = self._window_totals(window, read_statistics)
        grads, groups = sums.grouped, sums.shard_groups
        each = tracked.tensor_norms(grads, settings.norm_type, groups)
        each_largest: list[Tensor] | None = None  # each tensor's largest element, for clip_value
        if settings.clip_value is not None:
            each_largest = (
                each if settings.norm_type == math.inf else tracked.tensor_norms(grads, math.inf, groups)
            )
        if measured.noise is not None and settings.norm_type != 2.0:  # the noise scale needs the L2 norm
            l2 = combine_norms(tracked.tensor_norms(grads, 2.0, groups), 2.0, device=self.device)
            measured.l2_norm = l2
        if not on_host:
            per_tensor = settings.clip_scope == "parameter" and settings.max_grad_norm is not None
            norms = Norms.on_device(
                each, settings.norm_type, each_largest, device=self.device, keep_per_tensor=per_tensor
            )
            return measured, norms
        # Each tensor's norm goes to the host, where they are combined: no kernel for the total.
        measured.tensor_norms = _stacked(each, self.device)
        if each_largest is not None:
            measured.tensor_largest = _stacked(each_largest, self.device)
        measured.to_host(self._statistics.sync)
        wide = torch.float64 if any(dtype == torch.float64 for _, dtype in grads) else torch.float32
        norms = Norms.on_host(
            measured.tensor_norms,  # type: ignore[arg-type]
            settings.norm_type,
            measured.tensor_largest if settings.clip_value is not None else None,  # type: ignore[arg-type]
            dtype=wide,
        )
        return measured, norms

    def _window_totals(self, window: Window, read_statistics: bool) -> Measurement:
        """The window's totals and noise-scale totals, summed over ranks (one small all-reduce).

        Alone (no all-reduce), the loss totals are computed only if they will be read.
        """
        _, all_reduce = self._ranks
        totals = window.tally.totals(with_loss=all_reduce is not None)
        noise = self._noise.close_window(self.parameters)
        if all_reduce is not None:  # the declared packet, and the noise scale's totals in the same call
            packed = torch.stack([self._scalar(totals[name]) for name in SUMMED])
            reduced = all_reduce(packed if noise is None else torch.cat([packed, noise]))
            totals.update(zip(SUMMED, reduced[: len(SUMMED)].unbind(), strict=True))
            noise = reduced[len(SUMMED) :] if noise is not None else None
        elif read_statistics:
            totals.update(zip(LOSS, window.tally.loss_totals(), strict=True))
        return Measurement(totals, noise=noise)

    def _decide(self, window: Window, measured: Measurement, norms: Norms) -> tuple[Scalar, Decision]:
        """The normalization factor, and what it and clipping make of the window's sum."""
        world_size, _ = self._ranks
        factor = normalization(
            self.settings.scaling,
            window.micro_batches,
            dropped=measured["dropped"],
            weights=measured["weights"],
            loss_scale=self._scale.loss_scale,
            world_size=world_size,
        )
        decision = decide(
            norms,
            factor,
            # clip_mode="micro_batch" clipped each micro-batch: a sum of them is not clipped again
            max_norm=self.settings.max_grad_norm if self.settings.clip_mode == "step" else None,
            clip_scope=self.settings.clip_scope,  # type: ignore[arg-type]
            clip_value=self.settings.clip_value,
        )
        return factor, decision

    def _account(
        self,
        window: Window,
        measured: Measurement,
        decision: Decision,
        factor: Scalar,
        sums: _Sums,
        reevaluation: bool,
        on_device: bool,
    ) -> bool | Tensor:
        """Fold the window into the statistics and say whether the optimizer steps (see :meth:`_keeps_step`).

        Raises:
            ValueError: an item count of the window was invalid (on every rank: the counts are summed).
            GradientOverflowError: ``overflow="raise"`` and the gradient is not finite.
        """
        has_items: Flag = measured["weights"] > 0 if self._weighting.weighted else True
        live = both(decision.finite, measured["dropped"] < window.micro_batches)
        skips = self._scale.scaler is not None or self.settings.overflow in ("skip", "skip_micro_batch")
        gradient_scale = self._scale.value()
        window_loss: Scalar | Callable[[], Scalar]
        if measured["loss_sum"] is not None and measured["loss_weight"] is not None:
            window_loss = mean_loss(measured["loss_sum"], measured["loss_weight"], gradient_scale)
        else:  # computed only if it is read before the next window closes

            def window_loss() -> Scalar:
                return mean_loss(*window.tally.loss_totals(), gradient_scale)

        self._statistics.close_window(
            {
                "non_finite_windows": negate(decision.finite),
                "dropped_micro_batches": measured["dropped"],
                "skipped_steps": both(negate(live), has_items) if skips else False,
                "empty_windows": negate(has_items),
                "clipped_steps": either(decision.clipped, measured["micro_clips"] > 0),
                "last_grad_norm": decision.norm,
                "items_last_step": measured["items"],
                **({"items_last_full_step": measured["items"]} if self.window_full else {}),
                "window_loss": window_loss,
                **self._noise_statistics(window, measured, decision, factor),
            },
            micro_batches=window.micro_batches,
            reevaluation=reevaluation,
        )
        world_size, _ = self._ranks
        self._weighting.rebase(measured["items"], window.micro_batches * world_size)
        return self._keeps_step(window, live, has_items, measured["bad_items"], sums, reevaluation, on_device)

    def _noise_statistics(
        self, window: Window, measured: Measurement, decision: Decision, factor: Scalar
    ) -> dict[str, Scalar]:
        """The window's noise-scale estimates (``noise_scale=True``), folded into the averages."""
        noise = measured.noise
        if noise is None or not isinstance(self._noise, NoiseScale):
            return {}
        parts: list[Scalar] = list(noise.unbind()) if isinstance(noise, Tensor) else list(noise)
        # |G_W|: the L2 norm of the final gradient before clipping (the p-norm's L2 twin for another p)
        scale: Any = abs(factor)  # a number or a device scalar
        norm = decision.norm if measured.l2_norm is None else measured.l2_norm * scale
        return self._noise.statistics(
            parts,
            norm,
            micro_batches=window.micro_batches,
            summed=self.settings.scaling == "sum",
            items=measured["items"],
        )

    def _keeps_step(
        self,
        window: Window,
        live: Flag,
        has_items: Flag,
        bad_items: Scalar,
        sums: _Sums,
        reevaluation: bool,
        on_device: bool,
    ) -> bool | Tensor:
        """Whether the optimizer steps; raises for invalid counts or ``overflow="raise"``.

        A host answer, or, ``on_device``, a float32 ``found_inf`` for the step (1.0: skip).
        """
        if on_device:
            return self._found_inf(
                window, live if self.settings.overflow != "ignore" else True, has_items, bad_items
            )
        flags = (live if self._decides_on_host else True, has_items, bad_items)
        if any(isinstance(flag, Tensor) for flag in flags):  # counts summed over ranks, overflow ignored
            keeps_step, has_any, bad = self._statistics.sync(*(self._scalar(flag) for flag in flags))
        else:
            keeps_step, has_any, bad = (float(flag) for flag in flags)
        if bad:
            raise ValueError(self._invalid_count_message(window, int(bad)))
        if has_any and not keeps_step and self.settings.overflow == "raise" and self._scale.scaler is None:
            step = self._statistics.windows - (0 if reevaluation else 1)
            named = [(n, t) for n, t in zip(self._tracked.names, sums.sources, strict=True) if t is not None]
            raise GradientOverflowError(step, non_finite_names(named))
        return bool(keeps_step and has_any)

    def _found_inf(self, window: Window, live: Flag, has_items: Flag, bad_items: Scalar) -> Tensor:
        """The window's verdict as a device ``found_inf``; an invalid count found on the device is held.

        A count known bad on the host raises now (on every rank alike: the counts were summed over ranks);
        one found on the device skips the step and raises at the next read of the statistics.
        """
        if not isinstance(bad_items, Tensor) and bad_items:
            raise ValueError(self._invalid_count_message(window, int(bad_items)))
        keep = both(live, has_items)
        if isinstance(bad_items, Tensor):
            keep = both(keep, bad_items == 0)
            step = self._statistics.windows - 1
            self._statistics.hold_check(bad_items, lambda count: self._held_count_message(step, count))
        if not isinstance(keep, Tensor):
            return as_scalar(0.0 if keep else 1.0, self.device, torch.float32)
        return (~keep).to(torch.float32)

    def _reciprocal(self, multiplier: Scalar) -> Tensor | None:
        """``1 / multiplier`` as a float32 device scalar (``None`` for 1), a fused step's ``grad_scale``."""
        if isinstance(multiplier, Tensor):
            return (1.0 / multiplier).to(torch.float32)
        if multiplier == 1.0:
            return None
        return as_scalar(1.0 / multiplier, self.device, torch.float32)

    def decides_on_device(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether a window stepped by ``optimizer`` can be decided on the device (``finalize(on_device=)``).

        For an optimizer that skips on the device (``core.device_step.skips_on_device``), without a
        ``grad_scaler`` (it skips itself) and unless ``overflow="raise"`` (it raises at the step).
        """
        return self._scale.scaler is None and self.settings.overflow != "raise" and skips_on_device(optimizer)

    def _check_on_device(self) -> None:
        if self.settings.overflow == "raise" or self._scale.scaler is not None:
            scaler = self._scale.scaler is not None
            given = "a GradScaler" if scaler else f"overflow={self.settings.overflow!r}"
            raise ValueError(
                f"`finalize(on_device=True)` cannot decide on the device with {given}: `overflow='raise'`"
                " raises at the step, and a GradScaler skips the step itself."
            )

    @staticmethod
    def _held_count_message(first_step: int, count: int) -> str:
        return (
            f"{count} invalid item count(s) in the windows since optimizer step {first_step} (the"
            " statistics' last read), found on the device; the steps with them were skipped. An item count"
            " must be a finite number >= 0 (a micro-batch with 0 items weighs nothing); check"
            " `item_count_fn` or the `items` given."
        )

    def _scalar(self, value: Scalar) -> Tensor:
        """A scalar on the ledger device, created by a fill kernel (no host-to-device copy)."""
        return as_scalar(value, self.device, self._ledger_dtype)

    def _close_empty(self, reevaluation: bool) -> bool:
        """Close a window in which no micro-batch was recorded: no step (counted in ``empty_windows``)."""
        self._tracked.set_grads_to_none()  # e.g. stale gradients of an earlier window: nothing to step with
        self._statistics.close_empty_window(reevaluation=reevaluation)
        self._window.close()
        self._window = self._new_window()
        return False

    @staticmethod
    def _invalid_count_message(window: Window, count: int) -> str:
        found = window.tally.invalid_counts()
        where = "; ".join(problem.rstrip(".") for problem in found) if found else "on another rank"
        return (
            f"{count} invalid item count(s) in this window: {where}. An item count must be a finite number"
            " >= 0 (a micro-batch with 0 items weighs nothing); check `item_count_fn` or the `items` given."
        )

    def step(
        self, optimizer: torch.optim.Optimizer, *, force: bool = False, on_device: bool | None = None
    ) -> bool:
        """Finalize and step ``optimizer`` when the window is full (or ``force``), then zero gradients.

        Args:
            optimizer: The optimizer to step.
            force: Finalize a window that is not full (e.g. the last of an epoch).
            on_device: Decide on the device and let the optimizer skip a non-finite window itself, with no
                host sync and no separate multiply pass (``finalize(on_device=True, fold_multiplier=True)``).
                ``None``: for torch's fused optimizers (``fused=True``), without a ``grad_scaler`` and
                unless ``overflow="raise"``.

        Returns:
            Whether the optimizer stepped. On the device: whether it was asked to (it skips a non-finite
            window itself; :attr:`stats` counts it).
        """
        if not (self.window_full or (force and not self._window.empty)):
            return False
        scaler = self._scale.scaler
        if on_device is None:
            on_device = self.decides_on_device(optimizer)
        if on_device:
            stepped = self.finalize(on_device=True, fold_multiplier=True)
            if stepped:
                disarm(optimizer)  # a step interrupted before: its tensors are stale
                if self.device_step is not None:
                    self.device_step.arm(optimizer)
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return stepped
        if scaler is not None:
            self.flush_to_grad()  # the scaler unscales and checks `.grad`
            scaler.unscale_(optimizer)
        stepped = self.finalize()
        if scaler is not None:
            # the scaler skips a non-finite step itself; whether it did is one sync, here only
            found_inf = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
            stepped = stepped and not any(float(value.item()) for value in found_inf.values())
            scaler.step(optimizer)
            scaler.update()
        elif stepped:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return stepped

    def reset(self, *, set_grads_to_none: bool = True) -> None:
        """Discard the open window (its buffers, and its gradients by default); lifetime counters are kept."""
        self._window.close()
        self._window = self._new_window()
        self._noise.discard()
        self._pending = None
        if set_grads_to_none:
            self._tracked.set_grads_to_none()

    def remove_hooks(self) -> None:
        """Remove the gradient hooks (``noise_scale=True``, ``accumulate_in_backward``).

        Call it when the accumulator is replaced or training ends: the hooks of a dropped accumulator do
        nothing, but stay on the parameters until it is garbage-collected. A window opened afterwards
        hooks the parameters again.
        """
        self._noise.remove_hooks()
        if self._grad_hooks is not None:
            self._grad_hooks.remove()

    # -------------------------------------------------------------------------------------- reporting

    @property
    def stats(self) -> AccumulationStats:
        """A frozen snapshot of the statistics (syncs once if a window closed since the last read)."""
        return self._statistics.snapshot(
            accumulation_steps=self._accumulation_steps,
            open_window_micro_batches=self._window.micro_batches,
            num_parameters=self._tracked.num_parameters(),
            buffer_bytes=self._buffers.nbytes if self._buffers is not None else 0,
        )

    @property
    def last_window_items(self) -> float:
        """Items of the last window closed, over ranks (a host read: syncs if the step did not)."""
        return self._statistics.value("items_last_step")

    @property
    def window_loss(self) -> float:
        """Item-weighted mean loss of the last window, over ranks (``nan`` if no loss was recorded)."""
        return self._statistics.window_loss

    def state_dict(self) -> dict[str, Any]:
        """Counters as plain numbers (loadable with ``torch.load(weights_only=True)``)."""
        return {
            **self._statistics.state_dict(),
            "accumulation_steps": self._accumulation_steps,
            **({"noise": self._noise.state_dict()} if isinstance(self._noise, NoiseScale) else {}),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore counters saved by :meth:`state_dict`; nothing changes if they do not fit."""
        self._statistics.check_state(state)
        noise = state.get("noise")
        if isinstance(self._noise, NoiseScale) and noise is not None:
            self._noise.load_state_dict(noise)  # the averages go on where the saved run left them
        self._statistics.load_state_dict(state)

    # ---------------------------------------------------------------------------------- open window

    def window_state_dict(self) -> dict[str, Any] | None:
        """The open window (its summed gradients and counters), or ``None`` between windows.

        Under data parallelism the rank-dependent parts (gradients, items, losses) are summed over ranks:
        a collective, so every rank must call it (Lightning does, when it saves a checkpoint). Loaded on
        the first rank, with the other ranks starting from zero, the sum continues exactly, because the
        all-reduce at the end of the window is linear. Syncs with the device (checkpoint time only).
        """
        return save_open_window(
            self._window,
            self._tracked,
            self._buffers,
            scale=self._scale,
            weighting=self._weighting,
            world=self._world,
        )

    def load_window_state_dict(self, state: Mapping[str, Any], *, primary: bool = True) -> None:
        """Re-open a window saved by :meth:`window_state_dict`; nothing changes if it does not fit.

        The saved sums are rescaled from the loss scale (and AMP scale) they were saved with to the current
        ones, so a window resumes exactly with another K or after the GradScaler changed its scale.

        Args:
            state: The saved window.
            primary: Whether this rank takes the saved sums (rank 0); the other ranks start from zero.
        """
        if not self._window.empty:
            raise RuntimeError(
                "A saved window can only be loaded between windows (the open one is not empty)."
            )
        check_open_window(state, self._tracked, self._buffers, self._world)
        self.reset(set_grads_to_none=True)
        restore_open_window(
            state,
            self._window,
            self._tracked,
            self._buffers,
            scale=self._scale,
            weighting=self._weighting,
            primary=primary,
        )
        self._noise.mark_unusable()  # the restored micro-batches' own norms were not saved
