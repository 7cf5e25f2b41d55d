"""The one-token decode kernel alone (flexdma/perkey/triton_decode.py): its time with a cold L2
(do_bench clears it between calls: the cache a step reads is not in L2 in a real model either;
cold_us: the Python call, whose launch time shows where it exceeds the L2 clear; cold_graph_us:
a CUDA-graph replay of it) and from back-to-back graph replays (no host time, L2 warm), across its geometry (slots per block,
programs per plane) and launch options, at several cache lengths: what bounds it, latency or
bytes.

python -m scripts.dev.decode_kernel [--K 32768,131072] [--sweep] [--out FILE.json]
python -m scripts.dev.decode_kernel --K 131072 --once   # one call after warm-up, for ncu
python -m scripts.dev.decode_kernel --baseline OLD.py    # also an earlier triton_decode.py, same run
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json

import torch
from triton.testing import do_bench

from benchmarks.common import captured
from benchmarks.decode import kernel_case as case
from flexdma.perkey import triton_decode
from scripts.dev.select_bench import graph_us


def _load(path: str):
    """A triton_decode.py of another commit, as a module of the package (its relative imports)."""
    spec = importlib.util.spec_from_file_location("flexdma.perkey._baseline_decode", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(fn, rec: dict) -> dict:
    """rec with fn's times (cold: the Python call; cold_graph: its graph replay; graph: back-to-back
    replays), printed as it lands."""
    rec["cold_us"] = do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    rec["graph_us"] = graph_us(fn)
    rec["cold_graph_us"] = do_bench(captured(fn), warmup=25, rep=100, return_mode="median") * 1e3
    print(json.dumps(rec), flush=True)
    return rec


def variants(sweep: bool, window: int):
    yield dict(block=None, nsplit=None, num_warps=4, num_stages=2)  # the defaults
    if sweep:
        for block, nsplit, warps, stages in itertools.product((16, 32, 64), (8, 16, 32, 64, 128), (2, 4), (1, 2)):
            if (nsplit - 1) * block < window:  # no program without slots
                yield dict(block=block, nsplit=nsplit, num_warps=warps, num_stages=stages)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--K", default="8192,32768,131072,524288")
    ap.add_argument("--B", default="1")
    ap.add_argument("--H", type=int, default=2)
    ap.add_argument("--KVH", type=int, default=1)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--W", type=int, default=1024)
    ap.add_argument("--sweep", action="store_true", help="every geometry and launch option, not only the defaults")
    ap.add_argument("--once", action="store_true", help="one call after warm-up (under a profiler)")
    ap.add_argument("--baseline", default=None, help="a triton_decode.py to time beside this one (defaults only)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    geometry, config = triton_decode.geometry, dict(triton_decode.CONFIG)
    results = []
    for B, K in itertools.product((int(x) for x in a.B.split(",")), (int(x) for x in a.K.split(","))):
        if a.baseline:
            fn = case(B, a.H, a.KVH, a.D, K, a.W, _load(a.baseline))
            fn()
            results.append(measure(fn, dict(B=B, K=K, H=a.H, KVH=a.KVH, D=a.D, W=a.W, kernel="baseline")))
        fn = case(B, a.H, a.KVH, a.D, K, a.W)
        for var in variants(a.sweep, a.W):
            if var["block"] is not None:
                triton_decode.geometry = lambda *args, v=var: (v["block"], v["nsplit"])
            else:
                triton_decode.geometry = geometry
            triton_decode.CONFIG.update(num_warps=var["num_warps"], num_stages=var["num_stages"])
            fn()
            torch.cuda.synchronize()
            if a.once:
                fn()
                torch.cuda.synchronize()
                continue
            results.append(measure(fn, dict(B=B, K=K, H=a.H, KVH=a.KVH, D=a.D, W=a.W, **var)))
    triton_decode.geometry = geometry
    triton_decode.CONFIG.update(config)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
