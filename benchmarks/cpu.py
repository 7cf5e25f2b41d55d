"""`python -m benchmarks cpu`: flexdma's CPU kernel against SDPA on the CPU, in fp32.

Rows (B=2, H=KVH=8, D=64, causal, L=2048 unless --lengths):
  dense            no mask, no bias: flexdma `is_causal=True` vs SDPA `is_causal=True`;
  top25            a (1,1,L,L) bias and create_mask's top-L/4 keys per row of it: flexdma with
                   the mask and the bias vs SDPA with the mask folded into the bias (SDPA cannot
                   combine a mask with is_causal, the folded mask carries the causal cut);
  top25-blocks     a per-key (1,1,1,L) bias and create_mask(block_size=64) of it: every row
                   keeps the best 64-key blocks among those it sees, so most (query tile, key
                   tile) pairs keep nothing and the kernel skips them (with a per-row bias each
                   row picks its own blocks and a 64-row tile keeps nearly every block).
`dense` in every row is SDPA `is_causal=True` without mask or bias, the ceiling.

Each direction ("fwd", "fwd+bwd": forward and autograd backward with the grads of q, k, v and,
where there is one, the bias) is timed with the peers interleaved call by call, so that the load
of other processes on a shared machine hits them alike; min and median over the repetitions.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

import flexdma

from .common import public_argv, write_json

SCHEMA = "flexdma-bench-cpu/1"  # its own rows and table (benchmarks/report.py reads them)

B, H, KVH, D = 2, 8, 8, 64
LENGTH = 2048
BLOCK = 64


def _inputs(L: int, kind: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(B, L, h, D, generator=g) for h in (H, KVH, KVH, H))
    bias = mask = None
    if kind == "top25":
        bias = torch.randn(1, 1, L, L, generator=g)
        mask = flexdma.create_mask(bias, L // 4, is_causal=True)
    elif kind == "top25-blocks":
        bias = torch.randn(1, 1, 1, L, generator=g)
        mask = flexdma.create_mask(bias, L // 4, is_causal=True, query_len=L, block_size=BLOCK)
    return q, k, v, dout, bias, mask


def _peers(q, k, v, bias, mask) -> Dict[str, Tuple[Callable, List[torch.Tensor]]]:
    def bhsd(x):
        return x.transpose(1, 2)

    wrt = [q, k, v] + ([bias] if bias is not None else [])

    def mine():
        return flexdma.flash_dma_attention(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True, backend="cpu")

    def sdpa():
        if mask is None:
            return F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v), is_causal=True).transpose(1, 2)
        folded = bias.masked_fill(~mask, float("-inf"))
        return F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v), attn_mask=folded).transpose(1, 2)

    def dense():
        return F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v), is_causal=True).transpose(1, 2)

    peers = {"flexdma-cpu": (mine, wrt), "sdpa": (sdpa, wrt)}
    if mask is not None:
        peers["dense"] = (dense, [q, k, v])
    return peers


def _timed(fns: Dict[str, Callable], reps: int) -> Dict[str, dict]:
    for _ in range(2):  # warm-up: the first calls of a process pay for page faults and thread start
        for fn in fns.values():
            fn()
    times: Dict[str, List[float]] = {n: [] for n in fns}
    for _ in range(reps):
        for n, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[n].append((time.perf_counter() - t0) * 1e3)
    return {n: {"status": "ok", "min_ms": min(t), "median_ms": statistics.median(t), "ms": t} for n, t in times.items()}


def run(args, env: dict, out_path: str) -> dict:
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else [LENGTH]
    doc = dict(
        schema=SCHEMA,
        subcommand="cpu",
        argv=public_argv(sys.argv[1:]),
        **env,
        threads=torch.get_num_threads(),
        cpu_count=os.cpu_count(),
        dtype="float32",
        shape=dict(B=B, H=H, KVH=KVH, D=D),
        reps=dict(fwd=args.reps, fwdbwd=max(2, args.reps // 2)),
        timing="peers interleaved call by call; min and median of the repetitions, milliseconds",
        rows=[],
    )
    start = time.perf_counter()
    for L in lengths:
        for kind in ("dense", "top25", "top25-blocks"):
            q, k, v, dout, bias, mask = _inputs(L, kind, args.seed)
            density = 0.5 * (L + 1) / L if mask is None else float(mask.float().mean())
            for direction in ("fwd", "fwd+bwd"):
                leaves = [
                    t.detach().requires_grad_(direction != "fwd") if t is not None else None for t in (q, k, v, bias)
                ]
                peers = _peers(*leaves, mask)
                if direction == "fwd":
                    fns = {n: fn for n, (fn, _) in peers.items()}
                    reps = args.reps
                else:

                    def step(fn=None, wrt=None):
                        out = fn()
                        return torch.autograd.grad(out, wrt, dout)

                    fns = {n: (lambda fn=fn, wrt=wrt: step(fn, wrt)) for n, (fn, wrt) in peers.items()}
                    reps = max(2, args.reps // 2)
                with torch.no_grad() if direction == "fwd" else torch.enable_grad():
                    res = _timed(fns, reps)
                mine = res["flexdma-cpu"]
                row = dict(
                    kind=kind,
                    L=L,
                    dir=direction,
                    density=density,
                    results=res,
                    speedup={p: r["min_ms"] / mine["min_ms"] for p, r in res.items() if p != "flexdma-cpu"},
                )
                doc["rows"].append(row)
                print(row_line(row), flush=True)
            doc["elapsed_s"] = time.perf_counter() - start
            write_json(out_path, doc)
    print(f"\nwrote {out_path}\n\n{markdown(doc)}", flush=True)
    return doc


def row_line(row: dict) -> str:
    r = row["results"]
    cells = "  ".join(f"{p} {x['min_ms']:.0f}/{x['median_ms']:.0f}" for p, x in r.items())
    return f"{row['kind']:13s} L={row['L']} {row['dir']:8s} density {row['density']:.3f}  {cells} ms (min/median)"


def markdown(doc: dict) -> str:
    head = (
        f"`cpu` on {doc.get('gpu')}, {doc.get('threads')} threads, commit {doc.get('commit')}"
        f"{' (dirty tree)' if doc.get('dirty') else ''}, {doc.get('date')}; torch {doc.get('torch')}\n"
        f"fp32, B={doc['shape']['B']}, H=KVH={doc['shape']['H']}, D={doc['shape']['D']}, causal. "
        f"{doc.get('timing')}. `flexdma vs P` = P's min / flexdma's min (> 1: flexdma faster)."
    )
    lines = [
        head,
        "",
        "| row | L | dir | density | flexdma-cpu ms | sdpa ms | dense ms | flexdma vs sdpa | flexdma vs dense |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in doc.get("rows", []):
        r = row["results"]

        def cell(p):
            return f"{r[p]['min_ms']:.1f} / {r[p]['median_ms']:.1f}" if p in r else "–"

        def sp(p):
            return f"{row['speedup'][p]:.2f}x" if p in row["speedup"] else "–"

        lines.append(
            f"| {row['kind']} | {row['L']} | {row['dir']} | {row['density']:.3f} | {cell('flexdma-cpu')} | "
            f"{cell('sdpa')} | {cell('dense')} | {sp('sdpa')} | {sp('dense')} |"
        )
    return "\n".join(lines) + "\n"
