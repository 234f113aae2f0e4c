"""Each normalization steps the big batch of its window however the window is cut (one process).

Token mean, sequence mean (packed rows told apart by ``position_ids``) and a constant normaliser, each as
the loss of its contract (``lightning_gradacc.losses``) with the callback's settings for it: micro-batches
of 1, 2 and 8 rows, padded and packed rows, one-row pieces, a short last window; each against the
plain-PyTorch big batch of the window's sequences (``tests/normalization_cases.py``). Two ranks run in
``tests/distributed/test_normalizations.py``.
"""

from __future__ import annotations

import pytest

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h
from tests import normalization_cases as cases

ROWS = 40  # windows of 16 rows: 16, 16 and a short 8
PER_WINDOW = 16


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("normalization", list(cases.NORMALIZATIONS))
@pytest.mark.parametrize("micro_batch", [1, 2, 8])
def test_the_window_is_its_big_batch_whatever_the_micro_batch(
    normalization: str, packed: bool, micro_batch: int
) -> None:
    data = cases.make_sequences(ROWS, packed=packed)
    module = cases.SequenceModule(data, normalization, micro_batch)
    callback = GradientAccumulationCallback(PER_WINDOW // micro_batch, **cases.settings(normalization))
    h.fit(module, callback)
    expected = cases.big_batch(data, cases.row_windows(ROWS, PER_WINDOW), normalization)
    assert cases.difference(module.net, expected) < 1e-6


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("normalization", list(cases.NORMALIZATIONS))
def test_pieces_of_one_row_step_the_same_big_batch(normalization: str, packed: bool) -> None:
    data = cases.make_sequences(ROWS, packed=packed)
    module = cases.SequenceModule(data, normalization, 8)
    callback = GradientAccumulationCallback(2, piece_size=1, **cases.settings(normalization))
    h.fit(module, callback)
    expected = cases.big_batch(data, cases.row_windows(ROWS, PER_WINDOW), normalization)
    assert cases.difference(module.net, expected) < 1e-6


@pytest.mark.parametrize(
    ("normalization", "wrong"),
    [("token_mean", "mean"), ("sequence_mean", "token_mean"), ("constant", "mean")],
)
def test_another_mode_misses_the_big_batch(normalization: str, wrong: str) -> None:
    """The negative controls: the loss of one contract under another mode's settings is off.

    (``"sum"`` equals ``"constant"`` on one rank; two ranks tell them apart.)
    """
    data = cases.make_sequences(ROWS, packed=True)
    module = cases.SequenceModule(data, normalization, 2)
    settings = {"scaling": wrong} if wrong in ("mean", "sum") else cases.settings(wrong)
    h.fit(module, GradientAccumulationCallback(PER_WINDOW // 2, **settings))
    expected = cases.big_batch(data, cases.row_windows(ROWS, PER_WINDOW), normalization)
    assert cases.difference(module.net, expected) > 1e-3
