"""How far each accumulation ends from one big batch: Lightning's built-in against the callback.

Run: ``python examples/partial_window.py``. Two one-epoch runs of real ``Trainer.fit`` are compared with
plain PyTorch taking one SGD step per window on all of the window's data at once:

1. 10 micro-batches of 4 samples with K=4: the last window has 2 micro-batches. The built-in divides
   their sum by 4, so that step is half as large as it should be.
2. Padded sequences of 1 to 9 tokens, 2 per micro-batch, K=4: the built-in averages per-micro-batch
   means, so a token in a short micro-batch weighs more than one in a long micro-batch.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradacc import GradientAccumulationCallback
from lightning_gradacc.counters import IGNORE_INDEX, count_tokens

LossFn = Callable[[nn.Module, Tensor, Tensor], Tensor]


def mse(net: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return nn.functional.mse_loss(net(x), y)


def token_cross_entropy(net: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    logits = net(x)
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)


def regression_case() -> tuple[TensorDataset, nn.Module, LossFn, int]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 5, generator=generator)
    y = x @ torch.randn(5, 1, generator=generator)
    torch.manual_seed(0)
    return TensorDataset(x, y), nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)), mse, 4


def token_case() -> tuple[TensorDataset, nn.Module, LossFn, int]:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.zeros(24, 9, dtype=torch.long)
    labels = torch.full((24, 9), IGNORE_INDEX)
    for row in range(24):
        length = int(torch.randint(1, 10, (), generator=generator))
        inputs[row, :length] = torch.randint(1, 11, (length,), generator=generator)
        labels[row, :length] = torch.randint(0, 11, (length,), generator=generator)
    torch.manual_seed(0)
    return (
        TensorDataset(inputs, labels),
        nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 11)),
        token_cross_entropy,
        2,
    )


class Module(pl.LightningModule):
    def __init__(self, data: TensorDataset, net: nn.Module, loss_fn: LossFn, batch_size: int) -> None:
        super().__init__()
        self.data, self.net, self.loss_fn, self.batch_size = data, copy.deepcopy(net), loss_fn, batch_size

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self.loss_fn(self.net, *batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


def big_batch_reference(
    data: TensorDataset, net: nn.Module, loss_fn: LossFn, batch_size: int, k: int
) -> nn.Module:
    """One SGD step per window of K micro-batches, on all of the window's rows as one batch."""
    net = copy.deepcopy(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    rows_per_window = batch_size * k
    for start in range(0, len(data), rows_per_window):
        optimizer.zero_grad()
        loss_fn(net, *(t[start : start + rows_per_window] for t in data.tensors)).backward()
        optimizer.step()
    return net


def distance(a: nn.Module, b: nn.Module) -> float:
    return max(
        float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def fit(module: Module, **trainer_kwargs: object) -> nn.Module:
    options = dict(max_epochs=1, logger=False, enable_progress_bar=False, enable_checkpointing=False)
    pl.Trainer(**options, enable_model_summary=False, **trainer_kwargs).fit(module)  # type: ignore[arg-type]
    return module.net


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    print("| case (K=4, one epoch) | built-in `accumulate_grad_batches=4` | `GradientAccumulationCallback` |")
    print("|---|---|---|")
    for title, case, callback in [
        ("10 micro-batches, last window of 2", regression_case, GradientAccumulationCallback(4)),
        (
            "padded sequences of 1-9 tokens",
            token_case,
            GradientAccumulationCallback(4, scaling="weighted", item_count_fn=count_tokens),
        ),
    ]:
        data, net, loss_fn, batch_size = case()
        reference = big_batch_reference(data, net, loss_fn, batch_size, k=4)
        builtin = fit(Module(data, net, loss_fn, batch_size), accumulate_grad_batches=4)
        fixed = fit(Module(data, net, loss_fn, batch_size), callbacks=[callback])
        print(f"| {title} | {distance(builtin, reference):.1e} | {distance(fixed, reference):.1e} |")
    print("\nmax |parameter - big-batch reference| (plain PyTorch, one step per window on all its data)")


if __name__ == "__main__":
    main()
