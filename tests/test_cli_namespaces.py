"""``lightning-gradacc`` in both Lightning namespaces, and always accumulating with the callback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import lightning_gradacc.demo.lightning as lit_demo
import lightning_gradacc.lightning as lit
from lightning_gradacc import GradientAccumulationCallback, demo
from lightning_gradacc.callback import GradientAccumulationLogic
from lightning_gradacc.cli import build_cli, detect_namespace
from tests.test_cli import CONFIGS, QUICK, ROOT

CALLBACKS = {
    "pytorch_lightning": GradientAccumulationCallback,
    "lightning.pytorch": lit.GradientAccumulationCallback,
}
MODULES = {"pytorch_lightning": demo.ClassifierModule, "lightning.pytorch": lit_demo.ClassifierModule}
FLAGS = {"pytorch_lightning": [], "lightning.pytorch": ["--namespace", "lightning"]}
NAMESPACES = pytest.mark.parametrize("ns", list(FLAGS))


def the_callback(cli: object) -> GradientAccumulationLogic:
    found = [c for c in cli.trainer.callbacks if isinstance(c, GradientAccumulationLogic)]  # type: ignore[attr-defined]
    assert len(found) == 1
    return found[0]


@NAMESPACES
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_config_instantiates_in_both_namespaces(ns: str, config: Path, tmp_path: Path) -> None:
    cli = build_cli(
        [*FLAGS[ns], "--config", str(config), f"--trainer.default_root_dir={tmp_path}"], run=False
    )
    assert type(the_callback(cli)) is CALLBACKS[ns]
    assert type(cli.model).__name__ == yaml.safe_load(config.read_text())["model"]["class_path"]
    assert isinstance(cli.trainer, __import__(ns, fromlist=["Trainer"]).Trainer)


@pytest.mark.parametrize("config", ["quickstart", "token_lm"])
def test_configs_train_under_lightning_pytorch(
    config: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = ROOT / "configs" / f"{config}.yaml"
    cli = build_cli(
        [
            "fit",
            "--namespace=lightning",
            "--config",
            str(path),
            *QUICK,
            "--trainer.log_every_n_steps=1",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
        ]
    )
    callback = the_callback(cli)
    assert type(callback) is lit.GradientAccumulationCallback
    assert callback.stats.windows == cli.trainer.global_step > 0
    assert "Gradient accumulation summary" in capsys.readouterr().out
    (events_file,) = tmp_path.rglob("events.out.tfevents.*")
    events = EventAccumulator(str(events_file.parent), size_guidance={"scalars": 0})
    events.Reload()
    assert len(events.Scalars("grad_accum/items_last_step")) == callback.stats.windows


@NAMESPACES
def test_the_namespace_follows_the_model_given(
    ns: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """No config, no flag, no callback: the model's classes decide; the callback adopts the Trainer's K."""
    module = MODULES[ns]
    args = [
        "fit",
        f"--model={module.__module__}.{module.__name__}",
        f"--data={module.__module__}.BlobsDataModule",
        "--data.num_samples=320",
        "--trainer.accelerator=cpu",
        "--trainer.max_epochs=1",
        "--trainer.accumulate_grad_batches=4",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    cli = build_cli(args)
    callback = the_callback(cli)
    assert type(callback) is CALLBACKS[ns]
    assert callback.stats.accumulation_steps == cli.trainer.accumulate_grad_batches == 4
    assert cli.trainer.global_step == 2  # 256 training samples / 32 = 8 micro-batches = 2 windows of 4
    assert "Gradient accumulation summary" in capsys.readouterr().out
    assert callback.plan.fixed is None  # adopted for this fit, not written into the configuration


@NAMESPACES
def test_lightnings_own_scheduler_in_a_config_is_refused(ns: str, tmp_path: Path) -> None:
    config = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())
    config["trainer"]["callbacks"] = [
        {"class_path": "GradientAccumulationScheduler", "init_args": {"scheduling": {0: 2}}}
    ]
    path = tmp_path / "scheduler.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(RuntimeError, match="Remove the scheduler and pass its schedule"):
        build_cli([*FLAGS[ns], "--config", str(path), f"--trainer.default_root_dir={tmp_path}"], run=False)


def test_classes_of_both_namespaces_are_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit, match=r"both Lightning namespaces.*lightning_gradacc.lightning.Gradient"):
        build_cli(
            [
                "--model=lightning_gradacc.demo.lightning.ClassifierModule",
                "--trainer.callbacks=lightning_gradacc.GradientAccumulationCallback",
            ],
            run=False,
        )


def test_a_namespace_flag_that_contradicts_the_classes_is_refused() -> None:
    with pytest.raises(
        SystemExit,
        match=r"asks for `pytorch_lightning`, but `lightning_gradacc.demo.lightning.ClassifierModule` are"
        r" `lightning.pytorch` classes",
    ):
        build_cli(
            ["--namespace", "pytorch_lightning", "--model=lightning_gradacc.demo.lightning.ClassifierModule"],
            run=False,
        )
    with pytest.raises(SystemExit, match=r"`--namespace` to be one of .* but got 'lightnin'"):
        build_cli(["--namespace=lightnin"], run=False)


PROBE = """
import atexit, os, sys
def _report():
    with open(os.path.join(os.environ["PROBE_DIR"], "rank" + os.environ.get("LOCAL_RANK", "0")), "w") as f:
        f.write(str("lightning_gradacc.demo.lightning" in sys.modules))
atexit.register(_report)
"""


@pytest.mark.slow
def test_ddp_config_under_lightning_pytorch_with_the_console_script(tmp_path: Path) -> None:
    """Lightning starts the other rank with the same command line: it must run the same namespace."""
    command = Path(sys.executable).parent / "lightning-gradacc"
    args = [
        str(command),
        "fit",
        "--namespace",
        "lightning",
        "--config",
        str(ROOT / "configs/ddp_cpu.yaml"),
        *QUICK,
    ]
    args.append(f"--trainer.logger.init_args.save_dir={tmp_path}")
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(PROBE)
    python_path = os.pathsep.join([str(probe), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PROBE_DIR": str(probe), "PYTHONPATH": python_path}
    result = subprocess.run(args, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("Gradient accumulation summary") == 1
    assert "optimizer steps taken        6 of 6 windows" in result.stdout
    assert (probe / "rank0").read_text() == (probe / "rank1").read_text() == "True"


def test_only_class_options_and_class_paths_are_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other dotted values (a directory `train.out`, a file `poems.txt`) are never imported."""
    (tmp_path / "train.py").write_text("raise SystemExit('train.py was imported')\n")
    (tmp_path / "poems.py").write_text("raise SystemExit('poems.py was imported')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["--config", str(ROOT / "configs/token_lm.yaml"), "--trainer.default_root_dir=train.out"]
    assert detect_namespace(args) is None  # short names only
    assert detect_namespace(["--model.init_args.text=poems.txt"]) is None


@pytest.mark.parametrize("form", ["json", "inline", "nested", "subcommand"])
def test_class_paths_in_every_form_lightning_cli_accepts(form: str, tmp_path: Path) -> None:
    model = {"class_path": "lightning_gradacc.demo.lightning.ClassifierModule"}
    if form == "json":
        path = tmp_path / "config.json"
        path.write_text(json.dumps({"model": model}))
        args = ["--config", str(path)]
    elif form == "inline":
        args = ["--model", json.dumps(model)]
    elif form == "nested":
        (tmp_path / "model.yaml").write_text(yaml.safe_dump(model))
        (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": "model.yaml"}))
        args = ["-c", str(tmp_path / "config.yaml")]
    else:
        (tmp_path / "config.yaml").write_text(yaml.safe_dump({"fit": {"model": model}}))
        args = [f"--config={tmp_path / 'config.yaml'}"]
    assert detect_namespace(args) == "lightning.pytorch"
