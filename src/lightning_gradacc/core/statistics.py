"""The run's statistics, in one part: what the run has done, per window and over its lifetime.

:class:`RunStatistics` is the one owner, with one interface: count a micro-batch, close a window (its values
folded in), sync (copy what waits on the device, in one copy with whatever the step needs), hold a check
found on the device until that sync, read a value, take a snapshot (:class:`AccumulationStats`), and save or
restore itself as plain numbers (``torch.load(weights_only=True)`` reads them back).

Each statistic is declared once, as a field of :class:`AccumulationStats` with its doc, where it is kept and
how it folds over windows (``sum``, ``max`` or ``last``); the ledger's table (:data:`STATISTICS`), reset,
folding, syncing, the snapshot, the checkpoint form and the logged names are loops over those fields.
Every value is computed from quantities already summed over ranks, so it is the same on every
rank. A window's values are Python numbers when the accumulator synced anyway (``overflow="skip"`` decides on
the host), or device scalars otherwise. Device rows wait in a list and are copied to the host in one sync
when the statistics are read (or every :data:`MAX_PENDING` windows, to bound memory); no kernel runs per
window for numbers that are already on the host.

The peak memory is the process's (:class:`PeakMemory`): on CUDA the caching allocator's peak
(``torch.cuda.max_memory_allocated``), on Linux CPUs the kernel's resident-set high-water mark (``VmHWM`` in
``/proc/self/status``, tens of µs), elsewhere ``getrusage``'s peak or the resident set now. These are
process-wide counters that the user, Lightning's ``DeviceStatsMonitor`` and profilers read too: a library
never resets them, so the peak is the one since the process started (or since the user last reset it), not a
window's. Nothing here synchronizes with a device but :meth:`RunStatistics.sync` and the reads that need it.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

import psutil
import torch
from torch import Tensor

from .scalars import Scalar
from .settings import doc_entries

Fold = Literal["sum", "max", "last"]
Kept = Literal["window", "count", "now", "part"]


def statistic(
    default: float,
    doc: str,
    *,
    kept: Kept = "window",
    fold: Fold = "last",
    empty: float | None = None,
    follows: str | None = None,
    logged: bool = True,
    noise: bool = False,
    engine: bool = True,
) -> Any:
    """A field of :class:`AccumulationStats`: its default, where it is kept, how it folds, its one doc.

    Args:
        default: Its value before the first window (``nan``: nothing has measured it yet); an ``int``
            default makes an integer field.
        doc: Its documentation (the class's ``Attributes`` and the README's table are made from it).
        kept: ``"window"``: computed from each window's values and folded over windows by the ledger;
            ``"count"``: a host counter of :class:`RunStatistics` (saved and restored with it); ``"now"``: a
            fact of the accumulator at the snapshot (K, the open window), neither folded nor saved;
            ``"part"``: a value of a part of the Lightning callback's fit (the window plan, the pieces),
            which that part keeps and saves; the core's snapshot leaves it at its default.
        fold: How windows fold into a ``"window"`` statistic: ``"sum"`` (a counter), ``"max"`` or ``"last"``.
        empty: What a window without micro-batches folds in (``None``: nothing; it keeps its value).
        follows: Another statistic whose every new value this one folds too (``max`` of a ``last``).
        logged: Whether the callback logs it (under ``grad_accum/``; a ``"part"`` value where the fit has
            that part).
        noise: Logged only with ``noise_scale=True``.
        engine: Whether a window driven inside an engine that accumulates itself (DeepSpeed) shows it;
            ``False``: its clipping, losses, buffers or skipped micro-batches are the engine's own, and the
            statistic is not logged there (never a made-up value).
    """
    metadata = {"doc": doc, "kept": kept, "fold": fold, "empty": empty, "follows": follows}
    return field(default=default, metadata={**metadata, "logged": logged, "noise": noise, "engine": engine})


def _comparable(value: float) -> object:
    """``nan`` ("not measured") as a value equal to itself, for snapshot equality."""
    return "nan" if isinstance(value, float) and math.isnan(value) else value


@dataclass(frozen=True, eq=False)
class AccumulationStats:
    """A snapshot of the accumulator's statistics, each declared once below with its fold and its doc.

    A new statistic is one field here (:func:`statistic`) and one value in the window's end
    (``WindowEnd._account``): folding, syncing, the snapshot, the checkpoint form and the logged names are
    loops over these fields.

    Example:
        >>> stats = AccumulationStats(accumulation_steps=4, windows=3, skipped_steps=1)
        >>> stats.steps_taken, stats.as_dict()["accumulation_steps"]
        (2, 4)
    """

    accumulation_steps: int = statistic(1, "Micro-batches per window now (K).", kept="now")
    open_window_micro_batches: int = statistic(
        0, "Micro-batches recorded in the window that is still open.", kept="now", logged=False
    )
    windows: int = statistic(
        0, "Windows closed: stepped, skipped (not finite) or empty (nothing in them).", kept="count"
    )
    total_micro_batches: int = statistic(
        0, "Micro-batches recorded since creation (re-evaluations by LBFGS not counted).", kept="count"
    )
    skipped_steps: int = statistic(
        0,
        "Windows not stepped because their gradient was not finite (by the accumulator, or by a"
        " ``GradScaler``).",
        fold="sum",
    )
    non_finite_windows: int = statistic(
        0,
        "Windows whose accumulated gradient was not finite (skipped or not, depending on ``overflow``).",
        fold="sum",
        engine=False,
    )
    dropped_micro_batches: int = statistic(
        0,
        'Micro-batches dropped by ``overflow="skip_micro_batch"``.',
        fold="sum",
        engine=False,
    )
    empty_windows: int = statistic(
        0,
        "Windows that took no step because nothing was in them: every ``training_step`` returned ``None``"
        " (or backward was skipped, as in ``StochasticWeightAveraging``'s BatchNorm epoch), or"
        ' ``scaling="weighted"`` counted 0 items in total.',
        fold="sum",
        empty=1.0,
        engine=False,
    )
    clipped_steps: int = statistic(
        0,
        'Windows whose gradient clipping changed (with ``clip_mode="micro_batch"``: where it changed some'
        " micro-batch's gradient).",
        fold="sum",
        engine=False,
    )
    last_grad_norm: float = statistic(
        0.0, "Total gradient norm of the last window, after scaling and before clipping.", empty=0.0
    )
    max_grad_norm_seen: float = statistic(
        0.0, "Largest finite ``last_grad_norm`` so far.", fold="max", follows="last_grad_norm"
    )
    items_last_step: float = statistic(
        0.0,
        "Items (samples, tokens) in the last window, summed over ranks: the real effective batch size (a"
        " float: counts such as ``attention_mask.float().sum()`` need not be integers).",
        empty=0.0,
    )
    items_seen: float = statistic(
        0.0,
        "Items of every window so far, summed over ranks (skipped windows included, dropped micro-batches"
        " not): the tokens or samples trained on, as the Hugging Face Trainer's ``num_input_tokens_seen``.",
        fold="sum",
    )
    items_last_full_step: float = statistic(
        0.0,
        "Items in the last window that held K micro-batches, summed over ranks: what a full optimizer"
        " step holds (``items_last_step`` is often an epoch's shorter, last window).",
    )
    micro_batches_last_step: int = statistic(
        0, "Micro-batches in the last window (k, which is < K for a partial window).", kept="count"
    )
    window_loss: float = statistic(
        math.nan,
        "Mean training loss over the last window, weighted by items and over ranks (Lightning itself logs"
        " only the last micro-batch's); ``nan`` where no loss was recorded.",
        empty=math.nan,
        engine=False,
    )
    num_parameters: int = statistic(
        0,
        "Trainable parameter elements tracked: the whole model's, also when FSDP shards it (not this"
        " rank's shards).",
        kept="now",
    )
    buffer_bytes: int = statistic(
        0,
        "Extra memory held by the accumulator (0: gradients accumulate in ``.grad``).",
        kept="now",
        engine=False,
    )
    peak_memory_bytes: int = statistic(
        0,
        "The process's peak memory on the gradients' device so far: the CUDA allocator's peak on GPU"
        " (since the process started or the user last called ``torch.cuda.reset_peak_memory_stats``), the"
        " process's resident-set peak on CPU. Read when the statistics are read; this package never resets"
        " a process-wide counter, so it is not a window's peak.",
        kept="count",
        engine=False,
    )
    noise_scale: float = statistic(
        math.nan,
        "The gradient noise scale B_simple = tr(Σ) / |G|² in items (samples, tokens: what the item counts"
        " count), from bias-corrected exponential averages of the two estimates below"
        " (``noise_scale=True``; ``nan`` until a window of at least 2 micro-batches gave one). It predicts"
        " the critical batch size (McCandlish et al. 2018).",
        noise=True,
    )
    grad_sq_norm_estimate: float = statistic(
        math.nan,
        "The last window's unbiased estimate of |G|², the squared norm of the true gradient (may be"
        " negative: it is a noisy estimate).",
        empty=math.nan,
        noise=True,
    )
    trace_sigma_estimate: float = statistic(
        math.nan,
        "The last window's unbiased estimate of tr(Σ), the summed variance of one item's gradient (may be"
        " negative).",
        empty=math.nan,
        noise=True,
    )
    # the values of the Lightning callback's parts: each part hands them over by these names
    lr_factor: float = statistic(
        math.nan,
        "With ``lr_scaling`` or ``lr_schedule``: the factor the last step's learning rates were multiplied"
        " by.",
        kept="part",
    )
    auto_target_k: float = statistic(
        math.nan,
        'With ``accumulation_steps="auto"``: the rule\'s K after the last step (``nan`` without an'
        " estimate).",
        kept="part",
    )
    auto_noise_scale: float = statistic(
        math.nan, 'With ``"auto"``: the noise scale that target came from.', kept="part"
    )
    auto_items_per_micro_batch: float = statistic(
        math.nan,
        'With ``"auto"``: the items of one micro-batch on one rank in the last window.',
        kept="part",
    )
    auto_t_micro: float = statistic(
        math.nan,
        'With ``"auto"`` and ``rule="goodput"``: the averaged seconds of an accumulating micro-batch.',
        kept="part",
    )
    auto_t_step: float = statistic(
        math.nan,
        'With ``"auto"`` and ``rule="goodput"``: what a window\'s last micro-batch costs on top.',
        kept="part",
    )
    piece_size: int = statistic(
        0,
        "With ``piece_size``: the largest piece the last batch ran (its items; 0 without pieces).",
        kept="part",
    )
    oom_retries: int = statistic(
        0,
        "With ``piece_size``: out-of-memory errors recovered from over the run, summed over the ranks.",
        kept="part",
    )

    @property
    def steps_taken(self) -> int:
        """Windows that ended in an optimizer step (``windows - skipped_steps - empty_windows``)."""
        return self.windows - self.skipped_steps - self.empty_windows

    def __eq__(self, other: object) -> bool:
        """Field by field; two snapshots that both did not measure something (``nan``) agree on it."""
        if not isinstance(other, AccumulationStats):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple[object, ...]:
        return tuple(_comparable(value) for value in asdict(self).values())

    def as_dict(self) -> dict[str, int | float]:
        """Return the fields by name, in declaration order, and ``steps_taken``."""
        values = asdict(self)
        values["steps_taken"] = self.steps_taken
        return values


def statistic_docs(indent: int = 8) -> str:
    """Every field's documentation as the entries of a Google-style ``Attributes:`` section.

    Example:
        >>> print(statistic_docs(0).splitlines()[0])
        accumulation_steps: Micro-batches per window now (K).
    """
    return doc_entries(fields(AccumulationStats), indent)


AccumulationStats.__doc__ = (
    f"{AccumulationStats.__doc__}\n    Attributes:\n{statistic_docs(8)}\n"
    "        steps_taken: Windows that ended in an optimizer step (a property).\n"
)


# ------------------------------------------------------------------------------------------ memory

_HWM = re.compile(r"VmHWM:\s+(\d+)\s+kB")


class PeakMemory:
    """Reads the peak memory of ``device`` so far (the process's, never reset here).

    Args:
        device: The device the gradients live on.

    Example:
        >>> PeakMemory(torch.device("cpu")).read() > 0
        True
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def read(self) -> int:
        """The peak in bytes: CUDA allocator peak on GPU, process resident-set peak on CPU."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if sys.platform.startswith("linux"):
            try:
                with open("/proc/self/status") as status:
                    match = _HWM.search(status.read())
                if match:
                    return int(match.group(1)) * 1024
            except OSError:
                pass
        if resource is not None:  # kB on Linux, bytes on macOS
            peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
            return peak if sys.platform == "darwin" else peak * 1024
        return int(psutil.Process().memory_info().rss)


# ------------------------------------------------------------------------------------------ the ledger

Deferred = Callable[[], Scalar]  # a "last" value computed only if it is read before the next window
MAX_PENDING = 1024


@dataclass(frozen=True)
class Statistic:
    """A value-dependent statistic as the ledger folds it (made from an :class:`AccumulationStats` field)."""

    name: str
    fold: Fold
    initial: float = 0.0
    empty: float | None = None  # what a window without micro-batches folds in
    follows: str | None = None


STATISTICS = tuple(
    Statistic(f.name, f.metadata["fold"], float(f.default), f.metadata["empty"], f.metadata["follows"])  # type: ignore[arg-type]
    for f in fields(AccumulationStats)
    if f.metadata["kept"] == "window"
)
COUNTS = tuple(f.name for f in fields(AccumulationStats) if f.metadata["kept"] == "count")  # on the host
NOW = tuple(f.name for f in fields(AccumulationStats) if f.metadata["kept"] == "now")  # the snapshot's facts
PARTS = tuple(f.name for f in fields(AccumulationStats) if f.metadata["kept"] == "part")  # the callback's
UNMEASURED = tuple(statistic.name for statistic in STATISTICS if math.isnan(statistic.initial))
NAMES = tuple(statistic.name for statistic in STATISTICS)
COUNTERS = tuple(statistic.name for statistic in STATISTICS if statistic.fold == "sum")
INTEGERS = frozenset(f.name for f in fields(AccumulationStats) if type(f.default) is int)
EMPTY_WINDOW = {statistic.name: statistic.empty for statistic in STATISTICS if statistic.empty is not None}
_FOLD = {statistic.name: statistic.fold for statistic in STATISTICS}
_FOLLOWERS = tuple((s.follows, s.name) for s in STATISTICS if s.follows is not None)
_COUNTER_SET = frozenset(COUNTERS)


def _initial() -> dict[str, float]:
    """Every statistic before the first window: 0, or ``nan`` for what nothing has measured yet."""
    return {statistic.name: statistic.initial for statistic in STATISTICS}


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
        for leader, follower in _FOLLOWERS:  # e.g. the largest norm seen follows each window's norm
            if leader in host:
                host[follower] = host[leader]
            elif leader in device:
                device[follower] = device[leader]
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

    def fold_plain(  # one value per statistic: no container built per step
        self,
        norm: float,
        items: float,
        window_loss: Deferred,
        *,
        non_finite: bool,
        skipped: bool,
        empty: bool,
        clipped: bool,
        full: bool,
    ) -> bool:
        """Fold one plain window's host numbers, its loss computed only if read; ``False``: rows wait.

        The window's end in its plain form (:meth:`WindowEnd.close_plain`): the folds of its statistics are
        the declared ones (sums, the last values, the largest finite norm seen), written out: a table walk
        costs a dictionary and a branch per value on every step (a test holds them to the general fold).
        """
        if self._pending or self._held is not None:
            return False
        self._deferred["window_loss"] = window_loss
        host = self._host
        host["non_finite_windows"] += non_finite
        host["skipped_steps"] += skipped
        host["empty_windows"] += empty
        host["clipped_steps"] += clipped
        host["items_seen"] += items
        host["last_grad_norm"] = norm
        host["items_last_step"] = items
        if full:
            host["items_last_full_step"] = items
        if norm - norm == 0.0 and not norm <= host["max_grad_norm_seen"]:  # finite and larger (or the first)
            host["max_grad_norm_seen"] = norm
        return True

    def _fold_host(self, values: Mapping[str, float]) -> None:
        host = self._host
        for name, value in values.items():
            if _FOLD[name] == "sum":  # most values of a window, inlined: a call per value costs more
                host[name] += value
            else:
                host[name] = _fold(_FOLD[name], host[name], value)

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


# ------------------------------------------------------------------------------------------ the one owner


class RunStatistics:
    """Lifetime counters and per-window statistics of one accumulator: the run's statistics' one owner.

    The host counters are :data:`COUNTS` (fields of :class:`AccumulationStats` kept ``"count"``); the
    value-dependent statistics are the ledger's (:data:`STATISTICS`). Both are saved and restored by loops
    over those declarations.

    Args:
        device: Where device statistics live (and whose memory peak is read).
        dtype: Their dtype (float64, or float32 where the device has none).

    Attributes:
        windows: Windows closed so far.
        total_micro_batches: Micro-batches recorded so far (a re-evaluation counts once).
        micro_batches_last_step: Micro-batches of the last window closed.
        peak_memory_bytes: The process's memory peak at the last snapshot.

    Example:
        >>> statistics = RunStatistics(torch.device("cpu"), torch.float64)
        >>> statistics.record_micro_batch(reevaluation=False)
        >>> statistics.close_window({"last_grad_norm": 2.0, "window_loss": 0.5}, micro_batches=1)
        >>> statistics.windows, statistics.total_micro_batches, statistics.window_loss
        (1, 1, 0.5)
        >>> statistics.value("max_grad_norm_seen")
        2.0
    """

    # the host counters (COUNTS), read on the hot path as plain attributes
    windows: int
    total_micro_batches: int
    micro_batches_last_step: int
    peak_memory_bytes: int

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self._ledger = Ledger(dtype)
        self._memory = PeakMemory(device)  # read when the statistics are read; never reset
        for name in COUNTS:
            setattr(self, name, 0)

    def record_micro_batch(self, *, reevaluation: bool) -> None:
        """Count a recorded micro-batch (a re-evaluation of the same one counts once)."""
        if not reevaluation:
            self.total_micro_batches += 1

    def close_window(
        self,
        statistics: Mapping[str, Scalar | bool | Deferred],
        *,
        micro_batches: int,
        reevaluation: bool = False,
    ) -> None:
        """Fold one window's statistics (see :data:`STATISTICS`) and count it.

        Args:
            statistics: The window's values by statistic name (a number, a device scalar, or a function for
                a ``"last"`` value computed only if it is read before the next window closes).
            micro_batches: The micro-batches it had.
            reevaluation: The same window evaluated again (LBFGS): its statistics replace the last ones and
                no counter advances.
        """
        self._ledger.fold(statistics, count=not reevaluation)
        self.micro_batches_last_step = micro_batches
        if not reevaluation:
            self.windows += 1

    def close_plain_window(
        self,
        norm: float,
        items: float,
        window_loss: Deferred,
        *,
        non_finite: bool,
        skipped: bool,
        empty: bool,
        clipped: bool,
        full: bool,
        micro_batches: int,
    ) -> bool:
        """Fold and count a plain window's host numbers (:meth:`Ledger.fold_plain`); ``False``: not folded."""
        folded = self._ledger.fold_plain(
            norm,
            items,
            window_loss,
            non_finite=non_finite,
            skipped=skipped,
            empty=empty,
            clipped=clipped,
            full=full,
        )
        if not folded:
            return False
        self.micro_batches_last_step = micro_batches
        self.windows += 1
        return True

    def close_empty_window(self, *, reevaluation: bool = False) -> None:
        """Fold a window in which no micro-batch was recorded: each statistic's declared ``empty`` value."""
        self.close_window(EMPTY_WINDOW, micro_batches=0, reevaluation=reevaluation)

    def sync(self, *extra: Tensor) -> list[Any]:
        """Copy what waits on the device, with ``extra`` device scalars or vectors, in one sync; fold it.

        Returns:
            The values of ``extra``: a float for a scalar, a list of floats for a vector.

        Raises:
            ValueError: A count of invalid item counts held by :meth:`hold_check` is not 0.
        """
        return self._ledger.sync(*extra)

    def hold_check(self, invalid: Tensor, message: Callable[[int], str]) -> None:
        """Hold a device count of invalid item counts until the next :meth:`sync`, which raises unless 0.

        For a step decided on the device: its invalid counts skipped it there, and the error waits for the
        next read of the statistics (the same step on every rank: the counts were summed over ranks).
        """
        self._ledger.hold_check(invalid, message)

    def value(self, name: str) -> float:
        """One statistic or counter on the host (syncs once if windows wait on the device).

        The window loss is computed when it is read (a few kernels no one may ever need).
        """
        if name in COUNTS:
            return float(getattr(self, name))
        return self._ledger.values(deferred=name == "window_loss")[name]

    @property
    def window_loss(self) -> float:
        """Item-weighted mean loss of the last window, over ranks (``nan`` if no loss was recorded)."""
        return self._ledger.values()["window_loss"]

    def snapshot(self, **now: Any) -> AccumulationStats:
        """A frozen snapshot of the counters and statistics, with the accumulator's facts (:data:`NOW`).

        Syncs once if a window closed since the last read.
        """
        ledger = self._ledger.values()
        self.peak_memory_bytes = self._memory.read()  # the process's peak so far (a file read)
        values = {**ledger, **{name: getattr(self, name) for name in COUNTS}, **now}
        return AccumulationStats(**{n: int(v) if n in INTEGERS else v for n, v in values.items()})

    def state_dict(self) -> dict[str, Any]:
        """The counters and statistics as plain numbers."""
        return {**{name: getattr(self, name) for name in COUNTS}, **self._ledger.state_dict()}

    @staticmethod
    def check_state(state: Mapping[str, Any]) -> dict[str, int]:
        """The saved counters, converted; ``ValueError`` if ``state`` is not a readable saved form."""
        missing = [key for key in ("windows", "total_micro_batches", "skipped_steps") if key not in state]
        if missing:
            raise ValueError(f"Accumulator state is missing {missing}.")
        return {name: int(state.get(name, 0)) for name in COUNTS}  # converted before anything is assigned

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from counters saved by :meth:`state_dict`; nothing changes if they do not fit."""
        counts = self.check_state(state)
        self._ledger.load_state_dict(state)  # all or nothing itself
        for name, value in counts.items():
            setattr(self, name, value)
