"""Where a per-key call's time goes: torch.profiler over flash_dma_attention(keep_window_size=W)
(forward, and forward + backward), device kernels and host time side by side.

python -m scripts.dev.perkey_profile [--L 32768] [--D 128] [--W 2048] [--host]
--host: the host's time per call (calls issued back to back, no sync) against the GPU's, and
the Python functions that take it (cProfile).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import flexdma
from benchmarks.common import issue_time, print_profile

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--L", type=int, default=32768)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--W", type=int, default=2048)
    ap.add_argument("--host", action="store_true")
    a = ap.parse_args()
    q = torch.randn(1, a.L, 2, a.D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, a.L, 1, a.D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, a.L, 1, a.D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.exp(torch.randn(1, 1, 1, a.L, device="cuda")).to(torch.bfloat16).requires_grad_()

    def fwd():
        with torch.no_grad():
            return flexdma.flash_dma_attention(q, k, v, None, bias, is_causal=True, keep_window_size=a.W)

    def train():
        out = flexdma.flash_dma_attention(q, k, v, None, bias, is_causal=True, keep_window_size=a.W)
        return torch.autograd.grad(out, (q, k, v, bias), torch.ones_like(out))

    for name, fn in (("forward", fwd), ("forward+backward", train)):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        if a.host:
            n = 50
            host, wall = issue_time(fn, n)
            print(f"==== {name}: host {host * 1e3:.3f} ms a call, host + drain {wall * 1e3:.3f} ms a call")
            print_profile(fn, n, lines=18)
            continue
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
        print(f"==== {name} (10 calls)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
