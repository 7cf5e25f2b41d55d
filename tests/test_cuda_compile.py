"""The CUDA sources compile for sm_90a without a GPU (nvcc only; skipped where nvcc is missing),
and the kernels whose speed depends on it keep every value in registers: a spill that creeps in
through a change (the backward sits at the 255-register limit) fails here before any GPU time is
spent. The kernels are torch-free, so this needs no CUDA build of torch."""

import glob
import os
import re
import shutil
import subprocess

import pytest

from scripts import nvcc_flags as NVCC_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = shutil.which("nvcc")


# setup.py's flags (scripts/nvcc_flags.py) for an sm_90a build of head dims 64 / 128.
FLAGS = NVCC_FLAGS.nvcc_flags(("90",), (64, 128)) + ["-I", os.path.join(ROOT, "csrc")]

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")


def _nvcc(src, tmp_path, link=False, flags=FLAGS):
    out = tmp_path / (os.path.basename(src) + (".bin" if link else ".o"))
    cmd = [NVCC, *flags, "-Xptxas", "-v", os.path.join(ROOT, src), "-o", str(out)]
    if not link:
        cmd.insert(1, "-c")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"nvcc {src} failed:\n{proc.stderr[-4000:]}"
    return proc.stderr


def _spills(ptxas_log):
    """{kernel: spill-store bytes} from ptxas -v output."""
    spills, name = {}, None
    for line in ptxas_log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and name:
            spills[name] = int(m.group(1))
    return spills


def _instantiations(dims):
    """The launchers' instantiation files of the head dims (csrc/cuda/instantiations/), as setup.py takes them."""
    return [
        os.path.relpath(f, ROOT)
        for d in dims
        for f in sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "instantiations", f"*_hdim{d}_*.cu")))
    ]


def _packed(kernel):
    """Whether a mangled kernel name is a packed-sequence instantiation of the dense kernels
    (PackedSequenceKeys: the warp-specialized forward and bwd_kernel; fwd_kernel with kPacked)."""
    return "SequenceKeysOfILb1E" in kernel or re.search(r"(fwd|bwd)_kernelI.*Lb1EEEv", kernel) is not None


# Spills measured and kept (kernel name pattern -> most bytes ptxas may spill there). The per-key
# backward at D = 128 holds the next piece's S in flight beside dQ and the piece product's rows
# during the reductions: ptxas (CUDA 13.0) spills four values there, two loads a piece, a cost the
# early S more than pays for (benchmarks/perf-log.md, 'Change: the per-key backward issues the next piece's S
# before this piece's reductions'). Any other spill, or more bytes
# there, fails.
KNOWN_SPILLS = {r"perkey_bwd_kernelI\w+Li128E": 16}


def _allowed(kernel):
    return max([b for pat, b in KNOWN_SPILLS.items() if re.search(pat, kernel)], default=0)


@pytest.mark.parametrize(
    "src",
    _instantiations((64, 128)) + ["csrc/cuda/tile_meta.cu", "csrc/cuda/perkey_select.cu", "csrc/cuda/decode_step.cu"],
)
def test_kernels_compile_without_spills(src, tmp_path):
    log = _nvcc(src, tmp_path)
    spills = _spills(log)
    assert spills, "ptxas reported no kernels"
    over = {k: v for k, v in spills.items() if v > _allowed(k)}
    assert not over, f"register spills: {over}"
    _assert_wgmma_not_serialised(log)


def test_known_spills_name_a_kernel(tmp_path):
    # Each allowance names a kernel the build compiles (a renamed kernel would leave it unused), and
    # only that one: the per-key backward at D = 64 and the other backward stay at zero.
    kernels = _spills(_nvcc("csrc/cuda/instantiations/bwd_hdim128_bf16.cu", tmp_path))
    for pat in KNOWN_SPILLS:
        assert any(re.search(pat, k) for k in kernels), f"{pat} names no kernel of {sorted(kernels)}"
    assert (
        _allowed(
            "_ZN7flexdma4cuda17perkey_bwd_kernelI13__nv_bfloat16Li64ENS0_10ListedKeysENS0_19SingleTileSchedulerEEEvNS_9BwdParamsE"
        )
        == 0
    )
    assert (
        _allowed(
            "_ZN7flexdma4cuda10bwd_kernelI13__nv_bfloat16Li128ELi0ENS0_14SequenceKeysOfILb0EEENS0_16KeyTileSchedulerEEEvNS_9BwdParamsE"
        )
        == 0
    )


def _assert_wgmma_not_serialised(log):
    # ptxas serialises every wgmma of a kernel where its pipeline crosses a call (an assert, a
    # printf) and only says so in this note: the forward's S / P.V overlap would be gone.
    serial = [line for line in log.splitlines() if "C7510" in line]
    assert not serial, "wgmma serialised:\n" + "\n".join(serial)


@pytest.mark.parametrize("src", _instantiations((192, 256)))
def test_wide_head_dims_compile(src, tmp_path):
    # Head dims 192 / 256 hold D / 2 accumulator floats a thread next to the score tiles: a few
    # dozen spilled bytes are known (ptxas, CUDA 13.0; up to 168 in the packed backward's dK pass);
    # a change that spills hundreds fails here.
    wide = NVCC_FLAGS.nvcc_flags(("90",), (192, 256)) + ["-I", os.path.join(ROOT, "csrc")]
    log = _nvcc(src, tmp_path, flags=wide)
    spills = _spills(log)
    kernel = "fwd_kernel" if os.path.basename(src).startswith("fwd") else "bwd_kernel"
    assert any(kernel in k for k in spills), f"expected the {kernel}, ptxas reported {sorted(spills)}"
    over = {k: v for k, v in spills.items() if v > (2 * 128 if _packed(k) else 128)}
    assert not over, f"register spills: {over}"
    _assert_wgmma_not_serialised(log)


def test_dispatch_compiles(tmp_path):
    _nvcc("csrc/cuda/flash_dma_cuda.cu", tmp_path)


@pytest.mark.parametrize("src", ["tests/cuda/wgmma_probe.cu"])
def test_probes_build(src, tmp_path):
    # The probes run on a GPU machine; here they must at least build against the current headers.
    _nvcc(src, tmp_path, link=True)
