"""The perkey bench's FlexAttention window peer (compiled, the last W keys a row sees, the per-key
bias as score_mod) at each kernel option set the benchmarks' peers try (benchmarks.peers.FLEX_OPTION_SETS):
forward without grad and the training call (forward + backward), do_bench medians in ms, at one
row per head dim and shape kind of the bench. What flex.sparse_mask_kernel_options takes for a
sliding window comes from this table. An option set that fails (out of resources) is reported as
such.

python -m scripts.dev.flex_window_options [OUT.json]
"""

from __future__ import annotations

import json
import sys

import torch

from benchmarks import perkey
from benchmarks.peers import FLEX_OPTION_SETS

NAMES = ("L=32K D=128", "B=2 L=8K H=16 KVH=4", "L=32K D=64", "B=2 L=8K H=16 KVH=4 D=64")


def main() -> None:
    # One compile per (shape, option set, grad): past the default limit Dynamo would run eager.
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    res = {"device": torch.cuda.get_device_name()}
    for c in (c for c in perkey.cases() if c["name"] in NAMES):
        for name, opts in FLEX_OPTION_SETS.items():
            key = f"{c['name']} {name}"
            try:
                q, k, v, bias = perkey._inputs(c, grad=False)
                with torch.no_grad():
                    fn = perkey._flex_window(c, q, k, v, bias, opts)
                    fn()
                    res[f"{key} fwd"] = perkey._time(fn)
                q, k, v, bias = perkey._inputs(c, grad=True)
                fwd = perkey._flex_window(c, q, k, v, bias, opts)

                def step():
                    out = fwd()
                    return torch.autograd.grad(out, (q, k, v, bias), torch.ones_like(out))

                step()
                res[f"{key} train"] = perkey._time(step, warmup=10, rep=50)
            except Exception as e:  # out of resources at these options is a result
                res[f"{key} error"] = f"{type(e).__name__}: {str(e)[:120]}"
            print(key, {k2: v2 for k2, v2 in res.items() if k2.startswith(key)}, flush=True)
    print(json.dumps(res, indent=1))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
