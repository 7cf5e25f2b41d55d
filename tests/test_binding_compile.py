"""The CUDA binding (ops/flexdma_cuda.cpp: the ops' CUDA kernels, the per-key support check's entry)
compiles as setup.py builds it, without a GPU or a CUDA build of torch: the host compiler on torch's
headers (a CPU build of torch ships its CUDA headers too) and the CUDA toolkit's; skipped where the
compiler or the toolkit is missing. tests/test_cuda_compile.py compiles the kernels themselves.

torch's CUDA headers include those of cuBLAS, cuSPARSE and cuSOLVER, which a toolkit installed
without those libraries lacks, and a header torch's CUDA build generates: the binding uses none of
their declarations, so where one is missing the test declares the few types torch's headers name."""

import os
import shutil
import subprocess
import sysconfig

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CXX = shutil.which("c++") or shutil.which("g++")


def _cuda_home():
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h")):
            return home
    return None


CUDA_HOME = _cuda_home()
pytestmark = pytest.mark.skipif(CXX is None or CUDA_HOME is None, reason="needs a C++ compiler and a CUDA toolkit")

# Header -> what torch's headers need of it, for a toolkit (or a CPU torch) without it.
_STAND_INS = {
    "cusparse.h": "typedef struct cusparseContext* cusparseHandle_t;\ntypedef int cusparseStatus_t;\n",
    "cublas_v2.h": "typedef struct cublasContext* cublasHandle_t;\ntypedef int cublasStatus_t;\n",
    "cublasLt.h": "typedef struct cublasLtContext* cublasLtHandle_t;\n",
    "cusolverDn.h": "typedef struct cusolverDnContext* cusolverDnHandle_t;\n",
    "cusolver_common.h": "typedef int cusolverStatus_t;\n",
    "c10/cuda/impl/cuda_cmake_macros.h": "",
}


def test_cuda_binding_compiles(tmp_path):
    torch_inc = os.path.join(os.path.dirname(torch.__file__), "include")
    found = [os.path.join(CUDA_HOME, "include"), torch_inc]
    for name, text in _STAND_INS.items():
        if not any(os.path.exists(os.path.join(d, name)) for d in found):
            path = tmp_path / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    includes = [
        torch_inc,
        os.path.join(torch_inc, "torch", "csrc", "api", "include"),
        os.path.join(CUDA_HOME, "include"),
        sysconfig.get_paths()["include"],
        os.path.join(ROOT, "csrc"),
        str(tmp_path),
    ]
    cmd = [CXX, "-std=c++17", "-fsyntax-only", "-Wall", *(f"-I{d}" for d in includes)]
    cmd += ["-DTORCH_API_INCLUDE_EXTENSION_H", os.path.join(ROOT, "ops", "flexdma_cuda.cpp")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"ops/flexdma_cuda.cpp does not compile:\n{proc.stderr[-4000:]}"
    ours = [line for line in proc.stderr.splitlines() if "warning" in line and line.startswith(("ops/", ROOT))]
    assert not ours, "\n".join(ours)
