"""Helpers the benchmark runners share (cli.py, cpu.py, topk.py): the recorded command line and
the JSON writer. Imports nothing of the other benchmark modules."""

from __future__ import annotations

import json
import os
from typing import List


def public_argv(argv: List[str]) -> List[str]:
    """The command line as recorded: directory arguments are where this run wrote, not part of what it measured."""
    out, skip = [], False
    for a in argv:
        if skip:
            out.append("DIR")
            skip = False
        elif a in ("--out", "--results", "--md"):
            out.append(a)
            skip = True
        elif a.split("=", 1)[0] in ("--out", "--results", "--md"):
            out.append(a.split("=", 1)[0] + "=DIR")
        else:
            out.append(a)
    return out


def write_json(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
    os.replace(tmp, path)
