"""The nvcc flags of the CUDA kernels: the one list that setup.py (the extension), the compile
test (tests/test_cuda_compile.py) and the SASS comparison (scripts/gpu/sass_compare.py) build
with, so that what the tests compile is what the extension runs. Torch-free and import-free:
setup.py loads it by path before torch is imported.

    nvcc_flags(archs, head_dims)   the flags of a build for those archs and head dims
"""

# Code generation and language flags of every kernel file.
BASE = [
    "-O3",
    "-std=c++17",
    "--use_fast_math",
    "--expt-relaxed-constexpr",
    "-lineinfo",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
]


def gencode(archs):
    """-gencode per arch ("90", "80", ...), sm_90 as sm_90a (wgmma needs the arch-specific target);
    -DFLEXDMA_SM90A where every target is sm_90a (the wgmma paths are compiled only then)."""
    flags = []
    for a in archs:
        arch = a + "a" if a in ("90",) else a
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    if archs and all(a == "90" for a in archs):
        flags.append("-DFLEXDMA_SM90A")
    return flags


def head_dim_defines(head_dims):
    """-DFLEXDMA_HEAD_DIM_<d> of the head dims a build compiles (csrc/cuda/head_dims.h)."""
    return [f"-DFLEXDMA_HEAD_DIM_{d}" for d in head_dims]


def nvcc_flags(archs=("90",), head_dims=(64, 128)):
    """Every nvcc flag of a kernel build, in setup.py's order (extra flags go after them)."""
    return BASE + gencode(list(archs)) + head_dim_defines(head_dims)
