"""The launchers' instantiation files (csrc/cuda/instantiations/) are what their generator writes
from the head-dim table: one per (direction, head dim, dtype), none missing or stale."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_instantiation_files_are_generated():
    gen = os.path.join(ROOT, "csrc", "cuda", "instantiations", "generate.py")
    proc = subprocess.run([sys.executable, gen, "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
