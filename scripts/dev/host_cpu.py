"""Host time of the eager per-key call's layers on the CPU: median wall time of small calls (L=32,
D=16, W=8, one thread) whose kernels take little, the forward without grad and the training call,
padded (flash_dma_attention) and packed (flash_dma_attention_varlen, two sequences). A CPU machine
is quieter than the GPU machine's host; an A/B still alternates processes between the two trees
(PYTHONPATH at each), several each, and compares the medians.

python scripts/dev/host_cpu.py TAG   -> one JSON line tagged TAG
"""

import json
import sys
import time

import torch

import flexdma


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    res = {}
    B, L, H, KVH, D, W = 1, 32, 2, 1, 16, 8
    q = torch.randn(B, L, H, D, requires_grad=True)
    k = torch.randn(B, L, KVH, D, requires_grad=True)
    v = torch.randn(B, L, KVH, D, requires_grad=True)
    bias = torch.randn(B, KVH, 1, L, requires_grad=True)
    cu = torch.tensor([0, 12, 32], dtype=torch.int32)
    qp, kp, vp = (t.detach()[0].clone().requires_grad_() for t in (q, k, v))
    bp = bias.detach()[0, :, 0].clone().requires_grad_()

    def fwd():
        with torch.no_grad():
            flexdma.flash_dma_attention(q, k, v, None, bias, is_causal=True, keep_window_size=W)

    def train():
        out = flexdma.flash_dma_attention(q, k, v, None, bias, is_causal=True, keep_window_size=W)
        torch.autograd.grad(out, (q, k, v, bias), torch.ones_like(out))

    def pfwd():
        with torch.no_grad():
            flexdma.flash_dma_attention_varlen(qp, kp, vp, cu, cu, 20, 20, bp, is_causal=True, keep_window_size=W)

    def ptrain():
        out = flexdma.flash_dma_attention_varlen(qp, kp, vp, cu, cu, 20, 20, bp, is_causal=True, keep_window_size=W)
        torch.autograd.grad(out, (qp, kp, vp, bp), torch.ones_like(out))

    for name, f in (("fwd", fwd), ("train", train), ("packed fwd", pfwd), ("packed train", ptrain)):
        for _ in range(50):
            f()
        ts = []
        for _ in range(15):
            t0 = time.perf_counter()
            for _ in range(100):
                f()
            ts.append((time.perf_counter() - t0) / 100 * 1e6)
        ts.sort()
        res[name] = round(ts[len(ts) // 2], 1)
    print(json.dumps(dict(tag=sys.argv[1], us=res)))


if __name__ == "__main__":
    main()
