"""GPU check of the FlexAttention backend at the seed's benchmark shape.

B=1, H=2, KVH=1, D=128, bf16, causal, Q=K=32768, per-row bias (1,1,Q,K), mask = top-W (W=1024)
of the causally visible bias per row. Times (median of triton.testing.do_bench):
  - BlockMask construction from the dense mask (ours) vs create_block_mask;
  - flexdma's flex forward / backward (dq, dk, dv, dbias) vs a hand-written compiled
    flex_attention (score_mod indexing the bias, create_block_mask BlockMask), same kernel_options;
  - optionally a few backward kernel_options candidates.
Writes JSON to the path given by --out. Run from the repository root:
`python -m scripts.dev.flex_check --out flex.json [--sweep]`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from triton.testing import do_bench

from flexdma import create_mask
from flexdma.dense import flex


def build_inputs(Q, K, W, device="cuda", dtype=torch.bfloat16):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, Q, 2, 128, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, K, 1, 128, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, K, 1, 128, device=device, dtype=dtype, generator=g)
    bias = torch.randn(1, 1, Q, K, device=device, dtype=dtype, generator=g)
    mask = create_mask(bias, W, is_causal=True)
    return q, k, v, bias, mask


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--sweep", action="store_true", help="also time backward kernel_options candidates")
    args = ap.parse_args()
    Q = K = args.seqlen
    res = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        Q=Q,
        K=K,
        W=args.window,
        B=1,
        H=2,
        KVH=1,
        D=128,
        dtype="bfloat16",
        causal=True,
        bias="per-row (1,1,Q,K)",
    )
    q, k, v, bias, mask = build_inputs(Q, K, args.window)
    res["mask_density"] = mask.float().mean().item()
    scale = 128**-0.5

    # (a) BlockMask construction.
    res["blockmask_ours_ms"] = do_bench(lambda: flex.block_mask_from_dense(mask, Q, K, 2, True, mask_mod=None))

    def cbm_mod(b, h, qi, ki):
        return mask[0, 0, qi, ki] & (ki <= qi)

    res["blockmask_create_block_mask_ms"] = do_bench(lambda: create_block_mask(cbm_mod, 1, 1, Q, K, device="cuda"))

    # (b) forward / backward: ours.
    def ours_fwd():
        return flex.flex_dma_attention(q, k, v, mask, bias, is_causal=True, softmax_scale=scale, softcap=0.0)

    with torch.no_grad():
        t0 = time.time()
        ours_fwd()
        torch.cuda.synchronize()
        res["ours_fwd_first_call_s"] = time.time() - t0
        res["ours_fwd_ms"] = do_bench(ours_fwd)
        # Where the forward time goes: BlockMask tensors vs the compiled FlexAttention call.
        # Inference: the kv side only, as flex_dma_attention builds it without grad.
        tensors = flex._block_tensors(mask, Q, K, 2, True, need_q=False)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        attend = flex._compiled()
        res["ours_block_tensors_ms"] = do_bench(lambda: flex._block_tensors(mask, Q, K, 2, True, need_q=False))
        res["ours_attend_only_ms"] = do_bench(
            lambda: attend(qt, kt, vt, mask, bias, tensors, Q, K, True, scale, 0.0, None, True)
        )
    qg, kg, vg, bg = (t.detach().clone().requires_grad_(True) for t in (q, k, v, bias))
    out, _ = flex.flex_dma_attention(qg, kg, vg, mask, bg, is_causal=True, softmax_scale=scale, softcap=0.0)
    dout = torch.randn_like(out)
    t0 = time.time()
    torch.autograd.grad(out, (qg, kg, vg, bg), dout, retain_graph=True)
    torch.cuda.synchronize()
    res["ours_bwd_first_call_s"] = time.time() - t0
    res["ours_bwd_ms"] = do_bench(lambda: torch.autograd.grad(out, (qg, kg, vg, bg), dout, retain_graph=True))
    # The forward of a training step: grad-requiring inputs, the backward's kernel_options, the q
    # side of the BlockMask too.
    res["ours_train_fwd_ms"] = do_bench(
        lambda: flex.flex_dma_attention(qg, kg, vg, mask, bg, is_causal=True, softmax_scale=scale, softcap=0.0)
    )
    opts = flex.kernel_options(q.device, q.shape[-1], q.dtype, True)
    res["kernel_options"] = opts

    # (b) baseline: hand-written compiled flex_attention.
    bm = create_block_mask(cbm_mod, 1, 1, Q, K, device="cuda")
    compiled = torch.compile(flex_attention, dynamic=False)

    def run_base(qh, kh, vh, b, options):
        def score_mod(s, bb, h, qi, ki):
            return s + b[0, 0, qi, ki]

        return compiled(
            qh, kh, vh, score_mod=score_mod, block_mask=bm, scale=scale, enable_gqa=True, kernel_options=options
        )

    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    with torch.no_grad():
        run_base(qh, kh, vh, bias, None)
        res["baseline_fwd_ms"] = do_bench(lambda: run_base(qh, kh, vh, bias, None))
    qb, kb, vb, bb = (t.detach().clone().requires_grad_(True) for t in (qh, kh, vh, bias))
    ob = run_base(qb, kb, vb, bb, opts)
    res["baseline_train_fwd_ms"] = do_bench(lambda: run_base(qb, kb, vb, bb, opts))
    dob = dout.transpose(1, 2)
    torch.autograd.grad(ob, (qb, kb, vb, bb), dob, retain_graph=True)
    res["baseline_bwd_ms"] = do_bench(lambda: torch.autograd.grad(ob, (qb, kb, vb, bb), dob, retain_graph=True))
    with torch.no_grad():
        err = (out.float() - ob.transpose(1, 2).float()).abs().max().item()
    res["ours_vs_baseline_out_maxdiff"] = err
    res["fwd_ratio"] = res["ours_fwd_ms"] / res["baseline_fwd_ms"]
    res["bwd_ratio"] = res["ours_bwd_ms"] / res["baseline_bwd_ms"]
    res["train_fwd_ratio"] = res["ours_train_fwd_ms"] / res["baseline_train_fwd_ms"]
    print(json.dumps(res, indent=1), flush=True)

    if args.sweep:
        cands = [
            {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "num_stages": 1},
            {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32, "num_stages": 1},
            {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32, "num_stages": 2},
        ]
        res["sweep"] = []
        for c in cands:
            entry = dict(options=c)
            try:
                o = run_base(qb, kb, vb, bb, c)
                torch.autograd.grad(o, (qb, kb, vb, bb), dob, retain_graph=True)
                entry["bwd_ms"] = do_bench(lambda: torch.autograd.grad(o, (qb, kb, vb, bb), dob, retain_graph=True))
            except Exception as e:  # noqa: BLE001 - a config that does not fit is a result too
                entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            res["sweep"].append(entry)
            print(entry, flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
