"""The boundary of a window as stateless functions: measure, decide, apply.

``measure`` computes norms (one fused pass), ``decide`` turns a norm and the window's normalization factor
into the finiteness, the clip coefficient and one multiplier, ``apply_`` multiplies (and clamps) in place.
``decide`` takes Python numbers or device scalars alike: the accumulator decides on the host when it
synchronizes anyway (``overflow="skip"``), on the device otherwise, with the same arithmetic.
:func:`clip_grads_` chains the three, without any host sync, as ``torch.nn.utils.clip_grad_norm_`` does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from .kernels import Tensors, _grouped, clamp_, combine_norms, scale_, tensor_norms
from .scalars import Flag, Scalar, both, is_finite

ClipScope = Literal["global", "parameter"]
EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6)


@dataclass(frozen=True)
class Norms:
    """Norms of the window's summed gradients (before the normalization factor)."""

    total: Scalar  # a device scalar, or its value once copied to the host
    per_tensor: list[Tensor] | list[float] | None = None  # in group order; for clip_scope="parameter"
    largest_element: Scalar | None = None  # the inf-norm, for clip_value statistics

    @classmethod
    def on_device(
        cls,
        per_tensor: list[Tensor],
        norm_type: float,
        largest: list[Tensor] | None = None,
        *,
        device: torch.device,
        keep_per_tensor: bool = False,
    ) -> Norms:
        """Norms combined on ``device`` from each tensor's norm (and each one's largest element).

        Example:
            >>> Norms.on_device([torch.tensor(3.0), torch.tensor(4.0)], 2.0, device=torch.device("cpu")).total
            tensor(5.)
        """
        total = combine_norms(per_tensor, norm_type, device=device)
        if largest is None:
            biggest = None
        elif largest is per_tensor and norm_type == math.inf:  # the total already is the largest element
            biggest = total
        else:
            biggest = combine_norms(largest, math.inf, device=device)
        return cls(total, per_tensor if keep_per_tensor else None, biggest)

    @classmethod
    def on_host(
        cls,
        per_tensor: list[float],
        norm_type: float,
        largest: list[float] | None = None,
        *,
        dtype: torch.dtype = torch.float64,
    ) -> Norms:
        """Norms combined on the host from each tensor's norm (copied in a sync the caller makes anyway).

        ``dtype`` is the one :func:`combine_norms` would combine them in on the device: a total beyond its
        range is ``inf`` here too, so that both paths call the same windows non-finite.

        Example:
            >>> Norms.on_host([3.0, 4.0], 2.0).total
            5.0
        """
        return cls(
            combine_on_host(per_tensor, norm_type, dtype),
            per_tensor,
            combine_on_host(largest, math.inf, dtype) if largest is not None else None,
        )


def combine_on_host(norms: list[float], norm_type: float, dtype: torch.dtype = torch.float64) -> float:
    """The norm of all tensors together from their own norms, on the host, as ``dtype`` would hold it.

    ``nan`` if any norm is ``nan``, else ``inf`` if any is ``inf`` or the total exceeds ``dtype``'s range,
    as ``torch.linalg.vector_norm`` in that dtype. Computed relative to the largest norm, so no
    intermediate overflows.

    Example:
        >>> combine_on_host([3.0, 4.0], 2.0), combine_on_host([3.0, 4.0], math.inf)
        (5.0, 4.0)
        >>> combine_on_host([1e30, 1e30], 2.0, torch.float32)  # 1.4e30 fits float32; 1e39 would not
        1.414213562373095e+30
    """
    if not norms:
        return 0.0
    if math.isnan(math.fsum(norms)):  # one C pass; inf + (-inf) cannot occur: norms are >= 0
        return math.nan
    largest = max(norms)
    if norm_type == math.inf or math.isinf(largest) or largest == 0.0:
        total = largest
    elif norm_type == 2.0:
        total = math.hypot(*norms)  # C, scaled internally: no intermediate overflow
    elif norm_type == 1.0:
        total = math.fsum(norms)
    else:  # largest * (sum (n / largest)^p)^(1/p): every term <= 1
        total = largest * math.fsum((n / largest) ** norm_type for n in norms) ** (1.0 / norm_type)
    return math.inf if total > torch.finfo(dtype).max else float(total)


@dataclass(frozen=True)
class Decision:
    """What the boundary does to the summed gradients.

    Attributes:
        norm: Norm of the final gradient before clipping (``total * factor``).
        finite: Whether every element is finite.
        clipped: Whether clipping changes the gradient (only meaningful when finite).
        multiplier: One factor (normalization times global clip coefficient), or one per tensor
            (``clip_scope="parameter"``).
    """

    norm: Scalar
    finite: Flag
    clipped: Flag
    multiplier: Scalar | list[Tensor] | list[float]


def measure(
    grads: Tensors,
    norm_type: float,
    *,
    device: torch.device,
    foreach: bool | None = None,
    per_tensor: bool = False,
    largest_element: bool = False,
) -> Norms:
    """Norms of ``grads`` in one fused pass per (device, dtype) group; nothing syncs.

    Args:
        grads: The summed gradients (a list, or grouped by ``(device, dtype)``).
        norm_type: Order of the norm (``p > 0`` or ``inf``).
        device: Where the results go.
        foreach: The ``torch.nn.utils`` contract (see :func:`~lightning_gradacc.core.kernels.use_foreach`).
        per_tensor: Keep each tensor's norm (per-parameter clipping).
        largest_element: Also the largest absolute element (value clipping counts whether it acts).

    Example:
        >>> measure([torch.tensor([3.0]), torch.tensor([4.0])], 2.0, device=torch.device("cpu")).total
        tensor(5.)
    """
    each = tensor_norms(grads, norm_type, device=device, foreach=foreach)
    largest: list[Tensor] | None = None
    if largest_element:
        largest = (
            each if norm_type == math.inf else tensor_norms(grads, math.inf, device=device, foreach=foreach)
        )
    return Norms.on_device(each, norm_type, largest, device=device, keep_per_tensor=per_tensor)


def _clip_coefficient(norm: Scalar, max_norm: float) -> Scalar:
    """``min(max_norm / (norm + eps), 1)``, on the host or the device."""
    if isinstance(norm, Tensor):
        return torch.clamp(max_norm / (norm + EPS), max=1.0)
    return min(max_norm / (norm + EPS), 1.0) if not math.isnan(norm) else math.nan


def decide(
    norms: Norms | Scalar,
    factor: Scalar = 1.0,
    *,
    max_norm: float | None = None,
    clip_scope: ClipScope = "global",
    clip_value: float | None = None,
    largest_element: Scalar | None = None,
) -> Decision:
    """Finiteness, clipping and the multiplier for summed gradients whose final form is ``sum * factor``.

    Args:
        norms: :func:`measure`'s result, or just the total norm (a number or a device scalar).
        factor: The normalization (e.g. ``1 / micro_batches``).
        max_norm: Clip the final gradient's norm (``clip_scope="global"``) or each tensor's norm
            (``"parameter"``, needs ``norms.per_tensor``) to this value.
        clip_scope: ``"global"`` or ``"parameter"``.
        clip_value: Elements will be clamped to ``[-clip_value, clip_value]`` (decides ``clipped`` only).
        largest_element: The largest absolute element of the sum (``norms.largest_element`` by default).

    Example:
        >>> decision = decide(10.0, 0.5, max_norm=1.0)
        >>> decision.norm, decision.finite, decision.clipped, round(decision.multiplier, 6)
        (5.0, True, True, 0.1)
    """
    total = norms.total if isinstance(norms, Norms) else norms
    if isinstance(total, Tensor) and isinstance(factor, Tensor):
        factor = factor.to(total.dtype)
    norm = total * factor
    finite = is_finite(norm)
    multiplier: Scalar | list[Tensor] | list[float] = factor
    clipped: Flag = False
    if max_norm is not None and clip_scope == "parameter":
        per_tensor = norms.per_tensor if isinstance(norms, Norms) else None
        if per_tensor is None:
            raise ValueError(
                "`clip_scope='parameter'` needs the per-tensor norms: `measure(..., per_tensor=True)`."
            )
        if per_tensor and not isinstance(factor, Tensor) and not isinstance(per_tensor[0], Tensor):
            on_host = [float(_clip_coefficient(float(n) * factor, max_norm)) for n in per_tensor]
            clipped = any(c < 1.0 for c in on_host)
            multiplier = [c * factor for c in on_host]
        elif per_tensor:
            per_tensor = [
                n if isinstance(n, Tensor) else torch.tensor(n, dtype=torch.float64) for n in per_tensor
            ]
            wide = torch.float64 if any(n.dtype == torch.float64 for n in per_tensor) else per_tensor[0].dtype
            own = torch.stack([n if n.dtype == wide else n.to(wide) for n in per_tensor]) * factor
            coefficients = torch.clamp(max_norm / (own + EPS), max=1.0)
            clipped = (coefficients < 1.0).any()
            multiplier = list((coefficients * factor).unbind())
    elif max_norm is not None:
        coefficient = _clip_coefficient(norm, max_norm)
        clipped = coefficient < 1.0
        multiplier = coefficient * factor
    if clip_value is not None:
        if largest_element is None and isinstance(norms, Norms):
            largest_element = norms.largest_element
        if largest_element is None:
            raise ValueError("`clip_value` needs the largest element: `measure(..., largest_element=True)`.")
        if isinstance(multiplier, list):
            scaled: Scalar = largest_element * factor  # per-tensor clipping only shrinks: an upper bound
        else:
            scaled = largest_element * multiplier
        acts = scaled > clip_value
        clipped = (
            clipped | acts if isinstance(clipped, Tensor) or isinstance(acts, Tensor) else clipped or acts
        )
    clipped = (
        clipped & finite if isinstance(clipped, Tensor) or isinstance(finite, Tensor) else clipped and finite
    )
    return Decision(norm, finite, both(clipped, finite), multiplier)


def apply_(
    grads: Tensors, decision: Decision, *, clip_value: float | None = None, foreach: bool | None = None
) -> None:
    """Multiply ``grads`` in place by the decision's multiplier, then clamp to ``clip_value``.

    Example:
        >>> grads = [torch.tensor([3.0, 4.0])]
        >>> apply_(grads, decide(5.0, max_norm=1.0))
        >>> grads[0]
        tensor([0.6000, 0.8000])
    """
    multiplier = decision.multiplier
    if clip_value is None and isinstance(multiplier, (int, float)) and multiplier == 1.0:
        return  # nothing to do (K=1, mean, not clipped): not even entering no_grad
    scale_(grads, multiplier, foreach=foreach)
    if clip_value is not None:
        clamp_(grads, clip_value, foreach=foreach)


@torch.no_grad()
def clip_grads_(
    grads: Sequence[Tensor],
    max_norm: float | None,
    norm_type: float = 2.0,
    *,
    factor: Scalar = 1.0,
    clip_scope: ClipScope = "global",
    clip_value: float | None = None,
    foreach: bool | None = None,
) -> Tensor:
    """Scale ``grads`` by ``factor`` and clip them in place, without a host sync; return the unclipped norm.

    With ``factor=1`` and ``clip_scope="global"`` this is ``torch.nn.utils.clip_grad_norm_`` on gradients
    (``clip_grads_with_norm_(get_total_norm(...))``). ``clip_scope="parameter"`` clips each tensor to
    ``max_norm`` on its own and returns the global norm.

    Example:
        >>> grads = [torch.tensor([3.0]), torch.tensor([4.0])]
        >>> clip_grads_(grads, max_norm=1.0)
        tensor(5.)
        >>> [round(float(g), 4) for g in grads]
        [0.6, 0.8]
    """
    grads = [g for g in grads if g is not None]
    if not grads:
        return torch.zeros(())
    device = grads[0].device
    grouped = _grouped(grads)
    norms = measure(
        grouped,
        norm_type,
        device=device,
        foreach=foreach,
        per_tensor=clip_scope == "parameter",
        largest_element=clip_value is not None,
    )
    decision = decide(norms, factor, max_norm=max_norm, clip_scope=clip_scope, clip_value=clip_value)
    apply_(grouped, decision, clip_value=clip_value, foreach=foreach)
    return decision.norm if isinstance(decision.norm, Tensor) else torch.tensor(decision.norm)
