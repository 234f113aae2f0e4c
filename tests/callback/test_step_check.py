"""The check of a user's step flags the three bug shapes users wrote, and passes a step keeping its contract.

Each step is ``tests/normalization_cases.py``'s module on packed sequences (4 batches of 2 rows): the same
steps that miss the plain-PyTorch big batch through ``Trainer.fit`` in ``test_normalizations.py``. The
command (``lightning-gradacc check``) runs in ``tests/test_examples.py`` on the RL example's config.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_gradacc.step_check import StepCheck, check_step
from tests import normalization_cases as cases


def check(normalization: str, bug: str | None, settings: dict[str, Any], ranks: int) -> StepCheck:
    data = cases.make_sequences(8, packed=True)
    batches = list(DataLoader(cases.Rows(data), batch_size=2))
    return check_step(cases.SequenceModule(data, normalization, 2, bug=bug), batches, settings, ranks=ranks)


def by_name(result: StepCheck) -> dict[str, Any]:
    return {entry.name: entry for entry in result.others}


@pytest.mark.slow
def test_a_step_that_keeps_its_contract_passes_on_items_and_ranks() -> None:
    result = check("token_mean", None, cases.settings("token_mean"), ranks=2)
    assert result.invariant
    assert max(result.yours.differences.values()) < 1e-6
    assert [s.name for s in result.suggestions] == ["token mean"]
    assert "invariant" in result.diagnosis()


@pytest.mark.slow
def test_a_loss_times_the_world_size_beside_a_local_count_is_flagged_by_the_ranks() -> None:
    result = check("token_mean", "world_size", cases.settings("token_mean"), ranks=2)
    assert not result.invariant and not result.suggestions
    assert result.yours.differences["items"] < 1e-6  # one rank cannot see it
    assert result.yours.differences["ranks"] == pytest.approx(1.0, abs=1e-5)  # twice the gradient
    assert "depends on the number of ranks" in result.diagnosis()


def test_an_auxiliary_term_normalized_per_micro_batch_is_flagged() -> None:
    result = check("constant", "aux_per_micro_batch", cases.settings("constant"), ranks=1)
    assert not result.invariant and not result.suggestions
    assert result.yours.differences["items"] > 1e-2
    assert "normalized per micro-batch" in result.diagnosis()


def test_a_mean_of_sequence_means_weighted_by_tokens_is_flagged_and_sequence_mean_suggested() -> None:
    result = check("sequence_mean", None, cases.settings("token_mean"), ranks=1)
    assert not result.invariant
    assert result.yours.differences["items"] > 1e-2
    assert [s.name for s in result.suggestions] == ["sequence mean"]
    assert by_name(result)["sequence mean"].differences["items"] < 1e-6
    assert "sequence mean (scaling='weighted', item_count_fn=count_sequences)" in result.report()


def needs_a_mask(batch: Any) -> Any:
    return batch["mask"].sum()  # these batches are tuples: it raises


def test_a_counter_that_does_not_fit_the_batches_is_reported_not_raised() -> None:
    from tests import helpers as h

    x, y = h.regression_data(5).tensors
    batches = [(x[:2], y[:2]), (x[2:], y[2:])]
    module = h.RegressionModule(h.regression_data(5))
    result = check_step(module, batches, {"scaling": "weighted", "item_count_fn": needs_a_mask}, ranks=1)
    assert not result.invariant
    assert result.yours.error is not None and "TypeError" in result.yours.error
    assert "| n/a |" in result.report()
    assert "sample mean" in [s.name for s in result.suggestions]  # the mean squared error of samples


def test_a_batch_the_splitter_cannot_cut_is_reported_as_such() -> None:
    from tests import helpers as h

    class FirstTwo(h.RegressionModule):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return super().training_step(batch[:2], batch_idx)

    x, y = h.regression_data(5).tensors
    flags = torch.ones(1)  # one per batch, not per item: the splitter cannot cut such a batch
    batches = [(x[:2], y[:2], flags), (x[2:4], y[2:4], flags)]
    result = check_step(FirstTwo(h.regression_data(5)), batches, {"scaling": "mean"}, ranks=1)
    assert not result.invariant
    assert "items" in result.yours.cut_errors and "failed" in result.report()
    assert result.diagnosis().startswith("The check could not compute the window cut into items")


def test_settings_that_cannot_reach_the_ranks_fail_that_cut_alone() -> None:
    data = cases.make_sequences(8, packed=True)
    batches = list(DataLoader(cases.Rows(data), batch_size=2))
    settings = {"scaling": "weighted", "item_count_fn": lambda batch: batch["labels"].ne(-100).sum()}
    result = check_step(cases.SequenceModule(data, "token_mean", 2), batches, settings, ranks=2)
    assert result.yours.differences["items"] < 1e-6  # the one-rank cut ran
    assert "ranks" in result.yours.cut_errors and not result.invariant  # a lambda does not pickle
    assert "could not be computed" in result.diagnosis()


def test_bad_arguments_are_refused_before_any_fit() -> None:
    with pytest.raises(ValueError, match="a positive multiple of `ranks=2`, but got 3"):
        check_step(None, [1, 2, 3], {}, ranks=2)
