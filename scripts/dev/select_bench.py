"""The per-key selection alone (flexdma::perkey_select on CUDA): GPU time by do_bench and CUDA events
of a CUDA-graph replay (no host time), device launches per call, and a check against the CPU op.

python -m scripts.dev.select_bench [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

import flexdma  # noqa: F401  (loads the ops)
from benchmarks.common import captured
from benchmarks.perkey import _launches as launches
from flexdma import perkey

# (name, planes, K, Q, W, tile rows)
CASES = [
    ("8K, 1 plane", 1, 8192, 8192, 2048, 128),
    ("32K, 1 plane", 1, 32768, 32768, 2048, 128),
    ("128K, 1 plane", 1, 131072, 131072, 2048, 128),
    ("B=2 L=8K, 8 planes", 8, 8192, 8192, 2048, 128),
    ("B=4 L=4K, 16 planes", 16, 4096, 4096, 2048, 128),
    ("L=16K, 4 planes", 4, 16384, 16384, 2048, 128),
    ("decode Q=1 K=512K", 1, 524288, 1, 1024, 128),
]


def graph_us(fn, reps=50) -> float:
    """GPU time of one call, replayed from a CUDA graph (what the kernels take without host time)."""
    replay = captured(fn)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    rows = []
    ap.add_argument("--cases", default=None, help="comma-separated indices into CASES")
    args = ap.parse_args()
    chosen = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES
    for name, P, K, Q, W, tr in chosen:
        torch.manual_seed(0)
        scores = torch.exp(torch.randn(1, P, K, device="cuda")).to(torch.bfloat16)
        fn = lambda: perkey.select(scores, W, Q, True, tr)  # noqa: E731
        got = fn()
        want = perkey.select(scores.cpu(), W, Q, True, tr)
        ok = torch.equal(want.key_rank, got.key_rank.cpu()) and torch.equal(want.row_thr, got.row_thr.cpu())
        r = dict(case=name, planes=P, K=K, Q=Q, W=W, tile_rows=tr, matches_cpu=ok)
        r["do_bench_us"] = do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
        r["graph_us"] = graph_us(fn)
        r["launches"] = launches(fn)
        # Without query rows: the sorts and ranks alone (no walk items).
        r["ranks_only_graph_us"] = graph_us(lambda: perkey.select(scores, W, 0, True, tr))
        rows.append(r)
        print(r, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(rows=rows, gpu=torch.cuda.get_device_name()), f, indent=1)


if __name__ == "__main__":
    main()
