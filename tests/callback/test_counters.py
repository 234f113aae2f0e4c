"""The ready item counters of ``counters.py``: which labels they count, shifted or not."""

from __future__ import annotations

import pytest
import torch

from lightning_gradacc.counters import TokenCounter, count_predicted_tokens, count_tokens


def test_counters_shift_along_the_last_dimension() -> None:
    labels = torch.tensor([[5, 6, -100], [7, -100, -100], [8, 9, 10]])
    assert int(count_predicted_tokens({"labels": labels})) == 1 + 0 + 2
    assert int(count_predicted_tokens((labels.clamp(min=0), labels))) == 3  # tuple batch: labels last
    assert int(TokenCounter(ignore_index=0, shift=True)(torch.tensor([[1, 2, 0], [3, 0, 0]]))) == 1
    assert int(TokenCounter(shift=False)({"labels": labels})) == int(count_tokens({"labels": labels})) == 6
    with pytest.raises(ValueError, match="`count_predicted_tokens` shifts the labels"):
        count_predicted_tokens({"labels": torch.tensor(3)})
    with pytest.raises(KeyError, match="`count_predicted_tokens` expects a 'labels' entry"):
        count_predicted_tokens({"input_ids": labels})
