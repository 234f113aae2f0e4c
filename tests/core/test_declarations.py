"""Each counted quantity, format version, scaling mode and strategy is declared in one place.

These guard the shape of the package (docs/architecture.md, "One declaration each"): a statistic is a field of
``AccumulationStats`` (its fold, its doc, where it is kept) and everything else loops over those fields; the
format version is written and read by one function each; a scaling mode is an object, never a name compared
outside ``core/scaling.py`` and the settings' check; a strategy is a layout, never asked its class outside
``layouts.py`` and the strategy check.
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from lightning_gradacc.core.statistics import (
    COUNTS,
    NOW,
    PARTS,
    STATISTICS,
    AccumulationStats,
    RunStatistics,
)
from lightning_gradacc.reporting import LOGGED_STATISTICS, NOISE_STATISTICS, PART_STATISTICS

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "lightning_gradacc"
REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_statistic_is_one_field_with_its_fold_and_doc() -> None:
    """Each field says where it is kept; the ledger, the counters and the snapshot's facts cover each once."""
    kept = {f.name: f.metadata["kept"] for f in fields(AccumulationStats)}
    ledger = [s.name for s in STATISTICS]
    assert sorted([*ledger, *COUNTS, *NOW, *PARTS]) == sorted(kept)
    for declared in fields(AccumulationStats):
        assert declared.metadata["doc"].strip(), declared.name
        assert declared.name in (AccumulationStats.__doc__ or ""), declared.name


def test_the_saved_counters_and_the_logged_names_follow_the_fields() -> None:
    statistics = RunStatistics(*_cpu())
    saved = statistics.state_dict()
    assert set(saved) == {*COUNTS, *(s.name for s in STATISTICS)}
    logged = {f.name for f in fields(AccumulationStats) if f.metadata["logged"]}
    assert {*LOGGED_STATISTICS, *NOISE_STATISTICS, *PART_STATISTICS} == logged | {"steps_taken"}
    reference = REFERENCE.read_text()
    every = (*LOGGED_STATISTICS, *NOISE_STATISTICS, *PART_STATISTICS)
    missing = [name for name in every if f"`{name}`" not in reference]
    assert not missing, f"docs/reference.md does not describe {missing}"


def test_an_empty_window_folds_each_statistic_s_declared_empty_value() -> None:
    statistics = RunStatistics(*_cpu())
    statistics.close_window({"last_grad_norm": 2.0, "items_last_step": 8.0}, micro_batches=2)
    statistics.close_empty_window()
    stats = statistics.snapshot()
    for declared in fields(AccumulationStats):
        empty = declared.metadata["empty"]
        if empty is not None and declared.metadata["fold"] == "last":
            value = getattr(stats, declared.name)
            assert value == empty or (math.isnan(empty) and math.isnan(value)), declared.name
    assert stats.empty_windows == 1 and stats.max_grad_norm_seen == 2.0


def test_the_format_version_is_written_and_read_in_one_module() -> None:
    users = [p.name for p in _sources() if "FORMAT_VERSION" in p.read_text()]
    assert users == ["checkpoint.py"]
    written = [  # a dict display with a "version" key: the saved forms' stamp
        f"{p.name}:{node.lineno}"
        for p in _sources()
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Dict)
        and any(isinstance(key, ast.Constant) and key.value == "version" for key in node.keys)
    ]
    assert len(written) == 1 and written[0].startswith("checkpoint.py"), written  # `stamp`


@pytest.mark.parametrize("mode", ["mean", "sum", "weighted", "constant", "average", "dynamic"])
def test_no_scaling_mode_name_is_compared_outside_its_declaration(mode: str) -> None:
    found = []
    for path in _sources():
        if path.name in ("scaling.py", "settings.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            parts = (node.left, *node.comparators) if isinstance(node, ast.Compare) else ()
            if any(isinstance(part, ast.Constant) and part.value == mode for part in parts) and any(
                "scaling" in ast.unparse(part) or "mode" in ast.unparse(part) for part in parts
            ):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    scaling_reads = [
        f"{p.name}: {line.strip()}"
        for p in _sources()
        if p.name not in ("scaling.py", "settings.py")
        for line in p.read_text().splitlines()
        if re.search(r"\.scaling\s*(==|!=|in\b)", line)
    ]
    assert not found and not scaling_reads, (found, scaling_reads)


def test_the_plan_never_asks_a_k_policy_its_class() -> None:
    policies = ("KPolicy", "FixedK", "EpochSchedule", "KeyedSchedule", "TargetBatchSize", "AutoK")
    asked = [
        ast.unparse(node)
        for node in ast.walk(ast.parse((PACKAGE / "window_plan.py").read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "isinstance"
        and any(name in ast.unparse(node.args[1]) for name in policies)
    ]
    assert not asked, asked


def test_strategy_classes_are_asked_only_by_the_layouts() -> None:
    """``isinstance(..., api.<x>_strategy)`` appears in `layouts.py` alone (and Lightning's own FSDP
    internals in `lightning_internals.py`): the callback asks its layout."""
    found = [
        f"{p.name}: {line.strip()}"
        for p in _sources()
        if p.name not in ("layouts.py", "lightning_internals.py", "namespaces.py")
        for line in p.read_text().splitlines()
        if re.search(r"_strategy\b", line) and "isinstance" in line
    ]
    assert not found, found


def _cpu() -> tuple[torch.device, torch.dtype]:
    return torch.device("cpu"), torch.float64


def test_the_settings_scaling_mode_survives_pickling_also_from_a_pickle_without_it() -> None:
    """`mode` is an attribute set from `scaling` (ddp_spawn pickles the settings); a settings object pickled
    before it existed gets it when unpickled."""
    import pickle

    from lightning_gradacc.core.scaling import SCALING_MODES
    from lightning_gradacc.core.settings import AccumulationSettings

    settings = AccumulationSettings(scaling="dynamic")
    assert pickle.loads(pickle.dumps(settings)).mode is SCALING_MODES["weighted"]
    older = AccumulationSettings.__new__(AccumulationSettings)
    older.__setstate__({k: v for k, v in settings.__dict__.items() if k != "mode"})
    assert older.mode is SCALING_MODES["weighted"] and older == settings


def test_the_refusal_table_of_the_docs_is_the_one_the_declarations_make() -> None:
    from lightning_gradacc.layouts import LAYOUTS
    from lightning_gradacc.needs import refusal_table

    limitations = (REFERENCE.parent / "limitations.md").read_text()
    assert refusal_table(LAYOUTS) in limitations


def test_every_unmet_need_is_refused_naming_the_setting_and_the_strategy() -> None:
    """Each setting that needs a provision, on a layout without it, raises before training (and with it,
    does not): values of the one check, for every (need, layout) pair."""
    from types import SimpleNamespace

    from lightning_gradacc import GradientAccumulationCallback
    from lightning_gradacc.layouts import LAYOUTS
    from lightning_gradacc.needs import NEEDS, refuse_unmet

    configured = [  # one callback per need that uses it
        GradientAccumulationCallback(2, piece_size=2),
        GradientAccumulationCallback(2, piece_size="auto"),
        GradientAccumulationCallback(2, scaling="weighted"),
        GradientAccumulationCallback(2, noise_scale=True),
        GradientAccumulationCallback(
            2, clip_mode="micro_batch", max_grad_norm=1.0, accumulation_dtype="float32"
        ),
        GradientAccumulationCallback(2, accumulation_dtype="float64"),
        GradientAccumulationCallback(2, clip_value=0.1),
        GradientAccumulationCallback(2, overflow="raise"),
        GradientAccumulationCallback(2, lr_scaling="sqrt"),
        GradientAccumulationCallback(items_per_step=64),
        GradientAccumulationCallback(2, sharded_reduction="window_end"),
    ]
    for need, callback in zip(NEEDS, configured, strict=True):
        assert need.applies(callback), need.name
        for layout in LAYOUTS:
            if need.provision in layout.provides:
                continue
            with pytest.raises(RuntimeError, match=rf"cannot take effect under {re.escape(layout.name)}"):
                refuse_unmet(callback, layout)
    refuse_unmet(GradientAccumulationCallback(2), SimpleNamespace(provides=frozenset(), name="none"))
