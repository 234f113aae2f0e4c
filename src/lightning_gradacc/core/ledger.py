"""The ledger: value-dependent statistics, declared once, folded over windows without a host sync.

Each statistic is declared once in :data:`STATISTICS` with how it folds over windows (``sum``, ``max`` or
``last``); reset, folding, syncing, the snapshot and the checkpoint form are generic over that table.
Every value is computed from quantities already summed over ranks, so it is the same on every rank.

A window's values are Python numbers when the accumulator synced anyway (``overflow="skip"`` decides on
the host), or device scalars otherwise. Device rows wait in a list and are copied to the host in one sync
when the statistics are read (or every :data:`MAX_PENDING` windows, to bound memory); no kernel runs per
window for numbers that are already on the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from .scalars import Scalar

Fold = Literal["sum", "max", "last"]
Deferred = Callable[[], Scalar]  # a "last" value computed only if it is read before the next window
MAX_PENDING = 1024


@dataclass(frozen=True)
class Statistic:
    """One value-dependent statistic: its name and how windows fold into it."""

    name: str
    fold: Fold


STATISTICS = (
    Statistic("skipped_steps", "sum"),
    Statistic("non_finite_windows", "sum"),
    Statistic("dropped_micro_batches", "sum"),
    Statistic("empty_windows", "sum"),
    Statistic("clipped_steps", "sum"),
    Statistic("last_grad_norm", "last"),
    Statistic("max_grad_norm_seen", "max"),
    Statistic("items_last_step", "last"),
    Statistic("items_last_full_step", "last"),  # folded by windows of K micro-batches only
    Statistic("window_loss", "last"),
    Statistic("noise_scale", "last"),
    Statistic("grad_sq_norm_estimate", "last"),
    Statistic("trace_sigma_estimate", "last"),
)
UNMEASURED = ("window_loss", "noise_scale", "grad_sq_norm_estimate", "trace_sigma_estimate")  # nan at first
NAMES = tuple(statistic.name for statistic in STATISTICS)
COUNTERS = tuple(statistic.name for statistic in STATISTICS if statistic.fold == "sum")
_FOLD = {statistic.name: statistic.fold for statistic in STATISTICS}
_COUNTER_SET = frozenset(COUNTERS)


def _initial() -> dict[str, float]:
    """Every statistic before the first window: 0, or ``nan`` for what nothing has measured yet."""
    return dict.fromkeys(NAMES, 0.0) | dict.fromkeys(UNMEASURED, math.nan)


def _fold(fold: Fold, old: float, new: float) -> float:
    if fold == "sum":
        return old + new
    if fold == "max":
        return new if math.isfinite(new) and not new <= old else old  # a non-finite norm is not a maximum
    return new


class Ledger:
    """The folded statistics, on the host, plus device rows not yet copied.

    Args:
        dtype: Dtype of the device rows (float64, or float32 where the device has none).

    Example:
        >>> ledger = Ledger(torch.float64)
        >>> ledger.fold({"skipped_steps": 1.0, "last_grad_norm": torch.tensor(2.0)})
        >>> ledger.fold({"skipped_steps": 0.0, "last_grad_norm": 3.0})
        >>> ledger.values()["skipped_steps"], ledger.values()["max_grad_norm_seen"]
        (1.0, 3.0)
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._host = _initial()
        # windows not folded yet: (host values, names of device values, their stacked row)
        self._pending: list[tuple[dict[str, float], tuple[str, ...], Tensor]] = []
        self._deferred: dict[str, Deferred] = {}  # the newest value of a "last" field, not computed yet
        # invalid item counts found on the device, with the error to raise once they are copied
        self._held: tuple[Tensor, Callable[[int], str]] | None = None

    def fold(self, window: Mapping[str, Scalar | Deferred], *, count: bool = True) -> None:
        """Fold one window's values in; ``max_grad_norm_seen`` follows ``last_grad_norm``.

        Args:
            window: A value for some statistics (the others: 0 for counters, unchanged otherwise). A
                ``"last"`` statistic may be given as a function, called only if it is read before a newer
                value arrives (the window loss costs kernels no one may ever read).
            count: ``False`` for a window evaluated again (LBFGS): counters do not advance.
        """
        host: dict[str, float] = {}
        device: dict[str, Tensor] = {}
        for name, value in window.items():
            if name in self._deferred:
                del self._deferred[name]
            if not count and name in _COUNTER_SET:
                continue
            if isinstance(value, Tensor):
                device[name] = value
            elif callable(value):
                assert _FOLD[name] == "last", name
                self._deferred[name] = value
            else:
                host[name] = float(value)
        if "last_grad_norm" in host:
            host["max_grad_norm_seen"] = host["last_grad_norm"]
        elif "last_grad_norm" in device:
            device["max_grad_norm_seen"] = device["last_grad_norm"]
        if not device and not self._pending:
            self._fold_host(host)
            return
        row = self._stack(list(device.values())) if device else torch.empty(0)
        self._pending.append((host, tuple(device), row))
        if len(self._pending) >= MAX_PENDING:
            self.sync()

    def _stack(self, scalars: list[Tensor]) -> Tensor:
        """One vector from device scalars (``torch.stack`` promotes their dtypes), in the ledger's dtype."""
        vector = torch.stack([t if t.dim() == 0 else t.reshape(()) for t in scalars])
        return vector if vector.dtype == self.dtype else vector.to(self.dtype)

    def _fold_host(self, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self._host[name] = _fold(_FOLD[name], self._host[name], value)

    def hold_check(self, invalid: Tensor, message: Callable[[int], str]) -> None:
        """Keep a device count of invalid item counts until the next sync, which raises if it is not 0.

        For a step decided on the device: its invalid counts skipped it there, and the error waits for the
        next read of the statistics (the same step on every rank: the counts were summed over ranks).

        Args:
            invalid: The window's count of invalid item counts (a device scalar).
            message: The error's text for a total count (the first held window's is kept).
        """
        invalid = invalid.reshape(()).to(self.dtype)
        if self._held is None:
            self._held = (invalid, message)
        else:
            self._held = (self._held[0] + invalid, self._held[1])

    @property
    def fresh(self) -> bool:
        """Whether every window is folded on the host (reading costs no sync)."""
        return not self._pending and self._held is None

    def sync(self, *extra: Tensor) -> list[Any]:
        """Copy the pending rows and ``extra`` device scalars or vectors to the host in one sync; fold.

        Everything is on the accumulator's device; ``torch.stack``/``torch.cat`` promote the dtypes.

        Returns:
            The values of ``extra``: a float for a scalar, a list of floats for a vector.

        Raises:
            ValueError: A held count of invalid item counts (:meth:`hold_check`) is not 0; the windows are
                folded first.
        """
        held, self._held = self._held, None
        if held is not None:
            extra = (*extra, held[0])
        rows = [row for _, _, row in self._pending if row.numel()]
        scalars = [t for t in extra if t.dim() == 0]
        vectors = [t for t in extra if t.dim() != 0]
        if not extra and not rows:
            copied: list[float] = []
        elif len(scalars) == 1 and not vectors and not rows:  # one scalar, one copy
            copied = [float(scalars[0].item())]
        else:  # one vector, one copy
            parts = ([torch.stack(scalars)] if scalars else []) + vectors + rows
            copied = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
        values: list[Any] = []
        at_scalar, at_vector = 0, len(scalars)
        for tensor in extra:
            if tensor.dim() == 0:
                values.append(copied[at_scalar])
                at_scalar += 1
            else:
                values.append(copied[at_vector : at_vector + tensor.numel()])
                at_vector += tensor.numel()
        offset = at_vector
        for host, names, row in self._pending:
            device_values = copied[offset : offset + row.numel()]
            offset += row.numel()
            self._fold_host({**host, **dict(zip(names, device_values, strict=True))})
        self._pending.clear()
        if held is not None:
            invalid = int(values.pop())
            if invalid:
                raise ValueError(held[1](invalid))
        return values

    def values(self, *, deferred: bool = True) -> dict[str, float]:
        """Every statistic by name (syncs once if device rows are pending or a deferred value is a tensor).

        ``deferred=False`` leaves deferred values uncomputed (their entries are then stale).
        """
        if not self.fresh:
            self.sync()
        if not deferred:
            return dict(self._host)
        for name, compute in self._deferred.items():
            value = compute()
            self._host[name] = float(value.item()) if isinstance(value, Tensor) else float(value)
        self._deferred.clear()
        return dict(self._host)

    def __getstate__(self) -> dict[str, object]:  # pickles (ddp_spawn): deferred values are computed first
        self.values()
        return self.__dict__.copy()

    def state_dict(self) -> dict[str, float]:
        """The statistics as plain numbers."""
        return self.values()

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        """Restore saved statistics (a statistic the state lacks starts from its initial value)."""
        loaded = _initial()
        for name, value in state.items():
            if name in loaded:
                loaded[name] = float(value)
        self._host = loaded
        self._pending.clear()
        self._deferred.clear()
        self._held = None
