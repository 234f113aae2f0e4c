"""Ported from Lightning-AI/pytorch-lightning: tests/tests_pytorch/callbacks/test_finetuning_callback.py.

Lightning's finetuning tests run without accumulation; here every fit also has a
``GradientAccumulationCallback``, whose windows are partial (so a parameter that the callback does not
normalize shows). ``BaseFinetuning`` freezes layers in ``setup`` and unfreezes them at the start of later
epochs: those layers must then be accumulated, normalized and clipped like the others. Oracles replay the
same finetuning callbacks on a plain ``nn.Module`` with a plain-PyTorch loop.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from pytorch_lightning import LightningModule, Trainer, seed_everything
from pytorch_lightning.callbacks import BackboneFinetuning, BaseFinetuning, ModelCheckpoint
from pytorch_lightning.demos.boring_classes import BoringModel, RandomDataset
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_gradacc import GradientAccumulationCallback

QUIET = dict(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False)


class TestBackboneFinetuningCallback(BackboneFinetuning):
    def on_train_epoch_start(self, trainer, pl_module):
        super().on_train_epoch_start(trainer, pl_module)
        epoch = trainer.current_epoch
        if self.unfreeze_backbone_at_epoch <= epoch:
            optimizer = trainer.optimizers[0]
            current_lr = optimizer.param_groups[0]["lr"]
            backbone_lr = self.previous_backbone_lr
            if epoch < 6:
                assert backbone_lr <= current_lr
            else:
                assert backbone_lr == current_lr


class FinetuningBackboneModel(BoringModel):
    def __init__(self, data: torch.Tensor | None = None):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(32, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU())
        self.layer = torch.nn.Linear(32, 2)
        self.backbone.has_been_used = False
        self.data = data

    def forward(self, x):
        self.backbone.has_been_used = True
        x = self.backbone(x)
        return self.layer(x)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.layer.parameters(), lr=0.1)
        lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return [optimizer], [lr_scheduler]

    def train_dataloader(self):
        return DataLoader(self.data if self.data is not None else RandomDataset(32, 64), batch_size=2)


# Original: test_finetuning_callback
def test_finetuning_callback(tmp_path):
    seed_everything(42)
    model = FinetuningBackboneModel()
    callback = TestBackboneFinetuningCallback(unfreeze_backbone_at_epoch=3, verbose=False)
    accumulation = GradientAccumulationCallback(3)  # 4 micro-batches per epoch: windows 3, 1

    trainer = Trainer(
        limit_train_batches=4,
        limit_val_batches=2,
        default_root_dir=tmp_path,
        callbacks=[callback, accumulation],
        max_epochs=8,
        logger=False,
        **QUIET,
    )
    trainer.fit(model)

    assert model.backbone.has_been_used
    assert accumulation.stats.windows == 8 * 2


def _plain_finetuning(
    net: nn.Module,
    finetuning: BaseFinetuning,
    data,
    *,
    epochs,
    num_batches,
    k,
    lr_sched,
    optimized,
    max_grad_norm=None,
    batch_size=2,
) -> nn.Module:
    """The finetuning callback's freeze/unfreeze logic driven by hand around a plain accumulation loop."""
    net = copy.deepcopy(net)
    finetuning.freeze_before_training(net)
    opt = torch.optim.SGD(optimized(net), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7) if lr_sched else None
    batches = [data[i * batch_size : (i + 1) * batch_size] for i in range(num_batches)]
    for epoch in range(epochs):
        finetuning.finetune_function(net, epoch, opt)
        for first in range(0, num_batches, k):
            window = batches[first : first + k]
            opt.zero_grad(set_to_none=True)
            for x in window:
                out = net.layer(net.backbone(x))
                (nn.functional.mse_loss(out, torch.ones_like(out)) / len(window)).backward()
            if max_grad_norm is not None:
                params = [p for group in opt.param_groups for p in group["params"]]
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            opt.step()
        if sched is not None:
            sched.step()
    return net


class AllTrainableOptimizedModel(FinetuningBackboneModel):
    """Optimizes every parameter that is trainable when training starts (the BatchNorm: train_bn=True)."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)
        lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return [optimizer], [lr_scheduler]


# Original: test_finetuning_callback (oracle added)
# The backbone's Linear is unfrozen at epoch 2: from then its gradient must be the mean over the window's
# micro-batches (the last window of each epoch has 1 of K=3) and count in the clipped norm.
@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
def test_backbone_finetuning_matches_plain_loop(tmp_path, max_grad_norm):
    seed_everything(42)
    data = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    model = AllTrainableOptimizedModel(data)
    plain = nn.Module()
    plain.backbone, plain.layer = copy.deepcopy(model.backbone), copy.deepcopy(model.layer)
    options = dict(unfreeze_backbone_at_epoch=2, backbone_initial_ratio_lr=1.0)
    trainer = Trainer(
        limit_train_batches=4,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        callbacks=[
            BackboneFinetuning(**options),
            GradientAccumulationCallback(3, max_grad_norm=max_grad_norm),
        ],
        max_epochs=5,
        logger=False,
        enable_checkpointing=False,
        **QUIET,
    )
    trainer.fit(model)
    expected = _plain_finetuning(
        plain,
        BackboneFinetuning(**options),
        data,
        epochs=5,
        num_batches=4,
        k=3,
        lr_sched=True,
        optimized=lambda net: [p for p in net.parameters() if p.requires_grad],
        max_grad_norm=max_grad_norm,
    )
    for name, value in model.backbone.state_dict().items():
        torch.testing.assert_close(
            value, expected.backbone.state_dict()[name], rtol=0, atol=1e-6, msg=f"backbone.{name} differs"
        )
    for name, value in model.layer.state_dict().items():
        torch.testing.assert_close(
            value, expected.layer.state_dict()[name], rtol=0, atol=1e-6, msg=f"layer.{name} differs"
        )


class TestBackboneFinetuningWarningCallback(BackboneFinetuning):
    def finetune_function(self, pl_module, epoch: int, optimizer):
        """Called when the epoch begins."""
        if epoch == 0:
            self.unfreeze_and_add_param_group(
                pl_module.backbone,
                optimizer,
                0.1,
                train_bn=self.train_bn,
                initial_denom_lr=self.initial_denom_lr,
            )


# Original: test_finetuning_callback_warning
def test_finetuning_callback_warning(tmp_path):
    seed_everything(42)

    class FinetuningBoringModel(BoringModel):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Linear(32, 2, bias=False)
            self.layer = None
            self.backbone.has_been_used = False

        def forward(self, x):
            self.backbone.has_been_used = True
            return self.backbone(x)

        def train_dataloader(self):
            return DataLoader(RandomDataset(32, 64), batch_size=2)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    chk = ModelCheckpoint(dirpath=tmp_path, save_last=True)

    model = FinetuningBoringModel()
    model.validation_step = None
    callback = TestBackboneFinetuningWarningCallback(unfreeze_backbone_at_epoch=3, verbose=False)

    trainer = Trainer(
        limit_train_batches=1,
        default_root_dir=tmp_path,
        callbacks=[callback, chk, GradientAccumulationCallback(2)],
        max_epochs=2,
        logger=False,
        **QUIET,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    assert any("Did you init your optimizer in" in str(w.message) for w in caught)

    assert model.backbone.has_been_used
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=3,
        limit_train_batches=1,
        callbacks=[GradientAccumulationCallback(2)],
        logger=False,
        **QUIET,
    )
    trainer.fit(model, ckpt_path=chk.last_model_path)


class OnEpochLayerFinetuning(BaseFinetuning):
    def freeze_before_training(self, pl_module: LightningModule):
        self.freeze(pl_module.layer)

    def finetune_function(self, pl_module: LightningModule, epoch: int, optimizer: Optimizer):
        self.unfreeze_and_add_param_group(pl_module.layer[epoch + 1], optimizer)


class FreezeModel(BoringModel):
    def __init__(self, data: torch.Tensor | None = None):
        super().__init__()
        self.layer = nn.Sequential(
            nn.Linear(32, 32, bias=False),
            nn.Linear(32, 32, bias=True),
            nn.Linear(32, 32, bias=False),
            nn.Linear(32, 32, bias=True),
            nn.Linear(32, 32, bias=False),
            nn.Linear(32, 2, bias=True),
        )
        self.data = data

    def forward(self, x):
        return self.layer(x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer[0].parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=2) if self.data is not None else super().train_dataloader()


# Original: test_base_finetuning_internal_optimizer_metadata
# Every layer is frozen when training starts; one more is unfrozen at the start of each epoch.
def test_base_finetuning_internal_optimizer_metadata(tmp_path):
    seed_everything(42)
    cb = OnEpochLayerFinetuning()
    chk = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    model = FreezeModel()
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=5,
        limit_train_batches=1,
        callbacks=[cb, chk, GradientAccumulationCallback(2)],
        logger=False,
        **QUIET,
    )
    trainer.fit(model)
    assert len(cb._internal_optimizer_metadata[0]) == 6
    assert cb._internal_optimizer_metadata[0][0]["params"] == ["layer.0.weight"]
    assert cb._internal_optimizer_metadata[0][1]["params"] == ["layer.1.weight", "layer.1.bias"]
    assert cb._internal_optimizer_metadata[0][2]["params"] == ["layer.2.weight"]
    assert cb._internal_optimizer_metadata[0][3]["params"] == ["layer.3.weight", "layer.3.bias"]
    assert cb._internal_optimizer_metadata[0][4]["params"] == ["layer.4.weight"]
    assert cb._internal_optimizer_metadata[0][5]["params"] == ["layer.5.weight", "layer.5.bias"]

    model = FreezeModel()
    cb = OnEpochLayerFinetuning()
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=10,
        callbacks=[cb, GradientAccumulationCallback(2)],
        logger=False,
        **QUIET,
    )
    with pytest.raises(IndexError, match="index 6 is out of range"):
        trainer.fit(model, ckpt_path=chk.last_model_path)


# Original: test_base_finetuning_internal_optimizer_metadata (oracle added: layers unfrozen epoch by epoch)
@pytest.mark.parametrize("finetuning_first", [True, False])
def test_base_finetuning_matches_plain_loop(tmp_path, finetuning_first):
    seed_everything(42)
    data = torch.randn(6, 32, generator=torch.Generator().manual_seed(2))
    model = FreezeModel(data)
    plain = nn.Module()
    plain.layer = copy.deepcopy(model.layer)
    plain.backbone = nn.Identity()
    accumulation = GradientAccumulationCallback(2)  # 3 micro-batches per epoch: windows 2, 1
    callbacks = [OnEpochLayerFinetuning(), accumulation]
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=4,
        limit_val_batches=0,
        callbacks=callbacks if finetuning_first else callbacks[::-1],
        logger=False,
        enable_checkpointing=False,
        **QUIET,
    )
    trainer.fit(model)
    expected = _plain_finetuning(
        plain,
        OnEpochLayerFinetuning(),
        data,
        epochs=4,
        num_batches=3,
        k=2,
        lr_sched=False,
        optimized=lambda net: net.layer[0].parameters(),
    )
    for name, value in model.layer.state_dict().items():
        torch.testing.assert_close(
            value, expected.layer.state_dict()[name], rtol=0, atol=1e-6, msg=f"layer.{name} differs"
        )
    assert accumulation.stats.windows == 4 * 2


class TestCallbacksRestoreCallback(BaseFinetuning):
    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.layer[:3])

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch >= 1:
            self.unfreeze_and_add_param_group(pl_module.layer[epoch - 1], optimizer)


class FinetuningBoringModel(BoringModel):
    def __init__(self):
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 2))

    def configure_optimizers(self):
        parameters = filter(lambda x: x.requires_grad, self.parameters())
        return torch.optim.SGD(parameters, lr=0.1)


# Original: test_callbacks_restore
def test_callbacks_restore(tmp_path):
    chk = ModelCheckpoint(dirpath=tmp_path, save_last=True)

    model = FinetuningBoringModel()
    callback = TestCallbacksRestoreCallback()

    trainer_kwargs = {
        "default_root_dir": tmp_path,
        "limit_train_batches": 3,
        "limit_val_batches": 1,
        "callbacks": [callback, chk, GradientAccumulationCallback(2)],
        "max_epochs": 2,
        "logger": False,
        **QUIET,
    }

    trainer = Trainer(**trainer_kwargs)
    trainer.fit(model)

    # only 1 optimizer
    assert len(callback._internal_optimizer_metadata) == 1

    # only 2 param groups
    assert len(callback._internal_optimizer_metadata[0]) == 2

    # original parameters
    expected = {
        "lr": 0.1,
        "momentum": 0,
        "dampening": 0,
        "weight_decay": 0,
        "nesterov": False,
        "params": ["layer.3.weight", "layer.3.bias"],
        "maximize": False,
        "foreach": None,
        "differentiable": False,
        "fused": None,
    }
    assert callback._internal_optimizer_metadata[0][0] == expected

    # new param group
    expected = {
        "lr": 0.01,
        "momentum": 0,
        "dampening": 0,
        "weight_decay": 0,
        "nesterov": False,
        "params": ["layer.0.weight", "layer.0.bias"],
        "maximize": False,
        "foreach": None,
        "differentiable": False,
        "fused": None,
    }
    assert callback._internal_optimizer_metadata[0][1] == expected

    trainer_kwargs["max_epochs"] = 3
    trainer_kwargs["callbacks"] = [TestCallbacksRestoreCallback(), GradientAccumulationCallback(2)]

    trainer = Trainer(**trainer_kwargs)
    trainer.fit(model, ckpt_path=chk.last_model_path)


class BackboneBoringModel(BoringModel):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(32, 2)
        self.backbone = nn.Linear(32, 32)

    def forward(self, x):
        return self.layer(self.backbone(x))


# Original: test_callbacks_restore_backbone
def test_callbacks_restore_backbone(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = Trainer(
        default_root_dir=tmp_path,
        limit_train_batches=3,
        limit_val_batches=1,
        max_epochs=2,
        logger=False,
        callbacks=[ckpt, BackboneFinetuning(unfreeze_backbone_at_epoch=1), GradientAccumulationCallback(2)],
        **QUIET,
    )
    trainer.fit(BackboneBoringModel())

    # initialize a trainer that continues the previous training
    accumulation = GradientAccumulationCallback(2)
    trainer = Trainer(
        default_root_dir=tmp_path,
        limit_train_batches=3,
        limit_val_batches=1,
        max_epochs=3,
        logger=False,
        callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1), accumulation],
        **QUIET,
    )
    trainer.fit(BackboneBoringModel(), ckpt_path=ckpt.last_model_path)
    assert accumulation.stats.windows == 3 * 2
