"""`python -m flexdma`: versions, backends, and a forward+backward self-check against the reference."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from typing import List, Optional

import torch

import flexdma
from flexdma import _ext


def _self_check(device: torch.device) -> bool:
    g = torch.Generator(device="cpu").manual_seed(0)
    B, Q, K, H, KVH, D = 2, 97, 131, 4, 2, 64
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device)

    q, k, v = rnd(B, Q, H, D), rnd(B, K, KVH, D), rnd(B, K, KVH, D)
    bias = rnd(B, KVH, 1, K)
    mask = flexdma.create_mask(bias, 48, is_causal=True, query_len=Q)
    dout = rnd(B, Q, H, D)
    ok = True
    results = {}
    for name, dt in (("ref64", torch.float64), ("lowp_ref", dtype), ("flexdma", dtype)):
        ins = [t.to(dt).requires_grad_() for t in (q, k, v, bias)]
        backend = "auto" if name == "flexdma" else "reference"
        out = flexdma.flash_dma_attention(*ins[:3], mask, ins[3], is_causal=True, backend=backend)
        grads = torch.autograd.grad(out, ins, dout.to(dt))
        results[name] = [out.double()] + [x.double() for x in grads]
    labels = ("out", "dq", "dk", "dv", "dbias")
    for i, label in enumerate(labels):
        ref, low, got = results["ref64"][i], results["lowp_ref"][i], results["flexdma"][i]
        err, base = (got - ref).abs().max().item(), (low - ref).abs().max().item()
        tol = 2 * base + {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 1e-3) * max(1.0, ref.abs().max().item())
        good = err <= tol and torch.isfinite(got).all().item()
        ok &= good
        print(f"  {label:6s} max err {err:.2e}  (tolerance {tol:.2e})  {'ok' if good else 'MISMATCH'}")
    return ok


def build_report() -> List[str]:
    """What this install contains, as its build recorded it (flexdma/_build_info.py, written by
    setup.py): the torch it compiled against, the CPU kernels, the CUDA kernels' head dims and GPU
    code, and whether Triton (the per-key CUDA kernels, FlexAttention's GPU kernels) is there."""
    info = _ext.BUILD_INFO
    lines = []
    if info is None:
        lines.append("build: no build record (flexdma/_build_info.py): setup.py never ran for this copy")
    else:
        built_for = getattr(info, "TORCH_VERSION", None)
        lines.append(f"build: compiled against torch {built_for}" if built_for else "build:")
    if _ext.LOAD_ERROR is not None:
        lines.append(f"  CPU and CUDA kernels: unavailable: {_ext.LOAD_ERROR}")
    else:
        lines.append("  CPU kernels: yes")
        if _ext.with_cuda():
            code = ", ".join(getattr(info, "CUDA_CODE", ())) or "sm_" + "/".join(info.CUDA_ARCHS)
            cuda = f", CUDA {info.TORCH_CUDA}" if getattr(info, "TORCH_CUDA", None) else ""
            dims = ", ".join(str(d) for d in info.CUDA_HEAD_DIMS)
            lines.append(
                f"  CUDA kernels: head dims {dims} for {code}{cuda} (other head dims and GPUs fall back to "
                "FlexAttention)"
            )
        else:
            lines.append("  CUDA kernels: not built (torch without CUDA, no nvcc, or FLEXDMA_SKIP_CUDA=1 at build)")
    if _ext.HAVE_TRITON:
        try:
            version = importlib.metadata.version("triton")
        except importlib.metadata.PackageNotFoundError:  # importable, but not installed by pip
            version = "found"
        lines.append(f"  Triton: {version}")
    else:
        lines.append("  Triton: not installed (the per-key CUDA kernels and FlexAttention on the GPU need it)")
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    argparse.ArgumentParser(
        prog="python -m flexdma",
        description="Print the flexdma, torch and CUDA versions and the available backends, then run a "
        "forward + backward self-check of the default backend against the float64 reference "
        "(on the GPU when there is one). Exit status 1 on a mismatch.",
    ).parse_args(argv)
    print(f"flexdma {flexdma.__version__} ({os.path.dirname(flexdma.__file__)})")
    print(
        f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}, "
        f"GPU: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}"
    )
    print("\n".join(build_report()))
    print(f"backends: {', '.join(flexdma.available_backends())}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"self-check on {device} (forward + backward vs the float64 reference):")
    ok = _self_check(device)
    print("self-check passed" if ok else "self-check FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
