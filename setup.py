"""Build of flexdma's C++/CUDA extension `flexdma._C`.

CPU kernels are always built. CUDA kernels are built when torch has CUDA and nvcc is found,
unless FLEXDMA_SKIP_CUDA=1. Dev-build switches:
  FLEXDMA_CUDA_ARCHS   e.g. "90" or "80;90" (default "90")
  FLEXDMA_HEAD_DIMS    e.g. "64,128" (default: all of 32,64,96,128,192,256; 192 and 256 only in
                       sm_90-only builds)
  FLEXDMA_NVCC_FLAGS   extra nvcc flags, e.g. "-Xptxas -v" (register and spill counts)
  MAX_JOBS             parallel compile jobs (ninja)

torch must be installed before the build, which compiles against it: install with
`pip install --no-build-isolation ...` (pip's default isolated build environment has no torch).
"""

import glob
import os
import re
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent.resolve()


def _table_head_dims():
    """The head dims the CUDA kernels implement, from their one table (csrc/cuda/head_dims.h)."""
    text = (ROOT / "csrc" / "cuda" / "head_dims.h").read_text()
    row = re.search(r"#define FLEXDMA_ALL_HEAD_DIMS\(X\)(.*)", text).group(1)
    return tuple(int(d) for d in re.findall(r"X\((\d+)\)", row))


# Other head dims fall back to FlexAttention at run time. The wide ones (above 128) run only on
# wgmma, so they are built only for sm_90a-only builds (a build for other archs drops them with a
# message). All six take ~95 s on 16 cores; a dev build names fewer.
ALL_HEAD_DIMS = _table_head_dims()
WGMMA_ONLY_HEAD_DIMS = tuple(d for d in ALL_HEAD_DIMS if d > 128)


def _head_dims():
    raw = os.environ.get("FLEXDMA_HEAD_DIMS", "")
    if not raw.strip():
        return ALL_HEAD_DIMS
    dims = tuple(sorted({int(x) for x in raw.replace(";", ",").split(",") if x.strip()}))
    bad = [d for d in dims if d not in ALL_HEAD_DIMS]
    if bad:
        raise ValueError(f"FLEXDMA_HEAD_DIMS has {bad}; the CUDA kernels implement {ALL_HEAD_DIMS}")
    return dims


def _instantiation_sources(head_dims):
    """The launchers' instantiation files of the head dims (one per direction and dtype, written by
    csrc/cuda/instantiations/generate.py): a build compiles only its head dims', in parallel."""
    sources = []
    for d in head_dims:
        found = sorted(glob.glob(f"csrc/cuda/instantiations/*_hdim{d}_*.cu"))
        if not found:
            raise RuntimeError(f"no instantiation files for head dim {d}: run csrc/cuda/instantiations/generate.py")
        sources += found
    return sources


def _nvcc_flags_module():
    """scripts/nvcc_flags.py, loaded by path (it imports nothing; torch is not loaded for it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("flexdma_nvcc_flags", ROOT / "scripts" / "nvcc_flags.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _want_cuda():
    if os.environ.get("FLEXDMA_SKIP_CUDA", "0") == "1":
        return False
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.version.cuda is not None and CUDA_HOME is not None and shutil.which("nvcc") is not None


def _has_shared_libstdcxx(cxx):
    """Whether compiler `cxx` links a shared libstdc++. Without one the extension gets a private
    static copy, and a C++ exception thrown in it (every failed input check) meets torch's own
    runtime on its way out: the process dies with SIGSEGV instead of raising (seen with a GCC build
    that shipped only libstdc++.a). Naming -lstdc++ does not help: there is no shared library to
    find. None when `cxx` does not run or is not GCC-like (then it is not second-guessed)."""
    import subprocess

    try:
        found = subprocess.run(
            [cxx, "-print-file-name=libstdc++.so"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    # GCC prints the bare name back when it does not find the file.
    return os.path.isabs(found) if found else None


def _gxx_on_path():
    """Every g++ on PATH, in PATH order (a machine may have several toolchains)."""
    seen, found = set(), []
    for d in os.environ.get("PATH", "").split(os.pathsep):
        c = os.path.join(d, "g++")
        real = os.path.realpath(c)
        if os.access(c, os.X_OK) and real not in seen:
            seen.add(real)
            found.append(c)
    return found


def _pick_cxx():
    """Choose the host C++ compiler before anything is compiled; returns whether the extension
    links libstdc++ statically after all. A CXX the user set is kept (with a warning if it has no
    shared libstdc++). Otherwise, where the default `c++` has none but a g++ on PATH has, CXX and CC
    are set to that g++ for the whole build (CC too: setuptools links with it)."""
    if not sys.platform.startswith("linux"):
        return False
    fix = (
        "set CXX (and CC) to a compiler that has a shared libstdc++ (`CXX -print-file-name=libstdc++.so` "
        "prints an absolute path), or install one (Debian / Ubuntu: g++)"
    )
    user = os.environ.get("CXX")
    if user:
        if _has_shared_libstdcxx(user) is False:
            print(
                f"WARNING: CXX={user} has no shared libstdc++: flexdma._C links it statically and any "
                f"C++ error raised inside it will crash the process; {fix}.",
                file=sys.stderr,
            )
            return True
        return False
    if _has_shared_libstdcxx("c++") is not False:
        return False
    for cxx in _gxx_on_path():
        if _has_shared_libstdcxx(cxx):
            cc = cxx[: -len("g++")] + "gcc"
            os.environ["CXX"] = cxx
            if os.access(cc, os.X_OK):
                os.environ["CC"] = cc
            print(
                f"flexdma: the default c++ has no shared libstdc++; building with CXX={cxx}"
                f"{' CC=' + cc if os.access(cc, os.X_OK) else ''}",
                file=sys.stderr,
            )
            return False
    print(
        f"WARNING: no C++ compiler with a shared libstdc++ found (c++ and every g++ on PATH link it "
        f"statically): flexdma._C will crash the process on any C++ error instead of raising; {fix}.",
        file=sys.stderr,
    )
    return True


def _cuda_code(archs):
    """The GPU code the kernels are compiled to ("sm_90a", ...), from the build's -gencode flags."""
    flags = _nvcc_flags_module().gencode(list(archs))
    return tuple(f.split("code=", 1)[1] for f in flags if "code=" in f)


def _write_build_info(with_cuda, head_dims, archs, static):
    import torch

    # The torch a build compiled against: the extension loads only under that release (C++ ABI).
    text = (
        "# Written by setup.py at build time.\n"
        f"STATIC_LIBSTDCXX = {static!r}\n"
        f"WITH_CUDA = {with_cuda!r}\n"
        f"CUDA_HEAD_DIMS = {tuple(head_dims) if with_cuda else ()!r}\n"
        f"CUDA_ARCHS = {tuple(archs) if with_cuda else ()!r}\n"
        f"CUDA_CODE = {_cuda_code(archs) if with_cuda else ()!r}\n"
        f"TORCH_VERSION = {torch.__version__!r}\n"
        f"TORCH_CUDA = {torch.version.cuda if with_cuda else None!r}\n"
    )
    (ROOT / "flexdma" / "_build_info.py").write_text(text)


def _extensions():
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    cxx = ["-O3", "-std=c++17"]
    # at::parallel_for is a header template: it runs its range on one thread unless this
    # extension itself is compiled with OpenMP (torch's own build is; the CPU kernel's work items
    # go through it). The runtime is the libgomp torch already loaded (same soname).
    openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
    cxx += openmp
    sources = sorted(glob.glob("ops/flexdma_ops.cpp")) + sorted(glob.glob("csrc/cpu/*.cpp"))
    with_cuda = _want_cuda()
    head_dims = _head_dims()
    archs = [a.strip() for a in os.environ.get("FLEXDMA_CUDA_ARCHS", "90").replace(",", ";").split(";") if a.strip()]
    if archs and not all(a == "90" for a in archs):
        dropped = [d for d in head_dims if d in WGMMA_ONLY_HEAD_DIMS]
        if dropped:
            print(
                f"flexdma: head dims {dropped} need an sm_90-only build (FLEXDMA_CUDA_ARCHS=90); "
                "they fall back at run time",
                file=sys.stderr,
            )
        head_dims = tuple(d for d in head_dims if d not in WGMMA_ONLY_HEAD_DIMS)
    _write_build_info(with_cuda, head_dims, archs, _pick_cxx())
    if not with_cuda:
        return [CppExtension("flexdma._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=openmp)]

    # The flags' one list (scripts/nvcc_flags.py): code generation, the archs' -gencode (sm_90 as
    # sm_90a; -DFLEXDMA_SM90A where every target is sm_90a) and the head dims' defines.
    nvcc = _nvcc_flags_module().nvcc_flags(archs, head_dims)
    nvcc += os.environ.get("FLEXDMA_NVCC_FLAGS", "").split()
    include_dirs = [str(ROOT / "csrc")]
    sources += ["ops/flexdma_cuda.cpp"] + sorted(glob.glob("csrc/cuda/*.cu")) + _instantiation_sources(head_dims)
    return [
        CUDAExtension(
            "flexdma._C",
            sources,
            include_dirs=include_dirs,
            extra_link_args=openmp,
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        )
    ]


def _cmdclass():
    from torch.utils.cpp_extension import BuildExtension

    class BuildExt(BuildExtension):
        def finalize_options(self):
            super().finalize_options()
            # setuptools gives an editable build a fresh temporary directory for the objects, so
            # every `pip install -e` (adding an extra, say) would recompile everything. Point it at
            # the one a regular build uses: ninja then recompiles only what changed (its depfiles
            # track the headers, its log the flags). Without ninja nothing tracks the headers, so
            # the temporary directory stays.
            if self.use_ninja and getattr(self, "editable_mode", False):
                build_base = self.get_finalized_command("build").build_base
                tag = f"{self.plat_name}-{sys.implementation.cache_tag}{getattr(sys, 'abiflags', '')}"
                self.build_temp = str(ROOT / build_base / f"temp.{tag}")

    class BuildPy(build_py):
        def run(self):
            # The build folder outlives a build and a wheel packs all of it: a module since deleted
            # from the source tree would still ship. Each build copies the package afresh.
            shutil.rmtree(Path(self.build_lib) / "flexdma", ignore_errors=True)
            super().run()

    return {"build_ext": BuildExt.with_options(use_ninja=True), "build_py": BuildPy}


def _require_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit(
            "flexdma's extension compiles against the torch it will run with, and this build environment "
            "has none: pip builds in an isolated environment of its own unless told not to. With torch "
            "installed (e.g. `pip install torch==2.13.0 setuptools wheel ninja`), build in the environment "
            'itself: `pip install --no-build-isolation -e .` (or `-e ".[hf]"`, or `.` without -e; '
            "README.md, Install)."
        )


# pip and setuptools run this file as __main__; tests load its functions under another name.
if __name__ == "__main__":
    _require_torch()
    setup(
        packages=find_packages(include=["flexdma", "flexdma.*"]),
        ext_modules=_extensions(),
        cmdclass=_cmdclass(),
    )
