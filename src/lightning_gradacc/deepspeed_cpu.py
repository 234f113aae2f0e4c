"""DeepSpeed on CPU processes: Lightning's ``DeepSpeedStrategy`` where it refuses to start.

Lightning's strategy raises "only supported on CUDA GPUs" on a CPU, although DeepSpeed itself runs there
(``DS_ACCELERATOR=cpu``, gloo): its own CI runs ZeRO on CPUs. :class:`DeepSpeedCPUStrategy` is the same
strategy with the three GPU assumptions lifted, so that a DeepSpeed run (and its accumulation) can be tried
and tested on a laptop or a CI machine before it goes to GPUs:

- the CUDA guard of ``setup_environment`` (the accelerator must be Lightning's CPU accelerator instead);
- the check that each process's device index is its local rank (CPU devices have no index);
- ``root_device``, whose index DeepSpeed takes as its ``device_rank``: ``cpu:0`` on every process.

DeepSpeed chooses its accelerator when it is first imported: the strategy sets ``DS_ACCELERATOR=cpu`` when it
is built (and the processes Lightning launches inherit it); where DeepSpeed was imported before with another
accelerator, it says so. ``lightning_gradacc.lightning.DeepSpeedCPUStrategy`` is ``lightning.pytorch``'s.

Example:
    >>> import pytorch_lightning as pl
    >>> from lightning_gradacc.deepspeed_cpu import DeepSpeedCPUStrategy
    >>> strategy = DeepSpeedCPUStrategy(stage=2)  # doctest: +SKIP
    >>> trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import sys
from typing import Any, cast

import torch
from pytorch_lightning.strategies import DeepSpeedStrategy


class OnCPU:
    """What a namespace's ``DeepSpeedStrategy`` needs to start on CPU processes (see the module).

    Put first among the bases of a subclass of that namespace's ``DeepSpeedStrategy``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported, here or in a child
        super().__init__(*args, **kwargs)

    def _deepspeed_strategy(self) -> Any:
        """The namespace's ``DeepSpeedStrategy`` this class extends."""
        return next(base for base in type(self).__mro__ if base.__name__ == "DeepSpeedStrategy")

    def setup_environment(self) -> None:
        """The DDP strategy's set-up, without the CUDA guard: the accelerator must be the CPU's."""
        accelerator = self.accelerator  # type: ignore[attr-defined]
        if type(accelerator).__name__ != "CPUAccelerator":
            raise RuntimeError(
                f"`{type(self).__name__}` runs DeepSpeed on CPU processes, but the Trainer's accelerator is"
                f" `{type(accelerator).__name__}`: pass `accelerator='cpu'`, or use `DeepSpeedStrategy` on"
                " GPUs."
            )
        from deepspeed.accelerator import get_accelerator

        name = get_accelerator().device_name()
        if name != "cpu":
            raise RuntimeError(
                f"DeepSpeed chose the {name!r} accelerator when it was first imported: set"
                " `DS_ACCELERATOR=cpu` in the environment before DeepSpeed is imported (or build"
                f" `{type(self).__name__}` first) to run it on CPU processes."
            )
        cast(Any, super(self._deepspeed_strategy(), self)).setup_environment()  # DDP's: no CUDA guard

    def setup_distributed(self) -> None:
        """DeepSpeed's process group over gloo, without the check of CUDA device indices."""
        reset_seed = sys.modules[self._deepspeed_strategy().__module__].reset_seed  # the namespace's
        reset_seed()
        self.set_world_ranks()  # type: ignore[attr-defined]
        self._init_deepspeed_distributed()  # type: ignore[attr-defined]

    @property
    def root_device(self) -> torch.device:
        """``cpu:0``: DeepSpeed reads the root device's index as its ``device_rank``."""
        return torch.device("cpu", 0)


class DeepSpeedCPUStrategy(OnCPU, DeepSpeedStrategy):
    """``pytorch_lightning``'s ``DeepSpeedStrategy`` on CPU processes (see the module): the same arguments."""


__all__ = ["DeepSpeedCPUStrategy", "OnCPU"]
