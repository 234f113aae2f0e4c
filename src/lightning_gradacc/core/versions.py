"""The oldest releases the package works with, checked where each is imported (pyproject.toml declares them).

A release below its floor is refused with both versions named, rather than failing later in a way that
names neither (torch before 2.6 lacks ``torch.nn.utils.get_total_norm`` and the public ``FSDPModule``;
Lightning before 2.5 replays a batch when it resumes inside an epoch).
"""

from __future__ import annotations

import re

TORCH_FLOOR = (2, 6)
LIGHTNING_FLOOR = (2, 5)


def check_version(package: str, version: str, floor: tuple[int, int]) -> None:
    """Raise ``ImportError`` if ``version`` of ``package`` is older than ``floor`` (major, minor).

    Example:
        >>> check_version("torch", "2.13.0+cpu", TORCH_FLOOR)
        >>> check_version("torch", "2.5.1", TORCH_FLOOR)
        Traceback (most recent call last):
        ...
        ImportError: lightning_gradacc needs torch>=2.6, but torch 2.5.1 is installed: ...
    """
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) >= floor:
        return  # a development build without a release number is taken as new enough
    wanted = ".".join(map(str, floor))
    raise ImportError(
        f"lightning_gradacc needs {package}>={wanted}, but {package} {version} is installed:"
        f" `pip install '{package}>={wanted}'`."
    )
