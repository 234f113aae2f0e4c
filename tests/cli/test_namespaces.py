"""``lightning-gradacc`` in both Lightning namespaces, and always accumulating with the callback."""

from __future__ import annotations

import importlib.metadata
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
from lightning_gradacc.cli import build_cli, detect_namespace
from tests.helpers import CONFIGS, PACKAGED_CONFIGS, QUICK, the_callback

CALLBACKS = {
    "pytorch_lightning": GradientAccumulationCallback,
    "lightning.pytorch": lit.GradientAccumulationCallback,
}
MODULES = {"pytorch_lightning": demo.ClassifierModule, "lightning.pytorch": lit_demo.ClassifierModule}
FLAGS = {"pytorch_lightning": [], "lightning.pytorch": ["--namespace", "lightning"]}
NAMESPACES = pytest.mark.parametrize("ns", list(FLAGS))

JSONARGPARSE = tuple(int(part) for part in importlib.metadata.version("jsonargparse").split(".")[:2])


@NAMESPACES
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_config_instantiates_in_both_namespaces(ns: str, config: Path, tmp_path: Path) -> None:
    cli = build_cli(
        [*FLAGS[ns], "--config", str(config), f"--trainer.default_root_dir={tmp_path}"], run=False
    )
    assert type(the_callback(cli)) is CALLBACKS[ns]
    assert type(cli.model).__name__ == yaml.safe_load(config.read_text())["model"]["class_path"]
    assert isinstance(cli.trainer, __import__(ns, fromlist=["Trainer"]).Trainer)


@pytest.mark.parametrize("config", ["quickstart", "token_lm", "warmup_tokens"])
def test_configs_train_under_lightning_pytorch(
    config: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = PACKAGED_CONFIGS / f"{config}.yaml"
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
    assert callback.plan.policy.k is None  # adopted for this fit, not written into the configuration


@NAMESPACES
def test_lightnings_own_scheduler_in_a_config_is_refused(ns: str, tmp_path: Path) -> None:
    config = yaml.safe_load((PACKAGED_CONFIGS / "quickstart.yaml").read_text())
    config["trainer"]["callbacks"] = [
        {"class_path": "GradientAccumulationScheduler", "init_args": {"scheduling": {0: 2}}}
    ]
    path = tmp_path / "scheduler.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(RuntimeError, match="Remove the scheduler and pass its schedule"):
        build_cli([*FLAGS[ns], "--config", str(path), f"--trainer.default_root_dir={tmp_path}"], run=False)


def test_classes_of_both_namespaces_are_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(
        SystemExit,
        match=r"both Lightning namespaces: `lightning_gradacc.demo.lightning.ClassifierModule`"
        r" \(lightning.pytorch\), `lightning_gradacc.demo.BlobsDataModule` \(pytorch_lightning\)",
    ):
        build_cli(
            [
                "--model=lightning_gradacc.demo.lightning.ClassifierModule",
                "--data=lightning_gradacc.demo.BlobsDataModule",
                "--trainer.callbacks=lightning_gradacc.GradientAccumulationCallback",
            ],
            run=False,
        )


# Every import path of this package's callback: a twin per namespace, the same arguments.
CALLBACK_PATHS = [
    "lightning_gradacc.GradientAccumulationCallback",
    "lightning_gradacc.callback.GradientAccumulationCallback",
    "lightning_gradacc.lightning.GradientAccumulationCallback",
]
OTHER_CALLBACK = {"pytorch_lightning": CALLBACK_PATHS[2], "lightning.pytorch": CALLBACK_PATHS[0]}


def callback_config(ns: str, callback_path: str, tmp_path: Path) -> Path:
    module = MODULES[ns]
    config = {
        "model": {"class_path": f"{module.__module__}.{module.__name__}"},
        "data": {"class_path": f"{module.__module__}.BlobsDataModule", "init_args": {"num_samples": 320}},
        "trainer": {
            "accelerator": "cpu",
            "max_epochs": 1,
            "logger": False,
            "enable_progress_bar": False,
            "default_root_dir": str(tmp_path),
            "callbacks": [
                {"class_path": callback_path, "init_args": {"accumulation_steps": 4, "max_grad_norm": 0.5}}
            ],
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@NAMESPACES
@pytest.mark.parametrize("callback_path", CALLBACK_PATHS)
def test_this_packages_callback_by_either_path_runs_in_the_models_namespace(
    ns: str, callback_path: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Issue #18, item 10: a `lightning.pytorch` model with `lightning_gradacc.GradientAccumulationCallback`
    in the YAML stopped with "classes from both namespaces"; the callback is ours, so it runs as the model's
    namespace's twin, with its arguments."""
    cli = build_cli(["fit", "--config", str(callback_config(ns, callback_path, tmp_path))])
    callback = the_callback(cli)
    assert type(callback) is CALLBACKS[ns]
    assert isinstance(cli.trainer, __import__(ns, fromlist=["Trainer"]).Trainer)
    assert (callback.stats.accumulation_steps, callback.settings.max_grad_norm) == (4, 0.5)
    assert callback.stats.windows == cli.trainer.global_step == 2  # 8 micro-batches, windows of 4
    assert "Gradient accumulation summary" in capsys.readouterr().out


@NAMESPACES
@pytest.mark.parametrize(
    "form", ["value", "separate_value", "class_path", "inline", "append", "nested_file", "namespace_flag"]
)
def test_the_other_namespaces_callback_in_every_form_becomes_this_namespaces(
    ns: str, form: str, tmp_path: Path
) -> None:
    other = OTHER_CALLBACK[ns]
    module = MODULES[ns]
    model = f"--model={module.__module__}.{module.__name__}"
    steps = "--trainer.callbacks.init_args.accumulation_steps=3"
    args = {
        "value": [model, f"--trainer.callbacks={other}", steps],
        "separate_value": [model, "--trainer.callbacks", other, steps],
        "class_path": [model, f"--trainer.callbacks.class_path={other}", steps],
        "inline": [
            model,
            "--trainer.callbacks",
            json.dumps([{"class_path": other, "init_args": {"accumulation_steps": 3}}]),
        ],
        "append": [model, f"--trainer.callbacks+={other}", "--trainer.callbacks.accumulation_steps=3"],
        "nested_file": [],
        "namespace_flag": [
            f"--namespace={ns}",
            "--model=ClassifierModule",
            f"--trainer.callbacks={other}",
            steps,
        ],
    }[form]
    if form == "nested_file":
        if JSONARGPARSE < (4, 51):
            pytest.skip("a config file as an item of `trainer.callbacks` is read from jsonargparse 4.51 on")
        (tmp_path / "callback.yaml").write_text(
            yaml.safe_dump({"class_path": other, "init_args": {"accumulation_steps": 3}})
        )
        (tmp_path / "config.yaml").write_text(yaml.safe_dump({"trainer": {"callbacks": ["callback.yaml"]}}))
        args = [model, "--config", str(tmp_path / "config.yaml")]
    cli = build_cli([*args, "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"], run=False)
    callback = the_callback(cli)
    assert type(callback) is CALLBACKS[ns]
    assert callback.stats.accumulation_steps == 3


@pytest.mark.parametrize("callback_path", CALLBACK_PATHS)
def test_this_packages_callback_decides_the_namespace_only_when_nothing_else_does(callback_path: str) -> None:
    ns = "lightning.pytorch" if ".lightning." in callback_path else "pytorch_lightning"
    assert detect_namespace([f"--trainer.callbacks={callback_path}", "--model=ClassifierModule"]) == ns
    for model_ns, module in MODULES.items():
        model = f"--model={module.__module__}.{module.__name__}"
        assert detect_namespace([model, f"--trainer.callbacks={callback_path}"]) == model_ns
    both = [f"--trainer.callbacks={path}" for path in CALLBACK_PATHS]
    assert detect_namespace(both) is None  # pytorch_lightning by default, `--namespace` chooses


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


# Written at each rank's exit (the last atexit handler): the namespace's demo loaded, a process group alive.
PROBE = """
import atexit, os, sys
def _report():
    distributed = sys.modules.get("torch.distributed")
    alive = distributed is not None and distributed.is_initialized()
    with open(os.path.join(os.environ["PROBE_DIR"], "rank" + os.environ.get("LOCAL_RANK", "0")), "w") as f:
        f.write(f"{'lightning_gradacc.demo.lightning' in sys.modules} {alive}")
atexit.register(_report)
"""


@pytest.mark.slow
def test_ddp_config_under_lightning_pytorch_with_the_console_script(tmp_path: Path) -> None:
    """Lightning starts the other rank with the same command line: it must run the same namespace. Both
    ranks destroy their process group before the interpreter's teardown (Lightning leaves a gloo one). (The
    console script's DDP run in the default namespace differs only by the flag: not run again, for time.)"""
    command = Path(sys.executable).parent / "lightning-gradacc"
    args = [
        str(command),
        "fit",
        "--namespace",
        "lightning",
        "--config",
        str(PACKAGED_CONFIGS / "ddp_cpu.yaml"),
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
    assert result.stdout.count("Gradient accumulation summary") == 1  # printed by rank 0 only
    # 6 micro-batches per rank and epoch, K=2: 3 steps per epoch; 32 x 2 x 2 ranks per step
    assert "optimizer steps taken        6 of 6 windows" in result.stdout
    assert "effective batch (items)      128 in the last full step (K micro-batches)\n" in result.stdout
    assert (probe / "rank0").read_text() == (probe / "rank1").read_text() == "True False"


def test_only_class_options_and_class_paths_are_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other dotted values (a directory `train.out`, a file `poems.txt`) are never imported."""
    (tmp_path / "train.py").write_text("raise SystemExit('train.py was imported')\n")
    (tmp_path / "poems.py").write_text("raise SystemExit('poems.py was imported')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["--config", str(PACKAGED_CONFIGS / "token_lm.yaml"), "--trainer.default_root_dir=train.out"]
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
