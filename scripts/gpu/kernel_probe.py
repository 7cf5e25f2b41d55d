"""Runs the flexdma CUDA op calls of named cases, each twice (warm-up, then the call a profiler
attaches to): `python3 scripts/gpu/kernel_probe.py CASE [D] [CASE [D] ...]`, CASE one of
nomask16k|perrow32k|perkey32k|bwd8k|small|smallkey|pairs|decode|topk|topkdecode|cachestep (small / smallkey: 333
queries x 333 keys with a per-row / per-key bias, forward and backward, for compute-sanitizer;
model: issue 19's model shape (B=2, L=8K, H=16, KVH=4, top-2048 of a bias per kv head and key), forward and
backward; pairs: B=4, L=333, H=16, KVH=4 (enough 128-row tiles for the forward to pair heads), mask
and bias per kv head, forward and backward, then a forward without either (the paired warpgroups'
turns); topk: the per-key top-W path (flexdma::perkey_select, perkey_fwd and perkey_bwd) at
333 x 333, W=100, GQA with a bias per kv head; topkdecode: one query over 5000 keys, W=600, whose
list splits over keys; topk32k: the per-key forward at the target shape, W=2048, for a profiler; topkselect: the
selection alone over 140000 keys, 4096-key chunks; cachestep: the cached decode step's ops,
flexdma::decode_step over 5000 keys (W=600: many CTAs a plane, then the merge; and W=20: one),
decode_append, and the API's one-row call (perkey_last_row: the selection kernel, then the same
attention), GQA 4 query heads a kv head).
B=1, H=2, KVH=1, D=128, bf16, causal; masks are top-1024 of the bias per row."""

import math
import sys

import torch

import flexdma  # noqa: F401
from scripts.dev.cuda_dev import top_w_mask


def main(case, D):
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    L = {
        "nomask16k": 16384,
        "perrow32k": 32768,
        "perkey32k": 32768,
        "bwd8k": 8192,
        "small": 333,
        "smallkey": 333,
        "pairs": 333,
        "decode": 5000,
        "topk": 333,
        "topkdecode": 5000,
        "cachestep": 5000,
        "topk32k": 32768,
        "topkselect": 140000,
        "model": 8192,
    }[case]
    if case.startswith("topk"):
        return topk_case(case, L, D)
    if case == "cachestep":
        return cache_step_case(L, D)
    B, H, KVH = {"model": (2, 16, 4), "pairs": (4, 16, 4)}.get(case, (1, 2, 1))
    q = torch.randn(B, L, H, D, device=dev, dtype=dt)
    k = torch.randn(B, L, KVH, D, device=dev, dtype=dt)
    v = torch.randn(B, L, KVH, D, device=dev, dtype=dt)
    mask = bias = None
    if case in ("model", "pairs"):  # issue 19's model shape: bias per kv head and key, top-L/4 per row
        bias = torch.randn(B, KVH, 1, L, device=dev, dtype=dt)
        mask = flexdma.create_mask(bias, L // 4, is_causal=True, query_len=L)
    elif case in ("perrow32k", "bwd8k", "small"):
        bias = torch.randn(1, 1, L, L, device=dev, dtype=dt)
        mask = top_w_mask(bias, L, L, 1024 if L > 1024 else L // 3)
    elif case == "decode":  # one query: key splits and the empty-tile scan
        bias = torch.randn(1, 1, 1, L, device=dev, dtype=dt)
        mask = top_w_mask(bias, L, L, 50)[:, :, -1:]
        q = q[:, -1:].contiguous()
    elif case in ("perkey32k", "smallkey"):
        bias = torch.randn(1, 1, 1, L, device=dev, dtype=dt)
        mask = top_w_mask(bias, L, L, 1024 if L > 1024 else L // 3)
    scale = 1.0 / math.sqrt(D)
    # The backward runs deterministic first (its turn counters under compute-sanitizer), then in
    # the default mode (the call a profiler attaches to).
    for deterministic in (True, False):
        out, lse, resid = torch.ops.flexdma.fwd(q, k, v, mask, bias, scale, True, 0.0, True)
        if case in ("bwd8k", "small", "smallkey", "model", "pairs"):
            torch.ops.flexdma.bwd(
                torch.randn_like(out),
                q,
                k,
                v,
                mask,
                bias,
                out,
                lse,
                scale,
                True,
                0.0,
                True,
                deterministic,
                out_resid=resid,
            )
    if case == "pairs":
        torch.ops.flexdma.fwd(q, k, v, None, None, scale, True, 0.0, False)
    torch.cuda.synchronize()


def topk_case(case, L, D):
    dev, dt = "cuda", torch.bfloat16
    if case == "topkselect":  # the selection alone past 128K keys (its 4096-key chunks), 300 rows
        from flexdma import perkey

        scores = torch.randn(1, 2, L, device=dev, dtype=dt)[:, 1:]
        perkey.select(scores, 2048, 300, True, 128)
        torch.cuda.synchronize()
        return
    Q, H, KVH, W = {"topk": (L, 4, 2, 100), "topkdecode": (1, 2, 1, 600), "topk32k": (L, 2, 1, 2048)}[case]
    q = torch.randn(1, Q, H, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(1, L, KVH, D, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(1, L, KVH, D, device=dev, dtype=dt, requires_grad=True)
    bias = torch.randn(1, KVH, 1, L, device=dev, dtype=dt).requires_grad_()
    for _ in range(2):
        out = flexdma.flash_dma_attention(q, k, v, None, bias, is_causal=True, keep_window_size=W, backend="cuda")
        if case != "topk32k":
            torch.autograd.grad(out, (q, k, v, bias), torch.randn_like(out))
    torch.cuda.synchronize()


def cache_step_case(L, D):
    from flexdma.perkey import decode

    dev, dt = "cuda", torch.bfloat16
    B, H, KVH = 2, 8, 2
    q = torch.randn(B, 1, H, D, device=dev, dtype=dt)
    k, v = torch.randn(2, B, L + 1, KVH, D, device=dev, dtype=dt)
    scores = torch.randn(B, KVH, L + 1, device=dev).to(dt)
    eligible = torch.ones(B, KVH, dtype=torch.bool, device=dev)
    for W in (600, 20):
        kept = decode.last_row(scores[..., :L], W)
        for _ in range(2):
            decode.attend_one(q, k, v, kept, scores[..., L], L, eligible, D**-0.5)
    kept = decode.last_row(scores[..., :L], 600)
    bias, padding = scores.clone(), torch.ones(B, L + 1, dtype=torch.bool, device=dev)
    k_new, v_new = torch.randn(2, B, 1, KVH, D, device=dev, dtype=dt)
    b_new, p_new = scores[..., L:, None].transpose(2, 3).contiguous(), eligible[:, :1]
    for _ in range(2):
        torch.ops.flexdma.decode_append(q, k_new, v_new, b_new, p_new, k, v, bias, padding, *kept, L, D**-0.5, 0.0)
    # The API's one row (flexdma::perkey_last_row): a kept set a kv head, and one a query head.
    for heads in (KVH, H):
        b_api = torch.randn(B, heads, 1, L, device=dev, dtype=dt)
        with torch.no_grad():
            for _ in range(2):
                flexdma.flash_dma_attention(q, k[:, :L], v[:, :L], None, b_api, is_causal=True, keep_window_size=600)
    # Its selection over several CTAs a plane (8192 keys a CTA at least), float32 scores too.
    for sdt in (dt, torch.float32):
        n = 40000
        kk, vv = torch.randn(2, B, n, KVH, D, device=dev, dtype=dt)
        scores = torch.randn(B, KVH, n, device=dev).to(sdt)
        torch.ops.flexdma.perkey_last_row(q, kk, vv, scores, 700, D**-0.5, 0.0)
    torch.cuda.synchronize()


if __name__ == "__main__":
    args = sys.argv[1:]
    while args:
        case = args.pop(0)
        D = int(args.pop(0)) if args and args[0].isdigit() else 128
        main(case, D)
