"""Host time of a per-key call and of its parts (8K by default): each part issued 200 times back to
back, then the GPU drained; "host" is the issue time per call, "wall" adds the drain. Where host
is near wall the GPU waited on the host (or the launch queue filled). Ends with cProfile of a
training call, by cumulative time.

python -m scripts.dev.host_parts [L]
"""

import math
import sys

import torch
import torch.nn.functional as F

import flexdma
from benchmarks.common import issue_time, print_profile
from flexdma.perkey import contract, ops
from scripts.dev import perkey_dev as TD


def main():
    L = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    D = 128
    torch.manual_seed(0)
    q, k, v, bias = TD._inputs(1, L, 2, 1, D, 1)
    s = 1 / math.sqrt(D)
    r = TD._route(q, k, v, bias, 2048, True)
    sel = TD._select(q, bias, 2048, True, r)
    tr = r.tile_rows
    sc = contract.selection_scores(bias, None, 2)
    o, lse, res = TD._fwd(r, q, k, v, bias, sel, s, True)
    do = torch.randn_like(q)
    qg, kg, vg, bg = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]

    def host(fn, n=200):
        h, w = issue_time(fn, n, warmup=10)
        return round(h * 1e6, 1), round(w * 1e6, 1)

    def api_fwd():
        with torch.no_grad():
            return flexdma.flash_dma_attention(q, k, v, None, bias, is_causal=True, keep_window_size=2048)

    def api_train():
        out = flexdma.flash_dma_attention(qg, kg, vg, None, bg, is_causal=True, keep_window_size=2048)
        return torch.autograd.grad(out, (qg, kg, vg, bg), do)

    def sdpa_train():
        out = F.scaled_dot_product_attention(
            qg.transpose(1, 2),
            kg.transpose(1, 2).expand(-1, 2, -1, -1),
            vg.transpose(1, 2).expand(-1, 2, -1, -1),
            is_causal=True,
        )
        return torch.autograd.grad(out, (qg, kg, vg), do.transpose(1, 2))

    def api_fwd_grad():
        return flexdma.flash_dma_attention(qg, kg, vg, None, bg, is_causal=True, keep_window_size=2048)

    _keep = {}

    def bwd_only():
        if "out" not in _keep:
            _keep["out"] = api_fwd_grad()
        return torch.autograd.grad(_keep["out"], (qg, kg, vg, bg), do, retain_graph=True)

    def perkey_bwd_op():
        return ops.run_backward(
            r, do, q, k, v, bias, sel.key_rank, sel.row_thr, o, lse, s, True, 0.0, True, False, sel.tile_keys, res
        )

    parts = {
        "api_fwd_grad": api_fwd_grad,
        "bwd_only": bwd_only,
        "perkey_bwd_op": perkey_bwd_op,
        "sdpa_fwd": lambda: F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2).expand(-1, 2, -1, -1),
            v.transpose(1, 2).expand(-1, 2, -1, -1),
            is_causal=True,
        ),
        "empty_x3": lambda: (
            torch.empty(10, device="cuda"),
            torch.empty(10, device="cuda"),
            torch.empty(10, device="cuda"),
        ),
        "selection_scores": lambda: contract.selection_scores(bias, None, 2),
        "perkey_select_op": lambda: torch.ops.flexdma.perkey_select(sc, 2048, L, True, tr),
        "contract_select": lambda: contract.select(sc, 2048, L, True, tr),
        # The route's forward op without autograd (the C++ kernels' flexdma::perkey_fwd, or Triton's).
        "perkey_fwd_op_nograd": lambda: ops.run_forward(
            r, q, k, v, bias, sel.key_rank, sel.row_thr, s, True, 0.0, False, sel.tile_keys
        ),
        "api_fwd": api_fwd,
        "api_train": api_train,
        "sdpa_train": sdpa_train,
    }
    for name, fn in parts.items():
        print(f"{name:24s} host/wall us {host(fn)}", flush=True)

    print_profile(api_train, 100, sort="cumulative", lines=45)


if __name__ == "__main__":
    main()
