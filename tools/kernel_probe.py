"""Runs one flexdma CUDA op call of a named case twice (warm-up, then the call a profiler
attaches to): `python3 tools/kernel_probe.py nomask16k|perrow32k|perkey32k|bwd8k|small|decode [D]`
(small: 333 queries x 333 keys, forward and backward, for compute-sanitizer).
B=1, H=2, KVH=1, D=128, bf16, causal; masks are top-1024 of the bias per row."""
import math
import sys

import torch

import flexdma  # noqa: F401
from benchmarks.cuda_dev import top_w_mask


def main(case):
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    L = {"nomask16k": 16384, "perrow32k": 32768, "perkey32k": 32768, "bwd8k": 8192, "small": 333, "decode": 5000}[case]
    D = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    q = torch.randn(1, L, 2, D, device=dev, dtype=dt)
    k = torch.randn(1, L, 1, D, device=dev, dtype=dt)
    v = torch.randn(1, L, 1, D, device=dev, dtype=dt)
    mask = bias = None
    if case in ("perrow32k", "bwd8k", "small"):
        bias = torch.randn(1, 1, L, L, device=dev, dtype=dt)
        mask = top_w_mask(bias, L, L, 1024 if L > 1024 else L // 3)
    elif case == "decode":  # one query: key splits and the empty-tile scan
        bias = torch.randn(1, 1, 1, L, device=dev, dtype=dt)
        mask = top_w_mask(bias, L, L, 50)[:, :, -1:]
        q = q[:, -1:].contiguous()
    elif case == "perkey32k":
        bias = torch.randn(1, 1, 1, L, device=dev, dtype=dt)
        mask = top_w_mask(bias, L, L, 1024)
    scale = 1.0 / math.sqrt(D)
    for _ in range(2):
        out, lse = torch.ops.flexdma.fwd(q, k, v, mask, bias, scale, True, 0.0, True)
        if case in ("bwd8k", "small"):
            torch.ops.flexdma.bwd(torch.randn_like(out), q, k, v, mask, bias, out, lse, scale, True, 0.0, True, True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1])
