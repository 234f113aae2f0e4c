"""The math settings declared once (`core/settings.py`), and the argument checks of GradAccumulator (shared
with the callback): each error names the argument and the value."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_gradacc import GradAccumulator, GradientAccumulationCallback


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"accumulation_steps": 0}, ValueError, "`accumulation_steps` to be a positive int, but got 0"),
        ({"accumulation_steps": 2.0}, TypeError, "`accumulation_steps` to be a positive int, but got 2.0"),
        ({"accumulation_steps": True}, TypeError, "`accumulation_steps` to be a positive int, but got True"),
        ({"scaling": "median"}, ValueError, "`scaling` to be one of .* but got 'median'"),
        ({"overflow": "retry"}, ValueError, "`overflow` to be one of .* but got 'retry'"),
        ({"max_grad_norm": 0.0}, ValueError, "`max_grad_norm` to be a positive float or None, but got 0.0"),
        (
            {"max_grad_norm": math.nan},
            ValueError,
            "`max_grad_norm` to be a positive float or None, but got nan",
        ),
        ({"clip_value": -1}, ValueError, "`clip_value` to be a positive float or None, but got -1"),
        ({"norm_type": 0}, ValueError, "`norm_type` to be a float > 0 or inf, but got 0"),
        ({"world_size": 0}, ValueError, "`world_size` to be a positive int, but got 0"),
    ],
)
def test_invalid_core_arguments(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        GradAccumulator([torch.zeros(1, requires_grad=True)], **kwargs)


def test_no_parameters_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one parameter"):
        GradAccumulator([])


def test_clip_scope_parameter_needs_max_grad_norm() -> None:
    weight = nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="clip_scope"):
        GradAccumulator([weight], 2, clip_scope="parameter")
    with pytest.raises(ValueError, match="clip_scope"):
        GradAccumulator([weight], 2, max_grad_norm=1.0, clip_scope="tensor")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"accumulation_dtype": "int32"}, "`accumulation_dtype` to be a floating dtype .* but got 'int32'"),
        ({"overflow": "skip_micro_batch"}, "`overflow='skip_micro_batch'` .* set `accumulation_dtype`"),
        (
            {"clip_mode": "micro_batch", "max_grad_norm": 1.0},
            "`clip_mode='micro_batch'` .* `accumulation_dtype`",
        ),
        (
            {"clip_mode": "micro_batch", "accumulation_dtype": "float64"},
            "clips to `max_grad_norm`, which is not",
        ),
        ({"clip_mode": "layer"}, "`clip_mode` to be one of .* but got 'layer'"),
    ],
)
def test_invalid_buffer_settings(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GradientAccumulationCallback(4, **kwargs)
    with pytest.raises(ValueError, match=match):
        GradAccumulator(nn.Linear(2, 1).parameters(), 4, **kwargs)


def test_the_settings_are_declared_once_and_the_callback_takes_each_by_keyword() -> None:
    """The callback keeps explicit keyword arguments (LightningCLI reads them): the same names and defaults
    as the declaration, and every docstring that lists a setting takes its text from it."""
    import dataclasses
    import inspect

    from lightning_gradacc.callback import GradientAccumulationLogic
    from lightning_gradacc.core.settings import AccumulationSettings

    declared = {f.name: f.default for f in dataclasses.fields(AccumulationSettings)}
    parameters = inspect.signature(GradientAccumulationCallback.__init__).parameters
    assert {name: parameters[name].default for name in declared} == declared
    for holder in (AccumulationSettings, GradAccumulator, GradientAccumulationLogic):
        for setting in dataclasses.fields(AccumulationSettings):
            first_words = " ".join(setting.metadata["doc"].split()[:6])
            assert f"{setting.name}: {first_words}" in " ".join((holder.__doc__ or "").split()), holder
    with pytest.raises(ValueError, match="either as `settings=` or by keyword"):
        GradAccumulator([torch.zeros(1, requires_grad=True)], settings=AccumulationSettings(), scaling="sum")
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_norm'"):
        GradAccumulator([torch.zeros(1, requires_grad=True)], max_norm=1.0)


def test_each_setting_is_normalized_by_its_declaration() -> None:
    """Aliases resolved, numbers made floats, dtype names made dtypes: what the core computes with."""
    from lightning_gradacc.core.settings import AccumulationSettings

    settings = AccumulationSettings(
        scaling="dynamic", norm_type="inf", max_grad_norm=1, clip_value=2, accumulation_dtype="fp32"
    )
    assert (settings.scaling, settings.norm_type, settings.accumulation_dtype) == (
        "weighted",
        math.inf,
        torch.float32,
    )
    assert type(settings.max_grad_norm) is float and type(settings.clip_value) is float
    assert AccumulationSettings(scaling="average").scaling == "mean"
