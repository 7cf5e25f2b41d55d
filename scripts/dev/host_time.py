"""do_bench medians of eager per-key calls (the forward without grad, the training call) at the
shapes a call's host time bounds (8K and 16K at D = 128, 8K at D = 64; B=1 H=2 KVH=1 W=2048), as
one JSON line tagged TAG. The host's speed moves these by up to 2x between runs, so an A/B of a
host-side change runs this in processes alternating between the two trees, several times each,
and compares the medians.

python -m scripts.dev.host_time TAG
"""

from __future__ import annotations

import json
import sys

import torch

import flexdma
from benchmarks.perkey import _inputs, _time


def main() -> None:
    res = {}
    for L, D in ((8192, 128), (16384, 128), (8192, 64)):
        # The topk bench's inputs and timing (its B=1 H=2 KVH=1 rows).
        q, k, v, bias = _inputs(dict(B=1, Q=L, L=L, H=2, KVH=1, D=D, bias_heads=1), grad=True)

        def fwd():
            with torch.no_grad():
                return flexdma.flash_dma_attention(q, k, v, None, bias, is_causal=True, keep_window_size=2048)

        def train():
            out = flexdma.flash_dma_attention(q, k, v, None, bias, is_causal=True, keep_window_size=2048)
            return torch.autograd.grad(out, (q, k, v, bias), torch.ones_like(out))

        for name, f in (("fwd", fwd), ("train", train)):
            f()
            torch.cuda.synchronize()
            res[f"L={L // 1024}K D={D} {name}"] = _time(f)
    print(json.dumps(dict(tag=sys.argv[1] if len(sys.argv) > 1 else "", ms=res)))


if __name__ == "__main__":
    main()
