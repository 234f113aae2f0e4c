"""Parameters after a real ``Trainer.fit`` equal a plain-PyTorch big-batch reference."""

from __future__ import annotations

import math

import pytest

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h
from tests.helpers import cuda_only

BATCH = 4


def fit_regression(
    callback: GradientAccumulationCallback | None, *, epochs: int = 1, num_samples: int = 40, **kwargs
):
    module = h.RegressionModule(h.regression_data(num_samples), **kwargs)
    trainer = h.trainer(callbacks=[callback] if callback else [], max_epochs=epochs)
    trainer.fit(module)
    return module, trainer


reference = h.regression_reference


@pytest.mark.parametrize("scaling", ["mean", "sum"])
@pytest.mark.parametrize("k", [4, 5])  # 10 batches: windows 4,4,2 (partial) and 5,5 (full)
def test_mean_and_sum_match_big_batch(scaling: str, k: int) -> None:
    callback = GradientAccumulationCallback(k, scaling=scaling)
    module, trainer = fit_regression(callback)
    expected = reference(h.windows(10, k), sum_of_means=scaling == "sum")
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert trainer.global_step == len(h.windows(10, k))
    assert callback.stats.micro_batches_last_step == (10 % k or k)


def test_builtin_gets_the_partial_window_wrong() -> None:
    """The oracle can fail: Lightning's own accumulation divides the last 2 micro-batches by 4."""
    module = h.RegressionModule(h.regression_data(40))
    h.trainer(accumulate_grad_batches=4).fit(module)
    assert h.max_abs_diff(module.net, reference(h.windows(10, 4))) > 1e-3


def test_adopts_the_trainer_k_and_fixes_its_partial_window() -> None:
    module = h.RegressionModule(h.regression_data(40))
    h.trainer(accumulate_grad_batches=4, callbacks=[GradientAccumulationCallback()]).fit(module)
    assert h.max_abs_diff(module.net, reference(h.windows(10, 4))) < 1e-6


def test_adam_matches_big_batch() -> None:
    module, _ = fit_regression(GradientAccumulationCallback(4), optimizer="adam", lr=0.01, epochs=2)
    expected = reference(h.windows(10, 4, epochs=2), optimizer="adam", lr=0.01)
    assert h.max_abs_diff(module.net, expected) < 1e-6


def test_weighted_uneven_last_batch_uses_inferred_batch_sizes() -> None:
    # 38 samples in batches of 4: the last micro-batch has 2 samples and must weigh half as much.
    callback = GradientAccumulationCallback(5, scaling="weighted")
    module, _ = fit_regression(callback, num_samples=38)
    assert h.max_abs_diff(module.net, reference(h.windows(10, 5), num_samples=38)) < 1e-6
    assert callback.stats.items_last_step == 18


@pytest.mark.parametrize("k", [4, 5])
def test_weighted_tokens_match_one_big_batch_of_all_tokens(k: int) -> None:
    data = h.token_data()
    module = h.TokenModule(data)
    callback = GradientAccumulationCallback(k, scaling="dynamic", item_count_fn=h.count_tokens)
    h.trainer(callbacks=[callback]).fit(module)
    expected = h.big_batch_reference(h.token_net(), data, 2, h.windows(12, k), h.token_loss, lr=0.5)
    assert h.max_abs_diff(module.net, expected) < 1e-6
    # the built-in averages per micro-batch means: a different (wrong) update
    builtin = h.TokenModule(data)
    h.trainer(accumulate_grad_batches=k).fit(builtin)
    assert h.max_abs_diff(builtin.net, expected) > 1e-3


def test_k1_is_identical_to_no_callback() -> None:
    with_callback, _ = fit_regression(GradientAccumulationCallback(1), epochs=2)
    without, _ = fit_regression(None, epochs=2)
    assert h.max_abs_diff(with_callback.net, without.net) == 0.0


@pytest.mark.parametrize(
    ("schedule", "k_of_epoch", "steps"),
    [
        ({1: 2, 3: 4}, lambda e: {0: 1, 1: 2, 2: 2, 3: 4}[e], 23),
        ({0: 2, 2: 1}, lambda e: 2 if e < 2 else 1, 30),
    ],
)
def test_epoch_schedule(schedule: dict[int, int], k_of_epoch, steps: int) -> None:
    given = dict(schedule)
    callback = GradientAccumulationCallback(schedule)
    module, trainer = fit_regression(callback, epochs=4)
    assert trainer.global_step == steps
    assert callback.stats.windows == steps
    assert h.max_abs_diff(module.net, reference(h.windows(10, k_of_epoch, epochs=4))) < 1e-6
    assert schedule == given and list(schedule) == list(given)  # the caller's dict is not mutated


def test_target_batch_size_derives_k() -> None:
    callback = GradientAccumulationCallback(target_batch_size=16)
    module, trainer = fit_regression(callback)
    assert trainer.accumulate_grad_batches == 4
    assert h.max_abs_diff(module.net, reference(h.windows(10, 4))) < 1e-6
    assert callback.stats.items_last_step == 8  # the partial window: 2 micro-batches of 4


def test_target_batch_size_not_a_multiple_warns_with_the_effective_size() -> None:
    callback = GradientAccumulationCallback(target_batch_size=14)
    with pytest.warns(UserWarning, match="using K=4, an effective batch size of 16"):
        fit_regression(callback)


def test_clipping_once_on_the_final_gradient() -> None:
    callback = GradientAccumulationCallback(4, max_grad_norm=0.5)
    module, _ = fit_regression(callback)
    assert h.max_abs_diff(module.net, reference(h.windows(10, 4), max_grad_norm=0.5)) < 1e-6
    assert callback.stats.clipped_steps == 3


def test_fixed_k_is_written_in_setup_for_estimated_stepping_batches() -> None:
    seen: list[int] = []

    class Probe(h.RegressionModule):
        def configure_optimizers(self):
            seen.append(self.trainer.estimated_stepping_batches)
            return super().configure_optimizers()

    h.trainer(callbacks=[GradientAccumulationCallback(4)], max_epochs=2).fit(Probe(h.regression_data(40)))
    assert seen == [6]


def test_fit_twice_with_the_same_callback() -> None:
    callback = GradientAccumulationCallback(4)
    module = h.RegressionModule(h.regression_data(40))
    trainer = h.trainer(callbacks=[callback])
    trainer.fit(module)
    trainer.fit_loop.max_epochs = 2
    trainer.fit(module)
    h.trainer(callbacks=[callback], max_epochs=1).fit(module)  # and again with a new Trainer
    assert h.max_abs_diff(module.net, reference(h.windows(10, 4, epochs=3))) < 1e-6
    assert callback.stats.windows == 9


@pytest.mark.parametrize(
    ("options", "reference_options"),
    [
        ({"clip_value": 0.05}, {"clip_value": 0.05}),
        ({"max_grad_norm": 0.3, "norm_type": math.inf}, {"max_grad_norm": 0.3, "norm_type": math.inf}),
        ({"max_grad_norm": 0.5, "clip_value": 0.05}, {"max_grad_norm": 0.5, "clip_value": 0.05}),
    ],
)
def test_clip_value_and_inf_norm_through_the_callback(options: dict, reference_options: dict) -> None:
    callback = GradientAccumulationCallback(4, **options)
    module, _ = fit_regression(callback)
    assert h.max_abs_diff(module.net, reference(h.windows(10, 4), **reference_options)) < 1e-6
    assert callback.stats.clipped_steps == 3


@pytest.mark.parametrize("scaling", ["mean", "weighted"])
def test_per_parameter_clipping_through_the_callback(scaling: str) -> None:
    callback = GradientAccumulationCallback(4, max_grad_norm=0.2, clip_scope="parameter", scaling=scaling)
    module, _ = fit_regression(callback)
    per_parameter = reference(h.windows(10, 4), max_grad_norm=0.2, clip_scope="parameter")
    assert h.max_abs_diff(module.net, per_parameter) < 1e-6
    # not the global clipping under another name: the two references differ
    assert h.max_abs_diff(per_parameter, reference(h.windows(10, 4), max_grad_norm=0.2)) > 1e-3
    assert callback.stats.clipped_steps == 3
    assert callback.stats.last_grad_norm > 0.2  # the global norm, before clipping, is reported


@cuda_only
def test_partial_window_oracle_on_cuda() -> None:
    module = h.RegressionModule(h.regression_data(40))
    h.trainer(accelerator="cuda", callbacks=[GradientAccumulationCallback(4, max_grad_norm=0.5)]).fit(module)
    expected = h.big_batch_reference(
        h.regression_net(), h.regression_data(40), 4, h.windows(10, 4), h.mse, max_grad_norm=0.5
    )
    assert h.max_abs_diff(module.net.cpu(), expected) < 1e-5
