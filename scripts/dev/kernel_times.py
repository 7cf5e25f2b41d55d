"""The attention kernels alone, for A/B runs of a kernel change (one build per variant, same process
layout): the per-key forward and backward (the sm_90a kernels) on the selection's lists (the
reference shapes and the model shapes, D = 128 / 64), and the dense packed forward on the varlen
bench's cases (its inputs) against the documents' own forwards (no window). do_bench medians in ms; the
selection and the forward's outputs are made once outside the timing.

python -m scripts.dev.kernel_times TAG OUT.json
"""

from __future__ import annotations

import json
import math
import sys

import torch
from triton.testing import do_bench

import flexdma
from benchmarks import varlen
from scripts.dev.perkey_dev import _bwd, _fwd, _inputs, _route, _select

# (B, L, H, KVH, D, selection plane heads)
PERKEY = [
    (1, 8192, 2, 1, 128, 1),
    (1, 32768, 2, 1, 128, 1),
    (1, 131072, 2, 1, 128, 1),
    (2, 8192, 16, 4, 128, 4),
    (4, 4096, 16, 4, 128, 4),
    (1, 32768, 2, 1, 64, 1),
    (1, 131072, 2, 1, 64, 1),
    (2, 8192, 16, 4, 64, 4),
]


def perkey(res: dict) -> None:
    for B, L, H, KVH, D, ph in PERKEY:
        torch.manual_seed(0)
        q, k, v, bias = _inputs(B, L, H, KVH, D, ph)
        r = _route(q, k, v, bias, 2048, True)
        sel = _select(q, bias, 2048, True, r)
        scale = 1 / math.sqrt(D)
        name = f"B={B} L={L} H={H} KVH={KVH} D={D}"
        res[f"perkey fwd {name}"] = do_bench(lambda: _fwd(r, q, k, v, bias, sel, scale, True), warmup=50, rep=200)
        out, lse, resid = _fwd(r, q, k, v, bias, sel, scale, True)
        do = torch.randn_like(q)
        res[f"perkey bwd {name}"] = do_bench(
            lambda: _bwd(r, do, q, k, v, bias, sel, out, lse, resid, scale, True), warmup=25, rep=100
        )


def dense_packed(res: dict) -> None:
    for c in varlen.cases():
        q, k, v, bias = varlen._inputs(c)
        offs = varlen._offsets(c["lengths"])
        cu = torch.tensor(offs, dtype=torch.int32, device="cuda")
        longest = max(c["lengths"])
        D = c["D"]
        res[f"dense packed D={D}"] = do_bench(
            lambda: flexdma.flash_dma_attention_varlen(q, k, v, cu, cu, longest, longest, bias, is_causal=True),
            warmup=50,
            rep=200,
        )
        per_doc = 0.0
        for a, b in zip(offs[:-1], offs[1:]):
            qd, kd, vd, bd = q[a:b][None], k[a:b][None], v[a:b][None], bias[:, a:b][None, :, None]
            per_doc += do_bench(
                lambda: flexdma.flash_dma_attention(qd, kd, vd, None, bd, is_causal=True), warmup=20, rep=80
            )
        res[f"dense per-doc sum D={D}"] = per_doc


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    tag, out = sys.argv[1], sys.argv[2]
    res: dict = {"tag": tag, "device": torch.cuda.get_device_name()}
    perkey(res)
    dense_packed(res)
    print(json.dumps(res, indent=1))
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
