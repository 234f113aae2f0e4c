"""WindowEnd: the end of a window, in five steps, from its summed gradients to the step's verdict.

1. **sums**: the window's sum per parameter (``.grad``, or the buffers averaged over ranks under
   ``reduce_gradients``), as local tensors grouped by (device, dtype), with the shard group of each sharded
   one.
2. **measure**: the window's declared quantities (and the noise scale's totals) summed over ranks in one
   small all-reduce; each tensor's norm in one ``_foreach_norm`` per group, combined over shards. When a
   decision needs the host (``overflow="skip"``, ``"raise"``, ``"skip_micro_batch"``), the measurement is
   copied in one sync together with the statistics waiting on the device, and the norms are combined on the
   host; otherwise everything stays on the device.
3. **decide**: the contract's normalization and the decision (finite, clip coefficient, one multiplier per
   window or per tensor), on host numbers or device scalars alike (:mod:`~lightning_gradacc.core.boundary`).
4. **account**: the statistics folded into the run's statistics, the weighted reference rebased, and the
   verdict: raise for invalid counts or ``overflow="raise"``, else whether the optimizer steps, a host bool or
   (decided on the device) a float32 ``found_inf`` for a fused step.
5. **keep or skip**: multiply (and clamp) in place with ``_foreach_mul_``, buffers written back to ``.grad``
   once; or every ``.grad`` set to ``None``, so that torch optimizers leave parameters and state unchanged;
   or, for a fused step, the multiplier handed to it as ``grad_scale``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .boundary import EPS, Decision, Norms, apply_, combine_on_host, decide
from .buffers import GradBuffers
from .kernels import GroupKey, combine_norms, non_finite_names
from .noise import TOTALS as NOISE_TOTALS
from .noise import NoiseScale, NoNoiseScale
from .parameters import TrackedParameters
from .scalars import Flag, Scalar, as_scalar, both, either, negate
from .settings import AccumulationSettings
from .statistics import RunStatistics
from .torch_internals import DeviceStep, device_has_foreach
from .weighting import GradientScale, ItemWeighting
from .window import LOSS, SUMMED, Measurement, Packet, Window, mean_loss
from .world import AllReduce


class GradientOverflowError(RuntimeError):
    """Raised by the ``overflow="raise"`` policy when an accumulated gradient is not finite.

    Attributes:
        step: Index of the optimizer step (0-based count of finished windows) that overflowed.
        parameter_names: Names of up to five parameters whose gradient holds ``nan`` or ``inf``.
    """

    def __init__(self, step: int, parameter_names: list[str]) -> None:
        self.step = step
        self.parameter_names = parameter_names
        names = ", ".join(f"`{name}`" for name in parameter_names) or "(none found after reduction)"
        super().__init__(
            f"Non-finite gradient at optimizer step {step} in {names}. The optimizer step was not taken."
            " Lower the learning rate, check the data of this window, or use `overflow='skip'` to drop"
            " such windows."
        )


@dataclass(slots=True)
class _Sums:
    """The window's summed gradients: per tracked parameter (``None``: none), and grouped for kernels."""

    sources: list[Tensor | None]
    grouped: dict[GroupKey, list[Tensor]]
    shard_groups: list[Any] | None  # in group order, the process group of each sharded tensor


def _stacked(scalars: list[Tensor], device: torch.device) -> Tensor:
    """One vector of scalars (empty when there are none)."""
    return torch.stack(scalars) if scalars else torch.zeros(0, device=device)


# the largest finite total norm in the dtype norms are combined in (beyond: `inf`, as on the device)
_LARGEST = {dtype: torch.finfo(dtype).max for dtype in (torch.float32, torch.float64)}


@dataclass
class WindowEnd:
    """The five steps of a window's end, over the accumulator's parts (see the module).

    Attributes:
        settings: The math settings.
        tracked: The parameters.
        buffers: The accumulation buffers, if any.
        scale: The loss and AMP scale the gradients carry.
        statistics: The run's statistics, which each window is folded into.
        noise: The noise scale (or its stand-in doing nothing).
        weighting: The item weighting, rebased after each window.
        reduce_buffers: Averages the buffered window over the ranks (``reduce_gradients``), else ``None``.
        foreach: As in ``torch.nn.utils.clip_grad_norm_``.
        dtype: The dtype of the window's totals.
        riders: Host numbers by name to sum over the ranks with the next window's totals
            (``GradAccumulator.ride``).
        ridden: The last window's riders summed over the ranks (a device vector until the statistics sync),
            in the order of ``rider_names``.
        rider_names: Their names.
    """

    settings: AccumulationSettings
    tracked: TrackedParameters
    buffers: GradBuffers | None
    scale: GradientScale
    statistics: RunStatistics
    noise: NoiseScale | NoNoiseScale
    weighting: ItemWeighting
    reduce_buffers: Callable[[], None] | None
    foreach: bool | None
    dtype: torch.dtype
    riders: dict[str, float] = field(default_factory=dict)
    ridden: Tensor | list[float] = field(default_factory=list)
    rider_names: tuple[str, ...] = ()
    plain: bool = field(init=False)  # the settings and parts let a window end in its plain form

    def __post_init__(self) -> None:
        settings = self.settings
        self.plain = (
            self.buffers is None
            and self.reduce_buffers is None
            and isinstance(self.noise, NoNoiseScale)
            and self.scale.scaler is None
            and settings.clip_value is None
            and settings.clip_scope == "global"
            and settings.norm_type == 2.0
            and not settings.per_micro_batch
            and settings.overflow in ("skip", "raise")
            and self.foreach is not False
            and device_has_foreach(self.tracked.device.type)
        )

    @property
    def device(self) -> torch.device:
        """Where the window's scalars live."""
        return self.tracked.device

    def check_on_device(self) -> None:
        """Refuse a decision on the device where the host must decide.

        Raises:
            ValueError: ``overflow="raise"`` (it raises at the step) or a ``grad_scaler`` (it skips itself).
        """
        if self.settings.overflow == "raise" or self.scale.scaler is not None:
            given = (
                "a GradScaler" if self.scale.scaler is not None else f"overflow={self.settings.overflow!r}"
            )
            raise ValueError(
                f"`finalize(on_device=True)` cannot decide on the device with {given}: `overflow='raise'`"
                " raises at the step, and a GradScaler skips the step itself."
            )

    def close_plain(self, window: Window, *, full: bool) -> bool | None:
        """End a window in its plain form, with the least Python: ``None`` where it does not apply.

        The default window's end (one process, gradients in ``.grad`` in one dtype, numbers counted on the
        host, no clipping by value or per parameter, no noise scale, a host decision) needs the total norm,
        its finiteness and one host read; the statistics are folded as host numbers in one call. What is not
        plain, or turns out not to be (a non-finite or empty window), takes :meth:`close`, from its start
        (nothing is changed before): the same arithmetic, the same result.
        """
        tally, tracked = window.tally, self.tracked
        if not self.plain or tally.on_device or tally.problems or self.riders or tracked.sharded:
            return None
        groups = tracked.grad_groups
        if len(groups) != 1:
            return None
        ((_, dtype),) = groups
        grads = [param.grad for _, param in tracked.named if param.grad is not None]
        if not grads or grads[0].requires_grad:  # nothing to step, or `create_graph`: the general path
            return None
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        try:
            each = torch._foreach_norm(grads, 2.0, dtype=wide)
        except (NotImplementedError, RuntimeError):  # a sparse gradient (torch 2.13 raises the first, 2.14
            return None  # the second): the general path says what is wrong
        values = torch.stack(each).tolist()  # the one host read
        total = math.hypot(*values)  # `combine_on_host`'s, for finite norms within the dtype
        if not total <= _LARGEST[wide]:
            total = combine_on_host(values, 2.0, wide)  # nan, or inf (beyond the dtype too)
        settings, host = self.settings, tally.host
        mode, micro_batches = settings.mode, window.micro_batches
        factor: float = mode.factor(  # type: ignore[assignment]  # host numbers: a number
            micro_batches,
            dropped=0.0,
            weights=host["weights"],
            loss_scale=self.scale.loss_scale,
            world_size=1,
        )
        norm = total * factor
        finite = norm - norm == 0.0  # neither nan nor inf, without a call
        has_items = host["weights"] > 0 if mode.weighted else True
        multiplier, clipped = factor, False
        if settings.max_grad_norm is not None and finite:
            coefficient = min(settings.max_grad_norm / (norm + EPS), 1.0)
            clipped, multiplier = coefficient < 1.0, coefficient * factor
        items, gradient_scale = host["items"], self.scale.loss_scale

        def window_loss() -> Scalar:  # computed only if it is read before the next window closes
            return mean_loss(*tally.loss_totals(), gradient_scale)

        folded = self.statistics.close_plain_window(
            norm,
            items,
            window_loss,
            non_finite=not finite,
            skipped=not finite and has_items and settings.overflow == "skip",
            empty=not has_items,
            clipped=clipped,
            full=full,
            micro_batches=micro_batches,
        )
        if not folded:
            return None  # earlier windows' values wait on the device: the general path folds them
        self.weighting.rebase(items, micro_batches)
        if not (finite and has_items):
            if has_items and settings.overflow == "raise":
                named = [(n, t) for n, t in zip(tracked.names, tracked.grads(), strict=True) if t is not None]
                raise GradientOverflowError(self.statistics.windows - 1, non_finite_names(named))
            tracked.set_grads_to_none()
            return False
        if multiplier != 1.0:  # a scalar tensor on a CPU is up to 3x faster there (see `kernels._scale`)
            on_cpu = grads[0].device.type == "cpu"
            torch._foreach_mul_(grads, torch.full((), multiplier, dtype=wide) if on_cpu else multiplier)
        return True

    def close(
        self,
        window: Window,
        *,
        ranks: tuple[int, AllReduce | None],
        full: bool,
        reevaluation: bool,
        read_statistics: bool,
        on_device: bool,
        fold_multiplier: bool,
    ) -> tuple[bool, DeviceStep | None]:
        """End a window that holds micro-batches: its gradients made final in place, or dropped.

        Args:
            window: The window (not empty).
            ranks: The world size and all-reduce of this boundary.
            full: Whether the window holds K micro-batches.
            reevaluation: See :meth:`GradAccumulator.finalize`.
            read_statistics: See :meth:`GradAccumulator.finalize`.
            on_device: See :meth:`GradAccumulator.finalize`.
            fold_multiplier: See :meth:`GradAccumulator.finalize`.

        Returns:
            Whether the optimizer steps, and the step's device tensors when decided on the device.

        Raises:
            GradientOverflowError: ``overflow="raise"`` and the gradient is not finite.
            ValueError: an item count of the window, on this rank or another, was invalid.
        """
        on_host = self.scale.scaler is None and self.settings.overflow != "ignore" and not on_device
        sums = self._sums(window)
        measured, norms = self._measure(window, sums, ranks[1], read_statistics, on_host)
        self.ridden = measured.riders if measured.riders is not None else []
        factor, decision = self._decide(window, measured, norms, ranks[0])
        verdict = self._account(
            window, measured, decision, factor, sums, full, ranks[0], reevaluation, on_device
        )
        if verdict is False:
            self.tracked.set_grads_to_none()
            return False, None
        step: DeviceStep | None = None
        if verdict is not True:  # a device flag: the step skips itself
            multiplier = decision.multiplier
            if (
                fold_multiplier
                and not isinstance(multiplier, list)
                and not window.sums_in_buffers
                and self.settings.clip_value is None
            ):  # the step divides by it: no multiply pass here
                return True, DeviceStep(verdict, self._reciprocal(multiplier))
            step = DeviceStep(verdict)
        apply_(sums.grouped, decision, clip_value=self.settings.clip_value, foreach=self.foreach)
        if window.sums_in_buffers:
            assert self.buffers is not None
            del sums  # its lists hold every buffer: each is released as its gradient is written
            self.buffers.write_to_grads()  # one rounding to the parameters' dtype, at the end
        return True, step

    # ------------------------------------------------------------------------------------- 1. sums

    def _sums(self, window: Window) -> _Sums:
        """The window's sums per tracked parameter, grouped by (device, dtype) as local tensors.

        Sharded gradients (``DTensor``) are replaced by their local shards, worked on in place.
        """
        tracked = self.tracked
        if window.sums_in_buffers:
            assert self.buffers is not None
            if self.reduce_buffers is not None:
                self.reduce_buffers()
            sources = self.buffers.window()  # dense by construction
        else:
            sources = tracked.grads()
            for name, tensor in zip(tracked.names, sources, strict=True):
                if tensor is not None and tensor.is_sparse:
                    raise TypeError(f"Sparse gradients are not supported (parameter `{name}`).")
        grouped, shard_groups = tracked.local_layout(sources, in_buffers=window.sums_in_buffers)
        return _Sums(sources, grouped, shard_groups)

    # ---------------------------------------------------------------------------------- 2. measure

    def _measure(
        self, window: Window, sums: _Sums, all_reduce: AllReduce | None, read_statistics: bool, on_host: bool
    ) -> tuple[Measurement, Norms]:
        """Norms and totals of the window over ranks, as host numbers or device scalars.

        On the host after the step's one sync when the decision is made there (everything else the step
        needs comes along in it); device scalars otherwise.
        """
        settings, tracked, device = self.settings, self.tracked, self.device
        measured = self._totals(window, all_reduce, read_statistics)
        grads, groups = sums.grouped, sums.shard_groups
        each = tracked.tensor_norms(grads, settings.norm_type, groups)
        each_largest: list[Tensor] | None = None  # each tensor's largest element, for clip_value
        if settings.clip_value is not None:
            each_largest = (
                each if settings.norm_type == math.inf else tracked.tensor_norms(grads, math.inf, groups)
            )
        if measured.noise is not None and settings.norm_type != 2.0:  # the noise scale needs the L2 norm
            measured.l2_norm = combine_norms(tracked.tensor_norms(grads, 2.0, groups), 2.0, device=device)
        if not on_host:
            per_tensor = settings.clip_scope == "parameter" and settings.max_grad_norm is not None
            norms = Norms.on_device(
                each, settings.norm_type, each_largest, device=device, keep_per_tensor=per_tensor
            )
            return measured, norms
        # Each tensor's norm goes to the host, where they are combined: no kernel for the total.
        measured.tensor_norms = _stacked(each, device)
        if each_largest is not None:
            measured.tensor_largest = _stacked(each_largest, device)
        measured.to_host(self.statistics.sync)
        wide = torch.float64 if any(dtype == torch.float64 for _, dtype in grads) else torch.float32
        norms = Norms.on_host(
            measured.tensor_norms,  # type: ignore[arg-type]
            settings.norm_type,
            measured.tensor_largest if settings.clip_value is not None else None,  # type: ignore[arg-type]
            dtype=wide,
        )
        return measured, norms

    def _totals(self, window: Window, all_reduce: AllReduce | None, read_statistics: bool) -> Measurement:
        """The window's totals and noise-scale totals, summed over ranks (one small all-reduce).

        Alone (no all-reduce), the loss totals are computed only if they will be read.
        """
        totals = window.tally.totals(with_loss=all_reduce is not None)
        noise = self.noise.close_window(self.tracked)
        riders: Tensor | list[float] | None = list(self.riders.values()) if self.riders else None
        rider_names = tuple(self.riders)
        if all_reduce is not None:  # the declared packet, the riders and the noise scale's totals, one call
            packet = Packet()
            packet.scalars("window", SUMMED, [self._scalar(totals[name]) for name in SUMMED])
            if rider_names:
                packet.scalars("riders", rider_names, [self._scalar(v) for v in self.riders.values()])
            if noise is not None:
                packet.vector("noise", NOISE_TOTALS, noise)
            parts = packet.reduce(all_reduce)
            totals.update(zip(SUMMED, parts["window"].unbind(), strict=True))
            riders, noise = parts.get("riders"), parts.get("noise")
        elif read_statistics:
            totals.update(zip(LOSS, window.tally.loss_totals(), strict=True))
        self.riders = {}
        self.rider_names = rider_names
        return Measurement(totals, noise=noise, riders=riders)

    def _scalar(self, value: Scalar) -> Tensor:
        """A scalar on the totals' device, created by a fill kernel (no host-to-device copy)."""
        return as_scalar(value, self.device, self.dtype)

    # ----------------------------------------------------------------------------------- 3. decide

    def _decide(
        self, window: Window, measured: Measurement, norms: Norms, world_size: int
    ) -> tuple[Scalar, Decision]:
        """The normalization factor, and what it and clipping make of the window's sum."""
        settings = self.settings
        factor = settings.mode.factor(
            window.micro_batches,
            dropped=measured.totals["dropped"],
            weights=measured.totals["weights"],
            loss_scale=self.scale.loss_scale,
            world_size=world_size,
        )
        decision = decide(
            norms,
            factor,
            # clip_mode="micro_batch" clipped each micro-batch: a sum of them is not clipped again
            max_norm=settings.max_grad_norm if settings.clip_mode == "step" else None,
            clip_scope=settings.clip_scope,  # type: ignore[arg-type]
            clip_value=settings.clip_value,
        )
        return factor, decision

    # ---------------------------------------------------------------------------------- 4. account

    def _account(
        self,
        window: Window,
        measured: Measurement,
        decision: Decision,
        factor: Scalar,
        sums: _Sums,
        full: bool,
        world_size: int,
        reevaluation: bool,
        on_device: bool,
    ) -> bool | Tensor:
        """Fold the window into the statistics and say whether the optimizer steps (see :meth:`_verdict`)."""
        settings, scale, totals = self.settings, self.scale, measured.totals
        has_items: Flag = totals["weights"] > 0 if self.weighting.weighted else True
        live = both(decision.finite, totals["dropped"] < window.micro_batches)
        skips = scale.scaler is not None or settings.overflow in ("skip", "skip_micro_batch")
        gradient_scale = scale.value()
        window_loss: Scalar | Callable[[], Scalar]
        if totals["loss_sum"] is not None and totals["loss_weight"] is not None:
            window_loss = mean_loss(totals["loss_sum"], totals["loss_weight"], gradient_scale)
        else:  # computed only if it is read before the next window closes

            def window_loss() -> Scalar:
                return mean_loss(*window.tally.loss_totals(), gradient_scale)

        self.statistics.close_window(
            {
                "non_finite_windows": negate(decision.finite),
                "dropped_micro_batches": totals["dropped"],
                "skipped_steps": both(negate(live), has_items) if skips else False,
                "empty_windows": negate(has_items),
                "clipped_steps": either(decision.clipped, totals["micro_clips"] > 0),
                "last_grad_norm": decision.norm,
                "items_last_step": totals["items"],
                "items_seen": totals["items"],
                **({"items_last_full_step": totals["items"]} if full else {}),
                "window_loss": window_loss,
                **self.noise.statistics(
                    measured.noise,
                    decision.norm,
                    l2_norm=measured.l2_norm,
                    factor=factor,
                    micro_batches=window.micro_batches,
                    summed=settings.mode.summed,
                    items=totals["items"],
                ),
            },
            micro_batches=window.micro_batches,
            reevaluation=reevaluation,
        )
        self.weighting.rebase(totals["items"], window.micro_batches * world_size)
        if on_device:
            return self._found_inf(
                window, live if settings.overflow != "ignore" else True, has_items, measured
            )
        return self._verdict(window, live, has_items, totals["bad_items"], sums, reevaluation)

    def _verdict(
        self, window: Window, live: Flag, has_items: Flag, bad_items: Scalar, sums: _Sums, reevaluation: bool
    ) -> bool:
        """Whether the optimizer steps, on the host; raises for invalid counts or ``overflow="raise"``."""
        settings, scaler = self.settings, self.scale.scaler
        flags = (live if scaler is None and settings.overflow != "ignore" else True, has_items, bad_items)
        if any(isinstance(flag, Tensor) for flag in flags):  # counts summed over ranks, overflow ignored
            keeps_step, has_any, bad = self.statistics.sync(*(self._scalar(flag) for flag in flags))
        else:
            keeps_step, has_any, bad = (float(flag) for flag in flags)
        if bad:
            raise ValueError(self._invalid_count_message(window, int(bad)))
        if has_any and not keeps_step and settings.overflow == "raise" and scaler is None:
            step = self.statistics.windows - (0 if reevaluation else 1)
            named = [(n, t) for n, t in zip(self.tracked.names, sums.sources, strict=True) if t is not None]
            raise GradientOverflowError(step, non_finite_names(named))
        return bool(keeps_step and has_any)

    def _found_inf(self, window: Window, live: Flag, has_items: Flag, measured: Measurement) -> Tensor:
        """The window's verdict as a device ``found_inf``; an invalid count found on the device is held.

        A count known bad on the host raises now (on every rank alike: the counts were summed over ranks);
        one found on the device skips the step and raises at the next read of the statistics.
        """
        bad_items = measured.totals["bad_items"]
        if not isinstance(bad_items, Tensor) and bad_items:
            raise ValueError(self._invalid_count_message(window, int(bad_items)))
        keep = both(live, has_items)
        if isinstance(bad_items, Tensor):
            keep = both(keep, bad_items == 0)
            step = self.statistics.windows - 1
            self.statistics.hold_check(bad_items, lambda count: _held_count_message(step, count))
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

    @staticmethod
    def _invalid_count_message(window: Window, count: int) -> str:
        found = window.tally.invalid_counts()
        where = "; ".join(problem.rstrip(".") for problem in found) if found else "on another rank"
        return (
            f"{count} invalid item count(s) in this window: {where}. An item count must be a finite number"
            " >= 0 (a micro-batch with 0 items weighs nothing); check `item_count_fn` or the `items` given."
        )


def _held_count_message(first_step: int, count: int) -> str:
    return (
        f"{count} invalid item count(s) in the windows since optimizer step {first_step} (the"
        " statistics' last read), found on the device; the steps with them were skipped. An item count"
        " must be a finite number >= 0 (a micro-batch with 0 items weighs nothing); check"
        " `item_count_fn` or the `items` given."
    )
