"""Small models, data, plain-PyTorch big-batch references and the other helpers shared by the tests.

A helper that more than one test file uses lives here: test files do not import each other. Everything here is
deterministic and importable by spawned DDP workers (``tests.helpers``).
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import lightning.pytorch.strategies.launchers.multiprocessing as lit_launchers
import pytest
import pytorch_lightning as pl
import pytorch_lightning.strategies.launchers.multiprocessing as pl_launchers
import torch
from torch import Tensor, func, nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from lightning_gradacc import GradAccumulator
from lightning_gradacc.callback import GradientAccumulationLogic

# The package's own token counter, re-exported: every oracle uses it (no re-implementation here).
from lightning_gradacc.counters import count_tokens as count_tokens

ROOT = Path(__file__).resolve().parents[1]  # the repository
IGNORE_INDEX = -100


NAMESPACES = ("pytorch_lightning", "lightning.pytorch")
PACKAGES: dict[str, Any] = {"pytorch_lightning": pl, "lightning.pytorch": L}


def trainer(namespace: str = "pytorch_lightning", **overrides: Any) -> pl.Trainer:
    """A quiet CPU Trainer for tests, of either Lightning namespace.

    ``strategy="ddp_spawn"`` is :data:`SPAWN`'s: each worker ends by :func:`exit_together`.
    """
    options: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        deterministic=True,
    )
    options.update(overrides)
    if options.get("strategy") == "ddp_spawn":
        options["strategy"] = SPAWN[namespace]()
    trainer_class: Any = PACKAGES[namespace].Trainer
    return trainer_class(**options)  # type: ignore[no-any-return]


def weights_only(value: bool) -> dict[str, bool]:
    """``Trainer.fit(weights_only=...)`` where Lightning takes it (2.6 on); before it, nothing."""
    return {"weights_only": value} if "weights_only" in inspect.signature(pl.Trainer.fit).parameters else {}


def fit(module: pl.LightningModule, *callbacks: pl.Callback, **kwargs: Any) -> pl.Trainer:
    """``trainer(callbacks=[*callbacks], **kwargs).fit(module)``; returns the Trainer."""
    trainer_ = trainer(callbacks=list(callbacks), **kwargs)
    trainer_.fit(module)
    return trainer_


def cuda_only(test: Callable[..., Any]) -> Callable[..., Any]:
    """Marks a CUDA check (``pytest -m cuda``, run by sessions that are lent a GPU): skipped without one."""
    skipped = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test)
    return pytest.mark.cuda(skipped)


def accumulation_callback(namespace: str = "pytorch_lightning", *args: Any, **kwargs: Any) -> Any:
    """``GradientAccumulationCallback`` of ``namespace``."""
    if namespace == "lightning.pytorch":
        from lightning_gradacc.lightning import GradientAccumulationCallback
    else:
        from lightning_gradacc import GradientAccumulationCallback
    return GradientAccumulationCallback(*args, **kwargs)


# ----------------------------------------------------------------------------------- regression model


def regression_data(num_samples: int = 40, features: int = 5, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, features, generator=generator)
    y = x @ torch.randn(features, 1, generator=generator) + 0.1 * torch.randn(
        num_samples, 1, generator=generator
    )
    return TensorDataset(x, y)


def positive_targets(batch: Sequence[Tensor]) -> int:
    """The samples of a regression batch with a positive target: an item count that varies by batch."""
    return int((batch[1] > 0).sum())


def regression_net(features: int = 5, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, 8), nn.Tanh(), nn.Linear(8, 1))


class _Regression:
    """MSE regression; ``nan_at`` makes the loss of chosen global micro-batch indices non-finite.

    The body of ``RegressionModule`` (``pytorch_lightning``) and ``LitRegressionModule`` (``lightning``).
    """

    def __init__(
        self,
        data: Dataset[Any] | None = None,
        batch_size: int = 4,
        lr: float = 0.1,
        optimizer: str = "sgd",
        nan_at: Sequence[int] = (),
        seed: int = 0,
        nan_rank: int | None = None,
        resumable: bool = False,
    ) -> None:
        super().__init__()
        self.net = regression_net(seed=seed)
        self.data = data if data is not None else regression_data()
        self.batch_size = batch_size
        self.lr = lr
        self.optimizer_name = optimizer
        self.nan_at = set(nan_at)
        self.nan_rank = nan_rank  # None: every rank
        self.resumable = resumable
        self.micro_batches_seen = 0

    def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.micro_batches_seen in self.nan_at and self.nan_rank in (None, self.global_rank):
            loss = loss * torch.tensor(float("nan"))
        self.micro_batches_seen += 1
        if self.resumable:
            self.trainer.train_dataloader.consumed += 1
        return loss

    def on_train_epoch_start(self) -> None:
        if self.resumable:
            self.trainer.train_dataloader.consumed = 0

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.optimizer_name, self.net.parameters(), self.lr)

    def train_dataloader(self) -> DataLoader[Any]:
        return ordered_loader(self, self.data, self.batch_size, resumable=self.resumable)


class RegressionModule(_Regression, pl.LightningModule):
    pass


class LitRegressionModule(_Regression, L.LightningModule):
    pass


REGRESSION_MODULES: dict[str, Any] = {
    "pytorch_lightning": RegressionModule,
    "lightning.pytorch": LitRegressionModule,
}


class ResumableLoader(DataLoader):  # type: ignore[type-arg]
    """A DataLoader that resumes mid-epoch: it skips the batches training has consumed.

    Lightning prefetches one batch ahead, so the loader cannot count consumed batches itself: the module
    advances ``consumed`` at the end of each ``training_step``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.consumed = 0
        self._skip = 0

    def __iter__(self) -> Any:
        iterator = super().__iter__()
        skip, self._skip = self._skip, 0
        for _ in range(skip):
            next(iterator)
        yield from iterator

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        finished = state["consumed"] >= len(self)  # saved on the epoch's last batch: start the next one
        self.consumed = self._skip = 0 if finished else state["consumed"]


def ordered_loader(
    module: pl.LightningModule, data: Dataset[Any], batch_size: int, resumable: bool = False
) -> DataLoader[Any]:
    """Batches in dataset order; under DDP rank r reads rows r, r + R, ...

    Run with ``use_distributed_sampler=False``.

    So micro-batch i of all ranks together is rows [i*B*R, (i+1)*B*R): the big-batch reference's batch i.
    """
    trainer = module._trainer
    loader_class = ResumableLoader if resumable else DataLoader
    if trainer is not None and trainer.world_size > 1:
        sampler = DistributedSampler(data, trainer.world_size, trainer.global_rank, shuffle=False)
        return loader_class(data, batch_size=batch_size, sampler=sampler)
    return loader_class(data, batch_size=batch_size, shuffle=False)


class BatchList:
    """A sized iterable without a ``batch_size`` (a plain list would be taken for a list of dataloaders)."""

    def __init__(self, batches: Any) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def make_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    """``"sgd"``, ``"adam"``, ``"adamw"``, or one of them fused (``"adam_fused"``: skips on the device)."""
    kind, _, fused = name.partition("_")
    options: dict[str, Any] = {"fused": True} if fused == "fused" else {}
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, **({"momentum": 0.9} if fused else {}), **options)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, **options)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, **options)
    raise ValueError(name)


# -------------------------------------------------------------------------------------- token model

VOCAB = 11


def token_data(num_sequences: int = 24, max_len: int = 9, seed: int = 0) -> TensorDataset:
    """Padded sequences of very different lengths (1..max_len real tokens); padding labels are ignored."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.zeros(num_sequences, max_len, dtype=torch.long)
    labels = torch.full((num_sequences, max_len), IGNORE_INDEX, dtype=torch.long)
    for row in range(num_sequences):
        length = int(torch.randint(1, max_len + 1, (), generator=generator))
        inputs[row, :length] = torch.randint(1, VOCAB, (length,), generator=generator)
        labels[row, :length] = torch.randint(0, VOCAB, (length,), generator=generator)
    return TensorDataset(inputs, labels)


def token_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, 6), nn.Linear(6, VOCAB))


def token_loss(net: nn.Module, inputs: Tensor, labels: Tensor) -> Tensor:
    logits = net(inputs)
    return nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE_INDEX
    )


class _Token:
    """Next-token cross entropy, a mean over the batch's real tokens; ``resumable`` as ``_Regression``'s."""

    def __init__(
        self,
        data: Dataset[Any] | None = None,
        batch_size: int = 2,
        lr: float = 0.5,
        optimizer: str = "sgd",
        seed: int = 0,
        resumable: bool = False,
    ) -> None:
        super().__init__()
        self.net = token_net(seed)
        self.data = data if data is not None else token_data()
        self.batch_size = batch_size
        self.lr = lr
        self.optimizer_name = optimizer
        self.resumable = resumable

    def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        if self.resumable:
            self.trainer.train_dataloader.consumed += 1
        return token_loss(self.net, *batch)

    def on_train_epoch_start(self) -> None:
        if self.resumable:
            self.trainer.train_dataloader.consumed = 0

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.optimizer_name, self.net.parameters(), self.lr)

    def train_dataloader(self) -> DataLoader[Any]:
        return ordered_loader(self, self.data, self.batch_size, resumable=self.resumable)


class TokenModule(_Token, pl.LightningModule):
    pass


class LitTokenModule(_Token, L.LightningModule):
    pass


TOKEN_MODULES: dict[str, Any] = {"pytorch_lightning": TokenModule, "lightning.pytorch": LitTokenModule}


# -------------------------------------------------------------------------------- plain references


def windows(num_batches: int, schedule: Callable[[int], int] | int, epochs: int = 1) -> list[list[int]]:
    """Micro-batch indices of each window, epoch by epoch, with Lightning's boundaries."""
    result: list[list[int]] = []
    for epoch in range(epochs):
        k = schedule(epoch) if callable(schedule) else schedule
        for start in range(0, num_batches, k):
            result.append(list(range(start, min(start + k, num_batches))))
    return result


def keyed_windows(
    schedule: dict[int, int],
    num_batches: int,
    *,
    epochs: int = 1,
    unit: str = "steps",
    items: Callable[[int], float] = lambda batch: 4.0,
    steps: int = 0,
    consumed: float = 0.0,
) -> list[tuple[list[int], int]]:
    """The windows of a schedule keyed by optimizer steps or items, epoch after epoch, each with its K.

    A window's K is the schedule's value at the count reached when it opens (1 before the first key); an
    epoch's end closes it (its K stays the schedule's). ``items(b)``: the items of micro-batch ``b`` over all
    ranks. ``steps`` and ``consumed``: where the count stands when the first window opens.
    """
    result: list[tuple[list[int], int]] = []
    for _ in range(epochs):
        start = 0
        while start < num_batches:
            count = steps if unit == "steps" else consumed
            started = [v for t, v in sorted(schedule.items()) if t <= count]
            k = started[-1] if started else 1
            window = list(range(start, min(start + k, num_batches)))
            result.append((window, k))
            start += len(window)
            steps += 1
            consumed += sum(items(b) for b in window)
    return result


def big_batch_reference(
    net: nn.Module,
    data: TensorDataset,
    batch_size: int,
    window_list: list[list[int]],
    loss_fn: Callable[..., Tensor],
    *,
    lr: float = 0.1,
    optimizer: str = "sgd",
    sum_of_means: bool = False,
    ranks_summed: int = 1,
    skip_windows: Sequence[int] = (),
    max_grad_norm: float | None = None,
    losses: list[float] | None = None,
    prepare: Callable[[nn.Module, int], None] | None = None,
    fp16_autocast: bool = False,
    norm_type: float = 2.0,
    clip_value: float | None = None,
    clip_scope: str = "global",
    lr_factors: Sequence[float] | None = None,
) -> nn.Module:
    """Train a copy of ``net`` with one optimizer step per window on the window's samples as ONE batch.

    The loss of the big batch is the loss of all its items at once (for token data: the mean over every
    real token of the window); ``sum_of_means`` multiplies it by the number of micro-batches (the "sum"
    contract with equal micro-batches), and ``ranks_summed`` by the ranks too (``"constant"``).
    ``prepare(reference, window_index)`` runs before each window (e.g. to
    freeze or unfreeze layers); only parameters with ``requires_grad`` then take part, as in the optimizer.
    ``fp16_autocast`` runs the forward under CPU fp16 autocast, as ``precision="16-mixed"`` does, so that
    16-mixed runs compare against the same arithmetic (the loss scale, a power of two, changes nothing).
    ``lr_factors[i]`` multiplies the learning rate of window i's step (``lr_scaling``).
    """
    reference = copy.deepcopy(net)
    opt = make_optimizer(optimizer, reference.parameters(), lr)
    tensors = data.tensors
    for index, window in enumerate(window_list):
        if prepare is not None:
            prepare(reference, index)
        rows = torch.cat([torch.arange(b * batch_size, min((b + 1) * batch_size, len(data))) for b in window])
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16_autocast):
            loss = loss_fn(reference, *(t[rows] for t in tensors))
        if losses is not None:
            losses.append(float(loss.detach()))
        if sum_of_means:
            loss = loss * len(window) * ranks_summed
        loss.backward()
        if max_grad_norm is not None:
            trainable = [p for p in reference.parameters() if p.requires_grad]
            # "parameter": torch's clipping applied to each parameter on its own
            for group in [[p] for p in trainable] if clip_scope == "parameter" else [trainable]:
                torch.nn.utils.clip_grad_norm_(group, max_grad_norm, norm_type=norm_type)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(
                [p for p in reference.parameters() if p.requires_grad], clip_value
            )
        if index in skip_windows:
            continue
        factor = 1.0 if lr_factors is None else lr_factors[index]
        for group in opt.param_groups:
            group["lr"] = lr * factor
        opt.step()
    return reference


def amp_plugin(init_scale: float = 2.0**8) -> Any:
    """``precision="16-mixed"`` on CPU with an explicit GradScaler (Lightning has none for CPU by default)."""
    from pytorch_lightning.plugins import MixedPrecision

    return MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=init_scale))


def regression_reference(window_list: list[list[int]], *, num_samples: int = 40, **kwargs: Any) -> nn.Module:
    """:func:`big_batch_reference` for ``RegressionModule`` defaults (micro-batches of 4)."""
    return big_batch_reference(regression_net(), regression_data(num_samples), 4, window_list, mse, **kwargs)


def mse(net: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return nn.functional.mse_loss(net(x), y)


class _Recorder:
    """An in-memory logger: every ``log_metrics`` call as ``(step, metrics)``."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((int(step or 0), dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(step, metrics[key]) for step, metrics in self.records if key in metrics]


class MetricsRecorder(_Recorder, pl.loggers.Logger):
    pass


class LitMetricsRecorder(_Recorder, L.loggers.Logger):
    pass


RECORDERS: dict[str, Any] = {"pytorch_lightning": MetricsRecorder, "lightning.pytorch": LitMetricsRecorder}


def series_steps(recorder: _Recorder, key: str) -> list[int]:
    return [step for step, _ in recorder.series(key)]


# --------------------------------------------------------------------------------- the core's pieces

INF = math.inf
F32, F64, F16, BF16 = torch.float32, torch.float64, torch.float16, torch.bfloat16
NORM_TYPES = [1.0, 2.0, 3.5, INF]
SHAPES = [(3, 4), (7,), (2, 3, 5), (), (16,)]
# tolerance of a value computed in a dtype, relative to the exact one (a few units in the last place)
RTOL = {F32: 1e-6, F64: 1e-12}
BATCH = 4  # rows per micro-batch of run_plain_loop


def random_grads(dtypes: list[torch.dtype], seed: int, scale: float = 1.0) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [SHAPES[i % len(SHAPES)] for i in range(len(dtypes))]
    return [
        (torch.randn(shape, generator=generator, dtype=F64) * scale).to(dtype)
        for shape, dtype in zip(shapes, dtypes, strict=True)
    ]


def torch_clip_each(grads: list[Tensor], max_norm: float, norm_type: float = 2.0) -> list[Tensor]:
    """``torch.nn.utils.clip_grad_norm_([g], max_norm)`` applied tensor by tensor."""
    clipped = []
    for grad in grads:
        param = nn.Parameter(torch.zeros_like(grad))
        param.grad = grad.clone()
        torch.nn.utils.clip_grad_norm_([param], max_norm, norm_type)
        clipped.append(param.grad)
    return clipped


def assert_same(actual: Tensor, expected: Tensor, rtol: float | None = None) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    rtol = RTOL.get(expected.dtype, 0.0) if rtol is None else rtol
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=0.0, equal_nan=True)


def run_plain_loop(
    accumulator_kwargs: dict, k: int, num_batches: int = 10, nan_at: tuple[int, ...] = ()
) -> tuple[nn.Module, GradAccumulator]:
    """GradAccumulator(``accumulator_kwargs``, K=``k``) in a plain loop over micro-batches of 4 of
    :func:`regression_data` (SGD, lr 0.1), stepping at every window's end; the loss of the micro-batches in
    ``nan_at`` is made nan."""
    data = regression_data(num_batches * BATCH)
    net = regression_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    accumulator = GradAccumulator(net.named_parameters(), k, **accumulator_kwargs)
    x_all, y_all = data.tensors
    for index in range(num_batches):
        x, y = x_all[index * BATCH : (index + 1) * BATCH], y_all[index * BATCH : (index + 1) * BATCH]
        loss = mse(net, x, y)
        if index in nan_at:
            loss = loss * math.nan
        accumulator.backward(loss, items=len(x))
        accumulator.step(optimizer, force=index == num_batches - 1)
    return net, accumulator


def linear_accumulator(**kwargs) -> tuple[nn.Linear, GradAccumulator]:
    """``nn.Linear(3, 2)`` (seed 1) and a GradAccumulator of K=2 over its parameters."""
    torch.manual_seed(1)
    model = nn.Linear(3, 2)
    return model, GradAccumulator(model.named_parameters(), 2, **kwargs)


def linear_backward(model: nn.Module, accumulator: GradAccumulator, scale: float = 1.0) -> None:
    """One micro-batch of 4 random rows through ``model`` (a ``nn.Linear``), its loss times ``scale``."""
    x = torch.randn(4, model.in_features)
    accumulator.backward(model(x).pow(2).mean() * scale, items=4)


class TwoLayer(nn.Module):
    """4 -> 5 -> 2 with a parameter that never gets a gradient (``unused``)."""

    def __init__(self, dtype: torch.dtype = F32) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.first = nn.Linear(4, 5)  # initialized in float32: the same values for every dtype
        self.second = nn.Linear(5, 2)
        self.unused = nn.Parameter(torch.zeros(3))
        self.to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(torch.tanh(self.first(x)))


def two_layer_batches(sizes: list[int], dtype: torch.dtype = F32) -> list[tuple[Tensor, Tensor]]:
    """Random ``(x, y)`` micro-batches of the given sizes for :class:`TwoLayer` (4 inputs, 2 outputs)."""
    generator = torch.Generator().manual_seed(sum(sizes))
    return [
        (torch.randn(n, 4, generator=generator).to(dtype), torch.randn(n, 2, generator=generator).to(dtype))
        for n in sizes
    ]


# ------------------------------------------------------------------------- the noise scale's data

NOISE_SAMPLES = 256


def noise_data() -> TensorDataset:
    """The noise-scale tests' data set: noisy linear targets of 5 features."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NOISE_SAMPLES, 5, generator=generator)
    y = x @ torch.randn(5, 1, generator=generator) + 0.5 * torch.randn(NOISE_SAMPLES, 1, generator=generator)
    return TensorDataset(x, y)


def noise_net() -> nn.Module:
    """The noise-scale tests' model: ``nn.Linear(5, 1)``, seed 0."""
    torch.manual_seed(0)
    return nn.Linear(5, 1)


def noise_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * (net(x) - y).pow(2).mean()  # a mean over the micro-batch's items


def noise_truth() -> tuple[float, float]:
    """|G|² and tr(Σ) of the per-sample gradients of the whole data set (sampling with replacement)."""
    net = noise_net()
    x, y = noise_data().tensors
    params = {name: p.detach() for name, p in net.named_parameters()}

    def one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return 0.5 * (func.functional_call(net, p, (xi[None],)) - yi[None]).pow(2).sum()

    per_sample = func.vmap(func.grad(one), in_dims=(None, 0, 0))(params, x, y)
    flat = torch.cat([g.reshape(NOISE_SAMPLES, -1) for g in per_sample.values()], dim=1).double()
    mean = flat.mean(dim=0)
    return float(mean @ mean), float((flat - mean).pow(2).sum(dim=1).mean())


class ReplacementBatches(Sampler[list[int]]):
    """Micro-batches of the given sizes (cycled), each drawn with replacement: i.i.d. samples."""

    def __init__(self, sizes: list[int], batches: int, seed: int) -> None:
        self.sizes, self.batches, self.seed = sizes, batches, seed
        self.sampler = self  # Lightning calls `batch_sampler.sampler.set_epoch` at each epoch

    def set_epoch(self, epoch: int) -> None:  # Lightning calls it: other samples in another epoch
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        generator = torch.Generator().manual_seed(self.seed + 1000 * getattr(self, "epoch", 0))
        for index in range(self.batches):
            size = self.sizes[index % len(self.sizes)]
            yield torch.randint(0, NOISE_SAMPLES, (size,), generator=generator).tolist()

    def __len__(self) -> int:
        return self.batches


class FixedModel(pl.LightningModule):
    """``noise_net`` at learning rate 0 (it never moves) on micro-batches drawn with replacement:
    ``windows`` x ``k`` micro-batches of the ``sizes`` (cycled)."""

    def __init__(self, sizes: list[int], windows: int, k: int = 4) -> None:
        super().__init__()
        self.net = noise_net()
        self.sizes, self.windows, self.k = sizes, windows, k

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return noise_loss(self.net, *batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self) -> DataLoader:
        sampler = ReplacementBatches(self.sizes, self.k * self.windows, seed=1 + self.global_rank)
        return DataLoader(noise_data(), batch_sampler=sampler)


class SteppedWindows(pl.Callback):
    """Which micro-batches each optimizer step took, read from the Trainer after every batch.

    ``out``: where each rank saves them (``windows-{rank}.pt``) with the controller's trajectory.
    """

    def __init__(self, out: Path | None = None) -> None:
        self.out = out
        self.windows: list[list[int]] = []
        self.estimates: list[tuple[float, float]] = []  # each step's |G|² and tr(Σ) (a read: with `out`)
        self._open: list[int] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._open, self._step = [], trainer.global_step  # a fit interrupted in a window stepped none of it

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        batch_idx = args[-1]
        self._open.append(batch_idx)
        if trainer.global_step != self._step:
            self.windows.append(self._open)
            self._open, self._step = [], trainer.global_step
            if self.out is not None:
                stats = self._callback(trainer).stats
                self.estimates.append((stats.grad_sq_norm_estimate, stats.trace_sigma_estimate))

    @staticmethod
    def _callback(trainer: pl.Trainer) -> GradientAccumulationLogic:
        return next(c for c in trainer.callbacks if isinstance(c, GradientAccumulationLogic))  # type: ignore[attr-defined]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.out is not None:
            trajectory = self._callback(trainer).plan.run.trajectory
            saved = (self.windows, trajectory, self.estimates)
            torch.save(saved, self.out / f"windows-{trainer.global_rank}.pt")


# -------------------------------------------------------------------------------------- preemption


class Preempted(Exception):
    pass


class _SaveAndStop:
    """Saves a checkpoint after global micro-batch ``at`` and interrupts training (a preemption).

    The body of ``SaveAndStop`` (``pytorch_lightning``) and ``LitSaveAndStop`` (``lightning``).
    """

    def __init__(self, at: int, path: Path) -> None:
        self.at, self.path, self.seen = at, path, 0

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if self.seen == self.at:
            trainer.save_checkpoint(self.path)
            raise Preempted
        self.seen += 1


class SaveAndStop(_SaveAndStop, pl.Callback):
    pass


class LitSaveAndStop(_SaveAndStop, L.Callback):
    pass


class RaiseAfter(pl.Callback):
    """Raises ``error`` at the end of global micro-batch ``at``: a fit interrupted inside a window."""

    def __init__(self, at: int, error: BaseException) -> None:
        self.at, self.error, self.seen = at, error, 0

    def on_train_batch_end(self, *args: Any) -> None:
        if self.seen == self.at:
            raise self.error
        self.seen += 1


def preempt(
    model: pl.LightningModule,
    callbacks: list[pl.Callback],
    at: int,
    path: Path,
    *,
    max_epochs: int = 2,
    **kwargs: Any,
) -> None:
    """Train until global micro-batch ``at``, checkpoint there, and stop as a preempted job would."""
    with pytest.raises(Preempted):
        trainer(callbacks=[*callbacks, SaveAndStop(at, path)], max_epochs=max_epochs, **kwargs).fit(model)


# ------------------------------------------------------------------------------ DDP communication

COMM = {"calls": 0, "bytes": 0}


def counting_allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: the default all-reduce, counting calls and bytes (one call per bucket and sync).

    Unannotated on purpose: DDP checks annotations, and this module's are strings.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    COMM["calls"] += 1
    COMM["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
    return allreduce_hook(state, bucket)


class CommCounterLogger(pl.Callback):
    """Registers the counting comm hook and logs its counters so that they reach the ddp_spawn parent.

    Lightning registers `ddp_comm_hook` only on CUDA, so the hook is registered here, before the first batch.
    """

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.model.register_comm_hook(None, counting_allreduce_hook)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        pl_module.log_dict(
            {"comm_calls": float(COMM["calls"]), "comm_bytes": float(COMM["bytes"])},
            on_step=True,
            on_epoch=False,
            batch_size=1,
        )


def max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in pairs)


# ------------------------------------------------------------------------ end of a distributed process


def exit_together() -> None:
    """End a distributed test process once its results are written: every rank meets, its process groups
    are destroyed, and it exits without the interpreter's teardown.

    Every test process that joins a process group ends here (``ddp_spawn`` workers through :data:`SPAWN`).
    A gloo worker thread can need the GIL after its collective has completed, to drop a Python object: the
    work's captured thread-local state holds the ``contextvars`` context autograd stashes for each backward
    (so every reduction DDP or FSDP starts in a backward carries one), a ``Future.then`` callback holds a
    Python function (DDP's Python comm hooks). If the interpreter is finalizing by then, CPython ends that
    thread with ``pthread_exit`` inside a C++ destructor and ``std::terminate`` aborts the process
    ("terminate called without an active exception", SIGABRT) after all its work is done. Lightning leaves
    gloo groups alive at exit, a barrier does not wait for those threads, and destroying the group does not
    join them while anything (DDP's reducer) still holds it; without the teardown no thread meets a
    finalizing interpreter.
    """
    from lightning_gradacc.core.torch_internals import leave_the_group_and_exit

    leave_the_group_and_exit()  # the package's own check ends its processes the same way


class _ExitTogether:
    """A ``ddp_spawn`` launcher whose workers end by :func:`exit_together` once Lightning's work in them is
    done (rank 0's results are in the queue to the launching process); a worker that raises ends as before.
    """

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)  # type: ignore[misc]
        exit_together()


class _Launcher(_ExitTogether, pl_launchers._MultiProcessingLauncher):
    pass


class _LitLauncher(_ExitTogether, lit_launchers._MultiProcessingLauncher):
    pass


class _Spawn:
    """``strategy="ddp_spawn"`` (``DDPStrategy(start_method="spawn")``) with the :class:`_ExitTogether`
    launcher."""

    launcher_class: type

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(start_method="spawn", **kwargs)  # type: ignore[call-arg]

    def _configure_launcher(self) -> None:
        self._launcher = self.launcher_class(self, start_method="spawn")


class SpawnStrategy(_Spawn, pl.strategies.DDPStrategy):
    launcher_class = _Launcher


class LitSpawnStrategy(_Spawn, L.strategies.DDPStrategy):
    launcher_class = _LitLauncher


SPAWN: dict[str, Any] = {"pytorch_lightning": SpawnStrategy, "lightning.pytorch": LitSpawnStrategy}


# ------------------------------------------------------------------------------------ two processes


def run_script(script: Path, out: Path, *args: str) -> Path:
    """Run a script that trains on 2 processes (its strategy re-runs it for the second rank), into ``out``."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, str(script), str(out), *args], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def ddp_trainer(*callbacks: pl.Callback, strategy: object = "ddp_spawn", **kwargs: Any) -> pl.Trainer:
    """A Trainer on two CPU processes that logs every step to a :class:`MetricsRecorder`."""
    options: dict[str, Any] = {
        "logger": MetricsRecorder(),
        "log_every_n_steps": 1,
        "use_distributed_sampler": False,  # the modules shard in dataset order (see ordered_loader)
        **kwargs,
    }
    return trainer(**options, strategy=strategy, devices=2, callbacks=list(callbacks))


# ------------------------------------------------------------------------------- configs and the CLI

# The demo experiments the package ships (`--config NAME`), whose classes go by short names in either
# namespace; examples/lm_finetune.yaml names its own (lightning.pytorch), run by tests/test_lm_recipe.py.
PACKAGED_CONFIGS = ROOT / "configs"  # the one copy; the wheel ships it as lightning_gradacc/configs
CONFIGS = sorted(PACKAGED_CONFIGS.glob("*.yaml"))
QUICK = [  # command-line overrides that keep a config's run short
    "--trainer.max_epochs=2",
    "--trainer.limit_train_batches=6",
    "--trainer.limit_val_batches=2",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]


def the_callback(cli: Any, cls: type = GradientAccumulationLogic) -> Any:
    """The one accumulation callback of a ``LightningCLI``'s Trainer (an instance of ``cls``)."""
    found = [c for c in cli.trainer.callbacks if isinstance(c, cls)]
    assert len(found) == 1
    return found[0]
