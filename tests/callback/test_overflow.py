"""Non-finite gradients injected at a chosen micro-batch, for each policy, with and without a GradScaler."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_gradacc import GradientAccumulationCallback, GradientOverflowError
from tests import helpers as h
from tests.helpers import fit

BATCH = 4


reference = h.regression_reference


@pytest.mark.parametrize("bad_micro_batch", [0, 6, 9])
def test_skip_changes_no_parameter_and_no_optimizer_state(bad_micro_batch: int) -> None:
    callback = GradientAccumulationCallback(4, overflow="skip")
    module = h.RegressionModule(h.regression_data(40), optimizer="adam", lr=0.01, nan_at=[bad_micro_batch])
    trainer = h.trainer(callbacks=[callback])
    with pytest.warns(UserWarning, match="optimizer step was skipped"):
        trainer.fit(module)
    bad_window = bad_micro_batch // 4
    expected = reference(h.windows(10, 4), optimizer="adam", lr=0.01, skip_windows=[bad_window])
    assert h.max_abs_diff(module.net, expected) < 1e-6
    stats = callback.stats
    assert (stats.skipped_steps, stats.non_finite_windows, stats.windows) == (1, 1, 3)
    assert trainer.global_step == 3  # as with Lightning's own GradScaler skip
    adam_steps = {int(state["step"]) for state in trainer.optimizers[0].state.values()}
    assert adam_steps == {2}


def test_raise_names_parameters_and_step() -> None:
    callback = GradientAccumulationCallback(4, overflow="raise")
    module = h.RegressionModule(h.regression_data(40), nan_at=[5])
    with pytest.raises(GradientOverflowError, match=r"optimizer step 1 in `net.0.weight`"):
        h.trainer(callbacks=[callback]).fit(module)


def test_ignore_counts_only() -> None:
    callback = GradientAccumulationCallback(4, overflow="ignore")
    module = h.RegressionModule(h.regression_data(40), nan_at=[9])
    h.trainer(callbacks=[callback]).fit(module)
    assert (callback.stats.non_finite_windows, callback.stats.skipped_steps) == (1, 0)
    assert not torch.isfinite(module.net[0].weight).all()


@pytest.mark.parametrize("algorithm", ["value", "norm"])
def test_skip_with_trainer_clipping_does_not_crash(algorithm: str) -> None:
    callback = GradientAccumulationCallback(4)
    module = h.RegressionModule(h.regression_data(40), nan_at=[2])
    trainer = h.trainer(callbacks=[callback], gradient_clip_val=0.5, gradient_clip_algorithm=algorithm)
    with pytest.warns(UserWarning, match="skipped"):
        trainer.fit(module)
    assert callback.stats.skipped_steps == 1
    assert trainer.gradient_clip_val == 0.5  # restored after the skipped step


def amp_trainer(callback: GradientAccumulationCallback, init_scale: float = 2.0**8):
    plugin = h.amp_plugin(init_scale)
    return h.trainer(callbacks=[callback], plugins=[plugin]), plugin.scaler


def test_16_mixed_with_cpu_grad_scaler_matches_fp32_reference() -> None:
    callback = GradientAccumulationCallback(4)
    trainer, scaler = amp_trainer(callback)
    module = h.RegressionModule(h.regression_data(40))
    trainer.fit(module)
    # the reference runs the same fp16 autocast: what is left is micro- vs big-batch fp16 rounding (3e-5)
    expected = reference(h.windows(10, 4), fp16_autocast=True)
    assert h.max_abs_diff(module.net, expected) < 2e-4
    # the built-in under the same precision keeps the partial-window error, far above fp16 noise
    builtin = h.RegressionModule(h.regression_data(40))
    h.trainer(accumulate_grad_batches=4, plugins=[h.amp_plugin()]).fit(builtin)
    assert h.max_abs_diff(builtin.net, expected) > 2e-2
    assert callback.stats.non_finite_windows == 0
    assert scaler.get_scale() == 2.0**8


def test_16_mixed_overflow_is_skipped_by_the_scaler_and_counted() -> None:
    callback = GradientAccumulationCallback(4)
    trainer, scaler = amp_trainer(callback)
    module = h.RegressionModule(h.regression_data(40), nan_at=[5])
    trainer.fit(module)
    expected = reference(h.windows(10, 4), skip_windows=[1], fp16_autocast=True)
    assert h.max_abs_diff(module.net, expected) < 2e-4
    assert (callback.stats.non_finite_windows, callback.stats.skipped_steps) == (1, 1)
    assert scaler.get_scale() == 2.0**7  # the scaler's own backoff still ran: no double handling


def test_16_mixed_raise_policy_warns_that_the_scaler_decides() -> None:
    callback = GradientAccumulationCallback(4, overflow="raise")
    trainer, _ = amp_trainer(callback)
    with pytest.warns(UserWarning, match="cannot take effect under a GradScaler"):
        trainer.fit(h.RegressionModule(h.regression_data(40)))


class ClipsByValueItself(h.RegressionModule):
    """The documented override: a hard-coded clip that ignores the Trainer's `gradient_clip_val`."""

    def configure_gradient_clipping(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=0.01, gradient_clip_algorithm="value")


def test_a_skipped_window_with_the_modules_own_clipping_by_value() -> None:
    module = ClipsByValueItself(h.regression_data(40), nan_at=[5])  # window 1 is not finite
    callback = GradientAccumulationCallback(4)
    with pytest.warns(UserWarning, match="optimizer step was skipped"):
        fit(module, callback)  # crashed: torch's clip_grad_value_ on a list with no gradient
    net, x_y = h.regression_net(), h.regression_data(40).tensors
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for index, window in enumerate(h.windows(10, 4)):  # the reference clips by value as the module does
        rows = torch.cat([torch.arange(b * BATCH, (b + 1) * BATCH) for b in window])
        optimizer.zero_grad()
        h.mse(net, *(t[rows] for t in x_y)).backward()
        torch.nn.utils.clip_grad_value_(net.parameters(), 0.01)
        if index != 1:
            optimizer.step()
    assert h.max_abs_diff(module.net, net) < 1e-6


class HugeGradients(h.RegressionModule):
    """Two float32 parameters whose window gradients are 3e38 each: every element is finite, but the window's
    norm (4.2e38) is beyond float32's range, as `torch.linalg.vector_norm` in float32 says (inf)."""

    def __init__(self, optimizer: str) -> None:
        super().__init__(h.regression_data(8), optimizer=optimizer, lr=0.01)
        self.a, self.b = torch.nn.Parameter(torch.ones(())), torch.nn.Parameter(torch.ones(()))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return (self.a + self.b) * 3e38  # Lightning's 1/K and the window's two micro-batches: 3e38 each

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return h.make_optimizer(self.optimizer_name, [self.a, self.b], self.lr)


@pytest.mark.parametrize("optimizer", ["adam", "adam_fused"])
def test_a_window_norm_beyond_the_dtype_s_range_is_non_finite_on_the_host_and_the_device(
    optimizer: str,
) -> None:
    """The plain reference: float32's own norm of the window's gradients is inf, so the window is skipped;
    the host path (plain Adam) and the device path (fused Adam) agree."""
    grads = [torch.tensor(3e38), torch.tensor(3e38)]
    assert torch.linalg.vector_norm(torch.stack(grads)).isinf()  # what float32 says
    module = HugeGradients(optimizer)
    callback = GradientAccumulationCallback(2)
    with pytest.warns(UserWarning, match="optimizer step was skipped"):
        h.fit(module, callback)
    assert (float(module.a), float(module.b)) == (1.0, 1.0)
    stats = callback.stats
    assert (stats.skipped_steps, stats.non_finite_windows, stats.windows) == (1, 1, 1)
