"""Measures flexdma's FlexAttention backend with each kernel option set the
benchmarks' peers try (benchmarks.peers.FLEX_OPTION_SETS) at one model shape per head dim, through
`flash_dma_attention(..., backend="flex")` itself, and prints the table flex.MEASURED_OPTIONS is
filled from. A training call is forward + backward with a (B, KVH, 1, L) bias that needs a
gradient (top-W general mask from create_mask); an inference call is the forward without grad.
The bias gradient of each option set is compared with the defaults' (they must agree).

Usage, from the repository root:
python -m scripts.dev.flex_options [--dims 64,128,256] [--dtype bf16] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton.testing

import flexdma
from benchmarks.peers import FLEX_OPTION_SETS
from flexdma import _device
from flexdma.dense import flex

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def inputs(B, L, H, KVH, D, W, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (
        torch.randn(B, L, h, D, device="cuda", dtype=dtype, generator=g, requires_grad=True) for h in (H, KVH, KVH)
    )
    bias = torch.randn(B, KVH, 1, L, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    mask = flexdma.create_mask(bias.detach(), W, is_causal=True, query_len=L)
    dout = torch.randn(B, L, H, D, device="cuda", dtype=dtype, generator=g)
    return q, k, v, bias, mask, dout


def measure(D, dtype, B, L, H, KVH, W):
    q, k, v, bias, mask, dout = inputs(B, L, H, KVH, D, W, dtype)
    cap = _device.device_capability(q.device)
    rows, dbias = {}, {}
    for training in (False, True):
        for name, opts in FLEX_OPTION_SETS.items():
            key = f"{'train' if training else 'fwd'}_{name}"
            key_ = (cap, D, dtype.itemsize, training)
            flex.MEASURED_OPTIONS[key_] = opts
            # flexdma replaces defaults whose forward does not fit: that must show as this set's failure.
            flex._DEFAULTS_FAILED.discard(key_)
            try:
                t0 = time.perf_counter()
                if training:

                    def call():
                        out = flexdma.flash_dma_attention(q, k, v, mask, bias, is_causal=True, backend="flex")
                        return torch.autograd.grad(out, (q, k, v, bias), dout)

                    dbias[name] = call()[3].float()
                else:

                    def call():
                        with torch.no_grad():
                            return flexdma.flash_dma_attention(q, k, v, mask, bias, is_causal=True, backend="flex")

                    call()
                torch.cuda.synchronize()
                if key_ in flex._DEFAULTS_FAILED:
                    raise RuntimeError("the defaults do not fit (flexdma fell back to other options)")
                rows[f"{key}_compile_s"] = round(time.perf_counter() - t0, 1)
                rows[f"{key}_ms"] = bench(call)
            except Exception as e:  # a set that does not fit is a result
                rows[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(D, key, rows.get(f"{key}_ms", rows.get(f"{key}_error")), flush=True)
            torch.cuda.empty_cache()
        flex.MEASURED_OPTIONS.pop((cap, D, dtype.itemsize, training), None)
    if "defaults" in dbias:
        ref = dbias["defaults"]
        for name, g in dbias.items():
            rows[f"dbias_rel_vs_defaults_{name}"] = float((g - ref).abs().max() / ref.abs().max())
    best = {}
    for training in ("fwd", "train"):
        ok = {n: rows[f"{training}_{n}_ms"] for n in FLEX_OPTION_SETS if f"{training}_{n}_ms" in rows}
        best[training] = min(ok, key=ok.get) if ok else None
    rows["best"] = best
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--shape", default="2,8192,16,4", help="B,L,H,KVH")
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    B, L, H, KVH = (int(x) for x in args.shape.split(","))
    dtype = DTYPES[args.dtype]
    doc = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        shape=dict(B=B, L=L, H=H, KVH=KVH, W=args.window, dtype=args.dtype),
        rows={},
    )
    for D in (int(d) for d in args.dims.split(",")):
        doc["rows"][D] = measure(D, dtype, B, L, H, KVH, args.window)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=1)
    print(json.dumps(doc, indent=1))
    print("best (head dim: inference, training):", {D: r["best"] for D, r in doc["rows"].items()})


if __name__ == "__main__":
    main()
