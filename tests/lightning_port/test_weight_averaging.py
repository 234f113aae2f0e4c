"""Ported from Lightning-AI/pytorch-lightning: tests/tests_pytorch/callbacks/test_weight_averaging.py.

``accumulate_grad_batches=2`` is replaced by ``GradientAccumulationCallback(2)``. ``WeightAveraging`` updates
its average after every optimizer step, so with accumulation it must see one update per window. An oracle
replays EMA with ``torch.optim.swa_utils.AveragedModel`` in a plain loop.
"""

from __future__ import annotations

import copy
import glob
import os
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning.callbacks
import torch
from pytorch_lightning import LightningModule, Trainer

if not hasattr(pytorch_lightning.callbacks, "EMAWeightAveraging"):
    pytest.skip("`EMAWeightAveraging` comes with Lightning 2.6", allow_module_level=True)

from pytorch_lightning.callbacks import EMAWeightAveraging, WeightAveraging
from pytorch_lightning.demos.boring_classes import BoringModel, RandomDataset, RandomIterableDataset
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_swa_avg_fn
from torch.utils.data import DataLoader, Dataset

from lightning_gradacc import GradientAccumulationCallback

K = 2


class TestModel(BoringModel):
    def __init__(self, batch_norm: bool = True) -> None:
        super().__init__()
        layers = [nn.Linear(32, 32)]
        if batch_norm:
            layers.append(nn.BatchNorm1d(32))
        layers += [nn.ReLU(), nn.Linear(32, 2)]
        self.layer = nn.Sequential(*layers)
        self.crash_on_epoch = None

    def training_step(self, batch: Tensor, batch_idx: int) -> None:
        if self.crash_on_epoch and self.trainer.current_epoch >= self.crash_on_epoch:
            raise Exception("CRASH")
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> None:
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


class EMAAveragingFunction:
    """EMA averaging function (a class rather than the closure of ``get_ema_avg_fn()``)."""

    def __init__(self, decay: float = 0.999) -> None:
        self.decay = decay

    @torch.no_grad()
    def __call__(self, ema_param: Tensor, current_param: Tensor, num_averaged: Tensor) -> Tensor:
        return self.decay * ema_param + (1 - self.decay) * current_param


class _CountingAveraging(WeightAveraging):
    """Counts the swaps and copies of the averaged weights (shared by the EMA and SWA test callbacks)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.swap_calls = 0
        self.copy_calls = 0
        self.first_epoch: int | None = None

    def _swap_models(self, *args: Any, **kwargs: Any):
        self.swap_calls += 1
        return super()._swap_models(*args, **kwargs)

    def _copy_average_to_current(self, *args: Any, **kwargs: Any):
        self.copy_calls += 1
        return super()._copy_average_to_current(*args, **kwargs)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        assert self.swap_calls == 0
        assert self.copy_calls == 0

    def on_train_epoch_start(self, trainer: Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        if self.first_epoch is None and not trainer.fit_loop.restarting:
            self.first_epoch = trainer.current_epoch


class EMATestCallback(_CountingAveraging):
    def __init__(self, devices: int = 1, **kwargs: Any) -> None:
        super().__init__(avg_fn=EMAAveragingFunction(), **kwargs)
        self.devices = devices

    def on_train_epoch_end(self, trainer: Trainer, *args: Any) -> None:
        super().on_train_epoch_end(trainer, *args)
        assert self._average_model.n_averaged == trainer.global_step
        assert self.swap_calls == (trainer.current_epoch + 1 - self.first_epoch) * 2
        assert self.copy_calls == 0

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        # length=32, batch_size=4, K=2 => 4 optimizer steps per epoch.
        steps_per_epoch = 4 // self.devices
        assert self._average_model.n_averaged == trainer.max_epochs * steps_per_epoch
        assert self.swap_calls == (trainer.max_epochs - self.first_epoch) * 2
        assert self.copy_calls == 1


class SWATestCallback(_CountingAveraging):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(avg_fn=get_swa_avg_fn(), **kwargs)

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        return epoch_idx in (3, 5, 7)

    def on_train_epoch_end(self, trainer: Trainer, *args: Any) -> None:
        super().on_train_epoch_end(trainer, *args)
        if trainer.current_epoch < 3:
            assert self._average_model.n_averaged == 0
        elif trainer.current_epoch < 5:
            assert self._average_model.n_averaged == 1
        elif trainer.current_epoch < 7:
            assert self._average_model.n_averaged == 2
        else:
            assert self._average_model.n_averaged == 3
        assert self.swap_calls == (trainer.current_epoch + 1 - self.first_epoch) * 2
        assert self.copy_calls == 0

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        assert self._average_model.n_averaged == 3
        assert self.swap_calls == (trainer.max_epochs - self.first_epoch) * 2
        assert self.copy_calls == 1


def _train(
    model: BoringModel,
    dataset: Dataset,
    tmp_path: str,
    callback: WeightAveraging,
    checkpoint_path: str | None = None,
    will_crash: bool = False,
    accumulation: GradientAccumulationCallback | None = None,
    max_epochs: int = 8,
) -> None:
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[callback, accumulation or GradientAccumulationCallback(K)],
        max_epochs=max_epochs,
        num_sanity_val_steps=0,
        limit_val_batches=2,
        enable_checkpointing=will_crash,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        default_root_dir=tmp_path,
    )
    dataloader = DataLoader(dataset, batch_size=4, shuffle=False)
    if will_crash:
        with pytest.raises(Exception, match="CRASH"):
            trainer.fit(model, dataloader, ckpt_path=checkpoint_path)
    else:
        trainer.fit(model, dataloader, ckpt_path=checkpoint_path)
    assert trainer.lightning_module == model


def _train_and_resume(model: TestModel, dataset: Dataset, tmp_path: str) -> TestModel:
    _train(model, dataset, tmp_path, EMATestCallback(), will_crash=True)

    checkpoint_dir = Path(tmp_path) / "checkpoints"
    checkpoint_names = os.listdir(checkpoint_dir)
    assert len(checkpoint_names) == 1
    checkpoint_path = str(checkpoint_dir / checkpoint_names[0])

    model = TestModel.load_from_checkpoint(checkpoint_path)
    callback = EMATestCallback()
    _train(model, dataset, tmp_path, callback, checkpoint_path=checkpoint_path)
    return model


# Original: test_ema
@pytest.mark.parametrize("batch_norm", [True, False])
@pytest.mark.parametrize("iterable_dataset", [True, False])
def test_ema(tmp_path, batch_norm: bool, iterable_dataset: bool):
    model = TestModel(batch_norm=batch_norm)
    dataset = RandomIterableDataset(32, 32) if iterable_dataset else RandomDataset(32, 32)
    _train(model, dataset, tmp_path, EMATestCallback())


# Original: test_ema_resume
@pytest.mark.parametrize("crash_on_epoch", [1, 3, 5])
def test_ema_resume(tmp_path, crash_on_epoch):
    dataset = RandomDataset(32, 32)
    model1 = TestModel()
    model2 = copy.deepcopy(model1)

    _train(model1, dataset, tmp_path, EMATestCallback())

    model2.crash_on_epoch = crash_on_epoch
    model2 = _train_and_resume(model2, dataset, tmp_path)

    for param1, param2 in zip(model1.parameters(), model2.parameters(), strict=True):
        assert torch.allclose(param1, param2)


# Original: test_swa
def test_swa(tmp_path):
    model = TestModel()
    dataset = RandomDataset(32, 32)
    _train(model, dataset, tmp_path, SWATestCallback())


# Original: test_ema_weight_averaging_step_frequency (with a partial window in each epoch)
def test_ema_weight_averaging_step_frequency(tmp_path):
    model = TestModel()
    dataset = RandomDataset(32, 32)  # 8 micro-batches, K=3: windows 3, 3, 2
    callback = EMAWeightAveraging(decay=0.95, update_every_n_steps=5)
    accumulation = GradientAccumulationCallback(3)
    _train(model, dataset, tmp_path, callback, accumulation=accumulation)
    assert callback._average_model is not None
    # 24 optimizer steps; updated after steps 1, 6, 11, 16, 21
    assert int(callback._average_model.n_averaged) == 5
    assert accumulation.stats.windows == 24


# Original: test_ema_weight_averaging_checkpoint_save_load
def test_ema_weight_averaging_checkpoint_save_load(tmp_path):
    model = TestModel()
    model.crash_on_epoch = 2
    dataset = RandomDataset(32, 32)

    callback = EMAWeightAveraging(decay=0.99, update_every_n_steps=2)
    _train(model, dataset, tmp_path, callback, will_crash=True)

    model2 = TestModel()
    callback2 = EMAWeightAveraging(decay=0.99, update_every_n_steps=2)
    accumulation = GradientAccumulationCallback(K)
    _train(
        model2,
        dataset,
        tmp_path,
        callback2,
        checkpoint_path=glob.glob((tmp_path / "checkpoints" / "*.ckpt").as_posix())[0],
        accumulation=accumulation,
    )
    assert callback2._average_model is not None
    assert accumulation.stats.windows == 8 * 4  # counters restored from the checkpoint


# Original: test_ema_weight_averaging (oracle added: the EMA weights equal a plain loop's)
@pytest.mark.parametrize("batch_norm", [True, False])
def test_ema_weight_averaging_matches_plain_loop(tmp_path, batch_norm: bool):
    torch.manual_seed(0)
    model = TestModel(batch_norm=batch_norm)
    initial = copy.deepcopy(model.layer)
    data = torch.randn(32, 32, generator=torch.Generator().manual_seed(5))
    callback = EMAWeightAveraging(decay=0.5, update_every_n_steps=1)
    accumulation = GradientAccumulationCallback(3)  # 8 micro-batches per epoch: windows 3, 3, 2
    _train(model, data, tmp_path, callback, accumulation=accumulation, max_epochs=3)

    net = copy.deepcopy(initial)
    average = AveragedModel(net, avg_fn=get_ema_avg_fn(0.5), use_buffers=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    batches = [data[i : i + 4] for i in range(0, 32, 4)]
    for _ in range(3):
        for first in range(0, 8, 3):
            window = batches[first : first + 3]
            opt.zero_grad()
            for x in window:
                out = net(x)
                (nn.functional.mse_loss(out, torch.ones_like(out)) / len(window)).backward()
            opt.step()
            average.update_parameters(net)
    expected = average.module.state_dict()
    assert int(callback._average_model.n_averaged) == 9
    for name, value in model.layer.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=f"layer.{name} differs")
