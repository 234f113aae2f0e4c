"""The two window drivers, the core accumulator and an engine's window, hold to one interface.

The callback's parts drive either without asking which one runs: every member of ``WindowDriver`` is
checked on both, a method by its signature (names, kinds, defaults), a property by its setter.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from lightning_gradacc import GradAccumulator
from lightning_gradacc.core.settings import AccumulationSettings
from lightning_gradacc.engine_window import EngineWindow
from lightning_gradacc.window_driver import WindowDriver


def members() -> dict[str, Any]:
    declared = {name: value for name, value in vars(WindowDriver).items() if not name.startswith("_")}
    declared.update(dict.fromkeys(WindowDriver.__annotations__, "attribute"))
    return declared


def test_the_interface_declares_what_the_parts_ask() -> None:
    assert {"begin_micro_batch", "begin_pieces", "end_micro_batch", "end_window", "reset", "window"} <= set(
        members()
    )


class _Engine:
    gradient_accumulation_steps = 1

    def set_boundary(self, last: bool) -> None: ...

    def drop_gradients(self) -> None: ...

    def skipped_steps(self) -> int:
        return 0

    def grad_norm(self) -> float | None:
        return None


def drivers() -> list[Any]:
    core = GradAccumulator([torch.zeros(2, requires_grad=True)])
    return [core, EngineWindow(_Engine(), settings=AccumulationSettings(), world_size=1)]


@pytest.mark.parametrize("index", [0, 1], ids=["core", "engine"])
def test_each_driver_has_every_member_with_the_interface_s_signature(index: int) -> None:
    instance = drivers()[index]
    driver = type(instance)
    for name, declared in members().items():
        assert hasattr(instance, name), (driver, name)
        if isinstance(declared, property) and declared.fset is not None:  # settable: a property with a setter
            implemented = inspect.getattr_static(driver, name)
            assert isinstance(implemented, property) and implemented.fset is not None, (driver, name)
        elif inspect.isfunction(declared):
            expected = list(inspect.signature(declared).parameters.values())[1:]
            actual = list(inspect.signature(getattr(driver, name)).parameters.values())[1:]
            assert [(p.name, p.kind, p.default) for p in actual] == [
                (p.name, p.kind, p.default) for p in expected
            ], (driver, name)


def test_instances_of_both_are_window_drivers_and_show_what_they_declare_absent() -> None:
    core, engine = drivers()
    assert isinstance(core, WindowDriver) and isinstance(engine, WindowDriver)
    assert core.absent == frozenset() and core.saves_open_window
    assert (
        "window_loss" in engine.absent and "empty_windows" in engine.absent and not engine.saves_open_window
    )
    stats = engine.stats.as_dict()
    assert not (engine.absent - set(stats) - {"last_grad_norm"})  # absent names are statistics


def test_an_engine_s_weighted_window_weighs_each_loss_by_its_count_read_ahead_and_checks_it() -> None:
    window = EngineWindow(_Engine(), settings=AccumulationSettings(scaling="weighted"), world_size=2)
    window.window_length = 2
    window.batch_start()
    window.expect([3.0, 1.0], 10.0)  # this rank's counts; 10 over both ranks
    # x 3 items x 2 ranks (DeepSpeed averages them) / 10 items
    assert float(window.begin_micro_batch(torch.tensor(1.0), torch.tensor(3))) == pytest.approx(0.6)
    window.end_micro_batch()
    with pytest.raises(RuntimeError, match=r"is 2.0 at its own micro-batch but was 1.0 when its window"):
        window.begin_micro_batch(torch.tensor(1.0), 2, label="The item count of batch 1")
    window.reset()
    assert not window.expecting  # a window abandoned: the next one is read ahead anew
