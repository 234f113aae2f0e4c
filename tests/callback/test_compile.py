"""``torch.compile`` with the callback, through ``Trainer.fit``: every window the big batch's step.

CPU inductor compiles C++ (the compiler CI has); a compiled submodule and a compiled LightningModule, with
clipping, fp64 buffers, the noise scale and ``skip_micro_batch``, against the plain big-batch loop (eager).
Compiles that capture CUDA graphs corrupt accumulated gradients on GPUs (pytorch #169545): refused there,
read from the module, before training; the GPU's positive case is in ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_gradacc import GradientAccumulationCallback
from lightning_gradacc.compatibility import check_cuda_graphs
from lightning_gradacc.core.torch_internals import compiled_with_cuda_graphs
from tests import helpers as h

# 10 micro-batches of 4, K=4: windows of 4, 4 and the epoch's 2
WINDOWS = h.windows(10, 4)


def compiled_submodule(**kwargs: Any) -> h.RegressionModule:
    module = h.RegressionModule(h.regression_data(40), **kwargs)
    module.net = torch.compile(module.net)  # type: ignore[assignment]
    return module


@pytest.mark.parametrize(
    "settings",
    [
        {"max_grad_norm": 0.5, "accumulation_dtype": "float64"},
        {"noise_scale": True},
    ],
    ids=["clipped-buffers", "noise-scale"],
)
def test_a_compiled_submodule_steps_the_big_batch(settings: dict[str, Any]) -> None:
    module = compiled_submodule()
    callback = GradientAccumulationCallback(4, **settings)
    h.fit(module, callback)
    clip = settings.get("max_grad_norm")
    assert h.max_abs_diff(module.net, h.regression_reference(WINDOWS, max_grad_norm=clip)) < 1e-6
    if settings.get("noise_scale"):
        assert callback.stats.trace_sigma_estimate == callback.stats.trace_sigma_estimate  # measured


def test_a_compiled_lightning_module_drops_a_non_finite_micro_batch_as_eager_does() -> None:
    """``torch.compile(module)``: ``Trainer.fit`` unwraps it and runs the compiled forward."""
    module = h.RegressionModule(h.regression_data(40), nan_at=(5,))
    compiled = torch.compile(module)
    callback = GradientAccumulationCallback(4, overflow="skip_micro_batch", accumulation_dtype="float64")
    h.fit(compiled, callback)  # type: ignore[arg-type]
    expected = h.regression_reference([[0, 1, 2, 3], [4, 6, 7], [8, 9]])
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert callback.stats.dropped_micro_batches == 1


def test_the_built_in_with_a_compiled_submodule_is_off_the_big_batch() -> None:
    """Negative control: Lightning's accumulation divides the epoch's last window of 2 by K=4."""
    module = compiled_submodule()
    h.fit(module, accumulate_grad_batches=4)
    assert h.max_abs_diff(module.net, h.regression_reference(WINDOWS)) > 1e-2


@pytest.mark.parametrize(
    ("compile_module", "found"),
    [
        (lambda m: torch.compile(m, mode="reduce-overhead"), "OptimizedModule"),
        (lambda m: torch.compile(m, mode="max-autotune"), "OptimizedModule"),
        (lambda m: torch.compile(m, options={"triton.cudagraphs": True}), "OptimizedModule"),
        (lambda m: torch.compile(m, backend="cudagraphs"), "backend='cudagraphs'"),
        (lambda m: setattr(m, "net", torch.compile(m.net, mode="reduce-overhead")) or m, "`net`"),
        (lambda m: m.compile(mode="reduce-overhead") or m, "RegressionModule"),
        (lambda m: torch.compile(m), None),
        (lambda m: torch.compile(m, mode="max-autotune-no-cudagraphs"), None),
        (lambda m: m, None),
    ],
    ids=[
        "reduce-overhead",
        "max-autotune",
        "option",
        "backend",
        "submodule",
        "module.compile",
        "default",
        "no-cudagraphs",
        "eager",
    ],
)
def test_a_compile_that_captures_cuda_graphs_is_found_in_the_module(compile_module: Any, found: Any) -> None:
    module = compile_module(h.RegressionModule(h.regression_data(8)))
    where = compiled_with_cuda_graphs(module)
    assert (where is None) if found is None else (found in where)


def test_cuda_graphs_with_accumulation_are_refused_on_cuda_and_left_alone_on_a_cpu() -> None:
    """The refusal reads the Trainer's device (a CPU captures no graph) and the plan's largest K."""
    module = h.RegressionModule(h.regression_data(8))
    module.net = torch.compile(module.net, mode="reduce-overhead")  # type: ignore[assignment]

    def trainer(device: str) -> Any:
        return SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)))

    with pytest.raises(RuntimeError, match=r"`net` .*capture CUDA graphs.*#169545.*mode='default'"):
        check_cuda_graphs(trainer("cuda"), module, 4)  # type: ignore[arg-type]
    check_cuda_graphs(trainer("cuda"), module, 1)  # type: ignore[arg-type]  # K=1 accumulates nothing
    with pytest.raises(RuntimeError, match="capture CUDA graphs"):  # but K=1 in pieces does
        check_cuda_graphs(trainer("cuda"), module, 1, pieces=True)  # type: ignore[arg-type]
    check_cuda_graphs(trainer("cpu"), module, 4)  # type: ignore[arg-type]
    # compiled in `configure_model` (after `setup`): seen at train start, in the model the strategy holds
    plain = h.RegressionModule(h.regression_data(8))
    wrapped = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("cuda")),
        model=torch.compile(plain, mode="reduce-overhead"),
    )
    with pytest.raises(RuntimeError, match="capture CUDA graphs"):
        check_cuda_graphs(wrapped, plain, 4)  # type: ignore[arg-type]


def test_reduce_overhead_on_a_cpu_steps_the_big_batch() -> None:
    """On a CPU inductor captures no CUDA graph: the mode runs as the default one, exactly."""
    module = h.RegressionModule(h.regression_data(40))
    module.net = torch.compile(module.net, mode="reduce-overhead")  # type: ignore[assignment]
    h.fit(module, GradientAccumulationCallback(4))
    assert h.max_abs_diff(module.net, h.regression_reference(WINDOWS)) < 1e-6


@h.cuda_only
def test_on_a_gpu_a_default_compile_is_exact_and_reduce_overhead_is_refused_before_training() -> None:
    module = compiled_submodule()
    h.fit(module, GradientAccumulationCallback(4, max_grad_norm=0.5), accelerator="gpu")
    expected = h.regression_reference(WINDOWS, max_grad_norm=0.5)
    assert h.max_abs_diff(module.net.cpu(), expected) < 1e-5  # TF32-free fp32 on the GPU: rounding
    graphs = h.RegressionModule(h.regression_data(40))
    graphs.net = torch.compile(graphs.net, mode="reduce-overhead")  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="capture CUDA graphs"):
        h.fit(graphs, GradientAccumulationCallback(4), accelerator="gpu")
