"""Host time of a decode step and of its parts, at 128K and 512K cached keys (bf16, B=1, H=2,
KVH=1, D=128, W=1024): the API's one-row call over the whole cache (flash_dma_attention with
keep_window_size: one flexdma::perkey_last_row call), the op alone ("api_op") and the API with the
op's call left out ("api_front": checks, Call, plan, route), and the nn cache's step
(DMACache.attend, as nn.DynamicMaskAttention runs it: the new key written into the buffers, the kept set updated and the
row's attention in one op call, flexdma::decode_append), and its parts (the route; the op call
alone), each issued 200 times back to back, then the GPU drained ("host" the issue
time per call, "wall" with the drain), the device operations of one call, and the API call's
device operations by name, with their mean device time.

python -m scripts.dev.cache_step [K,K...] [--profile]   (--profile: cProfile of 500 calls of each
step, by own time)
"""

import json
import sys

import torch

import flexdma
from benchmarks.common import issue_time, print_profile
from benchmarks.perkey import device_op_times, device_ops
from flexdma.nn import DMACache
from flexdma.perkey import cache as perkey_cache
from flexdma.perkey import contract


def main():
    args = [a for a in sys.argv[1:] if a != "--profile"]
    lengths = [int(x) for x in args[0].split(",")] if args else [131072, 524288]
    B, H, KVH, D, W = 1, 2, 1, 128, 1024
    dev, dt = "cuda", torch.bfloat16
    for K in lengths:
        torch.manual_seed(0)
        q = torch.randn(B, 1, H, D, device=dev, dtype=dt)
        k = torch.randn(B, K, KVH, D, device=dev, dtype=dt)
        v = torch.randn_like(k)
        bias = torch.exp(torch.randn(B, KVH, 1, K, device=dev)).to(dt)
        k1, v1, b1 = k[:, -1:], v[:, -1:], bias[..., -1:]
        pad = torch.ones(B, 1, dtype=torch.bool, device=dev)
        cache = DMACache.from_full(k[:, :-2], v[:, :-2], bias[..., :-2], None, W)
        cache = cache.step(k[:, -2:-1], v[:, -2:-1], bias[..., -2:-1], pad[:, 0])
        scale = D**-0.5
        how = perkey_cache.route(q, k1, cache.kept_set, W, gathers_bias=True)

        def api():
            return flexdma.flash_dma_attention(q, k, v, None, bias, is_causal=True, keep_window_size=W)

        sc = contract.selection_scores(bias, None, H, float64_ranks=False)
        last_row = perkey_cache.last_row

        def api_front():
            # The API's call with its one-row op (cache.last_row) replaced by a stub.
            perkey_cache.last_row = lambda call, query, *rest: query
            try:
                return api()
            finally:
                perkey_cache.last_row = last_row

        def api_op():
            return torch.ops.flexdma.perkey_last_row(q, k, v, sc, W, scale, 0.0)

        def nn_step():
            h = perkey_cache.route(q, k1, cache.kept_set, W, gathers_bias=True)
            return cache.attend(h, q, k1, v1, b1, pad, scale=scale)[0]

        n, bufs = cache.length, cache._bufs

        def op():
            return torch.ops.flexdma.decode_append(q, k1, v1, b1, pad, *bufs, *cache.kept_set, n, scale, 0.0)

        def route():
            return perkey_cache.route(q, k1, cache.kept_set, W, gathers_bias=True)

        def empty():
            return torch.empty(1, device=dev)

        res = dict(K=K, how=how)
        with torch.no_grad():
            parts = (("api", api), ("api_front", api_front), ("api_op", api_op), ("nn_step", nn_step), ("op", op))
            for name, fn in parts + (("route", route), ("empty", empty)):
                h, w = issue_time(fn, 200, warmup=20)
                res[name] = dict(host_us=round(h * 1e6, 1), wall_us=round(w * 1e6, 1))
            res["api_ops"] = device_ops(api)
            res["nn_step_ops"] = device_ops(nn_step)
            res["api_op_times_us"] = device_op_times(api)
        print(json.dumps(res), flush=True)
        if "--profile" in sys.argv:
            with torch.no_grad():
                for name, fn in (("api", api), ("nn_step", nn_step)):
                    print(f"== {name} K={K}: cProfile, 500 calls")
                    print_profile(fn, 500)


if __name__ == "__main__":
    main()
