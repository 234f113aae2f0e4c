"""The two Lightning namespaces: ``pytorch_lightning`` and ``lightning.pytorch`` (the ``lightning`` package).

They are parallel class trees: a ``lightning.pytorch`` Trainer's strategy is no ``pytorch_lightning``
``DDPStrategy``. The callback's logic imports neither; it asks this module for the classes of the
Trainer's own namespace, so every ``isinstance`` check compares like with like.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

PYTORCH_LIGHTNING = "pytorch_lightning"
LIGHTNING = "lightning.pytorch"
NAMESPACES = (PYTORCH_LIGHTNING, LIGHTNING)
# How a user imports this package's callback for each namespace.
CALLBACK_IMPORTS = {
    PYTORCH_LIGHTNING: "from lightning_gradacc import GradientAccumulationCallback",
    LIGHTNING: "from lightning_gradacc.lightning import GradientAccumulationCallback",
}


@dataclass(frozen=True)
class LightningNamespace:
    """The classes and helpers of one namespace that the callback needs.

    Example:
        >>> api = namespace("pytorch_lightning")
        >>> api.package, api.ddp_strategy.__module__
        ('pytorch_lightning', 'pytorch_lightning.strategies.ddp')
    """

    package: str
    callback: type
    gradient_accumulation_scheduler: type
    ddp_strategy: type
    single_device_strategy: type
    fsdp_strategy: type
    model_parallel_strategy: type
    deepspeed_strategy: type
    rank_zero_warn: Callable[..., Any]
    extract_batch_size: Callable[[Any], int]
    is_overridden: Callable[..., bool]
    is_param_in_hook_signature: Callable[..., bool]


def installed(package: str) -> bool:
    """Whether ``package`` (``"pytorch_lightning"`` or ``"lightning.pytorch"``) can be imported.

    Example:
        >>> installed("pytorch_lightning")
        True
    """
    try:
        return importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:  # "lightning.pytorch" when "lightning" is missing
        return False


@cache
def namespace(package: str) -> LightningNamespace:
    """The classes of ``package`` (imported on first use)."""
    if package not in NAMESPACES:
        raise ValueError(f"Expected a Lightning namespace in {list(NAMESPACES)}, but got {package!r}.")

    def load(module: str, name: str) -> Any:
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return LightningNamespace(
        package=package,
        callback=load("callbacks", "Callback"),
        gradient_accumulation_scheduler=load("callbacks", "GradientAccumulationScheduler"),
        ddp_strategy=load("strategies", "DDPStrategy"),
        single_device_strategy=load("strategies", "SingleDeviceStrategy"),
        fsdp_strategy=load("strategies", "FSDPStrategy"),
        model_parallel_strategy=load("strategies", "ModelParallelStrategy"),
        deepspeed_strategy=load("strategies", "DeepSpeedStrategy"),
        rank_zero_warn=load("utilities", "rank_zero_warn"),
        extract_batch_size=load("utilities.data", "extract_batch_size"),
        is_overridden=load("utilities.model_helpers", "is_overridden"),
        is_param_in_hook_signature=load("utilities.signature_utils", "is_param_in_hook_signature"),
    )


def namespace_of(obj: object) -> str | None:
    """The namespace whose classes ``obj`` (an instance or a class) derives from, or ``None``.

    Example:
        >>> from pytorch_lightning import Trainer
        >>> namespace_of(Trainer)
        'pytorch_lightning'
    """
    cls = obj if isinstance(obj, type) else type(obj)
    for base in cls.__mro__:
        module = base.__module__
        if module == LIGHTNING or module.startswith(LIGHTNING + "."):
            return LIGHTNING
        if module == PYTORCH_LIGHTNING or module.startswith(PYTORCH_LIGHTNING + "."):
            return PYTORCH_LIGHTNING
    return None
