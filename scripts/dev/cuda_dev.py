"""Quick timing of the CUDA kernels (torch.ops.flexdma.fwd / bwd) on the target shapes (forwards as
inference runs them: keep_resid=False; a training forward also stores out's rounding error):
B=1, H=2, KVH=1, D=128, bf16, causal, mask = top-W keys per row of the bias, 32K x 32K, with a
per-row bias (1,1,Q,K) and a per-key bias (1,1,1,K); and causal without mask or bias at 16K.
`model`: the model shapes B * L = 16K tokens, H=16, KVH=4 (L = 2K .. 16K; D=64 too at 8K), mask
(B, KVH, L, L) = top-L/4 of a bias (B, KVH, 1, L) per row, against FlexAttention (compiled, the
same mask and bias) and dense causal SDPA over all keys, in the same run.
Median of triton.testing.do_bench. Usage, from the repository root:
python -m scripts.dev.cuda_dev [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import triton.testing

import flexdma
from benchmarks.peers import FLEX_OPTION_SETS, compiled_flex

fwd = torch.ops.flexdma.fwd
bwd = torch.ops.flexdma.bwd


def top_w_mask(bias, Q, K, W):
    """(1, 1, Q, K) bool: the W largest causal (bottom-right) bias entries per query row."""
    return flexdma.create_mask(bias, W, is_causal=True, query_len=Q).expand(1, 1, Q, K)


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument(
        "--parts",
        default="fwd,bwd,nomask,decode",
        help="what to time, from fwd,bwd (the 32K rows), nomask, decode, model, modelfwd, maskbits: a variant that "
        "changes one kernel needs only its rows",
    )
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    dev, dt = "cuda", torch.bfloat16
    B, H, KVH, D, L, W = 1, 2, 1, 128, args.seqlen, args.window
    scale = 1.0 / math.sqrt(D)
    torch.manual_seed(0)
    q = torch.randn(B, L, H, D, device=dev, dtype=dt)
    k = torch.randn(B, L, KVH, D, device=dev, dtype=dt)
    v = torch.randn(B, L, KVH, D, device=dev, dtype=dt)
    dout = torch.randn(B, L, H, D, device=dev, dtype=dt)
    results = {
        "device": torch.cuda.get_device_name(),
        "seqlen": L,
        "window": W,
        "run_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "fwd_inference": True,  # forwards timed with keep_resid=False (what report.cuda_dev_section says)
    }

    for name, bshape in (("per_row", (1, 1, L, L)), ("per_key", (1, 1, 1, L))):
        if not parts & {"fwd", "bwd"}:
            break
        bias = torch.randn(bshape, device=dev, dtype=dt)
        mask = top_w_mask(bias, L, L, W)
        out, lse, resid = fwd(q, k, v, mask, bias, scale, True, 0.0, True)
        # The forward as the API runs it: tile activity bits computed from the mask (inside the op
        # when not given), then the kernel; the backward reuses the forward's bits.
        meta = torch.ops.flexdma.tile_meta(mask, L, L, True)
        results[f"{name}_tile_meta_ms"] = bench(lambda: torch.ops.flexdma.tile_meta(mask, L, L, True))
        if "fwd" in parts:
            results[f"{name}_fwd_ms"] = bench(
                lambda: fwd(q, k, v, mask, bias, scale, True, 0.0, True, keep_resid=False)
            )
        if "bwd" in parts:
            # The API's default (dQ added in arrival order) and the deterministic mode.
            for suffix, det in (("", False), ("_det", True)):
                results[f"{name}_bwd{suffix}_ms"] = bench(
                    lambda: bwd(dout, q, k, v, mask, bias, out, lse, scale, True, 0.0, True, det, meta, resid)
                )
        print(name, {k_: v_ for k_, v_ in results.items() if k_.startswith(name) and k_.endswith("_ms")}, flush=True)
        # Per-kernel split (forward, the backward's pre / main / post kernels, the op's torch glue).
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                o2, l2, r2 = fwd(q, k, v, mask, bias, scale, True, 0.0, True)
                bwd(dout, q, k, v, mask, bias, o2, l2, scale, True, 0.0, True, False, out_resid=r2)
                torch.cuda.synchronize()
            results[f"{name}_kernels_ms"] = {
                e.key[:60]: e.device_time_total / 1e3 for e in prof.key_averages() if e.device_time_total > 0
            }
            print(prof.key_averages().table(sort_by="device_time_total", row_limit=8), flush=True)
        except Exception as e:  # a profiler problem must not cost the timings
            print("profiler failed:", e, flush=True)
        del bias, mask, out, lse, resid
        torch.cuda.empty_cache()

    L2 = 16384
    if "nomask" in parts:
        q2, k2, v2 = (t[:, :L2].contiguous() for t in (q, k, v))
        results["nomask_causal_16k_fwd_ms"] = bench(
            lambda: fwd(q2, k2, v2, None, None, scale, True, 0.0, True, keep_resid=False)
        )
        qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q2, k2, v2))
        ks, vs = ks.expand(-1, H, -1, -1), vs.expand(-1, H, -1, -1)
        results["sdpa_causal_16k_fwd_ms"] = bench(
            lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        )
    # Decoding: one query, per-key bias, mask = top-W of the bias (broadcast over the query).
    for Kd in (4096, 65536, 524288) if "decode" in parts else ():
        kd = torch.randn(B, Kd, KVH, D, device=dev, dtype=dt)
        vd = torch.randn(B, Kd, KVH, D, device=dev, dtype=dt)
        bd = torch.randn(1, 1, 1, Kd, device=dev, dtype=dt)
        md = flexdma.create_mask(bd, W)
        qd = q[:, :1].contiguous()
        results[f"decode_{Kd}_fwd_ms"] = bench(
            lambda: fwd(qd, kd, vd, md, bd, scale, True, 0.0, True, keep_resid=False)
        )
        kds, vds = (t.transpose(1, 2).expand(-1, H, -1, -1) for t in (kd, vd))
        results[f"decode_{Kd}_dense_sdpa_ms"] = bench(
            lambda: torch.nn.functional.scaled_dot_product_attention(qd.transpose(1, 2), kds, vds)
        )
    if "maskbits" in parts:
        # The API's forward with a create_mask mask, whose tile activity bits come from what
        # create_mask knew (a per-key selection; a row-wise top-k's chunks), and with a copy of it,
        # whose bits the op computes from the mask's bytes. Keys maskbits[_per_row]_{selection|copy}.
        for tag, rows_b in (("", 1), ("_per_row", L)):
            bias = torch.randn(1, 1, rows_b, L, device=dev, dtype=dt)
            mask = flexdma.create_mask(bias, W, is_causal=True, query_len=L)
            for name, m in (("selection", mask), ("copy", mask.clone())):
                results[f"maskbits{tag}_{name}_fwd_ms"] = bench(
                    lambda: flexdma.flash_dma_attention(q, k, v, attn_mask=m, attn_bias=bias, is_causal=True)
                )
            del bias, mask
            torch.cuda.empty_cache()
    if "modelfwd" in parts:
        # flexdma's forward alone at the model shapes (no peers: a quick same-run comparison of builds).
        for L_m, D_m in ((2048, 128), (8192, 128), (8192, 64)):
            qm, km, vm, _, bm, mm = model_inputs(L_m, D_m)
            results[f"model_{L_m}_d{D_m}_flexdma_fwd_ms"] = bench(
                lambda: fwd(qm, km, vm, mm, bm, 1.0 / math.sqrt(D_m), True, 0.0, True, keep_resid=False)
            )
            del qm, km, vm, bm, mm
    if "model" in parts:
        results["model_flex_bias_grad"] = True  # what report.cuda_dev_section describes
        results["model_flex_option_sets"] = list(FLEX_OPTION_SETS)
        for L_m, D_m in ((2048, 128), (4096, 128), (8192, 128), (16384, 128), (8192, 64)):
            try:
                results.update(model_rows(L_m, D_m))
            except Exception as e:  # one shape's failure must not cost the others' rows
                results[f"model_{L_m}_d{D_m}_error"] = repr(e)[:300]
            print({k_: v_ for k_, v_ in results.items() if k_.startswith(f"model_{L_m}_d{D_m}")}, flush=True)
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


def model_inputs(L, D, H=16, KVH=4, tokens=16384):
    """q, k, v (requiring grad), dout, bias (B, KVH, 1, L) and mask (top-L/4 of the bias per row,
    causal) at one model shape, B = tokens // L."""
    B, dev, dt = tokens // L, "cuda", torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(B, L, H, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(B, L, KVH, D, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(B, L, KVH, D, device=dev, dtype=dt, requires_grad=True)
    dout = torch.randn(B, L, H, D, device=dev, dtype=dt)
    bias = torch.randn(B, KVH, 1, L, device=dev, dtype=dt)
    mask = flexdma.create_mask(bias, L // 4, is_causal=True, query_len=L)
    return q, k, v, dout, bias, mask


def model_rows(L, D, H=16, KVH=4, tokens=16384):
    """Forward and backward (fwd+bwd minus fwd) of flexdma's CUDA ops, FlexAttention and dense
    SDPA at one model shape; ms, keys model_{L}_d{D}_{peer}_{fwd|bwd}_ms."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, dev = tokens // L, "cuda"
    scale = 1.0 / math.sqrt(D)
    q, k, v, dout, bias, mask = model_inputs(L, D, H, KVH, tokens)
    G, key = H // KVH, f"model_{L}_d{D}"
    rows = {}

    def both(name, run):
        run(False)  # compiles (FlexAttention) outside the timed calls
        run(True)
        rows[f"{key}_{name}_fwd_ms"] = bench(lambda: run(False))
        rows[f"{key}_{name}_bwd_ms"] = bench(lambda: run(True)) - rows[f"{key}_{name}_fwd_ms"]

    meta = torch.ops.flexdma.tile_meta(mask, L, L, True)
    out, lse, resid = fwd(q, k, v, mask, bias, scale, True, 0.0, True)
    rows[f"{key}_flexdma_fwd_ms"] = bench(lambda: fwd(q, k, v, mask, bias, scale, True, 0.0, True, keep_resid=False))
    rows[f"{key}_flexdma_bwd_ms"] = bench(
        lambda: bwd(dout, q, k, v, mask, bias, out, lse, scale, True, 0.0, True, False, meta, resid)
    )

    qs, ks, vs = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))

    def sdpa(backward):
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        if backward:
            o.backward(dout.transpose(1, 2))

    both("sdpa", sdpa)
    flex = compiled_flex()
    # The bias gradient too, as flexdma's backward computes it (bias_requires_grad above); it is
    # what needs the small-block backward config.
    bias_g = bias.detach().clone().requires_grad_()
    block_mask = create_block_mask(
        lambda b, h, qi, ki: mask[b, h // G, qi, ki], B, H, L, L, device=dev, BLOCK_SIZE=128, _compile=True
    )

    def flex_run(options):
        def run(backward):
            o = flex(
                qs,
                ks,
                vs,
                score_mod=lambda sc, b, h, qi, ki: sc + bias_g[b, h // G, 0, ki],
                block_mask=block_mask,
                enable_gqa=True,
                kernel_options=options,
            )
            if backward:
                o.backward(dout.transpose(1, 2))

        return run

    # FlexAttention at its best: each option set timed, the fastest forward and training call kept
    # (the forward's and the backward's best may be different sets).
    for name, options in FLEX_OPTION_SETS.items():
        try:
            both(f"flexattn_{name}", flex_run(options))
        except Exception as e:  # a FlexAttention failure must not cost the other rows
            rows[f"{key}_flexattn_{name}_error"] = repr(e)[:300]
    for d in ("fwd", "bwd"):
        got = {n: rows[f"{key}_flexattn_{n}_{d}_ms"] for n in FLEX_OPTION_SETS if f"{key}_flexattn_{n}_{d}_ms" in rows}
        if got:
            rows[f"{key}_flexattn_{d}_ms"] = min(got.values())
    del q, k, v, mask, bias, out, lse, meta
    torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
