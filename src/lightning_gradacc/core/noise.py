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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

Scalar = float | Tensor


def _select(ok: Scalar, new: Scalar, old: Scalar) -> Scalar:
    """``new`` where ``ok`` else ``old``: host numbers or device scalars alike (no sync)."""
    if isinstance(ok, Tensor) or isinstance(new, Tensor) or isinstance(old, Tensor):
        device = next(v.device for v in (ok, new, old) if isinstance(v, Tensor))
        flag = ok if isinstance(ok, Tensor) else torch.tensor(bool(ok), device=device)
        return torch.where(flag, new, old)
    return new if ok else old


def _finite(value: Scalar) -> Scalar:
    return torch.isfinite(value) if isinstance(value, Tensor) else math.isfinite(value)


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
        small: Σ b_i |g_i|² over the window's micro-batches (all ranks).
        small_weight: Σ b_i over the same micro-batches.
        small_count: How many micro-batches (n).
        big_sq_norm: |G_W|², the squared norm of the window's (mean) gradient before clipping.
        beta_big: β_W = Σ w_i² / b_i for the window's weights w_i.

    Returns:
        (|G|², tr(Σ)); ``nan`` where n < 2 or the norms are not finite.

    Example:
        Two micro-batches of 1 item with gradients 1 and 3: |G|² ≈ 1.0, tr(Σ) ≈ 2.0.

        >>> estimate(small=1.0 + 9.0, small_weight=2.0, small_count=2.0, big_sq_norm=4.0, beta_big=0.5)
        (3.0, 2.0)
    """
    mean_small = small / small_weight if not _is_zero(small_weight) else math.nan
    beta_small = small_count / small_weight if not _is_zero(small_weight) else math.nan
    gap = beta_small - beta_big
    usable = small_count >= 2
    if isinstance(gap, Tensor) or isinstance(mean_small, Tensor) or isinstance(big_sq_norm, Tensor):
        gap_t = torch.as_tensor(gap)
        ok = usable & (gap_t > 0) if isinstance(usable, Tensor) else (gap_t > 0) & bool(usable)
        trace = torch.where(ok, (mean_small - big_sq_norm) / torch.where(ok, gap_t, 1.0), math.nan)
        return big_sq_norm - beta_big * trace, trace
    if not usable or not gap > 0:
        return math.nan, math.nan
    trace_value = (mean_small - big_sq_norm) / gap
    return big_sq_norm - beta_big * trace_value, trace_value


def _is_zero(value: Scalar) -> bool:
    return not isinstance(value, Tensor) and value == 0


class NoiseScale:
    """Collects the micro-batch norms of each window and keeps the smoothed estimates.

    Args:
        decay: Of the exponential averages (0.95: about the last 20 steps count).
        device: Where the per-micro-batch scalars live.
        dtype: Their dtype (float64, or float32 where the device has none).

    Example:
        >>> weight = torch.nn.Parameter(torch.zeros(2))
        >>> noise = NoiseScale(0.9, torch.device("cpu"), torch.float64)
        >>> noise.watch([weight])
        >>> (weight * torch.tensor([1.0, 3.0])).sum().backward()
        >>> noise.record(items=1.0, weight=1.0, scale=1.0)
        >>> round(float(noise.window_totals()[0]), 4)  # Σ b |g|²: 1 item, |g|² = 1 + 9
        10.0
        >>> noise.remove_hooks()
    """

    def __init__(self, decay: float, device: torch.device, dtype: torch.dtype) -> None:
        self.decay = decay
        self.device = device
        self.dtype = dtype
        self._parts: list[Tensor] = []  # the norms of the incoming gradients of the backward not recorded
        self._handles: list[Any] = []
        self._watched: tuple[int, ...] = ()
        self.discard()
        self.average_grad_sq_norm: Scalar = 0.0  # exponential averages, not yet bias-corrected
        self.average_trace_sigma: Scalar = 0.0
        self.average_weight: Scalar = 0.0  # their bias correction: 1 - decay**updates

    # ------------------------------------------------------------------------------ per micro-batch

    def watch(self, params: Sequence[Tensor]) -> None:
        """Hook the parameters that require a gradient (again, if the set changed)."""
        watched = [p for p in params if p.requires_grad]
        key = tuple(id(p) for p in watched)
        if key == self._watched:
            return
        self.remove_hooks()
        self._watched = key
        self._handles = [param.register_hook(self._on_gradient) for param in watched]  # type: ignore[no-untyped-call]

    @property
    def watching(self) -> bool:
        """Whether the hooks are in place."""
        return bool(self._handles)

    def remove_hooks(self) -> None:
        """Remove the gradient hooks (a replaced accumulator must not keep measuring)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._watched = ()

    def _on_gradient(self, grad: Tensor) -> None:
        self._parts.append(torch.linalg.vector_norm(grad))  # one kernel; the gradient is not kept

    def record(self, items: float | Tensor | None, weight: Scalar, scale: Scalar) -> None:
        """Count the backward just run; no sync, and with host numbers one kernel.

        Args:
            items: The micro-batch's items (``None``: 1, so that the noise scale is in micro-batches).
            weight: The factor its loss was multiplied by (``"weighted"``).
            scale: The loss scale times the AMP scale, which its gradient also carries.
        """
        parts, self._parts = self._parts, []
        count: Scalar = 1.0 if items is None else items
        if not parts:  # nothing back-propagated into the watched parameters
            return
        squared = torch.stack(parts).to(self.dtype).square().sum()
        factor = weight * scale  # the gradient is factor x g_i
        if isinstance(count, Tensor) or isinstance(factor, Tensor):
            count_t = torch.as_tensor(count).to(device=self.device, dtype=self.dtype).reshape(())
            factor_t = torch.as_tensor(factor).to(device=self.device, dtype=self.dtype).reshape(())
            ok = (count_t > 0) & (factor_t != 0)
            safe_count = torch.where(ok, count_t, 1.0)
            unscaled = squared / torch.where(ok, factor_t, 1.0).square()
            zero = torch.zeros((), dtype=self.dtype, device=self.device)
            self._small.append(torch.where(ok, safe_count * unscaled, zero))
            self._counts.append(
                torch.stack(
                    [torch.where(ok, count_t, zero), ok.to(self.dtype), torch.where(ok, 1 / safe_count, zero)]
                )
            )
            return
        if count <= 0 or factor == 0:  # no items: no mean gradient to measure
            return
        self._small.append(squared * (count / (factor * factor)))
        self._host_counts[0] += count
        self._host_counts[1] += 1.0
        self._host_counts[2] += 1.0 / count

    def window_totals(self) -> Tensor:
        """This rank's (Σ b|g|², Σ b, n, Σ 1/b) of the window (a device vector); forgets them."""
        small, counts, host = self._small, self._counts, self._host_counts
        self.discard()
        full = [torch.full((), value, dtype=self.dtype, device=self.device) for value in host]  # no copy
        totals = torch.stack([torch.stack(small).sum() if small else full[0] * 0, *full])
        if counts:
            totals[1:] += torch.stack(counts).sum(dim=0)
        return totals

    def discard_pending(self) -> None:
        """Forget the last backward's norms without counting them (a re-evaluated micro-batch)."""
        self._parts = []

    def discard(self) -> None:
        """Forget the open window's micro-batches."""
        self._small: list[Tensor] = []  # per micro-batch: b |g|², a device scalar
        self._counts: list[Tensor] = []  # per micro-batch with a tensor count: (b, 1, 1/b)
        self._host_counts = [0.0, 0.0, 0.0]  # (Σ b, n, Σ 1/b) of the micro-batches with host counts
        self._parts = []

    # -------------------------------------------------------------------------------- per window

    def update(
        self, totals: Sequence[Scalar], big_sq_norm: Scalar, *, weighted: bool, items: Scalar
    ) -> NoiseEstimate:
        """Estimate from one window's totals (summed over ranks) and fold into the averages.

        Args:
            totals: (Σ b|g|², Σ b, n, Σ 1/b) over every rank's micro-batches.
            big_sq_norm: |G_W|² of the window's mean gradient, before clipping.
            weighted: Whether the window's weights are b_i / B (else 1/n).
            items: B, the window's items over ranks (for the weighted β_W).
        """
        small, small_weight, count, inverse = totals
        if weighted:
            beta_big = 1.0 / items if not _is_zero(items) else math.nan
        else:
            beta_big = inverse / (count * count) if not _is_zero(count) else math.nan
        grad_sq_norm, trace_sigma = estimate(small, small_weight, count, big_sq_norm, beta_big)
        ok: Scalar = _finite(grad_sq_norm)
        ok = ok & _finite(trace_sigma) if isinstance(ok, Tensor) else ok and bool(_finite(trace_sigma))
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
