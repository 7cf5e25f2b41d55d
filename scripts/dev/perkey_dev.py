"""Kernel-level check and timing of the per-key top-W GPU path (no extension build needed).

python -m scripts.dev.perkey_dev --out results.json [--lengths 32768,131072] [--check]
Times selection, forward and backward (the C++ kernels where the route takes them, and the Triton ones)
against dense causal SDPA over all keys in the same run (do_bench medians), and with --check compares bf16 results against the
float64 reference at small shapes (FlashAttention's 2x rule).
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from flexdma import _dispatch, perkey
from flexdma.dense.naive import attention_ref
from flexdma.perkey import ops, route
from flexdma.perkey import triton as T


def _inputs(B, L, H, KVH, D, plane_heads, dtype=torch.bfloat16, grad=False):
    q = torch.randn(B, L, H, D, device="cuda", dtype=dtype, requires_grad=grad)
    k = torch.randn(B, L, KVH, D, device="cuda", dtype=dtype, requires_grad=grad)
    v = torch.randn(B, L, KVH, D, device="cuda", dtype=dtype, requires_grad=grad)
    bias = (torch.randn(B if plane_heads > 1 else 1, plane_heads, 1, L, device="cuda") * 2).to(dtype)
    return q, k, v, bias


def _route(q, k, v, bias, W, causal):
    """The call's route (flexdma/perkey/route.py), a backward following: the C++ kernels where they
    take it, else the Triton ones."""
    call = _dispatch.Call.of(q, k, v, None, bias, is_causal=causal, softcap=0.0, keep_window_size=W, requires_grad=True)
    return route.decide("cuda", call)


def _triton(r):
    # The Triton kernels on the route's lists (their tile rows suit both kernels).
    return r._replace(forward="triton", backward="triton")


def _select(q, bias, W, causal, r):
    sc = perkey.selection_scores(bias, None, q.shape[2])
    return perkey.Selection(*torch.ops.flexdma.perkey_select(sc, W, q.shape[1], causal, r.tile_rows))


def _fwd(r, q, k, v, bias, sel, scale, causal):
    return ops.run_forward(r, q, k, v, bias, sel.key_rank, sel.row_thr, scale, causal, 0.0, False, sel.tile_keys)


def _bwd(r, do, q, k, v, bias, sel, out, lse, res, scale, causal):
    args = (do, q, k, v, bias, *sel[:2], out, lse, scale, causal, 0.0, True, False, sel.tile_keys, res)
    return ops.run_backward(r, *args)


def check():
    rows = []
    for B, L, H, KVH, D, W, ph, causal in [
        (1, 1000, 2, 1, 128, 64, 1, True),
        (2, 777, 4, 2, 64, 100, 2, True),
        (1, 513, 4, 2, 128, 32, 4, False),
        (1, 600, 8, 2, 64, 700, 2, True),
    ]:
        q, k, v, bias = _inputs(B, L, H, KVH, D, ph)
        r = _route(q, k, v, bias, W, causal)
        sel = _select(q, bias, W, causal, r)
        km = perkey.keep_mask(sel, L, L, causal)
        scale = 1 / math.sqrt(D)
        do = torch.randn_like(q)
        out, lse, res = _fwd(r, q, k, v, bias, sel, scale, causal)
        dq, dk, dv, db = _bwd(r, do, q, k, v, bias, sel, out, lse, res, scale, causal)
        errs = {}
        for prec in (torch.float64, torch.bfloat16):
            ins = [t.detach().to(prec).requires_grad_() for t in (q, k, v, bias)]
            o, lse_r = attention_ref(*ins[:3], km, ins[3], is_causal=causal, softmax_scale=scale)
            (o.float() * do.float()).sum().backward()
            errs[prec] = (o, lse_r, *[t.grad for t in ins])
        ref, low = errs[torch.float64], errs[torch.bfloat16]
        res = {"shape": [B, L, H, KVH, D, W, ph, causal], "route": r.forward}
        ok = True
        for name, mine, r, lo in zip(("out", "lse", "dq", "dk", "dv", "dbias"), (out, lse, dq, dk, dv, db), ref, low):
            fin = torch.isfinite(r)
            e = (mine.double() - r.double())[fin].abs().max().item()
            e_lo = (lo.double() - r.double())[fin].abs().max().item()
            res[name] = [e, e_lo]
            ok &= e <= 2 * e_lo + 1e-4 + (1e-2 if name == "dbias" else 0) and bool(
                torch.isfinite(mine).all() or name == "lse"
            )
        res["ok"] = ok
        print(res, flush=True)
        rows.append(res)
    return rows


SWEEP = []


def bench(lengths, Ws, Ds, model=True):
    rows = []
    cfgs = [(1, L, 2, 1, D, W, 1) for L in lengths for W in Ws for D in Ds]
    if model:
        cfgs += [(2, 8192, 16, 4, 128, 2048, 4), (2, 8192, 16, 4, 128, 2048, 16)]
    for B, L, H, KVH, D, W, ph in cfgs:
        torch.cuda.empty_cache()
        q, k, v, bias = _inputs(B, L, H, KVH, D, ph)
        scale = 1 / math.sqrt(D)
        rt = _route(q, k, v, bias, W, True)
        sel = _select(q, bias, W, True, rt)
        r = {
            "B": B,
            "L": L,
            "H": H,
            "KVH": KVH,
            "D": D,
            "W": W,
            "plane_heads": ph,
            "list_mean": perkey.tile_lists(sel, L, rt.tile_rows)[..., 0].float().mean().item(),
            "list_max": perkey.tile_lists(sel, L, rt.tile_rows)[..., 0].max().item(),
            "cpp": rt.forward == "cuda",
        }
        tr = _triton(rt)
        r["select_ms"] = do_bench(lambda: _select(q, bias, W, True, rt), warmup=25, rep=100)
        r["fwd_ms"] = do_bench(lambda: _fwd(rt, q, k, v, bias, sel, scale, True), warmup=25, rep=100)
        # The Triton forward on the same lists, where the C++ one ran above.
        r["fwd_triton_ms"] = do_bench(lambda: _fwd(tr, q, k, v, bias, sel, scale, True), warmup=25, rep=100)
        out, lse, res = _fwd(rt, q, k, v, bias, sel, scale, True)
        do = torch.randn_like(q)
        r["bwd_ms"] = do_bench(lambda: _bwd(tr, do, q, k, v, bias, sel, out, lse, res, scale, True), warmup=10, rep=50)
        if r["cpp"]:
            r["bwd_cpp_ms"] = do_bench(
                lambda: _bwd(rt, do, q, k, v, bias, sel, out, lse, res, scale, True), warmup=10, rep=50
            )
            # The two backwards on the same call: the largest difference of each gradient,
            # relative to its largest magnitude.
            a = _bwd(rt, do, q, k, v, bias, sel, out, lse, res, scale, True)
            b = _bwd(tr, do, q, k, v, bias, sel, out, lse, res, scale, True)
            r["cpp_vs_triton_rel"] = [
                ((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-30)).item()
                for x, y in zip(a, b)
            ]
        for name, cfgs, fn in (
            ("fwd", T.FWD_CONFIG, lambda: _fwd(tr, q, k, v, bias, sel, scale, True)),
            ("bwd", T.BWD_CONFIG, lambda: _bwd(tr, do, q, k, v, bias, sel, out, lse, res, scale, True)),
        ):
            if not SWEEP:
                break
            keep = dict(cfgs)
            for cfg in SWEEP:
                cfgs.clear()
                cfgs.update(cfg)
                try:
                    r[f"{name}_sweep_{cfg['BN']}_{cfg['num_warps']}_{cfg['num_stages']}"] = do_bench(
                        fn, warmup=5, rep=30
                    )
                except Exception as e:  # e.g. out of shared memory
                    r[f"{name}_sweep_{cfg['BN']}_{cfg['num_warps']}_{cfg['num_stages']}"] = str(e)[:80]
            cfgs.clear()
            cfgs.update(keep)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        r["sdpa_fwd_ms"] = do_bench(
            lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True), warmup=10, rep=50
        )
        qg, kg, vg = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=True)
        g = torch.randn_like(o)
        r["sdpa_bwd_ms"] = do_bench(
            lambda: torch.autograd.grad(o, (qg, kg, vg), g, retain_graph=True), warmup=10, rep=50
        )
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        s2 = _select(q, k, bias, W, True)
        o2, l2, r2 = _fwd(q, k, v, bias, s2, scale, True)
        _bwd(do, q, k, v, bias, s2, o2, l2, r2, scale, True, True)
        r["extra_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        print(r, flush=True)
        rows.append(r)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--W", default="2048")
    ap.add_argument("--D", default="128")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--no-model", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time other launch configurations")
    ap.add_argument("--check-only", action="store_true", help="only the checks (e.g. under compute-sanitizer)")
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if a.sweep:
        SWEEP.extend(dict(BN=bn, num_warps=w, num_stages=st) for bn in (64, 128) for w in (4, 8) for st in (2, 3))
    if a.check:
        res["check"] = check()
    if a.check_only:
        raise SystemExit(0 if all(r["ok"] for r in res.get("check", [])) else 1)
    res["bench"] = bench(
        [int(x) for x in a.lengths.split(",")],
        [int(x) for x in a.W.split(",")],
        [int(x) for x in a.D.split(",")],
        model=not a.no_model,
    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
