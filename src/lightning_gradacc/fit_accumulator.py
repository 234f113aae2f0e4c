"""The accumulator of one fit: built over what the optimizers step, following their groups, given saved state.

It is built over the parameters the Trainer's optimizers step, follows their parameter groups, and takes the
counters and the open window a checkpoint (or the previous fit) left.

Which parameters are accumulated: those the optimizers step, named through the module. This is the set
Lightning's clipping and the GradScaler work on: a parameter that requires grad but is in no optimizer (a
frozen teacher, a loss module) is left alone. A checkpoint's entry waits in :class:`SavedState` until the
accumulator of the next fit is built (``on_train_start``); without one, the counters of the previous fit
carry over, so that they survive a second ``fit()`` as a resume.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .core import AccumulationStats, GradAccumulator
from .core.checkpoint import check_format, stamp
from .core.settings import AccumulationSettings
from .core.statistics import RunStatistics

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from .reduction import WindowReduction
    from .window_driver import WindowDriver


def optimized_parameters(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[tuple[str, Tensor]]:
    """What the optimizers step (their ``param_groups``), each once, named as in the module.

    A parameter the module does not hold is named after its place, e.g. ``optimizer0.param_groups[1][0]``.
    Without an optimizer (nothing steps) these are the module's parameters.
    """
    names = {id(param): name for name, param in pl_module.named_parameters()}
    named: list[tuple[str, Tensor]] = []
    seen: set[int] = set()
    for o, optimizer in enumerate(trainer.optimizers):
        for g, group in enumerate(optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                if id(param) not in seen:
                    seen.add(id(param))
                    named.append((names.get(id(param), f"optimizer{o}.param_groups[{g}][{i}]"), param))
    return named or list(pl_module.named_parameters())


def param_groups_signature(trainer: pl.Trainer) -> tuple[tuple[int, int], ...]:
    """Changes when a parameter group is added, or its list replaced or resized (``BaseFinetuning``).

    Looked at after every backward: one optimizer with one group, the common case, takes no loop.
    """
    optimizers = trainer.optimizers
    if len(optimizers) == 1:
        groups = optimizers[0].param_groups
        if len(groups) == 1:
            params = groups[0]["params"]
            return ((id(params), len(params)),)
    signature = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            params = group["params"]
            signature.append((id(params), len(params)))
    return tuple(signature)


class SavedState:
    """Saves the callback's state and holds a loaded one until :meth:`restore` hands it to an accumulator.

    Attributes:
        counters: The accumulator's state loaded from a checkpoint, not restored yet.
        window: The open window loaded from a checkpoint, not restored yet.

    Example:
        >>> entry = SavedState.save(None, mid_batch=False, warn=print)
        >>> entry["accumulator"], entry["window"]
        (None, None)
    """

    def __init__(self) -> None:
        self.counters: dict[str, Any] | None = None
        self.window: dict[str, Any] | None = None

    @staticmethod
    def save(
        accumulator: WindowDriver | None,
        *,
        mid_batch: bool,
        warn: Callable[[str], Any],
        in_batch: bool = False,
    ) -> dict[str, Any]:
        """The entry: counters and the open window (tensors and numbers: ``weights_only=True`` loads it).

        Under DDP this sums the open window over ranks (every rank takes part, as in every Lightning save).

        Args:
            accumulator: The accumulator of the current fit, or ``None``.
            mid_batch: Whether a micro-batch was recorded in a batch that has not ended.
            warn: Warns once (on rank zero) that such a save cannot resume exactly.
            in_batch: Whether a batch started and has not ended (``mid_batch`` too, once it is recorded).
        """
        window = accumulator.window_state_dict() if accumulator is not None else None
        if in_batch and not mid_batch:  # before the micro-batch's backward
            warn(
                "This checkpoint is taken inside a batch that has not ended (an exception in"
                " `on_train_batch_start` or `training_step`, saved by `OnExceptionCheckpoint`?). Lightning"
                " resumes the data where its loader stood at the save, after the batch it had fetched (a"
                " resumable loader such as torchdata's `StatefulDataLoader`), so that batch is never trained"
                " on: the resumed run is the uninterrupted run without it, not the same run. Checkpoints"
                " taken at a batch's end resume exactly."
            )
        if window is not None and mid_batch:
            warn(
                "This checkpoint is taken after a micro-batch's backward but before its batch ended (an"
                " exception in a later hook of the batch, saved by `OnExceptionCheckpoint`?): the saved"
                " window holds that micro-batch, while Lightning restarts the batch's index when it resumes,"
                " so a resume from it is not exact. Checkpoints taken at a batch's end resume exactly."
            )
        return stamp(
            {"accumulator": accumulator.state_dict() if accumulator is not None else None, "window": window}
        )

    def load(self, state_dict: dict[str, Any]) -> None:
        """Keep a checkpoint's entry for the next accumulator; refuse another format version now.

        The entry and each part carry the format version (see ``core.checkpoint.stamp``); they are checked
        here, at the load, not when a later accumulator takes a part.
        """
        check_format(state_dict, "`GradientAccumulationCallback` state")
        counters, window = state_dict.get("accumulator"), state_dict.get("window")
        for part, what in ((counters, "accumulator state"), (window, "pending accumulation window")):
            if part is not None:
                check_format(part, what)
        self.counters, self.window = counters, window

    def stats(self, accumulation_steps: int) -> AccumulationStats:
        """The loaded checkpoint's statistics, before an accumulator takes them (a checkpoint must be held).

        What a fit that trains nothing (its checkpoint's run is finished) reports.
        """
        assert self.counters is not None, "no checkpoint's statistics are held"
        statistics = RunStatistics(torch.device("cpu"), torch.float64)
        statistics.load_state_dict(self.counters)
        return statistics.snapshot(accumulation_steps=accumulation_steps)

    def restore(
        self,
        accumulator: WindowDriver,
        previous: WindowDriver | None,
        *,
        primary: bool,
    ) -> None:
        """Load the counters (a checkpoint's, else the previous fit's) and a saved window into a new one.

        The window is re-opened on the ``primary`` rank only (the others start from zero), and is taken even
        if it fails to load; the counters stay until they load.
        """
        counters = self.counters
        if counters is None and previous is not None:
            counters = previous.state_dict()
        if counters is not None:
            accumulator.load_state_dict(counters)
        window, self.window = self.window, None
        if window is not None:
            accumulator.load_window_state_dict(window, primary=primary)
        self.counters = None


def build_accumulator(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    *,
    settings: AccumulationSettings,
    grad_scaler: Any,
    reduction: WindowReduction,
    sharded_model: torch.nn.Module | None,
    in_backward: bool,
) -> GradAccumulator:
    """The accumulator of a fit, over what the Trainer's optimizers step.

    It all-reduces on the default group, as Lightning's DDP does, but without ``strategy.reduce``'s barrier.

    Args:
        trainer: The Trainer, its strategy set up.
        pl_module: The module trained.
        settings: The callback's math settings.
        grad_scaler: The fit's GradScaler, or ``None``.
        reduction: How the ranks reduce the window (who averages).
        sharded_model: The model FSDP shards, whose gradients the core finds per shard (``Layout``).
        in_backward: Whether buffers may take each gradient inside the backward.
    """
    return GradAccumulator(
        optimized_parameters(trainer, pl_module),
        world_size=trainer.world_size,
        settings=settings,
        grad_scaler=grad_scaler,
        fsdp_module=sharded_model,  # FSDP1's flat slices, FSDP2's gradients
        reduce_gradients=reduction.core_reduces,
        accumulate_in_backward=in_backward and reduction.gradients_in_backward,
    )


class ParameterGroups:
    """Follows the optimizers' parameter groups: a group added or changed (``BaseFinetuning``) is tracked.

    Attributes:
        signature: Of the groups the accumulator tracks (see :func:`param_groups_signature`).
    """

    def __init__(self) -> None:
        self.signature: tuple[tuple[int, int], ...] = ()
        # one optimizer with one group (the common case): its list of parameters and their number, looked at
        # with no tuple built (three times per micro-batch)
        self._params: list[Any] | None = None
        self._count = 0

    def tracked(self, trainer: pl.Trainer) -> None:
        """The accumulator was just built over the groups as they are."""
        self.signature = param_groups_signature(trainer)
        optimizers = trainer.optimizers
        groups = optimizers[0].param_groups if len(optimizers) == 1 else ()
        self._params = groups[0]["params"] if len(groups) == 1 else None
        self._count = len(self._params) if self._params is not None else 0

    def follow(self, trainer: pl.Trainer, pl_module: pl.LightningModule, accumulator: WindowDriver) -> None:
        """Track the optimized parameters again if a group was added or changed since the last look."""
        params = self._params
        if params is not None:
            optimizers = trainer.optimizers
            if len(optimizers) == 1:
                groups = optimizers[0].param_groups
                if len(groups) == 1 and groups[0]["params"] is params and len(params) == self._count:
                    return
        signature = param_groups_signature(trainer)
        if signature != self.signature:
            accumulator.track(optimized_parameters(trainer, pl_module))
            self.tracked(trainer)
