"""Every private or undocumented attribute of Lightning, the GradScaler and DDP that the callback relies on.

One small function each, so that a Lightning (or torch) upgrade that moves one of them breaks here, in one
place. The comments name what each relies on, in the sources of Lightning 2.6 (``pytorch_lightning`` and
``lightning.pytorch`` are the same code; paths are relative to either package) and torch 2.x. Nothing here
imports Lightning: the functions work on the objects of either namespace.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .core.torch_internals import steps_with_amp_scaling

if TYPE_CHECKING:
    import pytorch_lightning as pl

# ----------------------------------------------------------------------------------------------- loops


@contextlib.contextmanager
def as_training_step(trainer: pl.Trainer) -> Iterator[None]:
    """Run a ``training_step`` called from elsewhere (a piece's, inside the backward) as Lightning's own.

    ``LightningModule._current_fx_name``, which ``trainer/call.py``'s ``_call_strategy_hook`` sets around
    the strategy's ``training_step`` and restores: ``self.log`` files its values under that hook's name.
    """
    module = trainer.lightning_module
    previous = module._current_fx_name
    module._current_fx_name = "training_step"
    try:
        yield
    finally:
        module._current_fx_name = previous


def should_accumulate(trainer: pl.Trainer) -> bool:
    """Whether the current micro-batch does not end a window: Lightning's own test.

    ``_FitLoop._should_accumulate`` (``loops/fit_loop.py``, which asks ``loops/training_epoch_loop.py``):
    what ``loops/optimization/automatic.py`` asks before it steps, so the callback and Lightning agree on
    where a window ends, the epoch's last batch included.
    """
    return bool(trainer.fit_loop._should_accumulate())


def batches_ready(trainer: pl.Trainer) -> int:
    """Batches fetched in this epoch so far, the current one included.

    ``batch_progress.current.ready`` of ``loops/training_epoch_loop.py``: incremented before
    ``on_train_batch_start``, and what ``_accumulated_batches_reached`` takes the modulo of to decide a step.
    """
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def backward_skipped(trainer: pl.Trainer) -> bool:
    """Whether Lightning runs neither ``zero_grad`` nor ``backward`` in this batch.

    ``_FitLoop._skip_backward`` (``loops/fit_loop.py``, forwarded to ``loops/optimization/automatic.py``,
    whose ``_make_zero_grad_fn`` then returns ``None``); ``StochasticWeightAveraging`` sets it
    (``callbacks/stochastic_weight_avg.py``).
    """
    return bool(trainer.fit_loop._skip_backward)


class _HeldBatches(Iterator[Any]):
    """Lightning's batch iterator with batches read ahead held, in order, for Lightning to take next."""

    def __init__(self, source: Iterator[Any]) -> None:
        self.source, self.held, self.ended = source, collections.deque[Any](), False

    def __next__(self) -> Any:
        if self.held:
            return self.held.popleft()
        if self.ended:  # an exhausted iterator is not asked again
            raise StopIteration
        return next(self.source)

    def ahead(self, count: int) -> list[Any]:
        """The next ``count`` items (fewer where the iterator ends), left for :meth:`__next__`."""
        while len(self.held) < count and not self.ended:
            try:
                self.held.append(next(self.source))
            except StopIteration:
                self.ended = True
        return list(itertools.islice(self.held, count))


def read_ahead(trainer: pl.Trainer, count: int) -> list[Any]:
    """The next ``count`` training batches, as the loader yields them, without taking them from Lightning.

    ``_FitLoop._data_fetcher`` (``loops/fit_loop.py``): a ``_DataFetcher`` (``loops/fetchers.py``) whose
    ``iterator`` (the ``CombinedLoader``'s, made anew by ``iter(fetcher)`` each epoch) yields
    ``(batch, batch_idx, dataloader_idx)`` and whose ``batches`` (``_PrefetchDataFetcher``) holds those
    fetched already. The iterator is wrapped so that the batches read here are the ones Lightning takes
    next, in order; the fetcher's ``fetched`` and ``done`` count only what Lightning took. Fewer than
    ``count`` where the epoch ends first.
    """
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is None or fetcher.iterator is None or count <= 0:
        return []
    if not isinstance(fetcher.iterator, _HeldBatches):
        fetcher.iterator = _HeldBatches(fetcher.iterator)
    prefetched = list(getattr(fetcher, "batches", ()))[:count]
    items = prefetched + fetcher.iterator.ahead(count - len(prefetched))
    return [item[0] if isinstance(item, tuple) and len(item) == 3 else item for item in items]


def held_ahead(trainer: pl.Trainer) -> int:
    """Batches :func:`read_ahead` read that Lightning has not taken yet (0 where none were read)."""
    fetcher = trainer.fit_loop._data_fetcher
    iterator = getattr(fetcher, "iterator", None)
    return len(iterator.held) if isinstance(iterator, _HeldBatches) else 0


def load_train_data(trainer: pl.Trainer) -> None:
    """Load the train dataloader now, as ``trainer.estimated_stepping_batches`` does (once per fit).

    ``_FitLoop.setup_data`` (``loops/fit_loop.py``; ``trainer/trainer.py`` calls it for the estimate). On
    an error it forgets ``_FitLoop._combined_loader``: a half-built loader would be kept, and the fit would
    not load it again. Call it inside :func:`reading_train_data_early`.

    Raises:
        Exception: Whatever loading raised (e.g. data built in ``LightningModule.setup``, not yet run).
    """
    try:
        trainer.fit_loop.setup_data()
    except Exception:
        trainer.fit_loop._combined_loader = None
        raise


@contextlib.contextmanager
def reading_train_data_early(trainer: pl.Trainer) -> Iterator[list[bool]]:
    """Let the train dataloader be built early; yields ``[built]``: whether it was built inside.

    ``_FitLoop.setup_data`` loads the dataloaders' saved states (``_load_combined_loader_states``, e.g. a
    ``StatefulDataLoader``'s position) only when it builds ``_FitLoop._combined_loader``; built before a
    checkpoint's loop state is restored (for ``trainer.estimated_stepping_batches`` or a target batch
    size), the loader is never built again and a resume restarts the epoch's data from its start (Lightning
    #20550, open in 2.6). Where a checkpoint is already known to be restored (``trainer.ckpt_path``, set
    after ``setup``), a loader built here is forgotten at once; one built in ``setup`` is forgotten by
    :func:`forget_train_data` when the checkpoint's state arrives. Either way the fit builds it again after
    the restore: the user's ``train_dataloader()`` runs twice on a resume.
    """
    built_before = trainer.fit_loop._combined_loader is not None
    built = [False]
    try:
        yield built
    finally:
        built[0] = not built_before and trainer.fit_loop._combined_loader is not None
        if built[0] and trainer.ckpt_path is not None:
            forget_train_data(trainer)


def forget_train_data(trainer: pl.Trainer) -> None:
    """Drop a train dataloader built before a checkpoint's restore: ``_FitLoop._combined_loader = None``.

    The fit builds it again and loads its saved state (see :func:`reading_train_data_early`).
    """
    trainer.fit_loop._combined_loader = None


def logs_this_step(trainer: pl.Trainer) -> bool:
    """Whether ``self.log(on_step=True)`` values reach the loggers at this step (``log_every_n_steps``).

    ``_LoggerConnector.should_update_logs`` (``trainer/connectors/logger_connector/logger_connector.py``),
    which Lightning's own ``LearningRateMonitor`` and ``ThroughputMonitor`` ask too, computed as it does
    for the fit loop, whose training hooks are the only ones asking here: its own answer first finds the
    active loop through the Trainer's state enums, which costs about 4 µs a call. Its step is
    ``_batches_that_stepped`` of ``loops/training_epoch_loop.py``, plus 1.
    """
    every = trainer.log_every_n_steps  # type: ignore[attr-defined]  # set by the logger connector
    if every == 0:
        return False
    step = trainer.fit_loop.epoch_loop._batches_that_stepped + 1
    return step % every == 0 or bool(trainer.should_stop)


def log_step_metrics(trainer: pl.Trainer, metrics: dict[str, float], *, to_loggers: bool = True) -> None:
    """Hand ``metrics`` to every logger at this step, and to ``callback_metrics`` and ``logged_metrics``.

    ``to_loggers=False``: to ``callback_metrics`` only, as ``self.log`` fills it between logging steps.

    As ``callbacks/lr_monitor.py`` logs: ``logger.log_metrics(..., step=_batches_that_stepped)`` of
    ``loops/training_epoch_loop.py``, the step Lightning's own ``self.log`` values of this batch get
    (``_LoggerConnector.log_metrics``). ``self.log`` costs about 0.35 ms a value on a CPU (a result metric
    per key, moved and reduced as a tensor; on a GPU a host-to-device copy each), 6 ms for the callback's
    statistics. ``callback_metrics`` (read by ``ModelCheckpoint(monitor=...)``, ``EarlyStopping`` and
    ``ddp_spawn``'s return to the launcher) and ``logged_metrics`` are the dictionaries the logger
    connector keeps (``trainer/connectors/logger_connector/logger_connector.py``), updated in place.
    """
    if to_loggers and trainer.loggers:
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        for logger in trainer.loggers:
            logger.log_metrics(metrics=metrics, step=step)  # as the logger connector calls it
        trainer.logged_metrics.update(metrics)  # type: ignore[arg-type]
    if metrics:  # one tensor made for all (a tensor each cost 5 µs a value): each value a 0-d view of it
        values = torch.tensor(list(metrics.values()), dtype=torch.get_default_dtype()).unbind()
        trainer.callback_metrics.update(zip(metrics, values, strict=True))


# -------------------------------------------------------------------------------------------- clipping


def clip_as_lightning(trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
    """Clip as Lightning does after ``on_before_optimizer_step``: ``configure_gradient_clipping``.

    ``Precision._clip_gradients`` (``plugins/precision/precision.py``, called by ``_after_closure``), for a
    step the callback takes itself, which Lightning's own path would not clip.
    """
    trainer.precision_plugin._clip_gradients(
        pl_module, optimizer, trainer.gradient_clip_val, trainer.gradient_clip_algorithm
    )


def _no_clipping(*args: Any, **kwargs: Any) -> None:
    return None


@dataclass
class PausedClipping:
    """Lightning's clipping of one precision plugin, paused by :func:`pause_clipping` until :meth:`resume`.

    Attributes:
        plugin: The precision plugin whose ``clip_gradients`` is replaced.
        own: An instance attribute ``clip_gradients`` it had before (``None``: the class's method).
    """

    plugin: Any
    own: Any

    def resume(self) -> None:
        """The plugin's own ``clip_gradients`` again."""
        if self.own is not None:
            self.plugin.clip_gradients = self.own
        else:
            del self.plugin.clip_gradients  # the class's method again


def pause_clipping(plugin: Any) -> PausedClipping:
    """Make the plugin's ``clip_gradients`` do nothing: an instance attribute over the class's method.

    Every clipping Lightning does (``gradient_clip_val``, or a module's ``configure_gradient_clipping``
    calling ``LightningModule.clip_gradients``, ``core/module.py``) goes through
    ``Precision.clip_gradients`` (``plugins/precision/precision.py``).
    """
    paused = PausedClipping(plugin, plugin.__dict__.get("clip_gradients"))
    plugin.clip_gradients = _no_clipping
    return paused


# ------------------------------------------------------------------------------------ precision, scaler


def grad_scaler(trainer: pl.Trainer) -> torch.amp.GradScaler | None:
    """The GradScaler of ``precision="16-mixed"``, or ``None``.

    ``MixedPrecision.scaler`` (``plugins/precision/amp.py``); other plugins have no ``scaler``.
    """
    return getattr(trainer.precision_plugin, "scaler", None)


def lightning_unscales(optimizer: Any) -> bool:
    """Whether Lightning's ``MixedPrecision`` unscales the gradients before ``on_before_optimizer_step``.

    ``MixedPrecision.optimizer_step`` (``plugins/precision/amp.py``) skips ``scaler.unscale_`` for an
    optimizer that unscales inside its step (``_optimizer_handles_unscaling`` of ``lightning_fabric``: torch's
    fused ones, ``_step_supports_amp_scaling``): the hook would see gradients carrying the AMP scale.
    """
    return not steps_with_amp_scaling(optimizer)


# ---------------------------------------------------------------------------------------- strategies


def fsdp_uses_orig_params(strategy: Any) -> bool:
    """Whether an ``FSDPStrategy`` wraps with ``use_orig_params=True``.

    ``FSDPStrategy.kwargs`` (``strategies/fsdp.py``), where it defaults ``use_orig_params`` to ``True``.
    """
    return bool(getattr(strategy, "kwargs", {}).get("use_orig_params", True))


def tensor_parallel_size(strategy: Any) -> Any:
    """A ``ModelParallelStrategy``'s tensor-parallel size (an int, or ``"auto"`` before its set-up).

    ``ModelParallelStrategy._tensor_parallel_size`` (``strategies/model_parallel.py``); 1 for others.
    """
    return getattr(strategy, "_tensor_parallel_size", 1)


def ddp_comm_hook(strategy: Any) -> Any:
    """The ``ddp_comm_hook`` a ``DDPStrategy`` registers, or ``None``.

    ``DDPStrategy._ddp_comm_hook`` (``strategies/ddp.py``).
    """
    return getattr(strategy, "_ddp_comm_hook", None)


def compiled_module_context(pl_module: Any) -> Any:
    """The dynamo context of a ``torch.compile``-d LightningModule, else ``None``.

    ``Trainer.fit`` unwraps it into the module's ``_compiler_ctx``
    (``pytorch_lightning/utilities/compile.py``, ``from_compiled``).
    """
    context = getattr(pl_module, "_compiler_ctx", None)
    return context.get("dynamo_ctx") if isinstance(context, dict) else None
