"""setup.py's choice of the host C++ compiler: a build on a machine whose default `c++` links
libstdc++ statically (an extension whose C++ errors crash the process) picks a g++ that has a shared
one, or says at build time that none exists and how to fix it. Fake compilers on PATH stand in for
the toolchains."""

import os
import runpy
import stat
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the libstdc++ check is for Linux")


def _compiler(d: Path, name: str, libstdcxx: str) -> Path:
    # Answers `-print-file-name=libstdc++.so` as GCC does: an absolute path, or the bare name.
    p = d / name
    p.write_text(f"#!/bin/sh\necho {libstdcxx}\n")
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return p


@pytest.fixture
def setup_py(monkeypatch):
    # _pick_cxx sets CXX / CC in os.environ: setenv first, so that monkeypatch restores them.
    for name in ("CXX", "CC"):
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    return runpy.run_path(str(ROOT / "setup.py"), run_name="flexdma_setup")


def test_static_default_picks_a_shared_gxx(setup_py, monkeypatch, tmp_path, capsys):
    static, shared = tmp_path / "a", tmp_path / "b"
    static.mkdir(), shared.mkdir()
    _compiler(static, "c++", "libstdc++.so")
    _compiler(static, "g++", "libstdc++.so")  # first on PATH, static too: skipped
    gxx = _compiler(shared, "g++", "/opt/gcc/lib64/libstdc++.so")
    gcc = _compiler(shared, "gcc", "/opt/gcc/lib64/libstdc++.so")
    monkeypatch.setenv("PATH", f"{static}{os.pathsep}{shared}")
    assert setup_py["_pick_cxx"]() is False
    assert os.environ["CXX"] == str(gxx) and os.environ["CC"] == str(gcc)
    assert f"building with CXX={gxx}" in capsys.readouterr().err


def test_no_shared_libstdcxx_says_so_at_build_time(setup_py, monkeypatch, tmp_path, capsys):
    _compiler(tmp_path, "c++", "libstdc++.so")
    _compiler(tmp_path, "g++", "libstdc++.so")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert setup_py["_pick_cxx"]() is True
    err = capsys.readouterr().err
    assert "no C++ compiler with a shared libstdc++" in err and "set CXX" in err
    assert "CXX" not in os.environ


def test_user_cxx_is_kept(setup_py, monkeypatch, tmp_path, capsys):
    _compiler(tmp_path, "c++", "libstdc++.so")
    _compiler(tmp_path, "g++", "/usr/lib/libstdc++.so")
    mine = _compiler(tmp_path, "my-c++", "libstdc++.so")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CXX", str(mine))
    assert setup_py["_pick_cxx"]() is True
    assert os.environ["CXX"] == str(mine)
    assert f"CXX={mine} has no shared libstdc++" in capsys.readouterr().err


def test_shared_default_is_kept(setup_py, monkeypatch, tmp_path):
    _compiler(tmp_path, "c++", "/usr/lib/libstdc++.so")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert setup_py["_pick_cxx"]() is False
    assert "CXX" not in os.environ
