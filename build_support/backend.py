"""The package's build backend: setuptools, with a package description that reads well off the repository.

The README links to files of the repository (``docs/guides.md#...``): on a package index those links lead
nowhere. Before every build this writes ``build_support/description.md``, the README with each relative link
turned into its text and the file it names (shipped in the source distribution), and pyproject.toml takes the
package's description from it. Everything else is setuptools' ``build_meta``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (the PEP 517 hooks not wrapped here)

ROOT = Path(__file__).resolve().parent.parent
DESCRIPTION = ROOT / "build_support" / "description.md"
# [text](target) where target is neither a URL nor an anchor of the page itself
RELATIVE_LINK = re.compile(r"\[([^\]]+)\]\((?![a-z]+://|#|mailto:)([^)#\s]+)(#[^)\s]*)?\)")


def description(readme: str) -> str:
    """``readme`` with each relative link as ``text (path in the source distribution)``.

    Example:
        >>> description("see [Exact resume](docs/guides.md#exact-resume) and [torch](https://pytorch.org)")
        'see Exact resume (docs/guides.md in the source distribution) and [torch](https://pytorch.org)'
    """
    return RELATIVE_LINK.sub(lambda m: f"{m.group(1)} ({m.group(2)} in the source distribution)", readme)


def _write_description() -> None:
    DESCRIPTION.write_text(description((ROOT / "README.md").read_text(encoding="utf-8")), encoding="utf-8")


def _wrapped(name: str) -> Any:
    hook = getattr(_setuptools, name)

    def run(*args: Any, **kwargs: Any) -> Any:
        _write_description()
        return hook(*args, **kwargs)

    run.__name__ = name
    return run


get_requires_for_build_wheel = _wrapped("get_requires_for_build_wheel")
get_requires_for_build_sdist = _wrapped("get_requires_for_build_sdist")
get_requires_for_build_editable = _wrapped("get_requires_for_build_editable")
prepare_metadata_for_build_wheel = _wrapped("prepare_metadata_for_build_wheel")
prepare_metadata_for_build_editable = _wrapped("prepare_metadata_for_build_editable")
build_wheel = _wrapped("build_wheel")
build_sdist = _wrapped("build_sdist")
build_editable = _wrapped("build_editable")
