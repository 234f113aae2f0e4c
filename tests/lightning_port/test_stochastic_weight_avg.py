"""Ported from Lightning-AI/pytorch-lightning: tests/tests_pytorch/callbacks/test_stochastic_weight_avg.py.

``accumulate_grad_batches=2`` is replaced by ``GradientAccumulationCallback(2)``, listed before and after
``StochasticWeightAveraging`` (their hooks then run in either order). A plain-PyTorch oracle replays SWA
(``SWALR``, the running average, the BatchNorm update epoch) with exact accumulation.
"""

from __future__ import annotations

import copy
import os
from contextlib import AbstractContextManager
from pathlib import Path
from unittest import mock

import pytest
import torch
from pytorch_lightning import Callback, Trainer
from pytorch_lightning.callbacks import StochasticWeightAveraging
from pytorch_lightning.demos.boring_classes import BoringModel, RandomDataset, RandomIterableDataset
from pytorch_lightning.strategies import Strategy
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.optim.swa_utils import SWALR
from torch.utils.data import DataLoader

from lightning_gradacc import GradientAccumulationCallback
from tests.helpers import weights_only
from tests.helpers import windows as k_windows

K = 2


class SwaTestModel(BoringModel):
    def __init__(
        self,
        batchnorm: bool = True,
        interval: str = "epoch",
        iterable_dataset: bool = False,
        crash_on_epoch=None,
        data: torch.Tensor | None = None,
    ):
        super().__init__()
        layers = [nn.Linear(32, 32)]
        if batchnorm:
            layers.append(nn.BatchNorm1d(32))
        layers += [nn.ReLU(), nn.Linear(32, 2)]
        self.layer = nn.Sequential(*layers)
        self.interval = interval
        self.iterable_dataset = iterable_dataset
        self.crash_on_epoch = crash_on_epoch
        self.data = data  # fixed data for the oracle test; None: Lightning's random data

    def training_step(self, batch, batch_idx):
        if self.crash_on_epoch and self.trainer.current_epoch >= self.crash_on_epoch:
            raise Exception("SWA crash test")
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        if self.data is not None:
            return DataLoader(self.data, batch_size=2)
        dset_cls = RandomIterableDataset if self.iterable_dataset else RandomDataset
        dset = dset_cls(32, 64)
        return DataLoader(dset, batch_size=2)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.layer.parameters(), lr=0.1)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1),
                "interval": self.interval,
            },
        }


class SwaTestCallback(StochasticWeightAveraging):
    update_parameters_calls: int = 0
    transfer_weights_calls: int = 0
    # Record the first epoch, as if we are resuming from a checkpoint this may not be equal to 0
    first_epoch: int | None = None

    def update_parameters(self, *args, **kwargs):
        self.update_parameters_calls += 1
        return StochasticWeightAveraging.update_parameters(*args, **kwargs)

    def transfer_weights(self, *args, **kwargs):
        self.transfer_weights_calls += 1
        return StochasticWeightAveraging.transfer_weights(*args, **kwargs)

    def on_train_epoch_start(self, trainer, *args):
        super().on_train_epoch_start(trainer, *args)
        if self.first_epoch is None and not trainer.fit_loop.restarting:
            self.first_epoch = trainer.current_epoch
        assert trainer.fit_loop._skip_backward == (trainer.current_epoch > self.swa_end)
        if self.swa_start <= trainer.current_epoch:
            assert isinstance(trainer.lr_scheduler_configs[0].scheduler, SWALR)
            assert trainer.lr_scheduler_configs[0].interval == "epoch"
            assert trainer.lr_scheduler_configs[0].frequency == 1

    def on_train_epoch_end(self, trainer, *args):
        super().on_train_epoch_end(trainer, *args)
        if self.swa_start <= trainer.current_epoch <= self.swa_end:
            swa_epoch = trainer.current_epoch - self.swa_start
            assert self.n_averaged == swa_epoch + 1
            assert self._swa_scheduler is not None
            # Scheduler is stepped once on initialization and then at the end of each epoch
            assert self._swa_scheduler._step_count == swa_epoch + 2
        elif trainer.current_epoch > self.swa_end:
            assert self.n_averaged == self._max_epochs - self.swa_start

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)

        # make sure these are correctly set again
        assert not trainer.fit_loop._skip_backward
        assert trainer.accumulate_grad_batches == K
        assert trainer.num_training_batches == 5

        # check backward call count. the batchnorm update epoch should not backward
        assert trainer.strategy.backward.call_count == (
            (trainer.max_epochs - self.first_epoch) * trainer.limit_train_batches
        )

        # check call counts
        first_swa_epoch = max(self.first_epoch, self.swa_start)
        assert self.update_parameters_calls == trainer.max_epochs - first_swa_epoch
        assert self.transfer_weights_calls == 1


def _callbacks(swa: Callback, accumulation: Callback, accumulation_first: bool) -> list[Callback]:
    return [accumulation, swa] if accumulation_first else [swa, accumulation]


def train_with_swa(
    tmp_path,
    batchnorm=True,
    interval="epoch",
    iterable_dataset=False,
    accumulation_first=True,
):
    model = SwaTestModel(batchnorm=batchnorm, interval=interval, iterable_dataset=iterable_dataset)
    swa_start = 2
    max_epochs = 5
    swa_callback = SwaTestCallback(swa_epoch_start=swa_start, swa_lrs=0.1)
    assert swa_callback.update_parameters_calls == 0
    assert swa_callback.transfer_weights_calls == 0
    accumulation = GradientAccumulationCallback(K)

    trainer = Trainer(
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        max_epochs=max_epochs,
        limit_train_batches=5,
        limit_val_batches=0,
        callbacks=_callbacks(swa_callback, accumulation, accumulation_first),
        accelerator="cpu",
        devices=1,
    )

    with _backward_patch(trainer):
        trainer.fit(model, **weights_only(False))

    # check the model is the expected
    assert trainer.lightning_module == model
    # 5 training epochs of 5 micro-batches in windows 2, 2, 1; the BatchNorm epoch only closes empty windows
    stats = accumulation.stats
    assert stats.windows - stats.empty_windows == max_epochs * 3
    assert stats.total_micro_batches == max_epochs * 5
    assert (stats.empty_windows > 0) == batchnorm


# Original: test_swa_callback
@pytest.mark.parametrize("accumulation_first", [True, False])
@pytest.mark.parametrize("batchnorm", [True, False])
@pytest.mark.parametrize("iterable_dataset", [True, False])
def test_swa_callback(tmp_path, batchnorm: bool, iterable_dataset: bool, accumulation_first: bool):
    train_with_swa(
        tmp_path,
        batchnorm=batchnorm,
        iterable_dataset=iterable_dataset,
        accumulation_first=accumulation_first,
    )


# Original: test_swa_callback_scheduler_step
@pytest.mark.parametrize("interval", ["epoch", "step"])
def test_swa_callback_scheduler_step(tmp_path, interval: str):
    train_with_swa(tmp_path, interval=interval)


# ------------------------------------------------------------------------------------------ oracle

DATA = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))


def _mse_to_ones(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = net(x)
    return nn.functional.mse_loss(out, torch.ones_like(out))


def plain_swa(
    net: nn.Module,
    batchnorm: bool,
    num_batches=5,
    max_epochs=5,
    swa_epoch_start=2,
    swa_lr=0.1,
    windows: list[list[int]] | None = None,
):
    """Lightning's SWA schedule replayed in plain PyTorch, each window the mean over its micro-batches.

    ``windows``: the micro-batches of each epoch's windows (by default K at a time).

    SWA starts at epoch ``swa_epoch_start - 1``: at the start of each epoch from there the current weights
    are averaged in and ``SWALR`` replaces ``StepLR``. After the last epoch the average is copied into the
    model and, with BatchNorm, one extra pass over the data (no backward, no optimizer step) recomputes the
    running statistics.
    """
    net = copy.deepcopy(net)
    average = copy.deepcopy(net)
    n_averaged = 0
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    start = swa_epoch_start - 1
    batches = [DATA[2 * i : 2 * i + 2] for i in range(num_batches)]
    for epoch in range(max_epochs):
        if epoch >= start:
            if epoch == start:
                for group in opt.param_groups:
                    group["initial_lr"] = swa_lr
                fit_max_epochs = max_epochs + batchnorm  # Lightning adds the BatchNorm epoch
                sched = SWALR(opt, swa_lr=[swa_lr], anneal_epochs=10, last_epoch=fit_max_epochs)
            with torch.no_grad():
                for p_avg, p in zip(average.parameters(), net.parameters(), strict=True):
                    p_avg.copy_(p if n_averaged == 0 else p_avg + (p - p_avg) / (n_averaged + 1))
            n_averaged += 1
        for indices in windows or k_windows(num_batches, K):
            window = [batches[index] for index in indices]
            opt.zero_grad()
            for x in window:
                (_mse_to_ones(net, x) / len(window)).backward()
            opt.step()
        sched.step()
    with torch.no_grad():
        for p_avg, p in zip(average.parameters(), net.parameters(), strict=True):
            p.copy_(p_avg)
    if batchnorm:
        norms = [m for m in net.modules() if isinstance(m, nn.BatchNorm1d)]
        for bn in norms:
            bn.reset_running_stats()
            bn.momentum = None
        with torch.no_grad():
            for x in batches:
                net(x)
        for bn in norms:
            bn.momentum = 0.1
    return net


def oracle_trainer(tmp_path, callbacks: list[Callback]) -> Trainer:
    """The fit ``plain_swa`` replays: 5 epochs of the 5 batches of ``DATA``, quiet, no validation."""
    return Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        max_epochs=5,
        limit_train_batches=5,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=callbacks,
    )


# Original: test_swa_callback (oracle added: the averaged weights and the BatchNorm statistics)
# Lightning's built-in accumulation steps the optimizer once more on the last batch of the BatchNorm epoch,
# with the stale gradient of the last training window, so its weights are no longer the SWA average. The
# exact behaviour asserted here: the BatchNorm epoch runs no optimizer step; the weights are the average.
@pytest.mark.parametrize("accumulation_first", [True, False])
@pytest.mark.parametrize("batchnorm", [True, False])
def test_swa_matches_plain_loop(tmp_path, batchnorm: bool, accumulation_first: bool):
    torch.manual_seed(0)
    model = SwaTestModel(batchnorm=batchnorm, data=DATA)
    initial = copy.deepcopy(model.layer)
    swa = StochasticWeightAveraging(swa_epoch_start=2, swa_lrs=0.1)
    trainer = oracle_trainer(tmp_path, _callbacks(swa, GradientAccumulationCallback(K), accumulation_first))
    trainer.fit(model)
    expected = plain_swa(initial, batchnorm).state_dict()
    for name, value in model.layer.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=f"layer.{name} differs")


def positive_first_features(batch: torch.Tensor) -> int:
    return int((batch[:, 0] > 0).sum()) + 1  # 1, 1, 1, 3 and 2 in the 5 batches of each epoch


# Not in Lightning: SWA over windows that K policies choose one by one: closed on an item budget (3, 1 and 1
# micro-batches in each epoch), and a K keyed by steps ({0: 2}: 2, 2 and 1). In the BatchNorm epoch, which
# runs forwards only, SWA drives Lightning (one window of the epoch, empty, closed without a step), and its
# forwards consume no items.
@pytest.mark.parametrize(
    ("policy", "windows", "steps", "items"),
    [
        ({"items_per_step": 3, "budget_count_fn": positive_first_features}, [[0, 1, 2], [3], [4]], 3, 8),
        ({"accumulation_steps": {0: 2}, "schedule_unit": "steps"}, [[0, 1], [2, 3], [4]], 3, None),
    ],
    ids=["budget", "keyed_by_steps"],
)
@pytest.mark.parametrize("batchnorm", [True, False])
def test_swa_over_windows_chosen_one_by_one_matches_plain_loop(
    tmp_path, batchnorm: bool, policy: dict, windows: list[list[int]], steps: int, items: int | None
):
    torch.manual_seed(0)
    model = SwaTestModel(batchnorm=batchnorm, data=DATA)
    initial = copy.deepcopy(model.layer)
    accumulation = GradientAccumulationCallback(**policy)
    trainer = oracle_trainer(
        tmp_path, [StochasticWeightAveraging(swa_epoch_start=2, swa_lrs=0.1), accumulation]
    )
    trainer.fit(model)
    assert trainer.global_step == 5 * steps + batchnorm  # as Lightning counts the BatchNorm epoch
    assert accumulation.stats.empty_windows == batchnorm
    if items is not None:  # the BatchNorm epoch's batches were not trained on
        assert accumulation.items_consumed == 5 * items
    expected = plain_swa(initial, batchnorm, windows=windows).state_dict()
    for name, value in model.layer.state_dict().items():  # running_var up to 241: 1.5e-5 is 1 ulp
        torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-6, msg=f"layer.{name} differs")


# Original: test_swa_multiple_lrs
def test_swa_multiple_lrs(tmp_path):
    swa_lrs = [0.123, 0.321]

    class TestModel(BoringModel):
        def __init__(self):
            super().__init__()
            self.layer1 = torch.nn.Linear(32, 32)
            self.layer2 = torch.nn.Linear(32, 2)
            self.on_train_epoch_start_called = False

        def forward(self, x):
            x = self.layer1(x)
            return self.layer2(x)

        def configure_optimizers(self):
            params = [
                {"params": self.layer1.parameters(), "lr": 0.1},
                {"params": self.layer2.parameters(), "lr": 0.2},
            ]
            return torch.optim.Adam(params)

        def on_train_epoch_start(self):
            optimizer = trainer.optimizers[0]
            assert [pg["lr"] for pg in optimizer.param_groups] == [0.1, 0.2]
            assert [pg["initial_lr"] for pg in optimizer.param_groups] == swa_lrs
            assert [pg["swa_lr"] for pg in optimizer.param_groups] == swa_lrs
            self.on_train_epoch_start_called = True

    model = TestModel()
    swa_callback = StochasticWeightAveraging(swa_lrs=swa_lrs)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        callbacks=[swa_callback, GradientAccumulationCallback(K)],
        fast_dev_run=3,
    )
    trainer.fit(model)
    assert model.on_train_epoch_start_called


def _swa_resume_training_from_checkpoint(tmp_path, model, resume_model):
    swa_start = 3
    trainer_kwargs = {
        "default_root_dir": tmp_path,
        "max_epochs": 5,
        "accelerator": "cpu",
        "devices": 1,
        "limit_train_batches": 5,
        "limit_val_batches": 0,
        "enable_progress_bar": False,
        "logger": False,
    }
    trainer = Trainer(
        callbacks=[SwaTestCallback(swa_epoch_start=swa_start, swa_lrs=0.1), GradientAccumulationCallback(K)],
        **trainer_kwargs,
    )

    with _backward_patch(trainer), pytest.raises(Exception, match="SWA crash test"):
        trainer.fit(model, **weights_only(False))

    checkpoint_dir = Path(tmp_path) / "checkpoints"
    checkpoint_files = os.listdir(checkpoint_dir)
    assert len(checkpoint_files) == 1
    ckpt_path = str(checkpoint_dir / checkpoint_files[0])

    accumulation = GradientAccumulationCallback(K)
    trainer = Trainer(
        callbacks=[SwaTestCallback(swa_epoch_start=swa_start, swa_lrs=0.1), accumulation], **trainer_kwargs
    )

    with _backward_patch(trainer):
        trainer.fit(resume_model, ckpt_path=ckpt_path, **weights_only(False))
    # counters survive the resume: 3 steps per training epoch, none in the BatchNorm epoch
    stats = accumulation.stats
    assert stats.windows - stats.empty_windows == 5 * 3
    assert stats.total_micro_batches == 5 * 5


class CustomSchedulerModel(SwaTestModel):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.layer.parameters(), lr=0.1)

        def lr_lambda(current_step: int):
            return 0.1

        scheduler = LambdaLR(optimizer, lr_lambda, -1)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {
                "scheduler": scheduler,
                "interval": self.interval,
            },
        }


# Original: test_swa_resume_training_from_checkpoint
@pytest.mark.parametrize("crash_on_epoch", [1, 3])
def test_swa_resume_training_from_checkpoint(tmp_path, crash_on_epoch):
    model = SwaTestModel(crash_on_epoch=crash_on_epoch)
    resume_model = SwaTestModel()
    _swa_resume_training_from_checkpoint(tmp_path, model, resume_model)


# Original: test_swa_resume_training_from_checkpoint_custom_scheduler
@pytest.mark.parametrize("crash_on_epoch", [1, 3])
def test_swa_resume_training_from_checkpoint_custom_scheduler(tmp_path, crash_on_epoch):
    model = CustomSchedulerModel(crash_on_epoch=crash_on_epoch)
    resume_model = CustomSchedulerModel()
    _swa_resume_training_from_checkpoint(tmp_path, model, resume_model)


# Original: test_swa_with_infinite_epochs_and_batchnorm
def test_swa_with_infinite_epochs_and_batchnorm(tmp_path):
    """With max_epochs=-1 SWA has no BatchNorm epoch; training stops on max_steps (optimizer steps)."""
    model = SwaTestModel(batchnorm=True)
    swa_callback = StochasticWeightAveraging(swa_lrs=0.1, swa_epoch_start=2)
    accumulation = GradientAccumulationCallback(K)

    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        enable_progress_bar=False,
        enable_model_summary=False,
        max_epochs=-1,
        max_steps=30,  # Use max_steps as stopping condition
        limit_train_batches=5,
        limit_val_batches=0,
        callbacks=[swa_callback, accumulation],
        logger=False,
    )
    assert trainer.max_epochs == -1
    assert trainer.fit_loop.max_epochs == -1

    trainer.fit(model)
    # 5 micro-batches in windows 2, 2, 1: 3 optimizer steps per epoch, 10 epochs for 30 steps
    assert trainer.current_epoch == 10
    assert trainer.global_step == 30
    assert trainer.max_epochs == -1
    assert accumulation.stats.windows == 30
    assert accumulation.stats.micro_batches_last_step == 1

    assert swa_callback.n_averaged is not None
    assert swa_callback.n_averaged > 0, "SWA should have updated parameters"


def _backward_patch(trainer: Trainer) -> AbstractContextManager:
    return mock.patch.object(Strategy, "backward", wraps=trainer.strategy.backward)
