r"""``lightning-gradacc``: a LightningCLI for either namespace; its experiments are YAML files.

Usage::

    lightning-gradacc fit --config quickstart
    lightning-gradacc fit --config quickstart --namespace lightning   # lightning.pytorch
    lightning-gradacc fit --config quickstart --trainer.max_epochs=2 \\
        --trainer.callbacks.init_args.accumulation_steps=8
    lightning-gradacc fit --model my_project.MyModule --trainer.accumulate_grad_batches 4
    lightning-gradacc check --config token_lm --batches 4 --ranks 2   # is the step invariant?

The namespace (``pytorch_lightning`` or ``lightning.pytorch``) follows the classes given: a model, data
module, logger or callback named by its import path decides it; ``--namespace`` chooses it when only short
class names are given (the shipped configs use them, so each runs in both); ``pytorch_lightning``
otherwise. This package's own callback does not decide it: named by either namespace's import path, it runs
as the callback of the chosen namespace, with the same arguments. The command always accumulates with
:class:`GradientAccumulationCallback`: without one in the config it adds one that adopts
``--trainer.accumulate_grad_batches``. Modules in the working directory import, as with ``python -m``.
"""

from __future__ import annotations

import importlib
import itertools
import os
import re
import sys
import warnings
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import get_loader, set_loader

from .callback import GradientAccumulationLogic
from .compatibility import SCHEDULER_CONFLICT
from .core.torch_internals import leave_the_group
from .core.versions import JSONARGPARSE_FLOOR, require
from .namespaces import LIGHTNING, NAMESPACES, PYTORCH_LIGHTNING, installed, namespace_of
from .step_check import TOLERANCE

require("jsonargparse", JSONARGPARSE_FLOOR)

NAMESPACE_FLAG = "--namespace"
_NAMESPACE_NAMES = {
    "pytorch_lightning": PYTORCH_LIGHTNING,
    "lightning": LIGHTNING,
    "lightning.pytorch": LIGHTNING,
}
# Modules whose classes the configs may name by their short names, per namespace.
_SHORT_NAME_MODULES = {
    PYTORCH_LIGHTNING: ("lightning_gradacc.callback", "lightning_gradacc.demo"),
    LIGHTNING: ("lightning_gradacc.lightning", "lightning_gradacc.demo.lightning"),
}
# The import paths of this package's callback: one class per namespace, the same arguments. They do not decide
# the namespace; each runs as the callback of the namespace the other classes choose.
_CALLBACK_PATHS = {
    "lightning_gradacc.GradientAccumulationCallback": PYTORCH_LIGHTNING,
    "lightning_gradacc.callback.GradientAccumulationCallback": PYTORCH_LIGHTNING,
    "lightning_gradacc.lightning.GradientAccumulationCallback": LIGHTNING,
}
_CALLBACK_OF = {
    PYTORCH_LIGHTNING: "lightning_gradacc.GradientAccumulationCallback",
    LIGHTNING: "lightning_gradacc.lightning.GradientAccumulationCallback",
}


class _GradAccCLI:
    """What ``lightning-gradacc`` adds to each namespace's ``LightningCLI``."""

    callback_class: type[GradientAccumulationLogic]
    trainer: Any

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """The Trainer, with a ``GradientAccumulationCallback`` added if the config has none."""
        trainer = super().instantiate_trainer(**kwargs)  # type: ignore[misc]
        callbacks = trainer.callbacks
        if any(type(callback).__name__ == "GradientAccumulationScheduler" for callback in callbacks):
            raise RuntimeError(SCHEDULER_CONFLICT)
        if not any(isinstance(callback, GradientAccumulationLogic) for callback in callbacks):
            callbacks.insert(0, self.callback_class())  # adopts `trainer.accumulate_grad_batches`
        return trainer

    def init_parser(self, **kwargs: Any) -> Any:
        """LightningCLI's parser, whose help does not offer the callbacks the command refuses."""
        parser = super().init_parser(**kwargs)  # type: ignore[misc]
        formatted = parser.format_help
        parser.format_help = lambda: without_refused_callbacks(formatted())
        return parser

    def after_fit(self) -> None:
        """Print the summary table of the run's ``GradientAccumulationCallback`` (on global rank 0)."""
        trainer = self.trainer
        callback = next((c for c in trainer.callbacks if isinstance(c, GradientAccumulationLogic)), None)
        if callback is None or not trainer.is_global_zero:
            return
        print(callback.summary(), flush=True)


# Callbacks the command refuses (`instantiate_trainer`), which jsonargparse lists among the known subclasses
_REFUSED_CALLBACKS = tuple(
    f"{package}.callbacks.GradientAccumulationScheduler"
    for package in ("pytorch_lightning", "lightning.pytorch")
)


def without_refused_callbacks(help_text: str) -> str:
    """``help_text`` without the refused callbacks in its lists of known classes (wrapped lines included).

    Example:
        >>> wrapped = "a.Timer, pytorch_lightning.callbacks.Gradient" + chr(10) + "  AccumulationScheduler, b"
        >>> without_refused_callbacks(wrapped)
        'a.Timer, b'
    """
    for name in _REFUSED_CALLBACKS:
        wrapped = r"(?:\n\s*)?".join(re.escape(char) for char in name)  # the help wraps inside names
        help_text = re.sub(rf"{wrapped},?\s*", "", help_text)
    return help_text


@cache
def cli_class(package: str) -> type:
    """The command's LightningCLI for ``package``: ``"pytorch_lightning"`` or ``"lightning.pytorch"``."""
    if not installed(package):
        raise RuntimeError(
            f"`{package}` is not installed: `pip install lightning-gradacc[lightning]` brings"
            " `lightning.pytorch`."
        )
    for module in _SHORT_NAME_MODULES[package]:  # so that jsonargparse resolves the configs' short names
        importlib.import_module(module)
    lightning_cli = importlib.import_module(f"{package}.cli").LightningCLI
    callback_module = importlib.import_module(_SHORT_NAME_MODULES[package][0])
    attributes = {"callback_class": callback_module.GradientAccumulationCallback, "__module__": __name__}
    return type("GradAccCLI", (_GradAccCLI, lightning_cli), attributes)


def _split_namespace_flag(args: list[str]) -> tuple[str | None, list[str]]:
    """Take ``--namespace NAME`` / ``--namespace=NAME`` out of ``args`` (LightningCLI does not know it)."""
    chosen: str | None = None
    rest: list[str] = []
    items = iter(args)
    for arg in items:
        if arg == NAMESPACE_FLAG or arg.startswith(NAMESPACE_FLAG + "="):
            value = arg.partition("=")[2] if "=" in arg else next(items, "")
            if value not in _NAMESPACE_NAMES:
                raise SystemExit(
                    f"Expected `{NAMESPACE_FLAG}` to be one of {sorted(_NAMESPACE_NAMES)}, but got {value!r}."
                )
            chosen = _NAMESPACE_NAMES[value]
        else:
            rest.append(arg)
    return chosen, rest


# Options whose value names a class (an import path, or a config holding `class_path`).
_CLASS_OPTIONS = (
    "--model",
    "--data",
    "--trainer.logger",
    "--trainer.callbacks",
    "--optimizer",
    "--lr_scheduler",
)
_CONFIG_OPTIONS = ("--config", "-c")
# `--config NAME` (see `packaged_configs`): the wheel's copy, else a checkout's (an editable install)
PACKAGED_CONFIGS = next(
    (
        folder
        for folder in (Path(__file__).parent / "configs", Path(__file__).parents[2] / "configs")
        if folder.is_dir()
    ),
    Path(__file__).parent / "configs",
)


def _load(text_or_path: str, base: Path) -> tuple[Any, Path] | None:
    """A config given as a file (YAML or JSON) or inline, and the folder its relative paths start from.

    ``None`` if it is neither, or does not parse (jsonargparse then reports it in its own words).
    """
    path = Path(text_or_path) if Path(text_or_path).is_absolute() else base / text_or_path
    try:
        if text_or_path.endswith((".yaml", ".yml", ".json")) and path.is_file():
            return yaml.safe_load(path.read_text()), path.parent
        if text_or_path.lstrip().startswith(("{", "[")):
            return yaml.safe_load(text_or_path), base
    except (OSError, yaml.YAMLError):
        return None
    return None


# Where a config may name a class by a plain string (an import path or another config file).
_CLASS_KEYS = {("model",), ("data",), ("trainer", "logger"), ("trainer", "callbacks")}
_SUBCOMMANDS = {"fit", "validate", "test", "predict"}


def _class_paths(node: Any, base: Path, keys: tuple[str, ...] = ()) -> Iterator[str]:
    """The ``class_path`` values of a parsed config; config files it names for classes are read too."""
    if keys[:1] and keys[0] in _SUBCOMMANDS:  # a config for the whole command: `fit: {model: ...}`
        keys = keys[1:]
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "class_path" and isinstance(value, str):
                yield value
            else:
                yield from _class_paths(value, base, (*keys, str(key)))
    elif isinstance(node, list):
        for value in node:
            yield from _class_paths(value, base, keys)
    elif isinstance(node, str) and keys in _CLASS_KEYS:
        loaded = _load(node, base)
        if loaded is not None:  # `model: model.yaml`
            yield from _class_paths(*loaded, keys)
        else:  # `model: my.Module`
            yield node


def _candidate_paths(args: list[str]) -> Iterator[str]:
    """The class import paths named in ``args``: by the options that take classes, and in config files."""
    cwd = Path.cwd()
    items = iter(args)
    for arg in items:
        option, has_value, value = arg.partition("=")
        if not option.startswith("-"):
            continue
        is_config = option in _CONFIG_OPTIONS
        is_class = option in _CLASS_OPTIONS or option.endswith(".class_path")
        if not (is_config or is_class):
            continue
        if not has_value:
            value = next(items, "")
        keys = () if is_config else tuple(option.removeprefix("--").removesuffix(".class_path").split("."))
        loaded = _load(value, cwd)
        if loaded is not None:
            yield from _class_paths(*loaded, keys)
        elif is_class:
            yield value


def _namespace_of_path(path: str) -> str | None:
    """The namespace of the class at import path ``path`` (``None``: not a class, or not importable)."""
    module_name, _, attribute = path.rpartition(".")
    if not module_name or not all(part.isidentifier() for part in path.split(".")):
        return None
    if module_name.split(".")[0] == "lightning" and not installed(LIGHTNING):
        raise SystemExit(
            f"`{path}` is a `lightning.pytorch` class, but `lightning` is not installed: run"
            " `pip install lightning-gradacc[lightning]`."
        )
    try:
        found = getattr(importlib.import_module(module_name), attribute, None)
    except Exception:  # jsonargparse reports an import path that does not import, in its own words
        return None
    return namespace_of(found) if isinstance(found, type) else None


def _detect(args: list[str]) -> tuple[dict[str, str], str | None]:
    """The classes named in ``args`` that decide the namespace, with theirs; and the namespace they name.

    This package's callbacks are left out of the first: their namespace counts only when no other class
    names one (and when they all name the same).

    Raises:
        SystemExit: the deciding classes come from both namespaces.
    """
    paths = list(_candidate_paths(args))
    decisive = {
        path: ns
        for path in paths
        if path not in _CALLBACK_PATHS and (ns := _namespace_of_path(path)) is not None
    }
    if len(set(decisive.values())) > 1:
        listed = ", ".join(f"`{path}` ({ns})" for path, ns in decisive.items())
        raise SystemExit(
            f"The classes given come from both Lightning namespaces: {listed}. Use the classes of one"
            " (`lightning_gradacc.GradientAccumulationCallback` fits either)."
        )
    named = set(decisive.values()) or {_CALLBACK_PATHS[path] for path in paths if path in _CALLBACK_PATHS}
    return decisive, next(iter(named)) if len(named) == 1 else None


def detect_namespace(args: list[str]) -> str | None:
    """The namespace of the classes named by import path in ``args`` (and their config files), if any.

    Only the values LightningCLI takes as classes are looked at: ``class_path`` entries, and the values of
    ``--model``, ``--data``, ``--trainer.logger``, ``--trainer.callbacks``, ``--optimizer`` and
    ``--lr_scheduler`` (inline, or as config files), in the command line and in ``--config`` files. This
    package's ``GradientAccumulationCallback`` exists in both namespaces: it decides only when no other class
    does.

    Raises:
        SystemExit: the other classes come from both namespaces.
    """
    return _detect(args)[1]


def choose_namespace(args: list[str]) -> tuple[str, list[str]]:
    """The namespace to run ``args`` in, and ``args`` without ``--namespace``.

    This package's callbacks named on the command line become the chosen namespace's (the parser's loader
    maps those in configs).
    """
    chosen, rest = _split_namespace_flag(args)
    decisive, detected = _detect(rest)
    if chosen is not None and decisive and chosen != detected:
        paths = ", ".join(f"`{path}`" for path in decisive)
        raise SystemExit(
            f"`{NAMESPACE_FLAG}` asks for `{chosen}`, but {paths} are `{detected}` classes. Drop"
            f" `{NAMESPACE_FLAG}`, or name the `{chosen}` classes instead."
        )
    package = chosen or detected or PYTORCH_LIGHTNING
    return package, [_callback_for(arg, package) for arg in rest]


def _callback_for(value: str, package: str) -> str:
    """``value`` (an argument or ``--option=value``) with this package's callback named as ``package``'s."""
    option, equals, path = value.rpartition("=")
    if path in _CALLBACK_PATHS and _CALLBACK_PATHS[path] != package:
        return f"{option}{equals}{_CALLBACK_OF[package]}"
    return value


def _with_callbacks_of(package: str, node: Any) -> Any:
    """A loaded config with this package's callbacks of another namespace named as ``package``'s."""
    if isinstance(node, dict):
        return {key: _with_callbacks_of(package, value) for key, value in node.items()}
    if isinstance(node, list):
        return [_with_callbacks_of(package, value) for value in node]
    if isinstance(node, str) and node in _CALLBACK_PATHS:
        return _callback_for(node, package)
    return node


def _parser_mode(package: str) -> str:
    """The command's jsonargparse parser mode: YAML, with this package's callback named as ``package``'s.

    Every config read goes through it: files, nested files, inline values. The check that a class fits its
    argument (a ``lightning.pytorch`` ``Callback`` for a ``lightning.pytorch`` Trainer) comes before any hook
    of LightningCLI, so the class path is mapped as the config is read.
    """
    mode = f"yaml_lightning_gradacc_{package.replace('.', '_')}"
    yaml_load = get_loader("yaml")

    def load(text: str) -> Any:
        return _with_callbacks_of(package, yaml_load(text))

    set_loader(mode, load, (yaml.YAMLError,))
    return mode


def packaged_configs() -> dict[str, Path]:
    """The experiments the package ships, by name: what ``--config NAME`` runs.

    Example:
        >>> sorted(packaged_configs())[:3]
        ['auto', 'ddp_cpu', 'quickstart']
    """
    return {path.stem: path for path in sorted(PACKAGED_CONFIGS.glob("*.yaml"))}


def resolve_config_names(args: list[str]) -> list[str]:
    """``--config NAME`` (``-c NAME``) as the path of the config the package ships under that name.

    A value that is a file here, a path, a file name with a suffix or an inline config is left as it is.

    Raises:
        SystemExit: ``NAME`` is no file here and no config the package ships (the shipped ones are named).

    Example:
        >>> resolve_config_names(["fit", "--config", "quickstart"])[2].endswith("configs/quickstart.yaml")
        True
    """
    resolved: list[str] = []
    items = iter(args)
    for arg in items:
        option, has_value, value = arg.partition("=")
        if option not in _CONFIG_OPTIONS:
            resolved.append(arg)
            continue
        if not has_value:
            value = next(items, "")
        if value.isidentifier() and not Path(value).exists():
            shipped = packaged_configs()
            if value not in shipped:
                raise SystemExit(
                    f"`{option} {value}`: no such file, and no config of the package is named {value!r}."
                    f" Its configs: {', '.join(shipped)}; or give a path to a YAML file."
                )
            value = str(shipped[value])
        resolved.extend([option, value])
    return resolved


def build_cli(args: list[str] | None = None, *, run: bool = True) -> Any:
    """Parse ``args`` (default: ``sys.argv[1:]``), instantiate; run the subcommand unless ``run=False``.

    ``--config NAME`` runs a config the package ships (:func:`packaged_configs`).
    """
    given = list(sys.argv[1:] if args is None else args)
    package, rest = choose_namespace(resolve_config_names(given))
    # `sys.argv` keeps `--namespace`: Lightning's DDP launcher starts the other ranks with it.
    description = (
        f"Gradient accumulation with lightning_gradacc, in `{package}`. `{NAMESPACE_FLAG} lightning` or"
        f" `{NAMESPACE_FLAG} pytorch_lightning` (anywhere on the command line) chooses the namespace when the"
        " classes given do not."
    )
    parser_kwargs = {"description": description, "parser_mode": _parser_mode(package)}
    return cli_class(package)(
        args=rest, run=run, save_config_kwargs={"overwrite": True}, parser_kwargs=parser_kwargs
    )


CHECK_OPTIONS = {"--batches": (int, 4), "--ranks": (int, 2), "--tolerance": (float, TOLERANCE)}


def _check_options(args: list[str]) -> tuple[dict[str, Any], list[str]]:
    """``check``'s own options (``--batches 4`` or ``--batches=4``), and the rest for LightningCLI."""
    chosen = {name: default for name, (_, default) in CHECK_OPTIONS.items()}
    rest: list[str] = []
    index = 0
    while index < len(args):
        name, _, value = args[index].partition("=")
        if name in CHECK_OPTIONS:
            if not value:
                if index + 1 >= len(args):
                    raise SystemExit(f"lightning-gradacc check: {name} needs a value")
                index += 1
                value = args[index]
            kind = CHECK_OPTIONS[name][0]
            try:
                chosen[name] = kind(value)
            except ValueError:
                raise SystemExit(
                    f"lightning-gradacc check: {name} expects {kind.__name__}, got {value!r}"
                ) from None
        else:
            rest.append(args[index])
        index += 1
    return chosen, rest


def run_check(args: list[str]) -> int:
    """``lightning-gradacc check [--batches N] [--ranks R] [--tolerance T] <fit's config and options>``.

    Builds the experiment as ``fit`` would (model, data, the callback's settings) without training, takes
    the first ``N`` batches of its train loader, and runs :func:`~lightning_gradacc.step_check.check_step`:
    prints the report; exit status 0 where the step is invariant, 1 where it is not.
    """
    from .step_check import check_step

    options, rest = _check_options(args)
    cli = build_cli(rest, run=False)
    callback = next(c for c in cli.trainer.callbacks if isinstance(c, GradientAccumulationLogic))
    settings = {"scaling": callback.settings.scaling, "item_count_fn": callback.item_count_fn}
    data = cli.datamodule
    if data is not None:
        data.prepare_data()
        data.setup("fit")
        loader = data.train_dataloader()
    else:
        loader = cli.model.train_dataloader()
    batches = list(itertools.islice(iter(loader), options["--batches"]))
    result = check_step(
        cli.model,
        batches,
        settings,
        ranks=options["--ranks"],
        tolerance=options["--tolerance"],
        split_fn=callback.split_fn,
    )
    print(result.report())
    return 0 if result.invariant else 1


def main() -> None:
    """Entry point of ``lightning-gradacc`` and ``python -m lightning_gradacc``."""
    # The arguments are the command line's, less `--namespace`: LightningCLI's warning about `args` is moot.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within")
    _import_from_the_working_directory()
    if sys.argv[1:2] == ["check"]:
        raise SystemExit(run_check(sys.argv[2:]))
    build_cli()
    leave_the_group()  # under DDP: every rank meets, then the group goes (see there)


def _import_from_the_working_directory() -> None:
    """Put the working directory first on ``sys.path``, as ``python -m`` does (unless ``-P``).

    A console script's ``sys.path[0]`` is the script's folder: without this, ``--model my_module.MyModule``
    does not import ``my_module.py`` from where the command runs.
    """
    cwd = os.getcwd()
    first = sys.path[0] if sys.path else None
    if not getattr(sys.flags, "safe_path", False) and first not in (cwd, ""):
        sys.path.insert(0, cwd)


__all__ = [
    "NAMESPACES",
    "build_cli",
    "choose_namespace",
    "cli_class",
    "detect_namespace",
    "main",
    "packaged_configs",
    "resolve_config_names",
    "run_check",
]
