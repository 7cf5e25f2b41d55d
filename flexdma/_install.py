"""How to add an optional dependency group (pyproject.toml's [project.optional-dependencies]) to an
existing install, for the errors raised where one is missing.

The command installs the group's packages alone, read from the installed distribution's metadata:
it works for every kind of install (a wheel, `pip install .`, `pip install -e .`) and never
rebuilds flexdma's extension, as reinstalling flexdma with the extra would.
"""

from __future__ import annotations

import importlib.metadata
import re
import shlex
from typing import List, Optional

# The groups pyproject.toml declares; the metadata of an install names the same.
EXTRAS = ("hf", "test", "bench")


def extra_requirements(extra: str) -> Optional[List[str]]:
    """The requirements of optional group `extra` (e.g. ["transformers>=4.56"]), from the installed
    flexdma's metadata; None where flexdma is not installed (a source tree on the path)."""
    if extra not in EXTRAS:
        raise ValueError(f"extra must be one of {EXTRAS}, got {extra!r}")
    try:
        requires = importlib.metadata.requires("flexdma")
    except importlib.metadata.PackageNotFoundError:
        return None
    marker = re.compile(r"""\bextra\s*==\s*["']""" + re.escape(extra) + r"""["']""")
    # Each entry reads 'transformers>=4.56; extra == "hf"'.
    return [r.split(";", 1)[0].strip() for r in requires or () if ";" in r and marker.search(r.split(";", 1)[1])]


def extra_install_command(extra: str) -> str:
    """The one command that adds group `extra` to this environment without rebuilding flexdma."""
    reqs = extra_requirements(extra)
    if not reqs:
        return f'pip install --no-build-isolation -e ".[{extra}]" in the flexdma source tree'
    return "pip install " + " ".join(shlex.quote(r) for r in reqs)
