"""do_bench medians of eager per-key calls (the forward without grad, the training call) at the
shapes a call's host time bounds (8K and 16K at D = 128, 8K at D = 64; B=1 H=2 KVH=1 W=2048), as
one JSON line tagged TAG. The host's speed moves these by up to 2x between runs, so an A/B of a
host-side change runs this in processes alternating between the two trees, several times each,
and compares the medians.

python -m benchmarks.dev.host_time TAG
"""

from __future__ import annotations

import json
import sys

import torch
from triton.testing import do_bench

import flexdma


def main() -> None:
    torch.manual_seed(0)
    res = {}
    for L, D in ((8192, 128), (16384, 128), (8192, 64)):
        q = torch.randn(1, L, 2, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, L, 1, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, L, 1, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        bias = torch.exp(torch.randn(1, 1, 1, L, device="cuda")).bfloat16().requires_grad_(True)

        def fwd():
            with torch.no_grad():
                return flexdma.flash_dma_attention(q, k, v, None, bias, is_causal=True, keep_window_size=2048)

        def train():
            out = flexdma.flash_dma_attention(q, k, v, None, bias, is_causal=True, keep_window_size=2048)
            return torch.autograd.grad(out, (q, k, v, bias), torch.ones_like(out))

        for name, f in (("fwd", fwd), ("train", train)):
            f()
            torch.cuda.synchronize()
            res[f"L={L // 1024}K D={D} {name}"] = do_bench(f, warmup=25, rep=100, return_mode="median")
    print(json.dumps(dict(tag=sys.argv[1] if len(sys.argv) > 1 else "", ms=res)))


if __name__ == "__main__":
    main()
