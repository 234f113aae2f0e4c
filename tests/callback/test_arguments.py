"""The callback's arguments are checked when it is built, each error naming the argument and the value."""

from __future__ import annotations

import math

import pytest

from lightning_gradacc import GradientAccumulationCallback


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"accumulation_steps": 0}, ValueError, "`accumulation_steps` to be a positive int, but got 0"),
        ({"accumulation_steps": -2}, ValueError, "`accumulation_steps` to be a positive int, but got -2"),
        ({"accumulation_steps": True}, TypeError, "`accumulation_steps` to be a positive int, but got True"),
        ({"accumulation_steps": 4.0}, TypeError, "`accumulation_steps` to be a positive int, but got 4.0"),
        (
            {"accumulation_steps": {-1: 2}},
            ValueError,
            "epochs .* of `accumulation_steps` to be ints >= 0, but got -1",
        ),
        (
            {"accumulation_steps": {"1": 2}},
            ValueError,
            "epochs .* of `accumulation_steps` to be ints >= 0, but got '1'",
        ),
        (
            {"accumulation_steps": {0: 0}},
            ValueError,
            r"`accumulation_steps\[0\]` to be a positive int, but got 0",
        ),
        ({"accumulation_steps": {}}, ValueError, "`accumulation_steps` to be a non-empty dict"),
        ({"accumulation_steps": 2, "target_batch_size": 64}, ValueError, "only one of `accumulation_steps`"),
        ({"target_batch_size": 0}, ValueError, "`target_batch_size` to be a positive int, but got 0"),
        ({"scaling": "median"}, ValueError, "`scaling` to be one of .* but got 'median'"),
        ({"overflow": "retry"}, ValueError, "`overflow` to be one of .* but got 'retry'"),
        ({"scaling": "weighted", "item_count_fn": 3}, TypeError, "`item_count_fn` to be callable"),
        (
            {"item_count_fn": len},
            ValueError,
            "`item_count_fn` is only used with `scaling='weighted'`, `piece_size` or `items_per_step`",
        ),
        ({"items_per_step": 0}, ValueError, "`items_per_step` to be a whole number > 0 .* but got 0"),
        ({"items_per_step": "lots"}, ValueError, "`items_per_step` to be a whole number > 0 .* got 'lots'"),
        (
            {"items_per_step": 64, "target_batch_size": 8},
            ValueError,
            "`items_per_step=64` closes each window on its items, so it cannot be combined with"
            " `target_batch_size` \\(8\\)",
        ),
        ({"items_per_step": 64, "lr_scaling": "sqrt"}, ValueError, "no K to scale the learning rate by"),
        ({"items_per_step": 64, "piece_size": 2}, ValueError, "cannot be combined with `piece_size=2` yet"),
        ({"max_grad_norm": 0}, ValueError, "`max_grad_norm` to be a positive float or None, but got 0"),
        ({"max_grad_norm": -1.0}, ValueError, "`max_grad_norm` to be a positive float or None, but got -1.0"),
        (
            {"max_grad_norm": math.nan},
            ValueError,
            "`max_grad_norm` to be a positive float or None, but got nan",
        ),
        ({"max_grad_norm": "1"}, TypeError, "`max_grad_norm` to be a positive float or None, but got '1'"),
        ({"clip_value": 0.0}, ValueError, "`clip_value` to be a positive float or None, but got 0.0"),
        ({"clip_value": math.nan}, ValueError, "`clip_value` to be a positive float or None, but got nan"),
        ({"norm_type": 0}, ValueError, "`norm_type` to be a float > 0 or inf, but got 0"),
        ({"norm_type": -2.0}, ValueError, "`norm_type` to be a float > 0 or inf, but got -2.0"),
        ({"log_stats": "yes"}, TypeError, "`log_stats` to be a bool, but got 'yes'"),
    ],
)
def test_invalid_arguments_raise_at_construction(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        GradientAccumulationCallback(**kwargs)
