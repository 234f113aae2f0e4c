"""The plain-PyTorch oracle of the ported tests: Lightning's ``BoringModel`` trained window by window.

``BoringModel`` has one ``Linear(32, 2)``, the loss ``mse_loss(out, ones)``, ``SGD(lr=0.1)`` and a
``StepLR(step_size=1)`` stepped once per epoch. One optimizer step per window; the window's gradient is the
mean over the micro-batches it really holds (an empty window steps nothing).
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def boring_reference(
    layer: nn.Module,
    data: torch.Tensor,
    epochs: list[list[list[int]]],
    *,
    batch_size: int = 1,
    gamma: float = 0.1,
) -> nn.Module:
    """Train a copy of ``layer`` on ``data``: ``epochs[e]`` lists the micro-batch indices of each window."""
    layer = copy.deepcopy(layer)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=gamma)
    for windows in epochs:
        for window in windows:
            optimizer.zero_grad(set_to_none=True)
            for b in window:
                out = layer(data[b * batch_size : (b + 1) * batch_size])
                (nn.functional.mse_loss(out, torch.ones_like(out)) / len(window)).backward()
            optimizer.step()
        scheduler.step()
    return layer
