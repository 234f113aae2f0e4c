"""The oldest releases the package works with, checked where each is imported (pyproject.toml declares them).

A release below its floor is refused with both versions named, rather than failing later in a way that
names neither (before torch 2.9 the suite's FSDP2 oracles fail on CPU: 2.8 with ``skip_micro_batch``,
2.7 by 0.16, 2.6 cannot gather; before 2.6 ``FSDPModule`` is private and ``get_total_norm`` missing;
Lightning 2.4 replays a batch when it resumes inside an epoch, 2.5 fails 18 of the suite's tests, 2.6.0 ends
a ``max_epochs=-1`` fit with ``StochasticWeightAveraging`` at epoch 0: docs/limitations.md, "Versions").
"""

from __future__ import annotations

import importlib.metadata
import re

TORCH_FLOOR = (2, 9)
LIGHTNING_FLOOR = (2, 6, 1)
JSONARGPARSE_FLOOR = (4, 39)  # the CLI's (what LightningCLI 2.6 asks for; 4.38 fails the CLI's tests)


def check_version(package: str, version: str, floor: tuple[int, ...]) -> None:
    """Raise ``ImportError`` if ``version`` of ``package`` is older than ``floor`` (major, minor[, patch]).

    Example:
        >>> check_version("torch", "2.13.0+cpu", TORCH_FLOOR)
        >>> check_version("torch", "2.8.0", TORCH_FLOOR)
        Traceback (most recent call last):
        ...
        ImportError: lightning_gradacc needs torch>=2.9, but torch 2.8.0 is installed: ...
        >>> check_version("lightning", "2.6.0", LIGHTNING_FLOOR)
        Traceback (most recent call last):
        ...
        ImportError: lightning_gradacc needs lightning>=2.6.1, but lightning 2.6.0 is installed: ...
    """
    found = re.match(r"\d+(\.\d+)*", version)
    if found is None or tuple(int(part) for part in found[0].split("."))[: len(floor)] >= floor:
        return  # a development build without a release number is taken as new enough
    wanted = ".".join(map(str, floor))
    raise ImportError(
        f"lightning_gradacc needs {package}>={wanted}, but {package} {version} is installed:"
        f" `pip install '{package}>={wanted}'`."
    )


def require(distribution: str, floor: tuple[int, ...]) -> None:
    """:func:`check_version` for the installed ``distribution`` (its version as pip installed it).

    A module importable without an installed distribution (a source tree on ``sys.path``) is not checked.

    Example:
        >>> require("torch", TORCH_FLOOR)
    """
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return
    check_version(distribution, version, floor)
