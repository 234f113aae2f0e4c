"""A small MLP classifier on Gaussian blobs generated from a seed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
import torch
import torchmetrics
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

if TYPE_CHECKING:  # the bodies are checked as pytorch_lightning classes; plain mixins at run time
    from pytorch_lightning import LightningDataModule as _LightningDataModuleBase
    from pytorch_lightning import LightningModule as _LightningModuleBase
else:
    _LightningDataModuleBase = object
    _LightningModuleBase = object


def make_blobs(num_samples: int, num_features: int, num_classes: int, seed: int) -> TensorDataset:
    """Overlapping Gaussian clusters, one per class: the same tensors for the same arguments.

    Example:
        >>> x, y = make_blobs(8, 3, 2, seed=0).tensors
        >>> tuple(x.shape), sorted(set(y.tolist())) <= [0, 1]
        ((8, 3), True)
    """
    generator = torch.Generator().manual_seed(seed)
    centers = 0.6 * torch.randn(num_classes, num_features, generator=generator)
    labels = torch.randint(0, num_classes, (num_samples,), generator=generator)
    features = centers[labels] + 1.0 * torch.randn(num_samples, num_features, generator=generator)
    return TensorDataset(features, labels)


class _BlobsData(_LightningDataModuleBase):
    """Train/validation split of :func:`make_blobs`.

    Args:
        num_samples: Samples in total (train + validation).
        num_features: Features per sample.
        num_classes: Classes.
        batch_size: Micro-batch size.
        val_fraction: Share of samples held out for validation.
        seed: Seed of the data and of the shuffling.
    """

    def __init__(
        self,
        num_samples: int = 4096,
        num_features: int = 16,
        num_classes: int = 4,
        batch_size: int = 32,
        val_fraction: float = 0.2,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.seed = seed
        data = make_blobs(num_samples, num_features, num_classes, seed)
        num_val = int(num_samples * val_fraction)
        x, y = data.tensors
        self.train_set = TensorDataset(x[num_val:], y[num_val:])
        self.val_set = TensorDataset(x[:num_val], y[:num_val])

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, generator=generator)

    @override
    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.val_set, batch_size=256)


class _Classifier(_LightningModuleBase):
    """Two-layer MLP with cross-entropy, SGD with momentum, and accuracy from torchmetrics.

    Args:
        num_features: Input features (must match the data).
        num_classes: Output classes (must match the data).
        hidden: Hidden width.
        lr: Learning rate.
    """

    def __init__(
        self, num_features: int = 16, num_classes: int = 4, hidden: int = 64, lr: float = 0.1
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(num_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
        self.lr = lr
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes)
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.val_acc(logits, y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))
        self.log("val_acc", self.val_acc, prog_bar=True)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class BlobsDataModule(_BlobsData, pl.LightningDataModule):  # noqa: D101  (the body's docstring: its Args feed the CLI's help)
    __doc__ = _BlobsData.__doc__


class ClassifierModule(_Classifier, pl.LightningModule):  # noqa: D101  (the body's docstring: its Args feed the CLI's help)
    __doc__ = _Classifier.__doc__
