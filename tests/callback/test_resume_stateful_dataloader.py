"""Exact mid-window resume with torchdata's ``StatefulDataLoader``.

Lightning saves the ``state_dict()`` of every train dataloader that has one in the checkpoint
(``FitLoop.on_save_checkpoint`` -> ``CombinedLoader._state_dicts``) and loads it back before the first
iterator is made on resume (``FitLoop.setup_data`` -> ``_load_combined_loader_states``). With the window
restored by the callback and the data resumed by the loader, the resumed run is the uninterrupted one:
the same micro-batches in the same order, the same parameters (measured: 0.0 difference).

Shuffling survives a resume when the sampler's random state is in the loader's state or is a function of
the epoch; the two ways it does not are tested too (see ``test_orders_that_do_not_survive_a_resume``).
Windows closed on an item budget resume the same way, their items so far restored with the shuffled order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import OnExceptionCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler, StatefulDistributedSampler

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h
from tests.helpers import Preempted, SaveAndStop

# torchdata 0.11 calls torch.set_vital, deprecated in recent torch; nothing to act on here.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

K = 4
BATCH = 4
NUM_SAMPLES = 38
MICRO_BATCHES = 10  # per epoch, the last of 2 samples: windows of 4, 4 and 2
EPOCHS = 3  # a resume in epoch 0 or 1 is followed by at least one whole epoch
# Global micro-batches after which the checkpoint is written: inside a window, in epoch 0 (window
# 4..7, 3 of 4 done) and in epoch 1 (window 14..17, 2 of 4 done).
MID_WINDOW = [6, 15]

LoaderFactory = Callable[[TensorDataset], DataLoader[Any]]


def indexed_data() -> TensorDataset:
    """The regression data with each sample's index as a third tensor, to record the order of the data."""
    x, y = h.regression_data(NUM_SAMPLES).tensors
    return TensorDataset(x, y, torch.arange(NUM_SAMPLES))


class Module(pl.LightningModule):
    """MSE regression whose loader comes from ``make_loader``; records the sample indices it trained on."""

    def __init__(self, make_loader: LoaderFactory) -> None:
        super().__init__()
        self.net = h.regression_net()
        self.make_loader = make_loader
        self.seen: list[list[int]] = []

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y, index = batch
        self.seen.append(index.tolist())
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        return self.make_loader(indexed_data())


def accumulating_trainer(builtin: bool, *callbacks: pl.Callback) -> pl.Trainer:
    """K=4 by the callback, or by Lightning's ``accumulate_grad_batches`` (``builtin``)."""
    if builtin:
        return h.trainer(callbacks=list(callbacks), accumulate_grad_batches=K, max_epochs=EPOCHS)
    return h.trainer(callbacks=[GradientAccumulationCallback(K), *callbacks], max_epochs=EPOCHS)


def fit(make_loader: LoaderFactory, seed: int, builtin: bool = False, **fit_kwargs: Any) -> Module:
    pl.seed_everything(seed, verbose=False)
    module = Module(make_loader)
    accumulating_trainer(builtin).fit(module, **fit_kwargs)
    return module


def interrupted_and_resumed(
    make_loader: LoaderFactory, at: int, tmp_path: Path, builtin: bool = False
) -> tuple[Module, list[list[int]]]:
    """Preempted after micro-batch ``at``, then resumed under another global seed.

    Returns the resumed module and the order of every micro-batch trained on, before and after.
    """
    path = tmp_path / "mid_window.ckpt"
    pl.seed_everything(0, verbose=False)
    first = Module(make_loader)
    with pytest.raises(Preempted):
        accumulating_trainer(builtin, SaveAndStop(at, path)).fit(first)
    # Another global seed: whatever the data order needs must come from the checkpoint.
    resumed = fit(make_loader, seed=1, builtin=builtin, ckpt_path=path)
    return resumed, first.seen + resumed.seen


def sequential(data: TensorDataset) -> DataLoader[Any]:
    return StatefulDataLoader(data, batch_size=BATCH)


def plain(data: TensorDataset) -> DataLoader[Any]:
    return DataLoader(data, batch_size=BATCH)


def shuffled(data: TensorDataset) -> DataLoader[Any]:
    """``shuffle=True`` without ``generator=``: the sampler owns its generator, saved with the loader."""
    return StatefulDataLoader(data, batch_size=BATCH, shuffle=True)


def shuffled_by_sampler_generator(data: TensorDataset) -> DataLoader[Any]:
    """A seed of one's own, given to torchdata's ``RandomSampler`` (not to the loader)."""
    sampler = RandomSampler(data, generator=torch.Generator().manual_seed(1234))
    return StatefulDataLoader(data, batch_size=BATCH, sampler=sampler)


def shuffled_per_epoch(data: TensorDataset) -> DataLoader[Any]:
    """The order is a function of (seed, epoch): Lightning calls ``set_epoch`` at every epoch start."""
    sampler = StatefulDistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=1234)
    return StatefulDataLoader(data, batch_size=BATCH, sampler=sampler)


def shuffled_by_loader_generator(data: TensorDataset) -> DataLoader[Any]:
    """Not exact: the generator given to the loader is shared by the sampler and the loader's base seed."""
    return StatefulDataLoader(
        data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(1234)
    )


def shuffled_by_torch_distributed_sampler(data: TensorDataset) -> DataLoader[Any]:
    """Not exact: torch's sampler draws the permutation when the iterator is made, before ``set_epoch``."""
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=1234)
    return StatefulDataLoader(data, batch_size=BATCH, sampler=sampler)


class Stream(IterableDataset[tuple[Tensor, ...]]):
    """The same samples as an iterable dataset without a length (a stream)."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        return (self.data[index] for index in range(len(self.data)))


def streamed(data: TensorDataset) -> DataLoader[Any]:
    return StatefulDataLoader(Stream(data), batch_size=BATCH)


@functools.cache
def uninterrupted(
    make_loader: LoaderFactory, builtin: bool = False
) -> tuple[dict[str, Tensor], list[list[int]]]:
    module = fit(make_loader, seed=0, builtin=builtin)
    return module.net.state_dict(), module.seen


def distance(module: Module, make_loader: LoaderFactory, builtin: bool = False) -> float:
    """Max |parameter difference| to the uninterrupted run with the same accumulation."""
    reference = h.regression_net()
    reference.load_state_dict(uninterrupted(make_loader, builtin)[0])
    return h.max_abs_diff(module.net, reference)


@pytest.mark.parametrize("at", MID_WINDOW)
def test_stateful_dataloader_resumes_mid_window_exactly(tmp_path: Path, at: int) -> None:
    resumed, order = interrupted_and_resumed(sequential, at, tmp_path)
    assert order == uninterrupted(sequential)[1]
    assert distance(resumed, sequential) <= 1e-6  # measured: 0.0


def test_the_loader_alone_is_not_enough_with_lightnings_accumulation(tmp_path: Path) -> None:
    """The same data, but Lightning's built-in accumulation: the open window's gradients are lost."""
    resumed, order = interrupted_and_resumed(sequential, 6, tmp_path, builtin=True)
    assert order == uninterrupted(sequential, builtin=True)[1]
    assert distance(resumed, sequential, builtin=True) > 1e-2  # measured: 4.8e-2


def test_a_plain_dataloader_restarts_the_epoch(tmp_path: Path) -> None:
    """The contrast: the window is restored, but the epoch's first batches are trained on again."""
    with pytest.warns(UserWarning, match="dataloader is not resumable"):
        resumed, order = interrupted_and_resumed(plain, 6, tmp_path)
    assert order[7:10] == [list(range(0, 4)), list(range(4, 8)), list(range(8, 12))]
    assert distance(resumed, plain) > 1e-2  # measured: 8.8e-2


@pytest.mark.parametrize("at", MID_WINDOW)
@pytest.mark.parametrize(
    "make_loader",
    [shuffled, shuffled_by_sampler_generator, shuffled_per_epoch],
    ids=["shuffle", "sampler_generator", "per_epoch_seed"],
)
def test_shuffled_order_survives_a_resume(tmp_path: Path, at: int, make_loader: LoaderFactory) -> None:
    resumed, order = interrupted_and_resumed(make_loader, at, tmp_path)
    expected_order = uninterrupted(make_loader)[1]
    second_epoch = expected_order[MICRO_BATCHES : 2 * MICRO_BATCHES]
    assert sorted(i for batch in second_epoch for i in batch) == list(range(NUM_SAMPLES))
    assert second_epoch != expected_order[:MICRO_BATCHES]  # shuffled anew
    assert order == expected_order
    assert distance(resumed, make_loader) <= 1e-6  # measured: 0.0


@pytest.mark.parametrize(
    ("make_loader", "wrong_epochs"),
    [(shuffled_by_loader_generator, {2}), (shuffled_by_torch_distributed_sampler, {1})],
    ids=["loader_generator", "torch_distributed_sampler"],
)
def test_orders_that_do_not_survive_a_resume(
    tmp_path: Path, make_loader: LoaderFactory, wrong_epochs: set[int]
) -> None:
    """Why the recipes above, and not these, are in docs/guides.md (resume in epoch 1, after micro-batch 15).

    ``generator=`` given to the loader: the loader draws each iterator's base seed from it right after the
    sampler drew the epoch's permutation, and the checkpoint holds the generator as it was before the
    permutation; the resumed epoch is right, the generator ends one draw behind, every later epoch differs.
    torch's ``DistributedSampler`` builds its permutation when the iterator is made, which on a resume
    happens before Lightning's ``set_epoch``: the resumed epoch gets epoch 0's permutation (later epochs,
    whose iterators are made after ``set_epoch``, are right again).
    """
    resumed, order = interrupted_and_resumed(make_loader, 15, tmp_path)
    expected_order = uninterrupted(make_loader)[1]
    wrong = {
        epoch
        for epoch in range(EPOCHS)
        if order[epoch * MICRO_BATCHES : (epoch + 1) * MICRO_BATCHES]
        != expected_order[epoch * MICRO_BATCHES : (epoch + 1) * MICRO_BATCHES]
    }
    assert wrong == wrong_epochs
    assert distance(resumed, make_loader) > 1e-2  # measured: 2.8e-2 and 9.0e-2


def test_a_stream_without_length_resumes_one_batch_late(tmp_path: Path) -> None:
    """Without a length Lightning fetches one batch ahead (``_PrefetchDataFetcher``), and the loader's state
    counts it: the resumed run skips the batch that was fetched but not trained on (with a length, as in
    the tests above, nothing is fetched ahead and the state is exact)."""
    resumed, order = interrupted_and_resumed(streamed, 6, tmp_path)  # 7 trained on, 8 fetched
    expected_order = uninterrupted(streamed)[1]
    assert order[:7] == expected_order[:7]
    assert order[7:9] == expected_order[8:10]  # micro-batch 7 (samples 28..31) is skipped
    assert distance(resumed, streamed) > 1e-2  # measured: 2.8e-2


class RaisesOnce(Module):
    """Raises in ``training_step`` of global micro-batch ``at`` (inside a window), once."""

    def __init__(self, make_loader: LoaderFactory, at: int) -> None:
        super().__init__(make_loader)
        self.at, self.count = at, 0

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        self.count += 1
        if self.count - 1 == self.at:
            raise RuntimeError("simulated crash")
        return super().training_step(batch, batch_idx)


def test_a_crash_inside_a_batch_resumes_without_the_batch_it_had_fetched(tmp_path: Path) -> None:
    """Saved by ``OnExceptionCheckpoint`` when ``training_step`` of micro-batch 6 raises: the loader's saved
    position is after batch 6 and Lightning restarts at index 6, so batch 6 is never trained on, and the
    epoch's loader runs out a batch before Lightning's count of 10: Lightning does not step batch 9 (index 8
    is not its last), and the callback discards that cut window at the next epoch (warned). The resumed run
    is exactly that, not the uninterrupted run; the save warns."""
    first, resumed = RaisesOnce(sequential, 6), Module(sequential)
    saver = OnExceptionCheckpoint(tmp_path, filename="crash")
    with (  # "weighted": the big batch of each window, also of the epochs' last (2 samples) micro-batches
        pytest.warns(UserWarning, match="inside a batch that has not ended"),
        pytest.raises(RuntimeError, match="simulated crash"),
    ):
        callbacks = [GradientAccumulationCallback(K, scaling="weighted"), saver]
        h.trainer(callbacks=callbacks, max_epochs=EPOCHS, enable_checkpointing=True).fit(first)
    with pytest.warns(UserWarning, match="never reached its optimizer step"):
        trainer = h.trainer(
            callbacks=[GradientAccumulationCallback(K, scaling="weighted")], max_epochs=EPOCHS
        )
        trainer.fit(resumed, ckpt_path=tmp_path / "crash.ckpt")
    trained = [indices[0] // BATCH for indices in first.seen + resumed.seen]
    assert trained[:10] == [0, 1, 2, 3, 4, 5, 7, 8, 9, 0]
    windows = [[0, 1, 2, 3], [4, 5, 7, 8], *h.windows(MICRO_BATCHES, K, epochs=EPOCHS - 1)]
    expected = h.big_batch_reference(
        h.regression_net(), h.regression_data(NUM_SAMPLES), BATCH, windows, h.mse
    )
    assert h.max_abs_diff(resumed.net, expected) < 1e-6
    uninterrupted_windows = h.windows(MICRO_BATCHES, K, epochs=EPOCHS)
    whole = h.big_batch_reference(
        h.regression_net(), h.regression_data(NUM_SAMPLES), BATCH, uninterrupted_windows, h.mse
    )
    assert h.max_abs_diff(resumed.net, whole) > 1e-2  # not the uninterrupted run


def budget_fit(
    make_loader: LoaderFactory, seed: int, *callbacks: pl.Callback, **fit_kwargs: Any
) -> tuple[Module, GradientAccumulationCallback]:
    """Windows closed on 5 positive targets (1 to 4 micro-batches, following the shuffled data)."""
    pl.seed_everything(seed, verbose=False)
    module = Module(make_loader)
    callback = GradientAccumulationCallback(items_per_step=5, budget_count_fn=h.positive_targets)
    h.trainer(callbacks=[callback, *callbacks], max_epochs=EPOCHS).fit(module, **fit_kwargs)
    return module, callback


@pytest.mark.parametrize("at", MID_WINDOW)
def test_an_item_budget_with_a_shuffled_stateful_dataloader_resumes_mid_window_exactly(
    tmp_path: Path, at: int
) -> None:
    """The budget's open window (its items so far) and the loader's order come back together."""
    path = tmp_path / "mid_budget_window.ckpt"
    whole, whole_callback = budget_fit(shuffled, 0)
    with pytest.raises(Preempted):
        budget_fit(shuffled, 0, SaveAndStop(at, path))
    saved = torch.load(path, weights_only=False)
    window = next(state for key, state in saved["callbacks"].items() if "GradientAccumulation" in key)
    assert window["plan"]["window_items"] > 0  # saved inside a budget window
    resumed, resumed_callback = budget_fit(shuffled, 1, ckpt_path=path)
    assert resumed.seen == whole.seen[at + 1 :]
    assert h.max_abs_diff(resumed.net, whole.net) <= 1e-6
    assert resumed_callback.items_consumed == whole_callback.items_consumed
