"""The launchers' instantiation files (csrc/cuda/instantiations/) are what their generator writes
from the head-dim table: one per (direction, head dim, dtype), none missing or stale; setup.py
compiles a head dim's files and no other."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_instantiation_files_are_generated():
    gen = os.path.join(ROOT, "csrc", "cuda", "instantiations", "generate.py")
    proc = subprocess.run([sys.executable, gen, "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_setup_compiles_each_head_dims_files(monkeypatch):
    # setup.py builds the files of FLEXDMA_HEAD_DIMS: per head dim, exactly the generator's files.
    import importlib.util
    import runpy

    spec = importlib.util.spec_from_file_location(
        "flexdma_instantiations", os.path.join(ROOT, "csrc", "cuda", "instantiations", "generate.py")
    )
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    setup = runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="flexdma_setup")
    monkeypatch.chdir(ROOT)
    for d in gen.head_dims():
        got = [os.path.basename(f) for f in setup["_instantiation_sources"]((d,))]
        want = sorted(gen.file_name(direction, d, dtype) for direction in gen.DIRECTIONS for dtype in gen.DTYPES)
        assert got == want, d
