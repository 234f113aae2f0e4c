"""The YAML configs and the ``lightning-gradacc`` command."""

from __future__ import annotations

import math
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightning_gradacc import GradientAccumulationCallback
from lightning_gradacc.cli import build_cli, main
from lightning_gradacc.core.settings import parse_threshold
from lightning_gradacc.counters import TokenCounter, count_predicted_tokens, count_tokens
from lightning_gradacc.k_policies import AutoK, AutoSettings
from tests.helpers import CONFIGS, PACKAGED_CONFIGS, QUICK, the_callback

SINGLE_PROCESS = [path for path in CONFIGS if path.stem != "ddp_cpu"]


def test_every_config_exists() -> None:
    expected = {"quickstart", "token_lm", "schedule", "target_batch", "ddp_cpu", "warmup_tokens", "auto"}
    assert {p.stem for p in CONFIGS} == expected


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_config_parses_and_instantiates(config: Path, tmp_path: Path) -> None:
    cli = build_cli(["--config", str(config), f"--trainer.default_root_dir={tmp_path}"], run=False)
    callback = the_callback(cli, GradientAccumulationCallback)
    raw = yaml.safe_load(config.read_text())["trainer"]["callbacks"][0]["init_args"]
    if "accumulation_steps" in raw:
        expected = raw["accumulation_steps"]
        if isinstance(expected, dict):  # thresholds such as "2k" are read as numbers
            expected = {parse_threshold("accumulation_steps", key): k for key, k in expected.items()}
        policy = callback.plan.policy
        if expected == "auto":  # the rule's settings, from the YAML mapping
            assert isinstance(policy, AutoK) and policy.settings == AutoSettings(**raw["auto"])
        else:
            assert (policy.schedule if isinstance(expected, dict) else policy.k) == expected
    else:
        assert callback.plan.policy.size == raw["target_batch_size"]
    assert callback.settings.max_grad_norm == raw.get("max_grad_norm")


def test_a_target_batch_size_per_stage_is_accepted_from_yaml_and_trains(tmp_path: Path) -> None:
    """As in Python: ``{steps: items}`` with ``schedule_unit: steps`` (the quickstart's micro-batches of 32
    make K 4, then 8); the CLI's fit runs those windows."""
    config = yaml.safe_load((PACKAGED_CONFIGS / "target_batch.yaml").read_text())
    config["trainer"]["callbacks"][0]["init_args"] = {
        "target_batch_size": {0: 128, 3: 256},
        "schedule_unit": "steps",
    }
    config["trainer"].update(max_epochs=1, logger=False, default_root_dir=str(tmp_path))
    path = tmp_path / "stages.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = build_cli(["fit", "--config", str(path)])
    callback = the_callback(cli, GradientAccumulationCallback)
    assert callback.plan.policy.size == {0: 128, 3: 256}
    assert callback.plan.position.steps >= 4 and callback.plan.position.window_k == 8


def test_token_lm_config_resolves_the_counter_import_path(tmp_path: Path) -> None:
    cli = build_cli(["--config", str(PACKAGED_CONFIGS / "token_lm.yaml")], run=False)
    callback = the_callback(cli, GradientAccumulationCallback)
    assert callback.settings.scaling == "weighted"
    assert callback.item_count_fn is count_tokens


def test_every_callback_argument_is_settable_from_yaml(tmp_path: Path) -> None:
    config = yaml.safe_load((PACKAGED_CONFIGS / "quickstart.yaml").read_text())
    config["trainer"]["callbacks"][0]["init_args"] = {
        "accumulation_steps": {0: 2, 3: 8},
        "scaling": "dynamic",
        "item_count_fn": "lightning_gradacc.counters.count_samples",
        "max_grad_norm": 0.5,
        "norm_type": math.inf,  # written as .inf, YAML's infinity
        "clip_value": 0.1,
        "overflow": "raise",
        "log_stats": False,
        "accumulation_dtype": "float32",
        "clip_mode": "micro_batch",
    }
    path = tmp_path / "all.yaml"
    path.write_text(yaml.safe_dump(config))
    callback = the_callback(build_cli(["--config", str(path)], run=False), GradientAccumulationCallback)
    assert callback.plan.policy.schedule == {0: 2, 3: 8}
    assert callback.settings.scaling == "weighted"
    assert callback.item_count_fn.__name__ == "count_samples"
    assert (callback.settings.max_grad_norm, callback.settings.norm_type, callback.settings.clip_value) == (
        0.5,
        math.inf,
        0.1,
    )
    assert (callback.settings.overflow, callback.log_stats) == ("raise", False)
    assert (callback.settings.accumulation_dtype, callback.settings.clip_mode) == (
        torch.float32,
        "micro_batch",
    )


@pytest.mark.parametrize(
    "override",
    [
        "--trainer.callbacks.init_args.accumulation_steps=8",
        "--trainer.callbacks.init_args.accumulation_steps 8",
    ],
)
def test_callback_arguments_can_be_overridden_on_the_command_line(override: str) -> None:
    args = ["--config", str(PACKAGED_CONFIGS / "quickstart.yaml"), *override.split(" ")]
    callback = the_callback(build_cli(args, run=False), GradientAccumulationCallback)
    assert callback.plan.policy.k == 8
    assert callback.settings.max_grad_norm == 1.0  # the rest of the config is kept


def test_invalid_yaml_value_is_reported_with_the_argument_name(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "--config",
        str(PACKAGED_CONFIGS / "quickstart.yaml"),
        "--trainer.callbacks.init_args.scaling=median",
    ]
    with pytest.raises(SystemExit):
        build_cli(args, run=False)
    error = capsys.readouterr().err
    assert "scaling" in error and "median" in error


@pytest.mark.parametrize("config", SINGLE_PROCESS, ids=lambda p: p.stem)
def test_config_runs_end_to_end(config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["fit", "--config", str(config), *QUICK, f"--trainer.logger.init_args.save_dir={tmp_path}"]
    cli = build_cli(args)
    callback = the_callback(cli, GradientAccumulationCallback)
    assert callback.stats.windows == cli.trainer.global_step > 0
    out = capsys.readouterr().out
    assert "Gradient accumulation summary" in out
    stats = callback.stats
    assert f"optimizer steps taken{' ' * 8}{stats.steps_taken} of {stats.windows} windows\n" in out
    assert str(tmp_path) in out
    assert list(tmp_path.rglob("events.out.tfevents.*"))


LOCAL_MODULE = """
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class MyLitModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 2), torch.randn(16, 1)), batch_size=2)
"""


def test_the_console_script_imports_a_module_of_the_working_directory(tmp_path: Path) -> None:
    """The README's `lightning-gradacc fit --model my_module.MyLitModule` with
    `my_module.py` where the command runs, as `python -m` would import it (no `PYTHONPATH`)."""
    (tmp_path / "my_module.py").write_text(LOCAL_MODULE)
    command = Path(sys.executable).parent / "lightning-gradacc"
    args = [
        str(command),
        "fit",
        "--model",
        "my_module.MyLitModule",
        "--trainer.accelerator=cpu",
        "--trainer.max_steps=2",
        "--trainer.accumulate_grad_batches=2",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
    ]
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PYTHONWARNINGS"] = "ignore"
    result = subprocess.run(args, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "optimizer steps taken        2 of 2 windows" in result.stdout


def test_python_dash_m_entry_point(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m lightning_gradacc --help`, in this process (a subprocess would import Lightning again)."""
    monkeypatch.setattr(sys, "argv", ["lightning_gradacc", "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("lightning_gradacc", run_name="__main__")
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(sub in out for sub in ("fit", "validate", "test", "predict"))


def test_counters_are_import_paths_in_yaml(tmp_path: Path) -> None:
    """Both forms the docs show (docs/guides.md): an import path, and a ``class_path`` with ``init_args``."""
    from lightning_gradacc.cli import build_cli

    config = yaml.safe_load((PACKAGED_CONFIGS / "token_lm.yaml").read_text())
    init_args = config["trainer"]["callbacks"][0]["init_args"]
    labels = torch.tensor([[5, 6, -1, -1], [7, 8, 9, -100]])  # shifted: [[6, -1, -1], [8, 9, -100]]
    token_counter = (
        "{class_path: lightning_gradacc.counters.TokenCounter, init_args: {ignore_index: -1, shift: true}}"
    )
    for item_count_fn, expected_count in [
        ("lightning_gradacc.counters.count_predicted_tokens", 5),  # -1 counts, -100 does not
        (token_counter, 4),  # -100 counts, -1 does not
    ]:
        init_args["item_count_fn"] = yaml.safe_load(item_count_fn) if "{" in item_count_fn else item_count_fn
        path = tmp_path / "counter.yaml"
        path.write_text(yaml.safe_dump(config))
        cli = build_cli(["--config", str(path)], run=False)
        (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, GradientAccumulationCallback)]
        counter = callback.item_count_fn
        assert isinstance(counter, TokenCounter) == ("TokenCounter" in item_count_fn)
        assert counter is count_predicted_tokens or (counter.ignore_index, counter.shift) == (-1, True)
        assert int(counter({"labels": labels})) == expected_count


def test_a_config_is_named_by_its_shipped_name_and_an_unknown_name_lists_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--config quickstart`` runs the config the package ships (a checkout is not needed); a name that is
    no file here and no shipped config fails before parsing, naming the shipped ones; a file wins."""
    cli = build_cli(["--config", "quickstart", f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert the_callback(cli, GradientAccumulationCallback).plan.policy.k == 4
    with pytest.raises(SystemExit, match=r"no config of the package is named 'quickstrat'.*quickstart"):
        build_cli(["fit", "--config=quickstrat"], run=False)
    own = tmp_path / "quickstart"
    own.write_text(
        PACKAGED_CONFIGS.joinpath("quickstart.yaml")
        .read_text()
        .replace("accumulation_steps: 4", "accumulation_steps: 2")
    )
    monkeypatch.chdir(tmp_path)
    cli = build_cli(["--config", "quickstart"], run=False)
    assert the_callback(cli, GradientAccumulationCallback).plan.policy.k == 2


@pytest.mark.parametrize(
    "override",
    [
        ["--trainer.callbacks.init_args.piece_size=auto", "--trainer.callbacks.init_args.oom_snapshot=true"],
        [
            "--trainer.callbacks.init_args.piece_size=8",
            "--trainer.callbacks.init_args.split_fn=lightning_gradacc.batch_pieces.split_batch",
        ],
    ],
    ids=["auto", "int-and-split_fn"],
)
def test_piece_size_comes_from_the_command_line_and_the_run_trains(
    override: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["fit", "--config", str(PACKAGED_CONFIGS / "quickstart.yaml"), *QUICK, *override]
    callback = the_callback(
        build_cli([*args, f"--trainer.logger.init_args.save_dir={tmp_path}"]), GradientAccumulationCallback
    )
    from lightning_gradacc.batch_pieces import split_batch

    assert callback.piece_size == ("auto" if "auto" in override[0] else 8)
    assert callback.split_fn in (None, split_batch)
    assert callback.stats.windows > 0 and callback.metrics()["grad_accum/piece_size"] > 0


@pytest.mark.parametrize("namespace", ["pytorch_lightning", "lightning"])
def test_fit_help_does_not_offer_the_callbacks_the_command_refuses(
    namespace: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning's ``GradientAccumulationScheduler`` is refused beside the callback: the help does not list
    it among the callbacks ``--trainer.callbacks`` accepts (the others stay)."""
    with pytest.raises(SystemExit) as exit_:
        monkeypatch.setattr(sys, "argv", ["lightning-gradacc", "--namespace", namespace, "fit", "--help"])
        main()
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "EarlyStopping" in out and "LearningRateMonitor" in out
    assert "AccumulationScheduler" not in out.replace(" ", "")
