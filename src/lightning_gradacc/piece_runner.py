"""Running each loader batch as pieces with their own backward, and surviving out-of-memory errors.

``piece_size`` keeps the loader's batch as Lightning's unit (every counter, the window plan, schedules and
"auto" K keep their meaning) and runs it inside the step as pieces of at most that many items, each
forward followed by its backward, its loss weighted by its share of the batch's items (tokens with an item
counter). The window's gradient is then exactly the one of the whole batch: memory follows the piece.

How it plugs in: for one fit the runner stands in for the strategy's ``training_step`` and the precision
plugin's ``backward`` (their public methods, on those instances only). ``training_step`` runs the first
piece's forward and hands Lightning a *stand-in* loss of the same value without its graph; Lightning's
hooks run as for any batch (``on_before_backward`` once, ``on_after_backward`` once), and its ``backward``
of the stand-in is where the runner back-propagates each real piece (the others' forwards there too). The
runner thus holds every graph itself and can drop it after an out-of-memory error: Lightning holds none.

``piece_size="auto"`` starts from whole batches. On ``torch.OutOfMemoryError`` (or the messages Lightning's
``is_oom_error`` knows) the piece size halves, rounded up (6, 3, 2, 1): after a forward, the batch goes on
from the failed piece (no gradient was added); after a backward, the batch runs again from its start where
nothing else is lost (``.grad`` then holds that batch's gradient alone: it opens its window, or the window's
earlier gradients are in fp32 buffers), or from a snapshot of the gradients (``oom_snapshot=True``), else it
raises with the reason. At each loader batch's end the data-parallel ranks agree on the size (the smallest)
and count the errors recovered over all of them, in one all-reduce, so that what is logged and saved is the
same on every rank (a checkpoint never holds one rank's view); a new size is announced once, on rank zero.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from .batch_pieces import SplitFn, UnsplittableBatch, batch_length, items_or, pieces_of
from .core.pieces import MicroBatchPieces
from .core.torch_internals import (
    ddp_backward_syncs,
    reset_scaler_optimizer_states,
    skip_ddp_buffer_sync_at_next_forward,
)
from .lightning_internals import as_training_step, grad_scaler

if TYPE_CHECKING:
    from .reduction import WindowReduction

PieceSize = int | Literal["auto"] | None


def check_piece_size(value: Any) -> PieceSize:
    """``value`` if it is ``None``, ``"auto"`` or an int >= 1; else an error naming the argument."""
    if value is None or value == "auto":
        return value  # type: ignore[no-any-return]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"Expected argument `piece_size` to be None, an int >= 1 (items per piece) or 'auto', but got"
            f" {value!r}."
        )
    return value


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an out-of-memory error: torch's, or one Lightning's ``is_oom_error`` knows."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    from pytorch_lightning.utilities.memory import is_oom_error

    return is_oom_error(error)


@dataclass
class PieceCounters:
    """What the runner saves in a checkpoint: the agreed size (a resume does not run out again) and counts.

    ``size`` and ``oom_retries`` are agreed over the ranks at every batch's end; ``new_retries`` and
    ``allocator_retries`` are this rank's own, between two agreements.
    """

    size: int | None = None  # the largest piece that fits ("auto"); None: whole batches so far
    oom_retries: int = 0  # out-of-memory errors recovered from, over the run and the ranks
    new_retries: int = 0  # this rank's, since the last agreement
    allocator_retries: int = 0  # the CUDA allocator's retries last seen (thrashing shrinks the size)

    def state_dict(self) -> dict[str, Any]:
        """The size (``inf``: whole batches, so that the smallest over the ranks is a minimum) and retries."""
        return {"size": math.inf if self.size is None else self.size, "oom_retries": self.oom_retries}

    def load_state_dict(self, state: Mapping[str, Any], *, size: bool = True) -> None:
        """Take a saved :meth:`state_dict` (``size=False``: keep this run's size, an int ``piece_size``)."""
        if size:
            saved = state.get("size")  # None in checkpoints before the ranks agreed at the save
            self.size = None if saved is None or math.isinf(saved) else int(saved)
        self.oom_retries = int(state.get("oom_retries", 0))


@dataclass
class _Run:
    """One loader batch as it runs: its pieces to come, what the first forward left for the backward."""

    batch: Any
    rest: tuple[Any, ...] = ()  # training_step's arguments after the batch
    kwargs: dict[str, Any] = field(default_factory=dict)
    items: Any = None  # the batch's item count (the share's denominator)
    pieces: list[Any] = field(default_factory=list)  # still to run
    first_loss: Tensor | None = None  # the first piece's real loss (with its graph), times its share
    loss_sum: Tensor | None = None  # Σ share x loss of the pieces run: the batch's loss
    largest: int = 0  # the largest piece run
    shares: dict[int, float | Tensor] = field(default_factory=dict)  # by piece (its id): counted once


class PieceRunner:
    """Runs each loader batch of a fit in pieces (see the module docstring).

    Args:
        setting: ``piece_size``: an int, or ``"auto"``.
        split_fn: ``(batch, size) -> list of pieces`` for a batch the default splitter cannot cut.
        snapshot: Keep a copy of the gradients before each batch, so that an out-of-memory error in a
            backward can start the batch over wherever it happens (one gradient of extra memory).
    """

    def __init__(self, setting: int | Literal["auto"], *, split_fn: SplitFn | None, snapshot: bool) -> None:
        self.setting = setting
        self.split_fn = split_fn
        self.snapshot = snapshot
        self.counters = PieceCounters(size=setting if isinstance(setting, int) else None)
        self._run: _Run | None = None
        self._handle: MicroBatchPieces | None = None  # the running batch's, from `begin_pieces`
        self._installed: tuple[Any, Any] | None = None  # (strategy, precision plugin) patched
        self._accumulator: Any = None
        self._count: Callable[[Any], Any] = batch_length
        self._length: Callable[[Any], int] = batch_length
        self._allocator_retries: Callable[[], int | None] = _cuda_allocator_retries
        self._world_size = 1
        self._last_largest = 0
        self._checked = False  # "auto": the first batch was checked to be splittable
        self._warn: Callable[[str], Any] = _ignore
        self._announced: int | None = None  # the last size announced (rank zero, once per size)
        self._mixing_checked = False
        self._lightning_k: Callable[[], int] = _one
        self._mark: Callable[[bool], None] = _ignore_mark
        self._counts_batch_itself = False
        self._sync: WindowReduction | None = None  # the fit's reduction
        self._additive = False  # losses are sums over the items: pieces add without a share

    @property
    def auto(self) -> bool:
        """Whether the size adapts to out-of-memory errors (``"auto"``)."""
        return self.setting == "auto"

    # ------------------------------------------------------------------------------------- the fit

    def install(
        self,
        trainer: Any,
        accumulator: Any,
        *,
        count: Callable[[Any], Any] | None,
        extract: Callable[[Any], int],
        warn: Callable[[str], Any],
        lightning_k: Callable[[], int],
        mark: Callable[[bool], None],
        sync: WindowReduction | None = None,
        additive: bool = False,
    ) -> None:
        """Stand in for the strategy's ``training_step`` and the plugin's ``backward`` for this fit.

        ``count``: the item counter (else a piece's length); ``extract``: Lightning's batch-size inference,
        for the length of a ``split_fn``'s piece the default walk cannot read; ``warn``: rank zero's;
        ``lightning_k``: what Lightning divides each loss by (the window plan's); ``mark(hold_in_grad)``: the
        running batch goes in pieces (its micro-batch must begin through ``begin_pieces``); ``sync``: the
        fit's reduction (FSDP's, deferred to the window's last backward, is held back in the other pieces);
        ``additive``: each loss is a sum over its items divided by a constant (``scaling="constant"``), so the
        pieces' losses add as they are, without a share.
        """
        self.uninstall()
        strategy, plugin = trainer.strategy, trainer.strategy.precision_plugin
        self._step, self._backward = strategy.training_step, plugin.backward
        strategy.training_step, plugin.backward = self._training_step, self._plugin_backward
        self._installed = (strategy, plugin)
        self._sync, self._additive = sync, additive
        self._scaler = grad_scaler(trainer)
        self._trainer = trainer
        self._accumulator = accumulator
        self._length = batch_length if self.split_fn is None else items_or(extract)
        # a piece's share of the items: the counter's, else the first dimension its tensors share (a batch
        # whose tensors disagree, e.g. images per item beside the items, has no such count: refused)
        self._count = count if count is not None else batch_length if self.split_fn is None else _unambiguous
        self._counts_batch_itself = count is None and self.split_fn is not None  # not Lightning's inference
        self._world_size = trainer.world_size
        self._checked = False
        self._warn, self._lightning_k, self._mark = warn, lightning_k, mark
        self._mixing_checked = False  # a forward mixing the items is warned of at the first batch cut
        self._announced = self.counters.size
        self.counters.new_retries = 0
        self.counters.allocator_retries = self._allocator_retries() or 0

    def uninstall(self) -> None:
        """Give the strategy and the plugin their own methods back (end of the fit, or an error)."""
        installed, self._installed = self._installed, None
        self._run, self._handle, self._accumulator, self._trainer, self._sync = None, None, None, None, None
        # what holds the fit goes: the runner is pickled with the callback (`ddp_spawn`) after a fit
        self._warn, self._lightning_k, self._mark = _ignore, _one, _ignore_mark
        if installed is not None:
            strategy, plugin = installed
            del strategy.training_step, plugin.backward  # the instance attributes: the class's show again
            del self._step, self._backward, self._scaler  # bound to the fit's strategy and plugin

    # ------------------------------------------------------------------------------------ per batch

    def begin_batch(self, batch: Any, items: Any) -> None:
        """A loader batch starts (its item count, the shares' denominator, is known)."""
        self._run = _Run(batch, items=items)

    def begun(self, handle: MicroBatchPieces) -> None:
        """The batch's micro-batch began in pieces: the handle that weighs and restarts them."""
        self._handle = handle

    @property
    def in_pieces(self) -> bool:
        """Whether the running batch goes through the runner's backward (else Lightning's, untouched)."""
        run = self._run
        return run is not None and run.first_loss is not None

    def end_batch(self, outputs: Any) -> None:
        """The batch ended: Lightning's ``outputs["loss"]`` becomes the whole batch's (it was the first's).

        With ``"auto"`` the ranks then agree on the size and the errors recovered (:meth:`agree`).
        """
        run, self._run, self._handle = self._run, None, None
        if run is not None and run.loss_sum is not None:
            self._last_largest = run.largest
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else None
            if isinstance(loss, Tensor):  # Lightning's detached copy of L / K
                loss.copy_(run.loss_sum / self._lightning_k())
        if self.auto:
            self.agree()

    def agree(self) -> None:
        """Between batches: the smallest size over the ranks, the errors recovered summed over them.

        One all-reduce under data parallelism (``"auto"``), so that every rank logs and saves the same
        values; a size reached for the first time is announced (rank zero).
        """
        counters = self.counters
        thrashing = self._shrink_if_thrashing()
        new, counters.new_retries = counters.new_retries, 0
        if self._world_size > 1:
            counters.size, new = self._agreed(counters.size, new)
        counters.oom_retries += new
        size = counters.size
        if size is not None and size != self._announced:
            self._announced = size
            why = (
                f"out of memory ({counters.oom_retries} error(s) recovered so far, over the ranks)"
                if new or not thrashing
                else "the CUDA allocator had to free its cache to fit (thrashing)"
            )
            self._warn(
                f"`piece_size='auto'`: {why}; each batch now runs in pieces of at most {size} items (global"
                f" step {self._trainer.global_step}). The gradient is still the whole batch's, but each error"
                f" costs a pass and a garbage collection: start a later run at `piece_size={size}`."
            )

    def metrics(self) -> dict[str, float]:
        """``piece_size`` (the largest piece of the last batch) and ``oom_retries`` (over the run)."""
        return {"piece_size": float(self._last_largest), "oom_retries": float(self.counters.oom_retries)}

    # --------------------------------------------------------------------------- the stand-in methods

    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        run = self._run
        if run is None or not args:
            return self._step(*args, **kwargs)
        run.rest, run.kwargs, run.loss_sum = args[1:], kwargs, None
        size = self.counters.size
        # an int size: the batch's length is read once, here
        whole = size is None or (length := self._length(run.batch)) <= size
        if whole and not self.auto:  # nothing to cut: Lightning's own path
            self._run, self._last_largest = None, length
            return self._step(*args, **kwargs)
        if whole and not self._checked:  # "auto": a batch no one can cut is refused before any error
            self._checked = True
            self._pieces_of(run.batch, (self._length(run.batch) + 1) // 2)
        self._set_pieces(run, [run.batch] if whole else self._pieces_of(run.batch, size))  # type: ignore[arg-type]
        while True:
            piece = run.pieces[0]
            try:
                with self._no_sync() if len(run.pieces) > 1 else nullcontext():
                    output = self._step(piece, *run.rest, **kwargs)
            except Exception as error:
                if not (self.auto and is_out_of_memory(error)):
                    raise
                message = str(error)
            else:
                if output is None and len(run.pieces) == 1 and piece is run.batch:
                    self._run = None  # a skipped batch ("auto", whole): Lightning's path, nothing to weigh
                    return output
                loss = self._piece_loss(output, piece, run)
                run.first_loss = loss
                self._mark(self.auto)  # "auto" holds the pieces in `.grad`: an error may drop them
                stand_in = loss.detach().requires_grad_() * 1.0  # the value, no graph: Lightning holds it
                return _stand_in_output(output, stand_in)
            self._forward_failed()
            self._recover(run, piece, message, backward=False)

    def _plugin_backward(self, tensor: Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        run = self._run
        if run is None or run.first_loss is None:
            self._backward(tensor, model, optimizer, *args, **kwargs)
            return
        del tensor  # the stand-in: its gradient is nothing
        handle = self._handle
        assert handle is not None, "the micro-batch began in pieces (`begin_pieces`)"
        snapshot = self._take_snapshot(handle) if self.snapshot else None
        handle.restart()  # the pieces weigh and record themselves
        while run.pieces:
            piece, last_piece = run.pieces[0], len(run.pieces) == 1
            stage, synced = "forward", False
            loss: Tensor | None
            try:
                loss, run.first_loss = run.first_loss, None
                if loss is None:  # a later piece (the first one's forward ran in `training_step`)
                    with nullcontext() if last_piece else self._no_sync(), as_training_step(self._trainer):
                        loss = self._piece_loss(self._step(piece, *run.rest, **run.kwargs), piece, run)
                assert loss is not None
                stage, synced = "backward", last_piece and self._syncs()
                # FSDP decides in the backward: a deferred reduction waits for the batch's last piece
                held = self._sync.held_back() if self._sync is not None and not last_piece else nullcontext()
                with held:
                    self._backward(self._weighed(loss, piece, run), model, optimizer, *args, **kwargs)
                del loss
            except Exception as error:
                if not (self.auto and is_out_of_memory(error)):
                    raise
                message = str(error)
            else:
                run.largest = max(run.largest, self._length(piece))
                run.pieces.pop(0)
                continue
            loss = None  # the failed pass's graph goes with it
            if stage == "forward":  # no gradient was added: go on from this piece, smaller
                self._forward_failed()
                self._recover(run, piece, message, backward=False)
            else:
                self._restart(run, piece, message, snapshot, synced=synced, handle=handle)

    def _weighed(self, loss: Tensor, piece: Any, run: _Run) -> Tensor:
        """``loss`` (a piece's, times its share) as Lightning back-propagates: / K, AMP-scaled, weighed."""
        scaled = loss / self._lightning_k()  # as Lightning divides (the plan's K for it)
        if self._scaler is not None:
            scaled = self._scaler.scale(scaled)
        assert self._handle is not None
        return self._handle.next(scaled, self._share(piece, run))

    # ------------------------------------------------------------------------------------- recovery

    def _recover(self, run: _Run, piece: Any, message: str, *, backward: bool) -> None:
        """Halve the size below the failed piece's and cut the pieces still to run again."""
        length = self._length(piece)
        if length <= 1:
            raise torch.OutOfMemoryError(
                f"A single item does not fit (piece_size='auto' halved down to 1 and ran out of memory in a"
                f" {'backward' if backward else 'forward'} again): {message}"
            )
        self.counters.size = (length + 1) // 2  # halved, rounded up: 6 -> 3 -> 2, not 6 -> 3 -> 1
        self.counters.new_retries += 1
        self._free()
        # the allocator retried before it raised: that is this error, not thrashing to halve for again
        self.counters.allocator_retries = self._allocator_retries() or 0
        size = self.counters.size
        again = self._pieces_of(piece, size)
        if self.split_fn is not None and max(self._length(part) for part in again) >= length:
            raise RuntimeError(
                f"`split_fn` was asked for pieces of at most {size} items of a piece of {length} that ran out"
                f" of memory, and returned pieces of {[self._length(part) for part in again]}: no smaller"
                " one, so halving would not end. Cut the batch into pieces of at most `size` items (its"
                f" second argument). The error: {message}"
            )
        self._set_pieces(run, [part for old in run.pieces for part in self._pieces_of(old, size)])
        run.loss_sum = None if backward else run.loss_sum

    def _restart(
        self,
        run: _Run,
        piece: Any,
        message: str,
        snapshot: list[Any] | None,
        *,
        synced: bool,
        handle: MicroBatchPieces,
    ) -> None:
        """After an out-of-memory error in a backward: run the batch again from its start, or raise."""
        accumulator = self._accumulator
        if synced:
            raise RuntimeError(
                "Out of memory in a backward that DDP synchronizes (the last piece of a window's last batch):"
                " its all-reduce is half done on this rank, so the batch cannot run again. Set an int"
                f" `piece_size` below {self._length(piece)} for this run. The error: {message}"
            )
        if snapshot is None and not handle.alone_in_grad:
            buffered = accumulator.window.buffered
            where = (
                "written into `.grad` before the window's last batch under DDP" if buffered else "in `.grad`"
            )
            fixes = (
                ""
                if buffered
                else "accumulate in buffers (`accumulation_dtype='float32'` for bf16 weights), "
            )
            raise RuntimeError(
                "Out of memory in a backward, which may have added part of a gradient to the window's earlier"
                f" micro-batches, {where}: the batch cannot run again exactly. To redo it, {fixes}keep a"
                " snapshot of the gradients (`oom_snapshot=True`: one gradient of memory), or set an int"
                f" `piece_size` below {self._length(piece)}. The error: {message}"
            )
        params = accumulator.parameters  # the optimizers' parameters, each once
        if snapshot is None:
            for param in params:
                param.grad = None
        else:
            for param, kept in zip(params, snapshot, strict=True):
                param.grad = None if kept is None else kept.clone()
        handle.restart()
        run.largest = 0  # the batch's pieces start over
        self._recover(run, piece, message, backward=True)
        self._set_pieces(run, self._pieces_of(run.batch, self.counters.size))  # type: ignore[arg-type]

    def _pieces_of(self, batch: Any, size: int) -> list[Any]:
        return pieces_of(batch, max(1, size), self.split_fn)

    def _set_pieces(self, run: _Run, pieces: list[Any]) -> None:
        """The pieces still to run, less those without items (counted on the host: a forward skipped)."""
        run.shares.clear()  # new pieces (an id may be a freed one's)
        run.pieces = pieces
        if len(pieces) > 1 and not self._mixing_checked:
            self._mixing_checked = True
            self._warn_of_mixing()
        if len(pieces) > 1:
            kept = [p for p in pieces if not (isinstance(s := self._share(p, run), float) and s == 0.0)]
            run.pieces = kept or pieces[:1]  # a batch without items runs as one piece, as it would whole

    def _warn_of_mixing(self) -> None:
        """A module whose forward mixes the batch's items (BatchNorm in training): pieces change it."""
        mixing = items_mixed_in_forward(self._trainer.lightning_module)
        if mixing is not None:
            self._warn(
                f"`piece_size={self.setting!r}` runs each batch in pieces, but `{mixing}` normalizes over the"
                " items of its forward (BatchNorm in training mode): each piece is normalized by its own"
                " statistics, so the forward, and the gradient, are not the whole batch's. Pieces are exact"
                " for forwards that treat each item on its own (LayerNorm, GroupNorm, BatchNorm in eval"
                " mode); a loss over pairs of items in the batch (in-batch negatives) is not either."
            )

    def _forward_failed(self) -> None:
        """DDP broadcast its buffers at the start of the failed forward: the next must not do it again."""
        model = getattr(self._installed[0], "model", None)  # type: ignore[index]
        if self._world_size > 1 and model is not None:
            skip_ddp_buffer_sync_at_next_forward(model)

    def _free(self) -> None:
        """What an out-of-memory error leaves: the scaler's per-optimizer state, the outputs, the cache."""
        if self._scaler is not None:
            reset_scaler_optimizer_states(self._scaler)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _take_snapshot(self, handle: MicroBatchPieces) -> list[Tensor | None] | None:
        if handle.alone_in_grad:
            return None  # nothing to lose: no copy
        return [None if p.grad is None else p.grad.detach().clone() for p in self._accumulator.parameters]

    # -------------------------------------------------------------------------------------- helpers

    def _piece_loss(self, output: Any, piece: Any, run: _Run) -> Tensor:
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if not isinstance(loss, Tensor):
            raise RuntimeError(
                "With `piece_size`, `training_step` must return the loss (a Tensor, or a mapping with 'loss')"
                f" for every piece; it returned {type(output).__name__}."
            )
        share = self._share(piece, run)
        if isinstance(share, Tensor):  # a piece without items: its mean is 0/0, its part nothing
            weighted = torch.where(share > 0, loss * share, torch.zeros_like(loss))
        else:
            weighted = loss if share == 1.0 else loss * share
        value = weighted.detach()
        run.loss_sum = value if run.loss_sum is None else run.loss_sum + value
        return weighted

    def _share(self, piece: Any, run: _Run) -> float | Tensor:
        """The piece's part of the batch's items (0 where the batch has none), counted once per piece.

        1 for an additive loss (``scaling="constant"``): its pieces add as they are, none is dropped (an
        unlabelled term may sit in a piece without items), and nothing is counted.
        """
        if self._additive:
            return 1.0
        share = run.shares.get(id(piece))
        if share is None:
            share = run.shares[id(piece)] = self._count_share(piece, run)
        return share

    def _count_share(self, piece: Any, run: _Run) -> float | Tensor:
        total = (
            run.items if run.items is not None and not self._counts_batch_itself else self._count(run.batch)
        )
        part = total if piece is run.batch else self._count(piece)
        if isinstance(total, Tensor) or isinstance(part, Tensor):
            total_t = torch.as_tensor(total)
            part_t = torch.as_tensor(part).to(total_t.device)
            return torch.where(total_t > 0, part_t / torch.where(total_t > 0, total_t, 1), 0.0)
        return float(part) / float(total) if total else 0.0

    @contextmanager
    def _no_sync(self) -> Iterator[None]:
        block = getattr(self._installed[0], "block_backward_sync", None)  # type: ignore[index]
        with block() if block is not None else nullcontext():  # DDP decides in the forward
            yield

    def _syncs(self) -> bool:
        """Whether the coming backward all-reduces over DDP ranks (its forward ran with sync on)."""
        model = getattr(self._installed[0], "model", None)  # type: ignore[index]
        return self._world_size > 1 and ddp_backward_syncs(model)

    def _agreed(self, size: int | None, new_retries: int) -> tuple[int | None, int]:
        """The smallest size over the ranks (None where every rank runs whole) and their new errors, summed.

        One all-reduce (a maximum) of ``[-size, 0, .., new_retries at this rank's slot, .., 0]``.
        """
        import torch.distributed as dist

        values = torch.zeros(1 + self._world_size, dtype=torch.float64)
        values[0] = -math.inf if size is None else -float(size)
        values[1 + int(dist.get_rank())] = float(new_retries)
        device = self._trainer.strategy.root_device
        reduced = values.to(device)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
        smallest, *retries = reduced.tolist()  # the one host read of "auto" per batch, under DDP only
        return (None if smallest == -math.inf else int(-smallest)), int(sum(retries))

    def _shrink_if_thrashing(self) -> bool:
        """The CUDA allocator retried (freed its cache to fit) during the batch: halve the size (True)."""
        retries = self._allocator_retries()
        if retries is None:
            return False
        seen, self.counters.allocator_retries = self.counters.allocator_retries, retries
        if retries > seen and self._last_largest > 1:
            self.counters.size = (min(self.counters.size or self._last_largest, self._last_largest) + 1) // 2
            return True
        return False


_BATCH_NORMS = (
    torch.nn.BatchNorm1d,
    torch.nn.BatchNorm2d,
    torch.nn.BatchNorm3d,
    torch.nn.SyncBatchNorm,
    torch.nn.LazyBatchNorm1d,
    torch.nn.LazyBatchNorm2d,
    torch.nn.LazyBatchNorm3d,
)


def items_mixed_in_forward(module: torch.nn.Module) -> str | None:
    """The name of a submodule whose training forward mixes the items of its batch (a BatchNorm), if any.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
        >>> items_mixed_in_forward(net), items_mixed_in_forward(net.eval())
        ('1', None)
    """
    for name, submodule in module.named_modules():
        if isinstance(submodule, _BATCH_NORMS) and submodule.training:
            return name or type(submodule).__name__
    return None


def _unambiguous(piece: Any) -> int:
    """The items of a ``split_fn``'s piece, where its tensors agree on their first dimension."""
    try:
        return batch_length(piece)
    except UnsplittableBatch as error:
        raise ValueError(
            "With `split_fn`, each piece's loss is weighted by its share of the batch's items, which cannot"
            f" be counted here: {error} Pass `item_count_fn` (e.g. `lambda batch: len(batch['input_ids'])`)"
            " to count the items of a batch and of its pieces."
        ) from None


def _ignore(message: str) -> None:
    """No one to tell (before a fit: a runner is pickled to ``ddp_spawn``'s processes, lambdas are not)."""


def _one() -> int:
    return 1


def _ignore_mark(hold_in_grad: bool) -> None:
    """No fit to tell (before ``install``)."""


def _stand_in_output(output: Any, loss: Tensor) -> Any:
    """What Lightning keeps of the first piece: the stand-in loss, the other values without their graph."""
    if isinstance(output, Mapping):
        return {**_detached(dict(output)), "loss": loss}
    return loss


def _detached(value: Any) -> Any:
    """``value`` with every tensor in its mappings, lists and tuples detached (the structure kept)."""
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, Mapping):
        return {key: _detached(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(item) for item in value) if type(value) in (list, tuple) else value
    return value


def _cuda_allocator_retries() -> int | None:
    """The CUDA caching allocator's ``num_alloc_retries`` (None without CUDA)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return None
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))
