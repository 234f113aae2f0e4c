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

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .buffers import buffers_for
from .checkpoint import WindowCheckpoint, check_format, stamp
from .grad_hooks import BufferHooks
from .noise import noise_scale_for
from .parameters import NamedParameters, TrackedParameters
from .pieces import MicroBatchPieces, PendingMicroBatch
from .settings import AccumulationSettings, check_positive_int, with_setting_docs
from .statistics import AccumulationStats, RunStatistics
from .stepping import OptimizerStepping
from .store import WindowGradients
from .torch_internals import DeviceStep
from .weighting import GradientScale, ItemCount, ItemWeighting
from .window import Window
from .window_end import WindowEnd
from .world import AllReduce, World


class GradAccumulator(OptimizerStepping):
    """Exact gradient accumulation over micro-batches, in place in ``.grad``.

    Args:
        parameters: The parameters the optimizer steps, or ``named_parameters()`` (names appear in error
            messages and in :attr:`gradients`). Every one is tracked, frozen ones too: whichever holds a
            gradient at the boundary is normalized, counted in the norm, clipped and checked (so a layer
            unfrozen later is handled). :meth:`track` follows a changed set.
        accumulation_steps: Micro-batches per window (K). :attr:`window_full` turns true after K records;
            a shorter window (end of an epoch) may be finalized at any time.
        world_size: Data-parallel ranks whose gradients are averaged at the last backward (as DDP does).
            ``None``: taken from ``torch.distributed`` when initialized, else 1.
        all_reduce: Sums a small tensor over ranks in place and returns it; used once per step when
            ``world_size > 1``. ``None``: ``torch.distributed.all_reduce``, which must then be initialized
            with ``world_size`` ranks.
        foreach: As in ``torch.nn.utils.clip_grad_norm_``: ``None`` uses fused ``torch._foreach_*`` kernels
            where supported and loops elsewhere, ``True`` raises where unsupported, ``False`` loops.
        grad_scaler: A ``torch.amp.GradScaler`` that scales every loss before backward, is asked to
            ``unscale_`` the gradients before :meth:`finalize`, and skips non-finite steps itself (the
            accumulator then counts them but neither drops gradients nor raises).
        settings: The math settings below as one ``AccumulationSettings`` (or each by keyword, not both).
        fsdp_module: The model wrapped by FSDP1 (``FullyShardedDataParallel(use_orig_params=True)``) or
            FSDP2 (``fully_shard``) whose parameters these are. FSDP1's gradients are flat slices of the
            whole, and their norms are combined over each wrapper's shard group: required for such
            parameters. With FSDP2 (whose ``DTensor`` gradients describe themselves) it lets a mid-window
            :meth:`window_state_dict` tell, parameter by parameter, a gradient FSDP2 holds unsynced.
        reduce_gradients: Average the buffered sums over the ranks when they leave the buffers, not in DDP's
            backward: for every backward under ``no_sync()`` (the per-micro-batch modes check the last one on
            its own too). Needs ``accumulation_dtype``; costs one all-reduce of the buffers per step (not
            overlapped) and one small host sync (which parameters hold a gradient on some rank).
        accumulate_in_backward: With ``accumulation_dtype``, add each gradient into its buffer inside the
            backward and release ``.grad`` (:mod:`~lightning_gradacc.core.grad_hooks`; the peak holds the
            buffers and one gradient). Not with the per-micro-batch checks or sharded parameters. ``False``:
            after the backward, for code reading ``.grad`` before :meth:`record`, or DDP with
            ``find_unused_parameters``/``static_graph`` (a ``no_sync()`` backward marks what ``.grad`` holds).
        Math settings: (each field of ``AccumulationSettings``, documented there once, listed here)

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
        world_size: int | None = None,
        all_reduce: AllReduce | None = None,
        foreach: bool | None = None,
        grad_scaler: Any = None,
        settings: AccumulationSettings | None = None,
        fsdp_module: torch.nn.Module | None = None,
        reduce_gradients: bool = False,
        accumulate_in_backward: bool = True,
        **math_settings: Any,
    ) -> None:
        self._accumulation_steps = check_positive_int("accumulation_steps", accumulation_steps)
        if settings is None:
            settings = AccumulationSettings(**math_settings)
        elif math_settings:
            raise ValueError(
                f"Pass the math settings either as `settings=` or by keyword ({sorted(math_settings)}),"
                " not both."
            )
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
        self._reduce_gradients = bool(reduce_gradients)
        self._buffers, self._intake = buffers_for(
            tracked,
            settings,
            self._scale,
            self._world,
            self._ledger_dtype,
            reduce_gradients=self._reduce_gradients,
            foreach=foreach,
        )
        self._accumulate_in_backward = bool(accumulate_in_backward)
        # the hooks that fill the buffers inside the backward, armed only while a micro-batch's backward runs
        self._grad_hooks = BufferHooks(self._buffers) if self._buffers is not None else None
        self._statistics = RunStatistics(self.device, self._ledger_dtype)
        self._noise = noise_scale_for(settings, tracked, device=self.device, dtype=self._ledger_dtype)
        self._measures_noise = settings.noise_scale  # else its points do nothing: not even called
        self._weighting = ItemWeighting(
            settings.mode.weighted, self._world, device=self.device, dtype=self._ledger_dtype
        )
        self._end = WindowEnd(
            settings,
            tracked,
            self._buffers,
            self._scale,
            self._statistics,
            self._noise,
            self._weighting,
            functools.partial(self._buffers.average_window, self._world)
            if self._buffers is not None and self._reduce_gradients
            else None,
            foreach,
            self._ledger_dtype,
        )
        # the open window's saved form, over the parts its sums and counts live in
        self._checkpoint = WindowCheckpoint(
            tracked, self._buffers, self._scale, self._weighting, self._world, self._noise
        )
        self._pending: PendingMicroBatch | None = None
        self._window = self._new_window()
        self.device_step: DeviceStep | None = None  # the last `finalize(on_device=True)`'s step tensors

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
        if self._grad_hooks is not None:
            self._grad_hooks.watch(self.accumulates_in_backward)

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
        # the noise scale hooks only the windows it measures (one in `noise_scale_every`)
        if self._measures_noise:
            measured = self._statistics.windows % self.settings.noise_scale_every == 0
            self._noise.open_window(measured, self._tracked)
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
        """Micro-batches per window (K).

        Inside a window it may change to more than the window holds (an item budget's window grows batch by
        batch); to less, only between windows.
        """
        return self._accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value: int) -> None:
        check_positive_int("accumulation_steps", value)
        recorded = self._window.micro_batches
        if value != self._accumulation_steps and value <= recorded and not self._window.empty:
            raise RuntimeError(
                f"Cannot change `accumulation_steps` from {self._accumulation_steps} to {value} inside an"
                f" open window of {recorded} micro-batches: it would already be past its end. Change it"
                " after `finalize()`, or to more than the micro-batches recorded."
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

        Never raises for a bad count and never syncs: the window's boundary raises, on every rank together
        (the arguments and the rules: :meth:`~lightning_gradacc.core.weighting.ItemWeighting.weigh`).

        Example:
            >>> accumulator = GradAccumulator([torch.zeros(1, requires_grad=True)], scaling="weighted")
            >>> accumulator.weigh(8).weight, accumulator.weigh(4).weight  # relative to the first count
            (1.0, 0.5)
        """
        label = label or f"the item count of micro-batch {self._window.micro_batches} of the window"
        return self._weighting.weigh(items, loss_dtype=loss_dtype, label=label, error=error)

    def loss_weight(self, items: Any) -> float | Tensor:
        """The factor a micro-batch's loss must be multiplied by before ``backward`` (1 unless weighted).

        ``items / reference`` for ``scaling="weighted"`` (:mod:`~lightning_gradacc.core.weighting`).

        Example:
            >>> GradAccumulator([torch.zeros(1, requires_grad=True)], scaling="weighted").loss_weight(7)
            1.0
        """
        return self.weigh(items).weight

    def begin_backward(self) -> None:
        """Say that a micro-batch's backward starts (:meth:`begin_micro_batch` does it for you).

        When you call ``loss.backward()`` and :meth:`record` yourself, call it before the backward: the noise
        scale then ignores gradients of other passes since the last record (a gradient penalty's), and with
        buffers each gradient goes into its buffer inside the backward (else :meth:`record` moves it).
        """
        if self._measures_noise:
            self._noise.begin_backward()
        if self._grad_hooks is not None:
            self._grad_hooks.armed = self._window.new_gradients_to_buffers

    def begin_micro_batch(
        self,
        loss: Tensor,
        items: Any = None,
        *,
        last: bool | None = None,
        label: str | None = None,
        error: str | None = None,
        in_place: bool = False,
        amp_scaled: bool = True,
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
            amp_scaled: ``False``: the ``grad_scaler`` scales ``loss`` in its backward (``fabric.backward``).

        Returns:
            The weighted loss to back-propagate (``loss`` itself with ``in_place``).
        """
        return self._begin(loss, items, last, label, error, in_place, amp_scaled)

    def begin_pieces(
        self,
        loss: Tensor,
        items: Any = None,
        *,
        share: float | Tensor = 1.0,
        hold_in_grad: bool = False,
        last: bool | None = None,
        label: str | None = None,
        error: str | None = None,
        in_place: bool = False,
    ) -> MicroBatchPieces:
        """Start one micro-batch that runs as pieces, each with its own backward; return their handle.

        As :meth:`begin_micro_batch`, for ``loss``, the first piece's (its mean loss times ``share``, its
        part of the items). The handle weighs the later pieces (:meth:`MicroBatchPieces.next`), restarts
        them after an error, and says whether ``.grad`` holds the micro-batch alone; its ``loss`` is the
        first piece's, weighed. :meth:`end_micro_batch` records the micro-batch once.

        Args:
            loss: The first piece's loss, as for :meth:`begin_micro_batch`.
            items: The micro-batch's item count (all its pieces').
            share: The first piece's part of the items.
            hold_in_grad: The pieces' gradients stay in ``.grad`` until :meth:`end_micro_batch` (buffers take
                their sum then), so that after an error the caller can drop them and restart; else buffers
                take each piece's in its backward.
            last: As for :meth:`begin_micro_batch`.
            label: As for :meth:`begin_micro_batch`.
            error: As for :meth:`begin_micro_batch`.
            in_place: As for :meth:`begin_micro_batch`.
        """
        weighed = self._begin(loss, items, last, label, error, in_place, True)
        pending = self._pending
        assert pending is not None
        pending.pieces = MicroBatchPieces(
            pending,
            window=self._window,
            noise=self._noise,
            scale=self._scale,
            weighted=self._weighting.weighted,
            share=share,
            loss=weighed,
        )
        if hold_in_grad:
            self._arm_hooks(False)  # the pieces add up in `.grad`: `record` moves their sum
        return pending.pieces

    def _begin(
        self,
        loss: Tensor,
        items: Any,
        last: bool | None,
        label: str | None,
        error: str | None,
        in_place: bool,
        amp_scaled: bool,
    ) -> Tensor:
        """Weigh ``loss`` and keep the pending micro-batch: the loss to back-propagate."""
        if self._pending is not None:
            raise RuntimeError(
                "`begin_micro_batch` was called twice without `end_micro_batch` after the backward between."
            )
        self.begin_backward()
        count = self.weigh(items, loss_dtype=loss.dtype, label=label, error=error)
        weighted = self._weighting.weighted
        # recorded as back-propagated, before its weight: a loss about to be weighted in place needs a copy
        recorded = loss.detach().clone() if in_place and weighted else loss.detach()
        if not amp_scaled and self._scale.scaler is not None:
            recorded = self._scale.scaler.scale(recorded)  # a multiply on the device: no sync
        to_backward = count.weigh_loss(loss, in_place=in_place) if weighted else loss
        last = self._window.micro_batches + 1 >= self._accumulation_steps if last is None else last
        self._pending = PendingMicroBatch(count, recorded, last)
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
        if pending.pieces is not None and self._noise.watching:  # the last piece's norms
            pending.pieces.measured()
        self.record(pending.count, pending.loss, reevaluation=reevaluation)
        if pending.last and self._scale.scaler is not None:
            self.flush_to_grad()  # the scaler unscales and checks `.grad`

    @property
    def uses_last(self) -> bool:
        """Whether :meth:`begin_micro_batch` acts on ``last`` (else a caller may skip computing it)."""
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
        if self._grad_hooks is not None:  # what the hooks took is in the buffers; what not, `.grad` holds
            self._grad_hooks.armed = False
        window = self._window
        count = items if isinstance(items, ItemCount) else self.weigh(items)
        if count.problem is not None or count.check is not None:
            window.tally.note(count.problem, count.check)
        to_buffers = window.new_gradients_to_buffers
        keep = self._intake.absorb(window, count) if to_buffers and self._intake is not None else None
        window.tally.record(count.items, loss, keep, count.weight if self._weighting.weighted else None)
        if self._measures_noise:
            self._noise.record_micro_batch(
                count.items, count.weight, self._scale.value, reevaluation=reevaluation
            )
        window.record_micro_batch(in_buffers=to_buffers)
        if not reevaluation:  # a re-evaluation of the same micro-batch counts once
            self._statistics.total_micro_batches += 1

    def flush_to_grad(self) -> None:
        """Write the buffered window into ``.grad`` so that the next backward adds to it (once per window).

        Before the backward DDP synchronizes (its one all-reduce carries the whole window), or before a
        GradScaler unscales ``.grad``; with ``reduce_gradients`` averaged over ranks first.
        """
        if self._buffers is not None and self._window.flush():
            if self._reduce_gradients:
                self._buffers.average_window(self._world)
            self._buffers.write_to_grads()
        self._arm_hooks(False)  # the sum is in `.grad` now: the next gradients add to it there

    # ---------------------------------------------------------------------------------------- boundary

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
            on_device: Decide with no host read, for an optimizer that skips a step itself (torch's fused
                ones: :mod:`~lightning_gradacc.core.torch_internals`): the verdict is :attr:`device_step`'s
                ``found_inf`` (1.0 where the host would skip), which the step must be given; an invalid count
                raises at the next read of the statistics. Not with ``overflow="raise"`` or a ``grad_scaler``.
            fold_multiplier: With ``on_device``, hand the multiplier to the step as ``grad_scale`` instead of
                a multiply pass, where nothing reads ``.grad`` before the step (not with ``clip_value``,
                ``clip_scope="parameter"`` or buffers, which are multiplied in their own dtype first).

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
        if on_device:
            self._end.check_on_device()
        if window.empty:  # nothing recorded: no step (e.g. stale gradients of an earlier window dropped)
            self._tracked.set_grads_to_none()
            self._statistics.close_empty_window(reevaluation=reevaluation)
            window.close()
            self._window = self._new_window()
            return False
        try:
            ranks = self._world.resolve()  # once per boundary: `torch.distributed` asked once
            if ranks[0] == 1 and not (on_device or read_statistics or reevaluation):
                stepped_plainly = self._end.close_plain(window, full=self.window_full)
                if stepped_plainly is not None:
                    return stepped_plainly
            stepped, self.device_step = self._end.close(
                window,
                ranks=ranks,
                full=self.window_full,
                reevaluation=reevaluation,
                read_statistics=read_statistics,
                on_device=on_device,
                fold_multiplier=fold_multiplier,
            )
            return stepped
        finally:
            window.close()
            self._window = self._new_window()

    def reset(self, *, set_grads_to_none: bool = True) -> None:
        """Discard the open window (its buffers, and its gradients by default); lifetime counters are kept."""
        self._window.close()
        self._window = self._new_window()
        self._noise.discard()
        self._pending = None
        if set_grads_to_none:
            self._tracked.set_grads_to_none()

    # what it cannot show: nothing (see `WindowDriver.absent`); a checkpoint holds its open window
    absent: frozenset[str] = frozenset()
    saves_open_window = True

    def remove_hooks(self) -> None:
        """Remove the gradient hooks (``noise_scale=True``, ``accumulate_in_backward``).

        Call it when the accumulator is replaced or training ends (a dropped one's hooks do nothing but stay
        until it is garbage-collected). A window opened afterwards hooks the parameters again.
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

    def ride(self, values: Mapping[str, float]) -> None:
        """Sum ``values`` over the ranks in the next window's all-reduce (no other); see :attr:`ridden`."""
        self._end.riders = {name: float(value) for name, value in values.items()}

    @property
    def ridden(self) -> dict[str, float]:
        """The last window's :meth:`ride` values by name, summed over the ranks (syncs if the step didn't)."""
        ridden = self._end.ridden
        values = ridden.tolist() if isinstance(ridden, Tensor) else ridden
        return {name: float(v) for name, v in zip(self._end.rider_names, values, strict=True)}

    def statistic(self, name: str) -> float:
        """One statistic of :attr:`stats` by name, on the host (syncs if the step did not, nothing else)."""
        return self._statistics.value(name)

    @property
    def window_loss(self) -> float:
        """Item-weighted mean loss of the last window, over ranks (``nan`` if no loss was recorded)."""
        return self._statistics.window_loss

    def state_dict(self) -> dict[str, Any]:
        """Counters as plain numbers (loadable with ``torch.load(weights_only=True)``)."""
        return stamp(
            {
                **self._statistics.state_dict(),
                "noise": self._noise.state_dict(),
                # between windows too: the next window's weights are relative to it (a resume rebases nothing)
                "weighting": self._weighting.state_dict(),
            }
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore counters saved by :meth:`state_dict`; nothing changes if they do not fit."""
        check_format(state, "accumulator state")
        self._statistics.check_state(state)
        noise = state.get("noise")
        if noise is not None:
            self._noise.load_state_dict(noise)  # the averages go on where the saved run left them
        self._statistics.load_state_dict(state)
        weighting = state.get("weighting")
        if weighting is not None:
            self._weighting.load_state_dict(weighting)

    # ---------------------------------------------------------------------------------- open window

    def window_state_dict(self) -> dict[str, Any] | None:
        """The open window (its summed gradients and counters), or ``None`` between windows.

        Under data parallelism a collective (summed over ranks): every rank must call it. Syncs with the
        device (checkpoint time only). See :class:`~lightning_gradacc.core.checkpoint.WindowCheckpoint`.
        """
        return self._checkpoint.state_dict(self._window)

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
        self._checkpoint.check(state)
        self.reset(set_grads_to_none=True)
        self._checkpoint.load_state_dict(state, self._window, primary=primary)


GradAccumulator.__doc__ = with_setting_docs(GradAccumulator.__doc__)
