"""Each normalization on two DDP ranks steps the big batch of both ranks' sequences (gloo, CPU).

``normalization_run.py`` trains every scenario in two processes; here each is held against the plain-PyTorch
big batch of its windows (16 rows over both ranks: rows 0-15, 16-31, 32-39, whichever rank read them).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import normalization_cases as cases
from tests.distributed import normalization_run as run
from tests.helpers import run_script

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_script(HERE / "normalization_run.py", tmp_path_factory.mktemp("normalizations"))


def trained_net(out: Path, name: str) -> torch.nn.Module:
    net = cases.net()
    net.load_state_dict(torch.load(out / f"{name}.pt")[0])
    return net


def expected(normalization: str, packed: bool) -> torch.nn.Module:
    data = cases.make_sequences(run.ROWS, packed=packed)
    return cases.big_batch(data, cases.row_windows(run.ROWS, 2 * run.PER_RANK_WINDOW), normalization)


CONTROLS = ("constant-as-sum", "world_size-bug")
CORRECT = [name for name in run.scenarios() if name not in CONTROLS and not name.startswith("budget")]
BUDGET = [name for name in run.scenarios() if name.startswith("budget")]


@pytest.mark.parametrize("name", CORRECT)
def test_two_ranks_step_the_big_batch(trained: Path, name: str) -> None:
    normalization, packed, _, _ = run.scenarios()[name]
    assert cases.difference(trained_net(trained, name), expected(normalization, packed)) < 1e-6


@pytest.mark.parametrize("name", BUDGET)
def test_two_ranks_agree_on_every_budget_window_and_step_its_big_batch(trained: Path, name: str) -> None:
    """Each window closes where the items of both ranks' micro-batches reach the budget (2 epochs)."""
    normalization, packed, micro_batch, settings = run.scenarios()[name]
    data = cases.make_sequences(run.ROWS, packed=packed)
    counts = "tokens" if "budget_count_fn" in settings else None  # else what the weights count
    budget = settings["items_per_step"]
    windows = cases.budget_windows(data, 2 * micro_batch, normalization, budget, epochs=2, counts=counts)
    state, steps = torch.load(trained / f"{name}.pt")
    assert steps == len(windows)
    net = cases.net()
    net.load_state_dict(state)
    assert cases.difference(net, cases.big_batch(data, windows, normalization)) < 1e-6


def test_sum_halves_a_constant_normalised_loss_on_two_ranks(trained: Path) -> None:
    """``"sum"`` averages over the ranks as DDP does; a loss divided by a constant of the step needs a sum."""
    assert cases.difference(trained_net(trained, "constant-as-sum"), expected("constant", True)) > 1e-3


def test_a_loss_times_the_world_size_beside_a_local_count_misses(trained: Path) -> None:
    assert cases.difference(trained_net(trained, "world_size-bug"), expected("token_mean", True)) > 1e-3
