"""Every layout x scaling mode x optional part, built from the declarations, through ``Trainer.fit``.

The matrix comes from what the package declares: the layouts (``layouts.LAYOUTS``), the scaling modes
(``core.scaling.SCALING_MODES``) and the optional parts a setting adds (pieces, fp64 buffers, a
per-micro-batch mode, which under DDP moves the reduction into the core). A combination the declarations
refuse (``needs.NEEDS`` against a layout's ``provides``) must be refused before training, naming the
setting and the strategy; every other one must step, window by window, the plain-PyTorch big batch. A new
layout, mode or part is tried against every other one by construction. The default run covers one process;
DDP (2 gloo processes) and DeepSpeed (CPU) run under the slow marker.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from lightning_gradacc import GradientAccumulationCallback
from lightning_gradacc.core.scaling import SCALING_MODES
from lightning_gradacc.layouts import LAYOUTS
from lightning_gradacc.needs import NEEDS
from tests import helpers as h

# the optional parts of a fit, by the settings that add them
PARTS: dict[str, dict[str, Any]] = {
    "none": {},
    "pieces": {"piece_size": 3},
    "fp64-buffers": {"accumulation_dtype": "float64"},
    "per-micro-batch": {"overflow": "skip_micro_batch", "accumulation_dtype": "float64"},
}
K = 2


def layout(name: str) -> Any:
    return next(layout for layout in LAYOUTS if layout.name.startswith(name))


def settings(mode: str, part: str) -> dict[str, Any]:
    return {"accumulation_steps": K, "scaling": mode, "max_grad_norm": 0.5, **PARTS[part]}


def refused(kwargs: dict[str, Any], strategy: Any) -> bool:
    """Whether the declarations refuse these settings under ``strategy``'s layout."""
    callback = GradientAccumulationCallback(**kwargs)
    return any(need.applies(callback) and need.provision not in strategy.provides for need in NEEDS)


def expected(world: int, rows_per_rank: int, mode: str, batches: int) -> Any:
    data = h.regression_data(batches * rows_per_rank * world)
    windows = h.windows(batches, K)
    sum_of_means = mode in ("sum", "constant")  # "constant": the sum over the ranks too
    return h.big_batch_reference(
        h.regression_net(),
        data,
        rows_per_rank * world,
        windows,
        h.mse,
        sum_of_means=sum_of_means,
        ranks_summed=world if mode == "constant" else 1,
        max_grad_norm=0.5,
    )


# "constant" adds a batch's pieces as they are: its contract is a loss summed over the items (this module's is
# a mean); its pieces are held to its own contract in tests/callback/test_normalizations.py
CASES = [
    (mode, part)
    for mode in SCALING_MODES
    if mode not in ("average", "dynamic")
    for part in PARTS
    if not (SCALING_MODES[mode].additive and part == "pieces")
]


@pytest.mark.parametrize(("mode", "part"), CASES, ids=[f"{m}-{p}" for m, p in CASES])
def test_one_process(mode: str, part: str) -> None:
    kwargs = settings(mode, part)
    assert not refused(kwargs, layout("single-device"))
    module = h.RegressionModule(h.regression_data(40), batch_size=8)
    h.fit(module, GradientAccumulationCallback(**kwargs))
    assert h.max_abs_diff(module.net, expected(1, 8, mode, 5)) < 1e-6


# "constant" on 2 ranks, with its own contract, in tests/distributed/test_normalizations.py
DDP_CASES = [
    (mode, part)
    for mode, part in CASES
    if (part in ("none", "pieces") or mode == "mean") and not SCALING_MODES[mode].additive
]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "part"), DDP_CASES, ids=[f"{m}-{p}" for m, p in DDP_CASES])
def test_two_ddp_processes(mode: str, part: str) -> None:
    kwargs = settings(mode, part)
    assert not refused(kwargs, layout("DDP"))
    module = h.RegressionModule(h.regression_data(80), batch_size=8)
    h.ddp_trainer(GradientAccumulationCallback(**kwargs), logger=False).fit(module)
    assert h.max_abs_diff(module.net, expected(2, 8, mode, 5)) < 1e-6


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_deepspeed(tmp_path: Path) -> None:
    from tests.deepspeed_run import Scenario, run

    strategy = layout("DeepSpeed")
    scenarios = [Scenario(callback=settings(mode, part), stage=2) for mode, part in CASES]
    for (mode, part), result in zip(CASES, run(scenarios, tmp_path), strict=True):
        if refused(settings(mode, part), strategy):
            assert f"cannot take effect under {strategy.name}" in result.get("error", ""), (mode, part)
            continue
        assert "error" not in result, (mode, part, result.get("error"))
        data = h.regression_data(20)
        windows = h.windows(5, K, epochs=2)
        reference = h.big_batch_reference(
            h.regression_net(),
            data,
            4,
            windows,
            h.mse,
            sum_of_means=mode in ("sum", "constant"),
            max_grad_norm=0.5,
        )
        state = result["state"]
        difference = max((state[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
        assert difference < 1e-6, (mode, part)
