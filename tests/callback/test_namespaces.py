"""Both Lightning namespaces: ``pytorch_lightning`` and ``lightning.pytorch`` (``import lightning as L``).

The oracle tests of the other files, in their essentials, run here under both namespaces, each against a
plain-PyTorch big-batch reference; then the ways the two class trees must not be mixed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import lightning_gradacc.lightning as lit
from lightning_gradacc import GradientAccumulationCallback
from lightning_gradacc.callback import LOGGED_STATISTICS
from tests import helpers as h

BATCH = 4
NAMESPACES = pytest.mark.parametrize("ns", h.NAMESPACES)


def fit(ns: str, callback: Any, *, module: Any = None, **kwargs: Any) -> tuple[Any, Any]:
    module = module if module is not None else h.REGRESSION_MODULES[ns](h.regression_data(40))
    trainer = h.trainer(ns, callbacks=[callback], **kwargs)
    trainer.fit(module)
    return module, trainer


reference = h.regression_reference


@NAMESPACES
@pytest.mark.parametrize("scaling", ["mean", "sum"])
def test_partial_window_matches_big_batch(ns: str, scaling: str) -> None:
    module, trainer = fit(ns, h.accumulation_callback(ns, 4, scaling=scaling))
    expected = reference(h.windows(10, 4), sum_of_means=scaling == "sum")
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert trainer.global_step == 3


@NAMESPACES
def test_weighted_tokens_match_one_big_batch(ns: str) -> None:
    data = h.token_data()
    callback = h.accumulation_callback(ns, 4, scaling="weighted", item_count_fn=h.count_tokens)
    module, _ = fit(ns, callback, module=h.TOKEN_MODULES[ns](data))
    expected = h.big_batch_reference(h.token_net(), data, 2, h.windows(12, 4), h.token_loss, lr=0.5)
    assert h.max_abs_diff(module.net, expected) < 1e-6


@NAMESPACES
def test_a_token_budget_closes_each_window_as_its_big_batch(ns: str) -> None:
    """``items_per_step``: each window ends at the first micro-batch whose tokens reach 20."""
    data = h.token_data()
    callback = h.accumulation_callback(
        ns, scaling="weighted", item_count_fn=h.count_tokens, items_per_step=20
    )
    module, trainer = fit(ns, callback, module=h.TOKEN_MODULES[ns](data))
    tokens = [int(h.count_tokens(data[2 * b : 2 * b + 2])) for b in range(12)]  # micro-batches of 2 rows
    windows: list[list[int]] = [[]]
    for b in range(12):
        windows[-1].append(b)
        if sum(tokens[i] for i in windows[-1]) >= 20 and b < 11:
            windows.append([])
    assert trainer.global_step == len(windows) > 2
    expected = h.big_batch_reference(h.token_net(), data, 2, windows, h.token_loss, lr=0.5)
    assert h.max_abs_diff(module.net, expected) < 1e-6


@NAMESPACES
def test_epoch_schedule_matches_big_batch(ns: str) -> None:
    module, trainer = fit(ns, h.accumulation_callback(ns, {0: 3, 1: 4}), max_epochs=2)
    expected = reference(h.windows(10, lambda epoch: 3 if epoch == 0 else 4, epochs=2))
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert trainer.global_step == 4 + 3


@NAMESPACES
def test_overflow_skip_and_clipping_match_big_batch(ns: str) -> None:
    module = h.REGRESSION_MODULES[ns](h.regression_data(40), nan_at=[5])
    callback = h.accumulation_callback(ns, 4, max_grad_norm=0.3)
    with pytest.warns(UserWarning, match="optimizer step was skipped"):
        fit(ns, callback, module=module)
    assert h.max_abs_diff(module.net, reference(h.windows(10, 4), max_grad_norm=0.3, skip_windows=[1])) < 1e-6
    assert callback.stats.skipped_steps == 1


@NAMESPACES
def test_mid_window_resume_is_exact(ns: str, tmp_path: Path) -> None:
    def module() -> Any:
        return h.REGRESSION_MODULES[ns](h.regression_data(40), resumable=True)

    def callback() -> Any:
        return h.accumulation_callback(ns, 4, scaling="weighted", max_grad_norm=0.5)

    uninterrupted = module()
    fit(ns, callback(), module=uninterrupted, max_epochs=2)
    path = tmp_path / "mid.ckpt"
    stop = (h.SaveAndStop if ns == "pytorch_lightning" else h.LitSaveAndStop)(5, path)  # inside window 1
    with pytest.raises(h.Preempted):
        h.trainer(ns, callbacks=[callback(), stop], max_epochs=2).fit(module())
    resumed = module()
    h.trainer(ns, callbacks=[callback()], max_epochs=2).fit(resumed, ckpt_path=path)
    assert h.max_abs_diff(resumed.net, uninterrupted.net) <= 1e-6
    assert h.max_abs_diff(uninterrupted.net, reference(h.windows(10, 4, epochs=2), max_grad_norm=0.5)) < 1e-6


@NAMESPACES
def test_tensorboard_gets_every_statistic_once_per_step(ns: str, tmp_path: Path) -> None:
    logger = h.PACKAGES[ns].loggers.TensorBoardLogger(save_dir=tmp_path, name="run", version=0)
    fit(ns, h.accumulation_callback(ns, 4), logger=logger, log_every_n_steps=1)
    events = EventAccumulator(str(tmp_path / "run" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    tags = {f"grad_accum/{name}" for name in LOGGED_STATISTICS} | {"grad_accum/window_loss"}
    assert set(events.Tags()["scalars"]) >= tags
    assert [e.value for e in events.Scalars("grad_accum/micro_batches_last_step")] == [4, 4, 2]


@pytest.mark.slow
def test_ddp_two_processes_under_lightning_pytorch() -> None:
    data = h.token_data(24)  # 6 micro-batches of 2 sequences per rank; K=4: windows 4, 2
    module = h.LitTokenModule(data)
    callback = lit.GradientAccumulationCallback(4, scaling="weighted", item_count_fn=h.count_tokens)
    trainer = h.trainer(
        "lightning.pytorch",
        callbacks=[callback],
        strategy="ddp_spawn",
        devices=2,
        logger=h.LitMetricsRecorder(),
        log_every_n_steps=1,
        use_distributed_sampler=False,
    )
    trainer.fit(module)
    expected = h.big_batch_reference(h.token_net(), data, 4, h.windows(6, 4), h.token_loss, lr=0.5)
    assert h.max_abs_diff(module.net, expected) < 1e-6
    assert float(trainer.callback_metrics["grad_accum/windows"]) == 2


# ------------------------------------------------------------------------- the trees do not mix


def test_a_single_lightning_callback_not_in_a_list() -> None:
    callback = lit.GradientAccumulationCallback(4)
    module = h.LitRegressionModule(h.regression_data(40))
    h.trainer("lightning.pytorch", callbacks=callback).fit(module)  # Lightning wraps a Callback in a list
    assert h.max_abs_diff(module.net, reference(h.windows(10, 4))) < 1e-6


@pytest.mark.parametrize(
    ("ns", "callback_class", "use"),
    [
        ("lightning.pytorch", GradientAccumulationCallback, "from lightning_gradacc.lightning import"),
        ("pytorch_lightning", lit.GradientAccumulationCallback, "from lightning_gradacc import"),
    ],
)
def test_a_callback_of_the_other_namespace_is_a_clear_error(ns: str, callback_class: type, use: str) -> None:
    module = h.REGRESSION_MODULES[ns](h.regression_data(40))
    with pytest.raises(RuntimeError, match=f"is a `{ns}` Trainer.*Use `{use} GradientAccumulationCallback`"):
        h.trainer(ns, callbacks=[callback_class(4)]).fit(module)
    assert h.max_abs_diff(module.net, h.regression_net()) == 0


@NAMESPACES
def test_lightnings_own_scheduler_is_refused_in_either_namespace(ns: str) -> None:
    scheduler = h.PACKAGES[ns].callbacks.GradientAccumulationScheduler({0: 2})
    with pytest.raises(RuntimeError, match="Remove the scheduler and pass its schedule"):
        h.trainer(ns, callbacks=[h.accumulation_callback(ns, 4), scheduler]).fit(
            h.REGRESSION_MODULES[ns](h.regression_data(40))
        )


def test_a_sharded_strategy_is_refused_with_lightning_pytorch_classes() -> None:
    """The strategy check compares against the Trainer's own namespace: with `pytorch_lightning` classes every
    `lightning.pytorch` strategy failed the check by mistake, and the guard was bypassed in a list."""
    other = type("HivemindStrategy", (L.strategies.Strategy,), {})  # another package's strategy
    other.__abstractmethods__ = frozenset()  # type: ignore[attr-defined]
    with pytest.raises(
        RuntimeError,
        match=r"DDP, FSDP and ModelParallel \(FSDP2\) strategies, but the Trainer uses `Hivemind",
    ):
        lit.GradientAccumulationCallback(4)._verify(
            "configuration", _FakeTrainer(other.__new__(other)), h.LitRegressionModule()
        )
    for accepted in (L.strategies.DDPStrategy(), L.strategies.FSDPStrategy()):
        lit.GradientAccumulationCallback(4)._verify(
            "configuration", _FakeTrainer(accepted), h.LitRegressionModule()
        )


class _FakeTrainer:
    """Just what the compatibility check reads."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.callbacks: list[Any] = []


def test_lightnings_cli_accepts_the_lightning_callback() -> None:
    from lightning.pytorch.cli import LightningCLI

    cli = LightningCLI(
        h.LitRegressionModule,
        args=[
            "--trainer.accelerator=cpu",
            "--trainer.logger=false",
            "--trainer.callbacks=lightning_gradacc.lightning.GradientAccumulationCallback",
            "--trainer.callbacks.accumulation_steps=4",
            "--trainer.callbacks.scaling=weighted",
        ],
        run=False,
    )
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, lit.GradientAccumulationCallback)]
    assert callback.plan.policy.k == 4 and callback.settings.scaling == "weighted"
