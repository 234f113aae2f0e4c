"""One shape for every capability of a fit: a part, the hooks it takes, the state it saves and declares.

A part is one capability of one fit (the window plan, the window and its driver, the step, the pieces, the
reporting): the callback builds the parts a fit uses, in order, and each of its hooks is a loop over the
parts that take that hook. A part the fit does not use is not in the list (Composer's ``Algorithm`` is the
model: a few methods run at events). What parts share is the :class:`Fit`: the Trainer, the module, the
window driver and the running :class:`Batch`.

A part saves its state by name and declares, for every field, how it stands over the data-parallel ranks
(:data:`Share`; torchmetrics' ``add_state(dist_reduce_fx=...)`` is the model), so that a checkpoint never
holds one rank's view of an agreed quantity: before the save the dispatcher checks the agreed fields equal
over the ranks and reduces the others (:meth:`Parts.state_dict`, one all-reduce per save). A part's
statistics are fields of ``AccumulationStats`` (``kept="part"``), handed over by those names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from ..reporting import SkipWarnings

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from ..core.pieces import MicroBatchPieces
    from ..layouts import Layout
    from ..namespaces import LightningNamespace
    from ..reduction import WindowReduction
    from ..window_driver import WindowDriver

# How a saved field stands over the data-parallel ranks:
# - "local": this rank's own (rank 0's is what the checkpoint holds): for what needs no agreement
# - "agreed": the same on every rank by construction: its numbers are checked equal over the ranks at the
#   save, and a difference raises, naming the field (a bug: a rank's view would be saved as everyone's)
# - "smallest" / "largest": each rank's view until the ranks agree: the save takes the smallest / largest
Share = Literal["local", "agreed", "smallest", "largest"]
# A part's declaration: each top-level key of its state, or of a mapping inside it ("*": every other key)
Declaration = Mapping[str, "Share | Declaration"]

# The hooks a part may take, in the order a fit calls them (the Lightning hook each runs in).
HOOKS = (
    "train_start",  # on_train_start
    "epoch_start",  # on_train_epoch_start
    "batch_start",  # on_train_batch_start
    "before_backward",  # on_before_backward
    "after_backward",  # on_after_backward
    "window_end",  # on_before_optimizer_step
    "batch_end",  # on_train_batch_end
    "window_discarded",  # an open window that can no longer end in a step was dropped
    "exception",  # on_exception
    "train_end",  # on_train_end
)
# Hooks that close what others opened: their parts run in reverse order, as nested contexts exit (the
# reduction leaves FSDP's `no_sync()` before the window records the micro-batch; the plan's fit ends last).
REVERSED = frozenset({"after_backward", "exception", "train_end"})


@dataclass(slots=True)
class Batch:
    """What the fit knows of the running micro-batch: ``on_train_batch_start`` starts a fresh one."""

    items: Any = None  # its item count (a number or a tensor); None: unknown
    label: str = ""  # what `items` is, for the core's messages
    error: str | None = None  # why `items` is unknown, raised at the boundary (on every rank together)
    backward_ran: bool = False  # False: `training_step` returned None
    recorded: bool = False  # recorded in the window, the batch not ended: a save now is mid-batch
    finalized: bool = False  # the window was finalized (stepped or skipped) in it; LBFGS may re-evaluate
    ended: bool = False  # `on_train_batch_end` ran: a save now is between batches
    last: bool = False  # its backward ends the window (where the driver or the reduction asks)
    in_pieces: bool = False  # it runs as pieces: the micro-batch begins through `begin_pieces`
    hold_in_grad: bool = (
        False  # its pieces add up in `.grad` until it is recorded ("auto": a redo drops them)
    )
    pieces: MicroBatchPieces | None = None  # the handle of its pieces, once its micro-batch began


class Fit:
    """What the parts of one fit share (built at ``setup``, filled in as the fit goes).

    Attributes:
        trainer: The Trainer.
        pl_module: The module trained.
        api: The Trainer's Lightning namespace.
        layout: What the strategy means for the gradients.
        driver: The window driver (the core accumulator, or an engine's window), from train start.
        sync: Which backward reduces over the ranks (from train start).
        scaler: The fit's GradScaler, or ``None``.
        batch: The running micro-batch.
        warn: Warns on rank zero.
        verify: Runs the run checks of a phase (``compatibility.CHECKS``).
        discard: Drops an open window that can no longer end in a step (every part's ``window_discarded``).
        skips: Warns of steps skipped for non-finite gradients (the callback's, over its fits).
        once: What was said or done once for the callback (over its fits).
        stepped_on_device: Whether a step of this fit was decided on the device.
    """

    def __init__(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        api: LightningNamespace,
        layout: Layout,
        *,
        scaler: torch.amp.GradScaler | None,
        verify: Callable[[str], None],
        skips: SkipWarnings | None = None,
        once: set[str] | None = None,
    ) -> None:
        self.trainer, self.pl_module, self.api, self.layout = trainer, pl_module, api, layout
        self.scaler, self.verify, self.warn = scaler, verify, api.rank_zero_warn
        self.driver: WindowDriver | None = None
        self.sync: WindowReduction | None = None
        self.batch = Batch(ended=True)
        self.discard: Callable[[str], None] = lambda why: None
        # the callback's, over its fits: steps skipped for non-finite gradients (warned of at a falling
        # rate), and what is said or read once (a count's warning, the labels of "weighted")
        self.skips = skips if skips is not None else SkipWarnings()
        self.once: set[str] = once if once is not None else set()
        self.stepped_on_device = False  # a step of this fit was decided on the device (a fused optimizer)


class FitPart:
    """One capability of a fit: it takes the hooks it overrides (:data:`HOOKS`), in the fit's part order.

    Attributes:
        fit: The fit it is a part of.
        saved: The keys of its state, each with how it stands over the ranks (:data:`Share`); empty: it
            saves nothing.
    """

    saved: ClassVar[Declaration] = {}

    def __init__(self, fit: Fit) -> None:
        self.fit = fit

    def train_start(self) -> None:
        """Training starts: the wrapped model, the optimizers and the reduction are known."""

    def epoch_start(self) -> None:
        """A training epoch starts."""

    def batch_start(self, batch: Any, batch_idx: int) -> None:
        """A loader batch starts (``fit.batch`` is fresh)."""

    def before_backward(self, loss: torch.Tensor) -> None:
        """Lightning is about to back-propagate ``loss`` (the batch's, or its first piece's stand-in)."""

    def after_backward(self) -> None:
        """The batch's backward ran."""

    def window_end(self, optimizer: torch.optim.Optimizer) -> None:
        """Lightning is about to step ``optimizer`` (``on_before_optimizer_step``)."""

    def batch_end(self, outputs: Any) -> None:
        """The batch ended (``on_train_batch_end``)."""

    def window_discarded(self) -> None:
        """An open window that can no longer end in a step was dropped (windows never merge)."""

    def exception(self) -> None:
        """The fit raised (``on_exception``)."""

    def train_end(self) -> None:
        """Training ended (``on_train_end``)."""

    def statistics(self) -> dict[str, float]:
        """Its values among ``AccumulationStats``' fields (``kept="part"``), by name."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Its state by the keys of :attr:`saved`."""
        return {}


class Parts:
    """The parts of one fit, in order, and for each hook the parts that take it: the callback's loops.

    Each hook's tuple holds, in the order its loop runs them (:data:`REVERSED` hooks backwards), the bound
    methods of the parts that override it: a part that does not take a hook costs nothing there.

    Example:
        >>> class Counts(FitPart):
        ...     def batch_start(self, batch, batch_idx): print("batch", batch_idx)
        >>> parts = Parts([Counts(None), FitPart(None)])
        >>> for hook in parts.batch_start: hook(None, 3)
        batch 3
        >>> parts.window_end
        ()
    """

    def __init__(self, parts: list[FitPart]) -> None:
        self.parts = tuple(parts)
        for hook in HOOKS:  # a hook's loop holds only the parts that take it
            base = getattr(FitPart, hook)
            taken = tuple(getattr(part, hook) for part in parts if getattr(type(part), hook) is not base)
            setattr(self, hook, taken[::-1] if hook in REVERSED else taken)

    # one attribute per hook (set above); declared for the type checker
    train_start: tuple[Callable[[], None], ...]
    epoch_start: tuple[Callable[[], None], ...]
    batch_start: tuple[Callable[[Any, int], None], ...]
    before_backward: tuple[Callable[[torch.Tensor], None], ...]
    after_backward: tuple[Callable[[], None], ...]
    window_end: tuple[Callable[[torch.optim.Optimizer], None], ...]
    batch_end: tuple[Callable[[Any], None], ...]
    window_discarded: tuple[Callable[[], None], ...]
    exception: tuple[Callable[[], None], ...]
    train_end: tuple[Callable[[], None], ...]

    def statistics(self) -> dict[str, float]:
        """The parts' values, by their names in ``AccumulationStats``."""
        values: dict[str, float] = {}
        for part in self.parts:
            values.update(part.statistics())
        return values

    def state_dict(self, world_size: int, device: torch.device) -> dict[str, Any]:
        """Every part's state, its agreed fields checked equal and the others reduced over the ranks.

        One all-reduce (of the declared numbers) under data parallelism; every rank must call it, as every
        rank takes part in a Lightning save.

        Raises:
            RuntimeError: An agreed number differs between the ranks (naming it).
        """
        entry: dict[str, Any] = {}
        declared: dict[str, Share | Declaration] = {}
        for part in self.parts:
            state = part.state_dict()
            undeclared = set() if "*" in part.saved else set(state) - set(part.saved)
            if undeclared:
                raise KeyError(f"{type(part).__name__} saves {sorted(undeclared)} without declaring them.")
            entry.update(state)
            declared.update(part.saved)
        if world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            agree_over_ranks(entry, declared, device)
        return entry


def _numbers(state: Any, declared: Share | Declaration, path: str) -> Iterator[tuple[str, Share, Any, Any]]:
    """Every number (or ``None``) of ``state`` with its path, its share and where it sits (mapping, key)."""
    if not isinstance(state, Mapping):
        return
    for key, value in state.items():
        share = declared if isinstance(declared, str) else declared.get(key, declared.get("*", "local"))
        where = f"{path}.{key}" if path else str(key)
        if isinstance(value, Mapping):
            yield from _numbers(value, share, where)
        elif not isinstance(share, Mapping) and (
            value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
        ):
            yield where, share, state, key


def agree_over_ranks(entry: dict[str, Any], declared: Declaration, device: torch.device) -> None:
    """Check the agreed numbers of ``entry`` equal over the ranks; reduce the smallest/largest ones, in place.

    Two all-reduces (maxima): how many numbers each rank holds, so that ranks holding different fields
    fail by name rather than in the collective; then ``[v, -v]`` of every number that is not local, ``nan``
    and ``None`` flagged apart (a maximum would hide them), for the largest and the smallest over the ranks.

    Raises:
        RuntimeError: An agreed number differs between the ranks, or the ranks hold different fields.
    """
    fields = [item for item in _numbers(entry, declared, "") if item[1] != "local"]
    count = torch.tensor([len(fields), -len(fields)], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
    if count[0] != -count[1]:
        raise RuntimeError(
            f"The ranks save different fields ({int(-count[1])} to {int(count[0])} numbers that are not"
            " local): a checkpoint would keep one rank's view. This is a bug of"
            " `GradientAccumulationCallback`; please report it."
        )
    if not fields:
        return
    numbers = [mapping[key] for _, _, mapping, key in fields]
    flags = [2.0 if value is None else 1.0 if value != value else 0.0 for value in numbers]  # None, nan
    values = [0.0 if flag else float(value) for value, flag in zip(numbers, flags, strict=True)]
    vector = torch.tensor(values + flags, dtype=torch.float64, device=device)
    both = torch.cat([vector, -vector])
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX)
    size = len(fields)
    high, low = both[:size].tolist(), (-both[2 * size : 3 * size]).tolist()
    flag_high, flag_low = both[size : 2 * size].tolist(), (-both[3 * size :]).tolist()
    for index, (where, share, mapping, key) in enumerate(fields):
        if share == "agreed" and (high[index] != low[index] or flag_high[index] != flag_low[index]):
            shown = (
                "None, nan or a number"
                if flag_high[index] != flag_low[index]
                else f"{low[index]} to {high[index]}"
            )
            raise RuntimeError(
                f"`{where}` is saved as agreed over the ranks, but they hold {shown}: a checkpoint would keep"
                " one rank's view. This is a bug of `GradientAccumulationCallback`; please report it."
            )
        if share in ("smallest", "largest") and flag_high[index] == 0.0:  # numbers on every rank
            chosen = low[index] if share == "smallest" else high[index]
            value = mapping[key]
            mapping[key] = type(value)(chosen) if math.isfinite(chosen) else chosen
