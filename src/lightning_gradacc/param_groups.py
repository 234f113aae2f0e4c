"""Which parameters the callback accumulates: those the Trainer's optimizers step, named through the module.

This is the set Lightning's clipping and the GradScaler work on: a parameter that requires grad but is in
no optimizer (a frozen teacher, a loss module) is left alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    import pytorch_lightning as pl


def optimized_parameters(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[tuple[str, Tensor]]:
    """What the optimizers step (their ``param_groups``), each once, named as in the module.

    A parameter the module does not hold is named after its place, e.g. ``optimizer0.param_groups[1][0]``.
    Without an optimizer (nothing steps) these are the module's parameters.
    """
    names = {id(param): name for name, param in pl_module.named_parameters()}
    named: list[tuple[str, Tensor]] = []
    seen: set[int] = set()
    for o, optimizer in enumerate(trainer.optimizers):
        for g, group in enumerate(optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                if id(param) not in seen:
                    seen.add(id(param))
                    named.append((names.get(id(param), f"optimizer{o}.param_groups[{g}][{i}]"), param))
    return named or list(pl_module.named_parameters())


def param_groups_signature(trainer: pl.Trainer) -> tuple[tuple[int, int], ...]:
    """Changes when a parameter group is added, or its list replaced or resized (``BaseFinetuning``).

    Looked at after every backward: one optimizer with one group, the common case, takes no loop.
    """
    optimizers = trainer.optimizers
    if len(optimizers) == 1:
        groups = optimizers[0].param_groups
        if len(groups) == 1:
            params = groups[0]["params"]
            return ((id(params), len(params)),)
    signature = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            params = group["params"]
            signature.append((id(params), len(params)))
    return tuple(signature)
