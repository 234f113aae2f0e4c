"""The callback for ``lightning.pytorch`` (``import lightning as L``): the ``lightning`` package's namespace.

``pip install lightning-gradacc[lightning]`` installs that package. The logic is the same as for
``pytorch_lightning`` (:class:`~lightning_gradacc.callback.GradientAccumulationLogic`); only the base class
differs, so that a ``lightning.pytorch`` Trainer and ``lightning.pytorch.cli.LightningCLI`` accept it.

Example:
    >>> import lightning as L
    >>> from lightning_gradacc.lightning import GradientAccumulationCallback
    >>> trainer = L.Trainer(callbacks=GradientAccumulationCallback(4), logger=False,
    ...                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    >>> trainer.callbacks[0].stats.accumulation_steps
    4
"""

from __future__ import annotations

from typing import ClassVar

from .namespaces import LIGHTNING, installed

if not installed(LIGHTNING):
    raise ImportError(
        "`lightning_gradacc.lightning` is the callback for `lightning.pytorch`, which is not installed: run"
        " `pip install lightning-gradacc[lightning]` (or `pip install lightning`). For `pytorch_lightning`"
        " use `from lightning_gradacc import GradientAccumulationCallback`."
    )

import lightning.pytorch as L  # after the check, for its message

from .callback import GradientAccumulationLogic, estimated_stepping_batches
from .core.versions import LIGHTNING_FLOOR, require
from .deepspeed_cpu import OnCPU

require("lightning", LIGHTNING_FLOOR)


class GradientAccumulationCallback(GradientAccumulationLogic, L.Callback):  # type: ignore[misc]
    """:class:`~lightning_gradacc.callback.GradientAccumulationLogic` as a ``lightning.pytorch`` callback.

    The same arguments and behaviour as ``lightning_gradacc.GradientAccumulationCallback`` (the
    ``pytorch_lightning`` one).
    """

    namespace: ClassVar[str] = LIGHTNING


class DeepSpeedCPUStrategy(OnCPU, L.strategies.DeepSpeedStrategy):
    """``lightning.pytorch``'s ``DeepSpeedStrategy`` on CPU processes (see :mod:`~.deepspeed_cpu`)."""


__all__ = ["DeepSpeedCPUStrategy", "GradientAccumulationCallback", "estimated_stepping_batches"]
