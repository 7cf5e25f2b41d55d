"""Installing flexdma as README's Install says: the build's message where pip's isolated build has
no torch, editable builds that keep their objects (adding an extra recompiles nothing), a wheel that
holds the package only and imports where it is installed (what `pip install .` does), the command
an error names where an extra is missing, and what `python -m flexdma` reports of the build."""

import importlib.metadata
import os
import re
import runpy
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

import flexdma
from flexdma import _ext, _install
from flexdma.__main__ import build_report

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd, **kwargs) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kwargs)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def _python_in(folder, code, *flags) -> str:
    """Runs `code` in a new interpreter with `folder` as its working directory and first on its
    path (away from the source tree); returns what it printed."""
    return _run([sys.executable, *flags, "-c", code], cwd=folder, env=dict(os.environ, PYTHONPATH=str(folder)))


@pytest.fixture(scope="module")
def setup_py():
    return runpy.run_path(str(ROOT / "setup.py"), run_name="flexdma_setup")


def test_build_without_torch_says_how_to_build(setup_py, monkeypatch):
    # What pip's default isolated build environment looks like to setup.py.
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(SystemExit) as e:
        setup_py["_require_torch"]()
    assert "pip install --no-build-isolation -e ." in str(e.value.code)


def test_editable_build_keeps_its_objects_where_a_regular_build_does(setup_py, monkeypatch):
    """setuptools gives each editable build a fresh temporary folder for the objects; flexdma's
    build_ext puts them where a regular build (`pip install .`, `pip wheel`) does, so ninja finds
    them again on the next install."""
    from setuptools import Distribution

    monkeypatch.chdir(ROOT)

    def build_temp(editable, given):
        dist = Distribution({"name": "flexdma", "ext_modules": []})
        build = dist.get_command_obj("build")
        build.build_temp = given
        cmd = setup_py["_cmdclass"]()["build_ext"](dist)
        cmd.editable_mode = editable
        cmd.ensure_finalized()
        return cmd.build_temp

    regular = build_temp(False, None)
    assert build_temp(True, "/tmp/setuptools-editable-xyz") == str(ROOT / regular)


def _pyproject_extra(extra):
    text = (ROOT / "pyproject.toml").read_text()
    row = re.search(rf"^{extra} = \[(.*)\]$", text, re.M).group(1)
    return re.findall(r'"([^"]+)"', row)


def test_extra_install_command_installs_the_extra_alone():
    extra = "hf"
    if _install.extra_requirements(extra) is None:
        pytest.skip("flexdma is not installed (a source tree on the path): no metadata to read")
    assert _install.extra_requirements(extra) == _pyproject_extra(extra)
    cmd = _install.extra_install_command(extra)
    assert cmd.startswith("pip install ") and "flexdma" not in cmd and "-e" not in cmd.split()
    for req in _pyproject_extra(extra):
        assert req in cmd


def test_extra_install_command_without_metadata(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "requires", missing)
    assert _install.extra_install_command("hf") == (
        'pip install --no-build-isolation -e ".[hf]" in the flexdma source tree'
    )
    with pytest.raises(ValueError, match=r"extra must be one of \('hf', 'test', 'bench'\), got 'hugging'"):
        _install.extra_install_command("hugging")


def test_missing_transformers_names_the_command(monkeypatch):
    from flexdma.integrations import transformers as fx

    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)
    cmd = _install.extra_install_command("hf")
    with pytest.raises(ImportError) as e:
        fx.register()
    assert cmd in str(e.value)
    with pytest.raises(ImportError) as e:
        fx.patch_doge(torch.nn.Module())
    assert cmd in str(e.value)


def test_build_report_names_what_the_build_holds(monkeypatch):
    info = types.SimpleNamespace(
        STATIC_LIBSTDCXX=False,
        WITH_CUDA=True,
        CUDA_HEAD_DIMS=(64, 128),
        CUDA_ARCHS=("90",),
        CUDA_CODE=("sm_90a",),
        TORCH_VERSION="2.11.0+cu130",
        TORCH_CUDA="13.0",
    )
    monkeypatch.setattr(_ext, "BUILD_INFO", info)
    monkeypatch.setattr(_ext, "LOAD_ERROR", None)
    monkeypatch.setattr(_ext, "HAVE_TRITON", False)
    lines = build_report()
    assert lines[0] == "build: compiled against torch 2.11.0+cu130"
    assert "  CPU kernels: yes" in lines
    assert any(x.startswith("  CUDA kernels: head dims 64, 128 for sm_90a, CUDA 13.0") for x in lines)
    assert any(x.startswith("  Triton: not installed") for x in lines)

    monkeypatch.setattr(info, "WITH_CUDA", False)
    assert any(x.startswith("  CUDA kernels: not built") for x in build_report())
    monkeypatch.setattr(_ext, "LOAD_ERROR", "the C++ extension flexdma._C did not load (boom)")
    assert "  CPU and CUDA kernels: unavailable: the C++ extension flexdma._C did not load (boom)" in build_report()


def test_load_error_names_the_torch_the_build_was_for(tmp_path):
    # A copy of the package whose extension fails to load as one built for another torch does (an
    # ImportError naming a symbol), and whose build record names that torch.
    pkg = tmp_path / "flexdma"
    shutil.copytree(ROOT / "flexdma", pkg, ignore=shutil.ignore_patterns("_C*", "__pycache__"))
    (pkg / "_C.py").write_text("raise ImportError('flexdma/_C.so: undefined symbol: _ZN3c104cuda')\n")
    (pkg / "_build_info.py").write_text(
        "STATIC_LIBSTDCXX = False\nWITH_CUDA = False\nCUDA_HEAD_DIMS = ()\nCUDA_ARCHS = ()\n"
        "CUDA_CODE = ()\nTORCH_VERSION = '2.0.0'\nTORCH_CUDA = None\n"
    )
    out = _python_in(tmp_path, "import flexdma._ext as e; print(e.LOAD_ERROR)")
    assert f"it was built against torch 2.0.0 and this is torch {torch.__version__}" in out


@pytest.mark.skipif(
    _ext.BUILD_INFO is None or _ext.BUILD_INFO.WITH_CUDA or _ext.LOAD_ERROR is not None,
    reason="needs the CPU-only build of the source tree (its objects are reused: a CUDA build would recompile)",
)
def test_wheel_holds_the_package_and_imports_where_installed(tmp_path):
    """README's wheel command (CPU-only here; it reuses the objects of the tree's build, so it only
    links): the wheel holds the package's modules as the source tree has them, its extension and
    build record and nothing else, and installed into an empty folder (as `pip install .` installs
    it) it imports without a warning and runs an op, away from the source tree."""
    egg_info = ROOT / "flexdma.egg-info"
    had_egg_info = egg_info.exists()
    env = dict(os.environ, FLEXDMA_SKIP_CUDA="1")
    try:
        _run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "--no-index"]
            + ["-w", str(tmp_path / "dist"), "."],
            cwd=ROOT,
            env=env,
        )
    finally:
        if not had_egg_info:  # pip builds the metadata in the tree: leave the tree as it was
            shutil.rmtree(egg_info, ignore_errors=True)
    (whl,) = (tmp_path / "dist").glob("flexdma-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert all(n.startswith(("flexdma/", "flexdma-")) for n in names), sorted(names)
    source = {p.relative_to(ROOT).as_posix() for p in (ROOT / "flexdma").rglob("*.py")}
    assert {n for n in names if n.endswith(".py")} == source
    assert len([n for n in names if re.fullmatch(r"flexdma/_C\..*\.so", n)]) == 1

    site = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site), str(whl)])
    code = (
        "import torch, flexdma\n"
        "q = torch.randn(1, 40, 2, 16)\n"
        "out = flexdma.flash_dma_attention(q, q, q, is_causal=True, backend='cpu')\n"
        "ref, _ = flexdma.attention_ref(q, q, q, is_causal=True)\n"
        "torch.testing.assert_close(out, ref)\n"
        "print(flexdma.__file__)\n"
    )
    printed = _python_in(site, code, "-W", "error").strip()
    assert Path(printed).resolve() == (site / "flexdma" / "__init__.py").resolve() != Path(flexdma.__file__).resolve()
