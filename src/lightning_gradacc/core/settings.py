"""The math settings, declared once, and the argument checks shared by the core and the Lightning callback.

Every check raises before any training starts and names the argument, the value and what is allowed.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import Field, dataclass, field, fields
from typing import Any, ClassVar, Literal, get_args

import torch

from .scaling import SCALING_MODES, ScalingMode

Scaling = Literal["mean", "sum", "weighted", "constant", "average", "dynamic"]
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
    """Return the canonical scaling name (``"mean"``, ``"sum"``, ``"weighted"``, ``"constant"``): no alias.

    Example:
        >>> check_scaling("average")
        'mean'
    """
    name = check_choice("scaling", value, Scaling)
    return _SCALING_ALIASES.get(name, name)


def check_overflow(value: Any) -> str:
    """Return ``value`` if it is a known overflow policy (``None``, the default, is ``"skip"``)."""
    return "skip" if value is None else check_choice("overflow", value, OverflowPolicy)


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


def _setting(default: Any, check: Callable[[Any], Any], doc: str) -> Any:
    """A field of :class:`AccumulationSettings`: its default, its check, and its one documentation."""
    return field(default=default, metadata={"check": check, "doc": doc})


@dataclass(frozen=True)
class AccumulationSettings:
    """The math settings of an accumulator, declared once: each with its default, its check and its doc.

    ``GradAccumulator`` takes them as ``settings=`` (or each by keyword), the Lightning callback as its own
    keyword arguments (LightningCLI reads those); both build this object, which checks every value (naming the
    argument, the value and what is allowed) and the combinations, and normalizes aliases. Every docstring
    that lists a setting takes its text from here (:func:`setting_docs`).

    Example:
        >>> AccumulationSettings(scaling="average", norm_type="inf").scaling
        'mean'
    """

    scaling: str = _setting(
        "mean",
        lambda value: check_scaling(value),
        '``"mean"`` (alias ``"average"``): the mean over the micro-batches actually run; ``"sum"``;'
        ' ``"weighted"`` (alias ``"dynamic"``): each micro-batch weighted by its items, over the'
        " micro-batches and the data-parallel ranks (the item counts count them): a token mean with"
        ' `count_tokens`, a sequence mean with `count_sequences`; ``"constant"``: each loss is a sum'
        " divided by a constant of the whole step, and the step adds every micro-batch's gradient over"
        " the micro-batches and the ranks.",
    )
    max_grad_norm: float | None = _setting(
        None,
        lambda value: check_optional_positive_float("max_grad_norm", value),
        "Clip the norm of the final gradient to this value, once per optimizer step.",
    )
    norm_type: float = _setting(
        2.0,
        lambda value: check_norm_type(value),
        "Order of the norm (any ``p > 0``, or ``inf``), for clipping and the statistics.",
    )
    clip_scope: str = _setting(
        "global",
        lambda value: check_choice("clip_scope", value, ClipScope),
        '``"global"`` clips the norm of all gradients together (as ``torch.nn.utils.clip_grad_norm_`` and'
        ' ``gradient_clip_val``); ``"parameter"`` rescales each parameter\'s gradient whose own norm exceeds'
        " ``max_grad_norm`` (the statistics report the global norm).",
    )
    clip_value: float | None = _setting(
        None,
        lambda value: check_optional_positive_float("clip_value", value),
        "Clamp every element of the final gradient to ``[-clip_value, clip_value]``, once per step.",
    )
    overflow: str = _setting(
        None,
        lambda value: check_overflow(value),
        'What a non-finite gradient does: ``"skip"`` the step (gradients set to ``None``, so torch'
        ' optimizers change neither parameters nor state), ``"raise"``'
        ' :class:`~lightning_gradacc.GradientOverflowError`, ``"ignore"`` (counted, and stepped), or'
        ' ``"skip_micro_batch"``: drop only the micro-batch whose gradient is not finite and keep the window'
        ' (needs ``accumulation_dtype``); ``None`` (the default) is ``"skip"`` where it can act, without a'
        " warning where a strategy cannot skip (DeepSpeed outside fp16). Under a ``GradScaler``"
        ' (``precision="16-mixed"``) the scaler skips such steps itself; they are counted.',
    )
    accumulation_dtype: torch.dtype | None = _setting(  # noqa: RUF009 (a `field`, as the others)
        None,
        lambda value: resolve_accumulation_dtype(value),
        'Accumulate in buffers of this dtype, e.g. ``"float32"`` for bf16 parameters'
        " (``precision=\"bf16-true\"``), instead of in the parameters' dtype: costs exactly the buffers'"
        " memory; each gradient is added into its buffer inside the backward.",
    )
    clip_mode: str = _setting(
        "step",
        lambda value: check_clip_mode(value),
        '``"step"`` clips the window\'s final gradient; ``"micro_batch"`` clips each micro-batch\'s own'
        " gradient to ``max_grad_norm`` before it is added (needs ``accumulation_dtype``).",
    )
    noise_scale: bool = _setting(
        False,
        lambda value: check_bool("noise_scale", value),
        "Estimate the gradient noise scale (McCandlish et al. 2018) from each window's micro-batches: the"
        " batch size, in items, beyond which larger batches stop paying off"
        " (``AccumulationStats.noise_scale``, logged as ``grad_accum/noise_scale``). One norm kernel per"
        " parameter per backward; needs K x ranks >= 2; single device and DDP; not with the per-micro-batch"
        " modes.",
    )
    noise_scale_decay: float = _setting(
        0.95,
        lambda value: check_decay("noise_scale_decay", value),
        "Of the exponential averages of |G|² and tr(Σ) before their ratio is taken (0.95: about the last"
        " 20 measured steps count).",
    )
    noise_scale_every: int = _setting(
        1,
        lambda value: check_positive_int("noise_scale_every", value),
        "Measure one window in this many (the others cost nothing; the estimate stays unbiased).",
    )

    mode: ClassVar[ScalingMode]  # set per instance from `scaling` (see `core.scaling`)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle (``ddp_spawn``), also a settings object pickled before ``mode`` existed."""
        self.__dict__.update(state)
        object.__setattr__(self, "mode", SCALING_MODES[self.scaling])

    def __post_init__(self) -> None:
        for setting in fields(self):  # each value checked and normalized by its own declaration
            object.__setattr__(self, setting.name, setting.metadata["check"](getattr(self, setting.name)))
        # the scaling mode's object (what it weights, how it normalizes): an attribute, not a setting, read
        # per micro-batch without a call
        object.__setattr__(self, "mode", SCALING_MODES[self.scaling])
        if self.noise_scale and self.per_micro_batch:
            raise ValueError(
                "`noise_scale=True` cannot be combined with `overflow='skip_micro_batch'` or"
                " `clip_mode='micro_batch'`: they drop or clip single micro-batches, so the window's gradient"
                " is no longer the mean of the micro-batch gradients the estimate compares it with."
            )
        if self.noise_scale and self.mode.additive:
            raise ValueError(
                "`noise_scale=True` (or `accumulation_steps='auto'`, which decides from it) cannot be"
                f" combined with `scaling={self.scaling!r}`: its losses are sums divided by a constant, not"
                " means over their items, so a micro-batch's gradient is not an estimate of the mean gradient"
                " the noise scale compares. Use `scaling='weighted'` with a counter for the noise scale."
            )
        check_buffer_settings(self.overflow, self.clip_mode, self.accumulation_dtype, self.max_grad_norm)
        if self.clip_scope == "parameter" and self.max_grad_norm is None:
            raise ValueError(
                "`clip_scope='parameter'` clips each parameter's gradient to `max_grad_norm`, which is not"
                " set."
            )
        if self.clip_scope == "parameter" and self.clip_mode == "micro_batch":
            raise ValueError(
                "`clip_scope='parameter'` is not available with `clip_mode='micro_batch'` (which clips each"
                " micro-batch's global norm); use `clip_mode='step'`."
            )

    @property
    def per_micro_batch(self) -> bool:
        """Whether each micro-batch's gradient is checked or clipped on its own."""
        return self.overflow == "skip_micro_batch" or self.clip_mode == "micro_batch"


SETTINGS = tuple(setting.name for setting in fields(AccumulationSettings))


def doc_entries(declared: Iterable[Field[Any]], indent: int = 8) -> str:
    """The ``doc`` metadata of dataclass fields as the entries of a Google-style ``Args:``/``Attributes:``.

    Example:
        >>> print(doc_entries(fields(AccumulationSettings), 0).splitlines()[0][:40])
        scaling: ``"mean"`` (alias ``"average"``
    """
    lines = []
    for declaration in declared:
        words, line = declaration.metadata["doc"].split(), f"{declaration.name}:"
        for word in words:
            if len(line) + 1 + len(word) > 110 - indent - 4 and line.strip():
                lines.append(" " * indent + line)
                line = "    " + word
            else:
                line += " " + word
        lines.append(" " * indent + line)
    return "\n".join(lines)


def setting_docs(indent: int = 8) -> str:
    """Every setting's documentation as the entries of a Google-style ``Args:`` section."""
    return doc_entries(fields(AccumulationSettings), indent)


def with_setting_docs(doc: str | None, marker: str = "Math settings:") -> str:
    """``doc`` with the line holding ``marker`` replaced by :func:`setting_docs` at its indentation."""
    assert doc is not None and marker in doc, marker
    lines = doc.splitlines()
    at = next(i for i, line in enumerate(lines) if marker in line)
    indent = len(lines[at]) - len(lines[at].lstrip())
    return "\n".join([*lines[:at], setting_docs(indent), *lines[at + 1 :]])


# The class's own documentation of each field, from the one declaration.
AccumulationSettings.__doc__ = f"{AccumulationSettings.__doc__}\n    Attributes:\n{setting_docs(8)}\n"
