"""The gradient noise scale of a window: which batch size the run actually needs.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", arXiv:1812.06162, Appendix A):
the mean gradient G_B of B i.i.d. items has E|G_B|² = |G|² + tr(Σ)/B, with G the true gradient and Σ
the covariance of one item's gradient. The simple noise scale B_simple = tr(Σ)/|G|² predicts the critical
batch size: below it a larger batch buys an almost linear speed-up, far above it steps are wasted.

A window holds two batch sizes at once. Micro-batch i (b_i items, mean gradient g_i) has
E|g_i|² = |G|² + tr(Σ)/b_i. The window's gradient G_W = Σ w_i g_i (``"mean"``: w_i = 1/n; ``"weighted"``:
w_i = b_i/B) has E|G_W|² = |G|² + tr(Σ)·β_W with β_W = Σ w_i²/b_i (independent micro-batches). With the
item-weighted mean of the small norms, S = Σ b_i|g_i|² / Σ b_i, whose expectation is |G|² + tr(Σ)·β_S with
β_S = n / Σ b_i, the two equations give unbiased per-window estimates:

    tr(Σ) ≈ (S - |G_W|²) / (β_S - β_W),        |G|² ≈ |G_W|² - β_W · tr(Σ).

For n equal micro-batches of b items these are tr(Σ) ≈ b·n·(S - |G_W|²)/(n - 1) and
|G|² ≈ (n·|G_W|² - S)/(n - 1). Per-window estimates are noisy and may be negative; they are averaged
separately (bias-corrected exponential averages) before their ratio is taken.

The small norms come from a gradient hook on each parameter: it sees the backward's incoming gradient
before it is added to ``.grad`` (before DDP reduces it) and takes its norm at once, a device scalar (no
host sync, and no gradient kept alive: ``register_multi_grad_hook`` would hold every incoming gradient
until the last one arrives, up to one gradient of extra memory). The scales the gradient carries (item
weight, loss scale 1/K, AMP scale) are divided out when the micro-batch is recorded.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .grad_hooks import WeakHook, remove_handles, same_tensors
from .parameters import TrackedParameters
from .scalars import Flag, Scalar, both, is_finite
from .shards import _dtensor_type, fsdp2_modules
from .torch_internals import fsdp2_unsharded_params


def _select(ok: Flag, new: Scalar, old: Scalar) -> Scalar:
    """``new`` where ``ok`` else ``old``: a host flag picks without a kernel, a device one without a sync."""
    if not isinstance(ok, Tensor):
        return new if ok else old
    return torch.where(ok, new, old)


@dataclass(frozen=True)
class NoiseEstimate:
    """One window's unbiased estimates (``nan`` when the window cannot give one) and the smoothed ratio."""

    grad_sq_norm: Scalar  # |G|², the squared norm of the true gradient
    trace_sigma: Scalar  # tr(Σ), the summed variance of one item's gradient
    noise_scale: Scalar  # smoothed tr(Σ) / smoothed |G|², in items


def estimate(
    small: Scalar, small_weight: Scalar, small_count: Scalar, big_sq_norm: Scalar, beta_big: Scalar
) -> tuple[Scalar, Scalar]:
    """Per-window estimates of |G|² and tr(Σ) (see the module's docstring).

    Args:
        small: Σ b_i |g_i|² over the measured micro-batches (all ranks; any subset of the window's).
        small_weight: Σ b_i over the same micro-batches.
        small_count: How many.
        big_sq_norm: |G_W|², the squared norm of the window's (mean) gradient before clipping.
        beta_big: β_W = Σ w_i² / b_i for the window's weights w_i.

    Returns:
        (|G|², tr(Σ)); ``nan`` where none was measured, β_S <= β_W, or the norms are not finite.

    Example:
        Two micro-batches of 1 item with gradients 1 and 3: |G|² ≈ 1.0, tr(Σ) ≈ 2.0.

        >>> estimate(small=1.0 + 9.0, small_weight=2.0, small_count=2.0, big_sq_norm=4.0, beta_big=0.5)
        (3.0, 2.0)
    """
    mean_small = small / small_weight if not _is_zero(small_weight) else math.nan
    beta_small = small_count / small_weight if not _is_zero(small_weight) else math.nan
    gap = beta_small - beta_big
    usable = small_count >= 1
    if isinstance(gap, Tensor) or isinstance(mean_small, Tensor) or isinstance(big_sq_norm, Tensor):
        gap_t = torch.as_tensor(gap)
        ok = (gap_t > 0) & usable  # a device bool either way: both operands of `where` are tensors
        trace = torch.where(ok, (mean_small - big_sq_norm) / torch.where(ok, gap_t, 1.0), math.nan)
        return big_sq_norm - beta_big * trace, trace
    if not usable or not gap > 0:
        return math.nan, math.nan
    trace_value = (mean_small - big_sq_norm) / gap
    return big_sq_norm - beta_big * trace_value, trace_value


def _is_zero(value: Scalar) -> bool:
    return not isinstance(value, Tensor) and value == 0


# The per-window totals, summed over ranks: what S and the two β need (a vector in this order, read by name).
TOTALS = (
    "measured_small",  # Σ b|g|² over the measured micro-batches
    "measured_items",  # Σ b over them
    "measured",  # how many
    "micro_batches",  # every micro-batch in the window's gradient
    "inverse_items",  # Σ 1/b over them (β_W of "mean")
    "unusable",  # > 0: the window cannot be measured (see `record`)
)
_SMALL = TOTALS.index("measured_small")  # where the device sums of the measured micro-batches go


class NoiseScale:
    """Collects the micro-batch norms of each window and keeps the smoothed estimates.

    A micro-batch is *measured* when its backward fired each hooked parameter's hook once (between
    :meth:`begin_backward` and :meth:`record`); any item-weighted subset of micro-batches gives an
    unbiased S, so an unmeasured one (re-entrant checkpointing of a shared weight fires a hook per
    segment; a gradient added without a backward) only leaves it out of S. The window's gradient still
    holds every micro-batch, so β_W counts them all. A window is *unusable* (no estimate) when that
    count is incomplete: micro-batches restored from a checkpoint that did not save their totals
    (:meth:`window_state`: older saves), a micro-batch of 0 items under
    ``"mean"``/``"sum"`` (its gradient is 0, not a mean), item counts known for some micro-batches only,
    or parameters that started to require a gradient inside the window.

    Args:
        decay: Of the exponential averages (0.95: about the last 20 measured steps count).
        device: Where the per-micro-batch scalars live.
        dtype: Their dtype (float64, or float32 where the device has none).
        weighted: Whether windows weight micro-batches by items (``"weighted"``), else equally.

    Example:
        >>> weight = torch.nn.Parameter(torch.zeros(2))
        >>> noise = NoiseScale(0.9, torch.device("cpu"), torch.float64)
        >>> noise.watch([weight])
        >>> noise.begin_backward()
        >>> (weight * torch.tensor([1.0, 3.0])).sum().backward()
        >>> noise.record(items=1.0, weight=1.0, scale=1.0)
        >>> totals = dict(zip(TOTALS, noise.window_totals().tolist()))
        >>> round(totals["measured_small"], 4), totals["micro_batches"]  # Σ b |g|²: 1 item, |g|² = 1 + 9
        (10.0, 1.0)
        >>> noise.remove_hooks()
    """

    def __init__(
        self,
        decay: float,
        device: torch.device,
        dtype: torch.dtype,
        *,
        weighted: bool = False,
        hook_targets: Callable[[Sequence[Tensor]], list[Tensor | None]] | None = None,
    ) -> None:
        self.decay = decay
        self.device = device
        self.dtype = dtype
        self.weighted = weighted
        # what to hook for each parameter: itself, or FSDP2's unsharded twin (None: not there yet)
        self._hook_targets = hook_targets or list
        self._waiting: tuple[Tensor, ...] | None = None  # parameters whose twins did not exist yet
        self._handles: list[Any] = []  # mutated in place: the finalizer below holds this list
        self._finalizer = weakref.finalize(self, remove_handles, self._handles)
        self._watched: tuple[Tensor, ...] = ()
        self._unit_missing = False  # this window's counts are missing (`items=None`: micro-batch units)
        self._unusable = False  # this window cannot be measured (see the class docstring)
        self.discard()
        self.average_grad_sq_norm: Scalar = 0.0  # exponential averages, not yet bias-corrected
        self.average_trace_sigma: Scalar = 0.0
        self.average_weight: Scalar = 0.0  # their bias correction: 1 - decay**updates

    # ------------------------------------------------------------------------------ per micro-batch

    def watch(self, params: Sequence[Tensor]) -> None:
        """Hook the parameters that require a gradient (again, if the set changed).

        A window already open then becomes unusable: its earlier micro-batches were measured on others, and
        so was a backward that ran since the last record (its micro-batch is recorded next). A parameter
        whose hook target does not exist yet (FSDP2's unsharded twin, made at the first forward) is watched
        when the next backward begins.
        """
        wanted = tuple(p for p in params if p.requires_grad)
        targets = self._hook_targets(wanted)
        if any(target is None for target in targets):
            self._waiting = wanted
            self._unusable = True  # its micro-batches so far went unmeasured
            return
        self._waiting = None
        watched = tuple(target for target in targets if target is not None)
        if same_tensors(watched, self._watched):
            return
        if self._micro_batches_recorded or self._fired:
            self._unusable = True
        remove_handles(self._handles)
        self._watched = watched
        self._handles.extend(
            param.register_hook(WeakHook(self._on_gradient, index))  # type: ignore[no-untyped-call]
            for index, param in enumerate(watched)
        )

    def stale(self, params: Sequence[Tensor]) -> bool:
        """Whether the parameters requiring a gradient are not the ones hooked (one host pass, no sync)."""
        if not self._handles:
            return False
        targets = self._hook_targets(tuple(p for p in params if p.requires_grad))
        return any(t is None for t in targets) or not same_tensors(tuple(targets), self._watched)  # type: ignore[arg-type]

    @property
    def watching(self) -> bool:
        """Whether the hooks are in place."""
        return bool(self._handles)

    def remove_hooks(self) -> None:
        """Remove the gradient hooks (a replaced accumulator must not keep measuring)."""
        remove_handles(self._handles)
        self._watched, self._waiting = (), None

    def begin_backward(self) -> None:
        """A micro-batch's backward starts: forget norms from other passes.

        E.g. ``torch.autograd.grad`` with respect to the parameters in ``training_step`` (a gradient
        penalty) fires the hooks too.
        """
        if self._waiting is not None:  # the forward has made FSDP2's twins by now
            unusable = self._unusable
            self.watch(self._waiting)
            self._unusable = unusable and self._micro_batches_recorded > 0
        self._parts: list[Tensor] = []
        self._fired: set[int] = set()
        self._repeated = False
        # the measured pieces of a micro-batch split into pieces, each with its own backward: (norms, items,
        # factor), folded into the window when the micro-batch is recorded
        self._pieces: list[tuple[list[Tensor], Scalar, Scalar]] = []

    def end_piece(self, items: Scalar | None, factor: Scalar) -> None:
        """A piece of the pending micro-batch ran its own backward: keep its norms as one measurement.

        Any item-weighted set of independent groups gives an unbiased S (class docstring), so each piece
        (``items`` of its own, its gradient ``factor`` x its mean gradient) is measured alone; the
        micro-batch still counts once in the window's gradient when it is recorded.
        """
        parts, repeated = self._parts, self._repeated
        self._parts, self._fired, self._repeated = [], set(), False
        if parts and not repeated:
            self._pieces.append((parts, 1.0 if items is None else items, factor))

    def _on_gradient(self, index: int, grad: Tensor) -> None:
        if index in self._fired:  # a second gradient of the same parameter in one pass: norms don't add
            self._repeated = True
        self._fired.add(index)
        low = grad.dtype in (torch.float16, torch.bfloat16)  # fp16 norms overflow: take them in fp32
        norm = torch.linalg.vector_norm(grad, dtype=torch.float32 if low else None)  # one kernel, not kept
        self._parts.append(norm if norm.device == self.device else norm.to(self.device, non_blocking=True))

    def record(self, items: float | Tensor | None, weight: Scalar, scale: Scalar) -> None:
        """Count the micro-batch whose backward just ran; no sync, and with host numbers one kernel.

        Args:
            items: The micro-batch's items (``None``: 1, so that the noise scale is in micro-batches).
            weight: The factor its loss was multiplied by (``"weighted"``).
            scale: The loss scale times the AMP scale, which its gradient also carries.
        """
        parts, repeated, pieces = self._parts, self._repeated, self._pieces
        self.begin_backward()
        for piece_parts, piece_items, piece_factor in pieces:  # a micro-batch run in pieces
            self._measure(piece_parts, piece_items, piece_factor)
        self._micro_batches_recorded += 1
        if (items is None) != self._unit_missing:
            if self._micro_batches_recorded > 1:  # counts known for some micro-batches only
                self._unusable = True
            self._unit_missing = items is None
        count: Scalar = 1.0 if items is None else items
        measured = bool(parts) and not repeated
        factor = weight * scale  # the gradient is factor x g_i
        if isinstance(count, Tensor) or isinstance(factor, Tensor):
            self._record_tensors(parts if measured else [], count, factor)
            return
        if count <= 0:
            if not self.weighted:  # "mean": a zero gradient counted as a micro-batch mean
                self._unusable = True
            return
        host = self._host
        host["micro_batches"] += 1.0
        host["inverse_items"] += 1.0 / count
        if measured:
            self._measure(parts, count, factor)

    def _record_tensors(self, parts: list[Tensor], count: Scalar, factor: Scalar) -> None:
        """:meth:`record` for a count or scale that is a device tensor: every term stays on the device."""
        count_t, factor_t = self._on_device(count), self._on_device(factor)
        has_items = count_t > 0
        safe_count = torch.where(has_items, count_t, 1.0)
        zero = self._full(0.0)
        # a micro-batch without items: nothing under "weighted", an unusable window otherwise
        unusable = zero if self.weighted else (~has_items).to(self.dtype)
        row = {
            "measured_small": zero,
            "measured_items": zero,
            "measured": zero,
            "micro_batches": has_items.to(self.dtype),
            "inverse_items": torch.where(has_items, 1 / safe_count, zero),
            "unusable": unusable,
        }
        if parts:
            row.update(self._measured_columns(parts, count_t, factor_t))
        self._rows.append(torch.stack([row[name] for name in TOTALS]))

    def _measure(self, parts: list[Tensor], count: Scalar, factor: Scalar) -> None:
        """Add one measurement (a micro-batch's norms, or a piece's) to S's sums; :meth:`record` counts it."""
        if isinstance(count, Tensor) or isinstance(factor, Tensor):
            row = dict.fromkeys(TOTALS, self._full(0.0))
            row.update(self._measured_columns(parts, self._on_device(count), self._on_device(factor)))
            self._rows.append(torch.stack([row[name] for name in TOTALS]))
            return
        if count <= 0 or factor == 0:
            return
        squared = torch.stack(parts).to(self.dtype).square().sum()
        self._small.append(squared * (count / (factor * factor)))
        self._host["measured_items"] += count
        self._host["measured"] += 1.0

    def _measured_columns(self, parts: list[Tensor], count: Tensor, factor: Tensor) -> dict[str, Tensor]:
        """S's three columns for one measurement with device numbers (zeros without items or a factor)."""
        ok = (count > 0) & (factor != 0)
        zero = self._full(0.0)
        squared = torch.stack(parts).to(self.dtype).square().sum()
        unscaled = squared / torch.where(ok, factor, 1.0).square()
        return {
            "measured_small": torch.where(ok, count * unscaled, zero),
            "measured_items": torch.where(ok, count, zero),
            "measured": ok.to(self.dtype),
        }

    def _on_device(self, value: Scalar) -> Tensor:
        """A host number or a device scalar, as a scalar of this estimator's device and dtype."""
        if isinstance(value, Tensor):
            return value.to(self.device, self.dtype).reshape(())
        return self._full(value)

    def _full(self, value: float) -> Tensor:
        return torch.full((), float(value), dtype=self.dtype, device=self.device)  # a fill: no copy, no sync

    def mark_unusable(self) -> None:
        """The open window cannot be measured (e.g. micro-batches restored without their totals)."""
        self._unusable = True

    def window_totals(self) -> Tensor:
        """This rank's :data:`TOTALS` of the window (a device vector); forgets them."""
        totals = self._open_totals()
        self.discard()
        return totals

    def _open_totals(self) -> Tensor:
        host = {**self._host, "unusable": 1.0 if self._unusable else 0.0}
        totals = torch.stack([self._full(host[name]) for name in TOTALS])  # fills: no host-to-device copy
        if self._small:
            totals[_SMALL] += torch.stack(self._small).sum()
        if self._rows:
            totals += torch.stack(self._rows).sum(dim=0)
        return totals

    def window_state(self, summed: Callable[[Tensor], Tensor]) -> dict[str, Any]:
        """The open window's :data:`TOTALS` over the ranks (``summed``: a collective), for a checkpoint.

        Restored on the first rank (the others from zero), the window's estimate is the uninterrupted one's:
        the totals are summed over the ranks at the boundary anyway.
        """
        return {
            "totals": dict(zip(TOTALS, summed(self._open_totals()).tolist(), strict=True)),
            "micro_batches": self._micro_batches_recorded,
            "unit_missing": self._unit_missing,
        }

    @staticmethod
    def check_window(state: Mapping[str, Any] | None) -> None:
        """Raise ``ValueError`` if a saved window's totals (see :meth:`window_state`) cannot be restored."""
        if state is None:
            return
        try:
            _saved_totals(state)
            int(state["micro_batches"]), bool(state["unit_missing"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(
                f"The checkpoint's pending window has noise-scale totals that cannot be read ({error!r}): it"
                f" needs `totals` ({', '.join(TOTALS)}), `micro_batches` and `unit_missing`."
            ) from None

    def restore_window(self, state: Mapping[str, Any] | None, *, primary: bool) -> None:
        """Take a saved window's totals (``None``: saved without them: the window gives no estimate)."""
        if state is None:
            self.mark_unusable()
            return
        totals = _saved_totals(state)
        self._host = totals if primary else dict.fromkeys(TOTALS, 0.0)
        self._unusable = primary and totals["unusable"] > 0
        self._micro_batches_recorded = int(state["micro_batches"])
        self._unit_missing = bool(state["unit_missing"])

    def discard_pending(self) -> None:
        """Forget the last backward's norms without counting them (a re-evaluated micro-batch)."""
        self.begin_backward()

    def discard(self) -> None:
        """Forget the open window's micro-batches."""
        self._small: list[Tensor] = []  # per measured micro-batch with host numbers: b |g|² (device)
        self._rows: list[Tensor] = []  # per micro-batch with a device count or scale: its TOTALS row
        self._host = dict.fromkeys(TOTALS, 0.0)  # the host numbers' part of TOTALS ("measured_small" stays 0)
        self._micro_batches_recorded = 0
        self._unit_missing = False
        self._unusable = False
        self.begin_backward()

    # ------------------------------------------------------------------- the accumulator's named points

    def open_window(self, measured: bool, tracked: TrackedParameters) -> None:
        """A window opens: hook the parameters if it is measured (one in ``noise_scale_every``), or unhook."""
        if measured:
            self.watch(tracked.params)
        else:
            self.remove_hooks()

    def follow(self, params: Sequence[Tensor]) -> None:
        """The tracked parameters changed: hook the new set if this window is measured."""
        if self.watching or self._waiting is not None:
            self.watch(params)

    def record_micro_batch(
        self, items: Any, weight: Scalar, scale: Callable[[], Scalar], *, reevaluation: bool
    ) -> None:
        """:meth:`record`, or forget the backward's norms for a re-evaluated micro-batch (measured once).

        ``scale`` gives the loss scale times the AMP scale (read only here: a kernel under AMP).
        """
        if reevaluation:
            self.discard_pending()
        else:
            self.record(items, weight, scale())

    def close_window(self, tracked: TrackedParameters) -> Tensor | None:
        """The window's :data:`TOTALS` at its boundary (see :meth:`window_totals`).

        A window in which a parameter started to require a gradient (a layer unfrozen) is unusable: it had
        no hook. ``tracked``, not its list of parameters: without the noise scale nothing reads it.
        """
        if self.stale(tracked.params):
            self._unusable = True
        return self.window_totals()

    def statistics(
        self,
        totals: Tensor | Sequence[float] | None,
        norm: Scalar,
        *,
        l2_norm: Scalar | None,
        factor: Scalar,
        micro_batches: int,
        summed: bool,
        items: Scalar,
    ) -> dict[str, Scalar]:
        """Fold a window into the averages; the statistics the accumulator logs.

        Args:
            totals: The window's :data:`TOTALS` over every rank (a device vector, or its host copy).
            norm: The final gradient's norm before clipping (in ``norm_type``).
            l2_norm: The L2 norm of the window's sums when ``norm_type`` is another (``None``: it is L2).
            factor: The normalization the sums are multiplied by.
            micro_batches: The window's micro-batches on this rank.
            summed: Whether the final gradient is a sum (``scaling="sum"``): k times the mean over every
                rank's micro-batches.
            items: B, the window's items over ranks.
        """
        assert totals is not None
        values = totals.unbind() if isinstance(totals, Tensor) else totals
        parts: dict[str, Scalar] = dict(zip(TOTALS, values, strict=True))
        if l2_norm is not None:  # |G_W|: the L2 twin of the p-norm, scaled as the final gradient is
            scale: Any = abs(factor)  # a number or a device scalar
            norm = l2_norm * scale
        mean = norm / micro_batches if summed else norm
        found = self.update(parts, mean * mean, items=items)
        return {
            "noise_scale": found.noise_scale,
            "grad_sq_norm_estimate": found.grad_sq_norm,
            "trace_sigma_estimate": found.trace_sigma,
        }

    # -------------------------------------------------------------------------------- per window

    def update(self, totals: Mapping[str, Scalar], big_sq_norm: Scalar, *, items: Scalar) -> NoiseEstimate:
        """Estimate from one window's :data:`TOTALS` (summed over ranks) and fold into the averages.

        Args:
            totals: The window's :data:`TOTALS` over every rank.
            big_sq_norm: |G_W|² of the window's mean gradient, before clipping.
            items: B, the window's items over ranks (for the weighted β_W).
        """
        micro_batches = totals["micro_batches"]
        if self.weighted:
            beta_big = 1.0 / items if not _is_zero(items) else math.nan
        else:
            inverse = totals["inverse_items"]
            beta_big = inverse / (micro_batches * micro_batches) if not _is_zero(micro_batches) else math.nan
        grad_sq_norm, trace_sigma = estimate(
            totals["measured_small"], totals["measured_items"], totals["measured"], big_sq_norm, beta_big
        )
        usable = both(micro_batches >= 2, totals["unusable"] == 0)
        grad_sq_norm = _select(usable, grad_sq_norm, math.nan)
        trace_sigma = _select(usable, trace_sigma, math.nan)
        ok = both(is_finite(grad_sq_norm), is_finite(trace_sigma))
        d = self.decay
        self.average_grad_sq_norm = _select(
            ok, d * self.average_grad_sq_norm + (1 - d) * grad_sq_norm, self.average_grad_sq_norm
        )
        self.average_trace_sigma = _select(
            ok, d * self.average_trace_sigma + (1 - d) * trace_sigma, self.average_trace_sigma
        )
        self.average_weight = _select(ok, d * self.average_weight + (1 - d), self.average_weight)
        return NoiseEstimate(grad_sq_norm, trace_sigma, self.noise_scale())

    def noise_scale(self) -> Scalar:
        """Smoothed tr(Σ) / smoothed |G|² (the bias corrections cancel); ``nan`` before any estimate."""
        g, t, w = self.average_grad_sq_norm, self.average_trace_sigma, self.average_weight
        if isinstance(g, Tensor) or isinstance(t, Tensor) or isinstance(w, Tensor):
            g_t = torch.as_tensor(g)
            return torch.where(torch.as_tensor(w) > 0, torch.as_tensor(t) / g_t, math.nan)
        return t / g if w > 0 and g != 0 else math.nan

    # ------------------------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, float]:
        """The averages, as host numbers (syncs: checkpoint time only)."""
        return {
            "decay": self.decay,
            "average_grad_sq_norm": float(self.average_grad_sq_norm),
            "average_trace_sigma": float(self.average_trace_sigma),
            "average_weight": float(self.average_weight),
        }

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Continue the averages of a saved run."""
        self.average_grad_sq_norm = float(state["average_grad_sq_norm"])
        self.average_trace_sigma = float(state["average_trace_sigma"])
        self.average_weight = float(state["average_weight"])


def _saved_totals(state: Mapping[str, Any]) -> dict[str, float]:
    """A saved window's :data:`TOTALS` by name (format 3 saved them as a list in that order)."""
    saved = state["totals"]
    if not isinstance(saved, Mapping):
        saved = dict(zip(TOTALS, saved, strict=True))
    return {name: float(saved[name]) for name in TOTALS}


def noise_scale_for(
    settings: Any,
    tracked: TrackedParameters,
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> NoiseScale | NoNoiseScale:
    """The noise scale ``settings`` ask for: :class:`NoiseScale`, or :class:`NoNoiseScale` when off.

    Under FSDP2 each parameter's hook goes on its unsharded twin, which holds this rank's micro-batch
    gradient before the reduce-scatter (``torch_internals.fsdp2_unsharded_params``; the model must be
    given as ``fsdp_module``).

    Raises:
        NotImplementedError: ``noise_scale=True`` with FSDP1 (flat parameters), or FSDP2 without the model.
    """
    if not settings.noise_scale:
        return NoNoiseScale()
    hook_targets = None
    if tracked.sharded:
        module = tracked.fsdp_module
        if tracked.flat_sharded or module is None:
            raise NotImplementedError(
                "`noise_scale=True` is not supported with FSDP1's flat parameters, nor with FSDP2 unless the"
                " model is given as `fsdp_module` (the callback does): a sharded gradient reaches its shard"
                " by reduce-scatter, and only FSDP2's unsharded parameters show each rank's micro-batch."
            )
        modules = fsdp2_modules(module)
        dtensor = _dtensor_type()

        def hook_targets(params: Sequence[Tensor]) -> list[Tensor | None]:
            twins = fsdp2_unsharded_params(modules)
            return [twins.get(id(p)) if dtensor is not None and isinstance(p, dtensor) else p for p in params]

    return NoiseScale(
        settings.noise_scale_decay,
        device,
        dtype,
        weighted=settings.mode.weighted,
        hook_targets=hook_targets,
    )


class NoNoiseScale:
    """Every named point of :class:`NoiseScale`, doing nothing (``noise_scale=False``): no hook, no cost.

    The accumulator calls the same points whether or not the noise scale is on.
    """

    watching = False

    def statistics(self, totals: Any, norm: Scalar, **window: Any) -> dict[str, Scalar]:
        """No estimate."""
        return {}

    def state_dict(self) -> None:
        """Nothing to save."""
        return None

    def load_state_dict(self, state: Any) -> None:
        """Nothing to restore (a saved run's averages are ignored)."""

    def open_window(self, measured: bool, tracked: TrackedParameters) -> None:
        """Nothing to hook."""

    def follow(self, params: Sequence[Tensor]) -> None:
        """Nothing to hook."""

    def begin_backward(self) -> None:
        """Nothing to forget."""

    def end_piece(self, items: Scalar | None, factor: Scalar) -> None:
        """Nothing to measure."""

    def record_micro_batch(
        self, items: Any, weight: Scalar, scale: Callable[[], Scalar], *, reevaluation: bool
    ) -> None:
        """Nothing to record."""

    def close_window(self, tracked: TrackedParameters) -> Tensor | None:
        """No totals."""
        return None

    def mark_unusable(self) -> None:
        """Nothing to mark."""

    def window_state(self, summed: Callable[[Tensor], Tensor]) -> None:
        """Nothing to save."""
        return None

    @staticmethod
    def check_window(state: Mapping[str, Any] | None) -> None:
        """Nothing to check (a saved run's totals are ignored)."""

    def restore_window(self, state: Mapping[str, Any] | None, *, primary: bool) -> None:
        """Nothing to restore."""

    def discard(self) -> None:
        """Nothing to forget."""

    def remove_hooks(self) -> None:
        """No hook to remove."""
