"""A check users run on their own step: is one window's gradient the same however its batches are cut?

The update of a window equals one big batch only if the loss ``training_step`` returns keeps the contract of
the callback's scaling (``docs/normalizations.md``). A loss that breaks it trains, and its curve looks fine:
a second factor hides in the update (an auxiliary term normalized per micro-batch arrives once per
micro-batch; a loss multiplied by the world size beside a local count grows with the ranks; a mean of
per-sequence means weighted by tokens favours long micro-batches). This module finds it the way those bugs
were found by hand: it computes the same window's gradient cut in different ways and compares.

The cuts, each through a real ``Trainer.fit`` of a copy of the module, on the CPU, in eval mode (dropout and
batch statistics would differ between cuts by themselves), stopped before its optimizer step:

* ``micro-batches``: the batches as the loader gave them, one window of all of them (the reference);
* ``items``: every batch cut into pieces of one item by the package's splitter, each piece a micro-batch
  of the window;
* ``ranks``: the batches dealt over ``ranks`` DDP processes (gloo), each rank's share one window.

It does so for the callback's own settings and for each normalization the package provides (token mean,
predicted-token mean, sequence mean, sample mean, a constant normaliser) and reports the relative difference
of each cut and which normalizations make the step invariant.

Example:
    >>> import torch
    >>> from torch import nn
    >>> import pytorch_lightning as pl
    >>> class Step(pl.LightningModule):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.net = nn.Linear(3, 1)
    ...     def training_step(self, batch, batch_idx):
    ...         x, y = batch
    ...         return nn.functional.mse_loss(self.net(x), y)  # a mean over the batch's samples
    ...     def configure_optimizers(self):
    ...         return torch.optim.SGD(self.parameters(), lr=0.1)
    >>> _ = torch.manual_seed(0)
    >>> batches = [(torch.randn(n, 3), torch.randn(n, 1)) for n in (2, 5)]  # unequal micro-batches
    >>> check_step(Step(), batches, {"scaling": "mean"}, ranks=1).invariant  # "mean" weighs 2 like 5
    False
    >>> check_step(Step(), batches, {"scaling": "weighted"}, ranks=1).invariant
    True
"""

from __future__ import annotations

import copy
import importlib
import logging
import math
import os
import pickle
import socket
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .batch_pieces import SplitFn, pieces_of
from .core.scaling import SCALING_MODES
from .core.settings import check_scaling
from .core.torch_internals import leave_the_group_and_exit
from .counters import count_predicted_tokens, count_sequences, count_tokens
from .namespaces import PYTORCH_LIGHTNING, namespace, namespace_of

# the settings of the callback that decide the normalization; the others (clipping, overflow) are left out
NORMALIZING = ("scaling", "item_count_fn")
CUTS = ("items", "ranks")
TOLERANCE = 1e-4  # relative: fp32 sums in another order differ by ~1e-7; a normalization bug by ~1e-1


# each normalization the package provides: its name in the report and the callback's settings for it
NORMALIZATIONS: dict[str, dict[str, Any]] = {
    "token mean": {"scaling": "weighted", "item_count_fn": count_tokens},
    "predicted-token mean": {"scaling": "weighted", "item_count_fn": count_predicted_tokens},
    "sequence mean": {"scaling": "weighted", "item_count_fn": count_sequences},
    "sample mean": {"scaling": "weighted"},
    "constant normaliser": {"scaling": "constant"},
}


def normalization_settings(name: str) -> dict[str, Any]:
    """The callback's settings of a normalization of :data:`NORMALIZATIONS` (a copy).

    Example:
        >>> normalization_settings("sequence mean")["item_count_fn"].__name__
        'count_sequences'
    """
    return dict(NORMALIZATIONS[name])


def describe(settings: dict[str, Any]) -> str:
    """The settings as the callback's arguments read.

    Example:
        >>> describe(normalization_settings("token mean"))
        "scaling='weighted', item_count_fn=count_tokens"
    """
    parts = [f"scaling={settings.get('scaling', 'mean')!r}"]
    count = settings.get("item_count_fn")
    if count is not None:
        parts.append(f"item_count_fn={getattr(count, '__name__', None) or repr(count)}")
    return ", ".join(parts)


def relative_difference(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    """``|a - b| / |b|`` over every parameter's gradient (``nan`` where either is missing or not finite).

    Example:
        >>> relative_difference({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([1.0, 1.0])})
        0.7071067811865476
    """
    if not a or set(a) != set(b):
        return math.nan
    squared = sum(float((a[n].double() - b[n].double()).pow(2).sum()) for n in b)
    scale = sum(float(b[n].double().pow(2).sum()) for n in b)
    return math.sqrt(squared / scale) if scale > 0 else (0.0 if squared == 0 else math.inf)


@dataclass(frozen=True)
class Normalization:
    """One normalization's cuts: each cut's relative difference to the window's micro-batches.

    Attributes:
        name: ``"your settings"``, or a name of :data:`NORMALIZATIONS`.
        settings: The callback's settings it ran with, described.
        differences: By cut (``"items"``, ``"ranks"``): the relative difference, for the cuts that ran.
        error: Why it could not run at all (e.g. its counter found no labels), else ``None``.
        cut_errors: By cut: why that cut could not run (a batch the splitter cannot cut, a module that
            cannot be pickled to the ranks, a rank that failed).
    """

    name: str
    settings: str
    differences: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    cut_errors: dict[str, str] = field(default_factory=dict)

    def invariant(self, tolerance: float) -> bool:
        """Whether every cut ran and is within ``tolerance`` of the micro-batches."""
        within = all(d <= tolerance for d in self.differences.values())
        return self.error is None and not self.cut_errors and within


@dataclass(frozen=True)
class StepCheck:
    """The result of :func:`check_step`.

    Attributes:
        yours: Your settings' cuts.
        others: Each normalization the package provides, its cuts.
        tolerance: The relative difference within which a cut counts as the same.
        batches: The loader batches of the window.
        ranks: The ranks of the ``"ranks"`` cut (1: not run).
    """

    yours: Normalization
    others: list[Normalization]
    tolerance: float
    batches: int
    ranks: int

    @property
    def invariant(self) -> bool:
        """Whether your settings give the same window gradient however the window is cut."""
        return self.yours.invariant(self.tolerance)

    @property
    def suggestions(self) -> list[Normalization]:
        """The normalizations that make the step invariant."""
        return [other for other in self.others if other.invariant(self.tolerance)]

    def diagnosis(self) -> str:
        """What the pattern of the differences says about the loss."""
        if self.invariant:
            return "The step is invariant: each window is one big batch, however it is cut."
        runnable = [n for n in (self.yours, *self.others) if n.error is None]
        failed = {cut: e for n in runnable for cut, e in n.cut_errors.items()}
        if not runnable:
            return f"The check could not run the step: {self.yours.error}."
        if "items" in failed:
            return f"The check could not compute the window cut into items: {failed['items']}."
        if self.suggestions:
            names = ", ".join(f"{s.name} ({s.settings})" for s in self.suggestions)
            return f"Your loss keeps the contract of: {names}. Use those settings."
        items_agree = [n for n in runnable if n.differences.get("items", math.nan) <= self.tolerance]
        if "ranks" in failed and items_agree:
            return f"The window over {self.ranks} ranks could not be computed: {failed['ranks']}."
        if self.ranks > 1 and items_agree:
            return (
                "No normalization makes it invariant, yet cutting into items changes nothing: the loss"
                " depends on the number of ranks (e.g. multiplied by the world size beside a count local"
                " to the rank). Let the callback normalize over the ranks: return the local loss."
            )
        return (
            "No normalization makes it invariant: a term of the loss is normalized per micro-batch (e.g. an"
            " auxiliary or regularization term averaged over each micro-batch beside a token-summed"
            " loss), so it arrives once per micro-batch. Normalize every term by the same count: the"
            " window's items (a mean with `scaling='weighted'`) or a constant (`scaling='constant'`)."
        )

    def report(self) -> str:
        """The table of cuts by normalization, and the diagnosis.

        Example:
            >>> yours = Normalization("your settings", "scaling='mean'", {"items": 0.25})
            >>> check = StepCheck(yours, [], 1e-4, batches=2, ranks=1)
            >>> print(check.report().splitlines()[4])
            | your settings (scaling='mean') | 2.5e-01 | - | no |
        """
        lines = [
            f"One window of {self.batches} batch(es): its gradient with micro-batches of one item, and over"
            f" {self.ranks} rank(s), relative to the batches as given (the same within {self.tolerance:g}):",
            "",
            "| normalization | items | ranks | invariant |",
            "|---|---|---|---|",
        ]
        for entry in (self.yours, *self.others):
            if entry.error is not None:
                lines.append(f"| {entry.name} ({entry.settings}) | {entry.error} | | n/a |")
                continue
            values = [
                f"{entry.differences[c]:.1e}"
                if c in entry.differences
                else "failed"
                if c in entry.cut_errors
                else "-"
                for c in CUTS
            ]
            verdict = "yes" if entry.invariant(self.tolerance) else "no"
            lines.append(f"| {entry.name} ({entry.settings}) | " + " | ".join(values) + f" | {verdict} |")
        return "\n".join([*lines, "", self.diagnosis()])


# ---------------------------------------------------------------------------------------- computing


class _Batches:
    """The window's batches as a loader: rank r of R takes batches r, r + R, ..."""

    def __init__(self, batches: Sequence[Any], ranks: int) -> None:
        self.batches, self.ranks = list(batches), ranks

    def _mine(self) -> list[Any]:
        if self.ranks == 1:
            return self.batches
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return self.batches[rank :: self.ranks]

    def __iter__(self) -> Any:
        return iter(self._mine())

    def __len__(self) -> int:
        return len(self.batches) // self.ranks


class _CaptureLogic:
    """Keeps the window's final gradient (after the accumulation callback's hooks) and stops the step."""

    def __init__(self, train_mode: bool) -> None:
        self.train_mode = train_mode
        self.gradient: dict[str, Tensor] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not self.train_mode:
            pl_module.eval()  # dropout and batch statistics would differ between the cuts by themselves

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        for name, param in pl_module.named_parameters():
            if param.grad is not None:
                self.gradient[name] = param.grad.detach().clone().cpu()
            param.grad = None  # torch's optimizers then leave the parameter alone
        trainer.should_stop = True


def _window_gradient(
    module: Any,
    batches: Sequence[Any],
    settings: dict[str, Any],
    *,
    ranks: int,
    train_mode: bool,
) -> dict[str, Tensor]:
    """The window's gradient of a copy of ``module`` through ``Trainer.fit`` (ranks: already in a group)."""
    package = namespace_of(module) or PYTORCH_LIGHTNING
    api = namespace(package)
    lightning = importlib.import_module(package)
    callback_module = "lightning_gradacc.lightning" if package != PYTORCH_LIGHTNING else "lightning_gradacc"
    accumulation = importlib.import_module(callback_module).GradientAccumulationCallback
    capture = type("_Capture", (_CaptureLogic, api.callback), {})(train_mode)
    per_rank = len(batches) // ranks
    callback = accumulation(per_rank, log_stats=False, **settings)
    with warnings.catch_warnings(), _quiet(package):
        warnings.simplefilter("ignore")  # the check's own fits: Lightning's notes on them are not the user's
        trainer = lightning.Trainer(
            accelerator="cpu",
            devices=ranks,
            strategy="ddp" if ranks > 1 else "auto",
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            use_distributed_sampler=False,
            callbacks=[callback, capture],
        )
        trainer.fit(copy.deepcopy(module), train_dataloaders=_Batches(batches, ranks))
    gradient: dict[str, Tensor] = capture.gradient
    return gradient


@contextmanager
def _quiet(package: str) -> Iterator[None]:
    """Lightning's information messages (GPU available, ``max_epochs`` reached) off for the check's fits.

    Both namespaces log through ``lightning.pytorch``'s and ``lightning.fabric``'s loggers too.
    """
    names = {package, "pytorch_lightning", "lightning_fabric", "lightning.pytorch", "lightning.fabric"}
    loggers = [logging.getLogger(name) for name in sorted(names)]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _one_item_each(batches: Sequence[Any], split_fn: SplitFn | None) -> list[Any]:
    """Every batch cut into pieces of one item (the package's splitter, or ``split_fn``)."""
    return [piece for batch in batches for piece in pieces_of(batch, 1, split_fn)]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _rank_worker(
    rank: int, ranks: int, port: int, payload: bytes, out: str, train_mode: bool
) -> None:  # pragma: no cover - runs in the spawned processes (covered by the tests through them)
    """One rank: every candidate's window through ``Trainer.fit`` under DDP; rank 0 saves the gradients."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(ranks),
    )  # Lightning then takes the processes as launched: no launcher of its own
    module, batches, candidates = pickle.loads(payload)
    gradients: list[dict[str, Any]] = []
    quiet = _quiet(namespace_of(module) or PYTORCH_LIGHTNING)
    quiet.__enter__()  # this process ends below
    for settings in candidates:
        try:
            gradients.append(_window_gradient(module, batches, settings, ranks=ranks, train_mode=train_mode))
        except Exception as error:  # e.g. a counter that finds no labels: the one-rank cuts say why
            gradients.append({"error": _message(error)})
    if rank == 0:
        torch.save(gradients, out)
    leave_the_group_and_exit()  # a gloo worker thread must not meet a finalizing interpreter


def _on_ranks(
    module: Any, batches: Sequence[Any], candidates: list[dict[str, Any]], ranks: int, train_mode: bool
) -> list[dict[str, Any]]:
    """Every candidate's window gradient on ``ranks`` CPU processes, in one launch."""
    payload = pickle.dumps((module, list(batches), candidates))
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "gradients.pt")
        torch.multiprocessing.spawn(  # type: ignore[attr-defined,no-untyped-call]
            _rank_worker, args=(ranks, _free_port(), payload, out, train_mode), nprocs=ranks, join=True
        )
        return torch.load(out, weights_only=False)  # type: ignore[no-any-return]


def check_step(
    module: Any,
    batches: Sequence[Any],
    settings: dict[str, Any] | None = None,
    *,
    ranks: int = 2,
    tolerance: float = TOLERANCE,
    train_mode: bool = False,
    split_fn: SplitFn | None = None,
) -> StepCheck:
    """Compute one window's gradient cut in different ways, for your settings and each normalization.

    Args:
        module: Your LightningModule (not changed: every cut trains a copy).
        batches: The window's batches, as your loader gives them (e.g. the first few of your datamodule's
            train loader); a multiple of ``ranks`` of them.
        settings: The callback's ``scaling`` and ``item_count_fn`` (others are ignored: clipping and overflow
            do not normalize; ``item_count_fn`` only weighs under ``"weighted"``).
        ranks: DDP processes of the ``"ranks"`` cut (gloo, CPU; 1: not run). The module, the batches and
            ``item_count_fn`` are pickled to them, so they must be importable (not defined in ``__main__``
            outside its guard, not a lambda); where they are not, that cut is reported as failed.
        tolerance: The relative difference within which two gradients are the same.
        train_mode: Run in train mode (dropout and batch statistics then differ between cuts by themselves).
        split_fn: The callback's ``split_fn`` for a batch the package's splitter cannot cut into items.

    Returns:
        The differences, whether your settings are invariant, and which normalizations are.

    Raises:
        ValueError: No batches, or a number of them that ``ranks`` does not divide.
    """
    settings = {k: v for k, v in (settings or {}).items() if k in NORMALIZING}
    if not SCALING_MODES[check_scaling(settings.get("scaling", "mean"))].weighted:  # it counts for budgets
        settings.pop("item_count_fn", None)
    if not batches or len(batches) % ranks:
        raise ValueError(
            f"Expected a number of batches that is a positive multiple of `ranks={ranks}`, but got"
            f" {len(batches)}."
        )
    candidates = [settings] + [normalization_settings(name) for name in NORMALIZATIONS]
    names = ["your settings", *NORMALIZATIONS]
    try:
        items: list[Any] | None = _one_item_each(batches, split_fn)
        split_error = None
    except Exception as error:  # a batch the splitter cannot cut: that cut alone is missing
        items, split_error = None, _message(error)
    results: list[Normalization] = []
    references: list[dict[str, Tensor] | None] = []
    for name, candidate in zip(names, candidates, strict=True):
        described = describe(candidate)
        try:
            reference = _window_gradient(module, batches, candidate, ranks=1, train_mode=train_mode)
            one_each = None
            if items is not None:
                one_each = _window_gradient(module, items, candidate, ranks=1, train_mode=train_mode)
        except Exception as error:  # the counter does not fit these batches (no labels, ...)
            results.append(Normalization(name, described, error=_message(error)))
            references.append(None)
            continue
        if one_each is None:
            results.append(Normalization(name, described, cut_errors={"items": str(split_error)}))
        else:
            difference = relative_difference(one_each, reference)
            results.append(Normalization(name, described, {"items": difference}))
        references.append(reference)
    if ranks > 1:
        runnable = [i for i, r in enumerate(references) if r is not None]
        try:
            gradients = _on_ranks(module, batches, [candidates[i] for i in runnable], ranks, train_mode)
        except Exception as error:  # nothing pickles, or a process died: the one-rank cuts still stand
            gradients = [{"error": _message(error)}] * len(runnable)
        for index, gradient in zip(runnable, gradients, strict=True):
            kept, entry = references[index], results[index]
            assert kept is not None
            if "error" in gradient:
                failed = {**entry.cut_errors, "ranks": str(gradient["error"])}
                results[index] = replace(entry, cut_errors=failed)
            else:
                difference = relative_difference(gradient, kept)
                results[index] = replace(entry, differences={**entry.differences, "ranks": difference})
    return StepCheck(results[0], results[1:], tolerance, batches=len(batches), ranks=ranks)


def _message(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


__all__ = ["NORMALIZATIONS", "Normalization", "StepCheck", "check_step", "relative_difference"]
