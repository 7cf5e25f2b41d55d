"""do_bench medians (ms) of the dense backward op alone (torch.ops.flexdma.bwd: its pre kernel, the
main pass bwd_kernel and the dQ conversion) at B=1 H=2 KVH=1, bf16, causal, head dims 128 / 64,
L = 8K / 32K, as one JSON line tagged TAG. Two cases a shape:
  bias: a per-key bias (B, KVH, 1, L) whose gradient is wanted, no mask;
  mask: the same bias and gradient, and a random bool mask (B, KVH, L, L) keeping half the keys
        (every tile active, so the walk visits every causal item and gathers keep and bias).
The forward's out / lse / residual come from one forward call per case; the tile activity bits
are computed once and handed in, as the API does. An A/B of a kernel change runs this once per
build (one process each) and compares the medians.

python -m scripts.dev.dense_bwd_time TAG
"""

from __future__ import annotations

import json
import math
import sys

import torch

import flexdma  # noqa: F401  (registers torch.ops.flexdma)

SHAPES = ((8192, 128), (32768, 128), (8192, 64), (32768, 64))
CASES = ("bias", "mask")


def case_inputs(L: int, D: int, case: str, gen: torch.Generator) -> dict:
    dev, dt = "cuda", torch.bfloat16
    B, H, KVH = 1, 2, 1
    q = torch.randn(B, L, H, D, device=dev, dtype=dt, generator=gen)
    k = torch.randn(B, L, KVH, D, device=dev, dtype=dt, generator=gen)
    v = torch.randn(B, L, KVH, D, device=dev, dtype=dt, generator=gen)
    bias = torch.randn(B, KVH, 1, L, device=dev, dtype=dt, generator=gen)
    mask = meta = None
    if case == "mask":
        mask = torch.rand(B, KVH, L, L, device=dev, generator=gen) < 0.5
        meta = torch.ops.flexdma.tile_meta(mask, L, L, True)
    return dict(q=q, k=k, v=v, bias=bias, mask=mask, meta=meta, dout=torch.randn_like(q))


def time_bwd(x: dict, D: int) -> float:
    from triton.testing import do_bench

    scale = 1.0 / math.sqrt(D)
    q, k, v, mask, bias, meta = x["q"], x["k"], x["v"], x["mask"], x["bias"], x["meta"]
    out, lse, resid = torch.ops.flexdma.fwd(q, k, v, mask, bias, scale, True, 0.0, False, tile_meta=meta)

    def bwd():
        return torch.ops.flexdma.bwd(
            x["dout"], q, k, v, mask, bias, out, lse, scale, True, 0.0, True, False, tile_meta=meta, out_resid=resid
        )

    dq, dk, dv, dbias = bwd()
    if not all(bool(t.isfinite().all()) for t in (dq, dk, dv, dbias)):
        raise RuntimeError(f"non-finite gradient at D={D} L={q.shape[1]}")
    return do_bench(bwd, warmup=25, rep=100, return_mode="median")


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("dense_bwd_time needs a CUDA device")
    gen = torch.Generator("cuda").manual_seed(0)
    res = {}
    for L, D in SHAPES:
        for case in CASES:
            x = case_inputs(L, D, case, gen)
            res[f"L={L // 1024}K D={D} {case}"] = round(time_bwd(x, D), 4)
            del x
            torch.cuda.empty_cache()
    print(json.dumps(dict(tag=sys.argv[1] if len(sys.argv) > 1 else "", device=torch.cuda.get_device_name(), ms=res)))


if __name__ == "__main__":
    main()
