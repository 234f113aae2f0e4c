"""Argument checks shared by :class:`GradAccumulator` and the Lightning callback.

Every check raises before any training starts and names the argument, the value and what is allowed.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

Scaling = Literal["mean", "sum", "weighted", "average", "dynamic"]
OverflowPolicy = Literal["skip", "raise", "ignore", "skip_micro_batch"]
ClipMode = Literal["step", "micro_batch"]
ClipScope = Literal["global", "parameter"]
ScheduleUnit = Literal["epochs", "steps", "items"]  # what the keys of an `accumulation_steps` schedule count

_SCALING_ALIASES = {"average": "mean", "dynamic": "weighted"}


def check_positive_int(name: str, value: Any) -> int:
    """Return ``value`` if it is an ``int`` >= 1 (``bool`` and ``float`` are rejected).

    Example:
        >>> check_positive_int("accumulation_steps", 4)
        4
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Expected argument `{name}` to be a positive int, but got {value!r}.")
    if value < 1:
        raise ValueError(f"Expected argument `{name}` to be a positive int, but got {value!r}.")
    return value


_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_threshold(name: str, key: Any) -> int:
    """A schedule key as an int: ``12``, ``"12"``, ``"10k"``, ``"250M"``, ``"2.4B"`` (k, M, B or G, T).

    Example:
        >>> parse_threshold("accumulation_steps", "2.4B"), parse_threshold("accumulation_steps", "10k")
        (2400000000, 10000)
    """
    value: Any = key
    if isinstance(key, str):
        text = key.strip().replace("_", "")
        factor = _SUFFIXES.get(text[-1:].lower(), 1) if text else 1
        number = text[:-1] if factor != 1 else text
        try:
            value = float(number) * factor
        except ValueError:
            value = None
        if value is not None and value == int(value):
            value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"Expected the keys of `{name}` to be whole numbers >= 0 (or strings such as '10k', '250M',"
            f" '2.4B'), but got {key!r}."
        )
    return value


def check_schedule(name: str, schedule: Any, unit: str = "epochs") -> dict[int, int]:
    """Validate a schedule ``{threshold: K}`` and return a sorted copy (the caller's dict is untouched).

    The thresholds count ``unit``: epochs, optimizer steps, or items consumed. Keys may be written as
    strings with a suffix (``"250M"``), as YAML configs do.

    Example:
        >>> check_schedule("accumulation_steps", {3: 4, 1: 2})
        {1: 2, 3: 4}
        >>> check_schedule("accumulation_steps", {0: 1, "10k": 4}, "items")
        {0: 1, 10000: 4}
    """
    if not isinstance(schedule, dict) or not schedule:
        raise ValueError(
            f"Expected argument `{name}` to be a non-empty dict {{{unit[:-1]}: K}}, but got {schedule!r}."
        )
    parsed: dict[int, int] = {}
    for key, steps in schedule.items():
        if unit == "epochs" and (isinstance(key, bool) or not isinstance(key, int) or key < 0):
            raise ValueError(
                f"Expected the epochs (keys) of `{name}` to be ints >= 0, but got {key!r} in {schedule!r}."
            )
        threshold = parse_threshold(name, key)
        if threshold in parsed:
            raise ValueError(f"The keys of `{name}` repeat {threshold} ({schedule!r}).")
        parsed[threshold] = check_positive_int(f"{name}[{key!r}]", steps)
    return dict(sorted(parsed.items()))


def check_choice(name: str, value: Any, choices: Any) -> str:
    """Return ``value`` if it is one of the ``Literal`` type ``choices``.

    Example:
        >>> check_choice("clip_mode", "step", ClipMode)
        'step'
    """
    allowed = list(get_args(choices))
    if value not in allowed:
        raise ValueError(f"Expected argument `{name}` to be one of {allowed}, but got {value!r}.")
    return str(value)


def check_scaling(value: Any) -> str:
    """Return the canonical scaling name (``"mean"``, ``"sum"`` or ``"weighted"``); aliases are resolved.

    Example:
        >>> check_scaling("average")
        'mean'
    """
    name = check_choice("scaling", value, Scaling)
    return _SCALING_ALIASES.get(name, name)


def check_overflow(value: Any) -> str:
    """Return ``value`` if it is a known overflow policy."""
    return check_choice("overflow", value, OverflowPolicy)


def check_clip_mode(value: Any) -> str:
    """Return ``value`` if it is a known clipping mode."""
    return check_choice("clip_mode", value, ClipMode)


def check_optional_positive_float(name: str, value: Any) -> float | None:
    """Return ``value`` as a float if it is ``None`` or a finite or infinite number > 0 (``nan`` rejected).

    Example:
        >>> check_optional_positive_float("max_grad_norm", 1)
        1.0
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"Expected argument `{name}` to be a positive float or None, but got {value!r}.")
    if math.isnan(value) or value <= 0:
        raise ValueError(f"Expected argument `{name}` to be a positive float or None, but got {value!r}.")
    return float(value)


def check_norm_type(value: Any) -> float:
    """Return the norm order as a float: any ``p > 0`` or ``inf``.

    Example:
        >>> check_norm_type("inf")
        inf
    """
    if isinstance(value, str) and value.lower() in ("inf", "infinity"):
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
        raise ValueError(f"Expected argument `norm_type` to be a float > 0 or inf, but got {value!r}.")
    return float(value)


def check_item_count(items: Any, where: str) -> float | torch.Tensor:
    """Validate one micro-batch's item count (a weight in ``sum(n_i * loss_i) / sum(n_i)``) without a sync.

    Any finite number >= 0 is an item count: an ``int``, a ``float``, a numpy scalar, or a real scalar tensor
    (``attention_mask.sum()``, ``mask.float().sum()``). Host numbers are returned as ``float``; a tensor is
    returned as is (reshaped to a scalar), its *value* is checked where the caller synchronizes anyway
    (checking it here would stall a GPU).

    Raises:
        TypeError: ``items`` is not a number or a one-element real tensor.
        ValueError: a host number that is negative or not finite.

    Example:
        >>> check_item_count(32, "items"), check_item_count(2.5, "items")
        (32.0, 2.5)
    """
    if isinstance(items, torch.Tensor):
        if items.numel() != 1 or items.is_complex() or items.dtype == torch.bool:
            raise TypeError(
                f"Expected {where} to be a number >= 0 or a one-element real tensor, but got a tensor"
                f" of dtype {items.dtype} and shape {tuple(items.shape)}."
            )
        return items.reshape(())
    real = isinstance(items, numbers.Real) and not isinstance(items, bool)
    numpy_array = (  # 0-d or one-element numpy arrays
        type(items).__module__ == "numpy"
        and getattr(items, "size", 0) == 1
        and getattr(getattr(items, "dtype", None), "kind", None) in ("i", "u", "f")
    )
    if not (real or numpy_array):
        raise TypeError(f"Expected {where} to be a number >= 0, but got {items!r}.")
    value = float(items)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"Expected {where} to be a finite number >= 0, but got {items!r}.")
    return value


def check_buffer_settings(
    overflow: str, clip_mode: str, accumulation_dtype: object, max_grad_norm: float | None
) -> None:
    """Per-micro-batch settings work on each micro-batch's own gradient, which only buffers keep apart.

    Example:
        >>> check_buffer_settings("skip_micro_batch", "step", "float32", None)
    """
    for setting, used in (
        ("overflow='skip_micro_batch'", overflow == "skip_micro_batch"),
        ("clip_mode='micro_batch'", clip_mode == "micro_batch"),
    ):
        if used and accumulation_dtype is None:
            raise ValueError(
                f"`{setting}` works on each micro-batch's own gradient, which needs accumulation buffers:"
                " set `accumulation_dtype` (e.g. 'float32')."
            )
    if clip_mode == "micro_batch" and max_grad_norm is None:
        raise ValueError("`clip_mode='micro_batch'` clips to `max_grad_norm`, which is not set.")


def resolve_accumulation_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """Turn ``"float32"``/``"fp32"``/``torch.float32`` into a floating dtype (``None`` stays ``None``).

    Example:
        >>> resolve_accumulation_dtype("fp32")
        torch.float32
    """
    if value is None or isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str):
        name = value.removeprefix("torch.")
        name = {"fp32": "float32", "fp64": "float64", "fp16": "float16", "bf16": "bfloat16"}.get(name, name)
        dtype = getattr(torch, name, None)
    else:
        dtype = None
    if value is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(
            "Expected argument `accumulation_dtype` to be a floating dtype such as 'float32',"
            f" but got {value!r}."
        )
    return dtype


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool.

    Example:
        >>> check_bool("noise_scale", True)
        True
    """
    if not isinstance(value, bool):
        raise TypeError(f"Expected argument `{name}` to be True or False, but got {value!r}.")
    return value


def check_decay(name: str, value: Any) -> float:
    """``value`` as a float in [0, 1): the weight an exponential average keeps of its past.

    Example:
        >>> check_decay("noise_scale_decay", 0.9)
        0.9
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"Expected argument `{name}` to be a number in [0, 1), but got {value!r}.")
    return float(value)


@dataclass(frozen=True)
class AccumulationSettings:
    """The math settings shared by ``GradAccumulator`` and the callback, checked and normalized once.

    Example:
        >>> AccumulationSettings.checked(scaling="average", norm_type="inf").scaling
        'mean'
    """

    scaling: str = "mean"
    max_grad_norm: float | None = None
    norm_type: float = 2.0
    clip_scope: str = "global"
    clip_value: float | None = None
    overflow: str = "skip"
    accumulation_dtype: torch.dtype | None = None
    clip_mode: str = "step"
    noise_scale: bool = False
    noise_scale_decay: float = 0.95
    noise_scale_every: int = 1

    @classmethod
    def checked(
        cls,
        *,
        scaling: Any = "mean",
        max_grad_norm: Any = None,
        norm_type: Any = 2.0,
        clip_scope: Any = "global",
        clip_value: Any = None,
        overflow: Any = "skip",
        accumulation_dtype: Any = None,
        clip_mode: Any = "step",
        noise_scale: Any = False,
        noise_scale_decay: Any = 0.95,
        noise_scale_every: Any = 1,
    ) -> AccumulationSettings:
        """Check every argument (naming it and its value in the error) and the combinations."""
        settings = cls(
            scaling=check_scaling(scaling),
            max_grad_norm=check_optional_positive_float("max_grad_norm", max_grad_norm),
            norm_type=check_norm_type(norm_type),
            clip_scope=check_choice("clip_scope", clip_scope, ClipScope),
            clip_value=check_optional_positive_float("clip_value", clip_value),
            overflow=check_overflow(overflow),
            accumulation_dtype=resolve_accumulation_dtype(accumulation_dtype),
            clip_mode=check_clip_mode(clip_mode),
            noise_scale=check_bool("noise_scale", noise_scale),
            noise_scale_decay=check_decay("noise_scale_decay", noise_scale_decay),
            noise_scale_every=check_positive_int("noise_scale_every", noise_scale_every),
        )
        per_micro_batch = settings.overflow == "skip_micro_batch" or settings.clip_mode == "micro_batch"
        if settings.noise_scale and per_micro_batch:
            raise ValueError(
                "`noise_scale=True` cannot be combined with `overflow='skip_micro_batch'` or"
                " `clip_mode='micro_batch'`: they drop or clip single micro-batches, so the window's gradient"
                " is no longer the mean of the micro-batch gradients the estimate compares it with."
            )
        check_buffer_settings(
            settings.overflow, settings.clip_mode, settings.accumulation_dtype, settings.max_grad_norm
        )
        if settings.clip_scope == "parameter" and settings.max_grad_norm is None:
            raise ValueError(
                "`clip_scope='parameter'` clips each parameter's gradient to `max_grad_norm`, which is not"
                " set."
            )
        if settings.clip_scope == "parameter" and settings.clip_mode == "micro_batch":
            raise ValueError(
                "`clip_scope='parameter'` is not available with `clip_mode='micro_batch'` (which clips each"
                " micro-batch's global norm); use `clip_mode='step'`."
            )
        return settings
