"""Host time of the eager per-key call's layers: median wall time of small calls whose kernels take
little, the forward without grad and the training call, padded (flash_dma_attention) and packed
(flash_dma_attention_varlen, two sequences). On the CPU (one thread) L=32, D=16, W=8, float32; on
CUDA L=512, D=64, W=64, bfloat16 (a call the C++ kernels take), the GPU drained after each 100
calls, so that the time is the host's wherever it issues slower than the GPU runs. A CPU machine
is quieter than the GPU machine's host; an A/B alternates processes between the two trees
(PYTHONPATH at each), several each, and compares the medians.

python scripts/dev/host_small.py TAG [cpu|cuda]   -> one JSON line tagged TAG
"""

import json
import sys
import time

import torch

import flexdma


def main() -> None:
    device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    torch.set_num_threads(1)
    torch.manual_seed(0)
    res = {}
    if device == "cpu":
        B, L, H, KVH, D, W, dtype, split = 1, 32, 2, 1, 16, 8, torch.float32, 12
    else:
        B, L, H, KVH, D, W, dtype, split = 1, 512, 2, 1, 64, 64, torch.bfloat16, 192
    opts = dict(device=device, dtype=dtype, requires_grad=True)
    q = torch.randn(B, L, H, D, **opts)
    k = torch.randn(B, L, KVH, D, **opts)
    v = torch.randn(B, L, KVH, D, **opts)
    bias = torch.randn(B, KVH, 1, L, **opts)
    cu = torch.tensor([0, split, L], dtype=torch.int32, device=device)
    longest = L - split
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
            flexdma.flash_dma_attention_varlen(
                qp, kp, vp, cu, cu, longest, longest, bp, is_causal=True, keep_window_size=W
            )

    def ptrain():
        out = flexdma.flash_dma_attention_varlen(
            qp, kp, vp, cu, cu, longest, longest, bp, is_causal=True, keep_window_size=W
        )
        torch.autograd.grad(out, (qp, kp, vp, bp), torch.ones_like(out))

    for name, f in (("fwd", fwd), ("train", train), ("packed fwd", pfwd), ("packed train", ptrain)):
        for _ in range(50):
            f()
        if device == "cuda":
            torch.cuda.synchronize()
        ts = []
        for _ in range(15):
            t0 = time.perf_counter()
            for _ in range(100):
                f()
            if device == "cuda":
                torch.cuda.synchronize()
            ts.append((time.perf_counter() - t0) / 100 * 1e6)
        ts.sort()
        res[name] = round(ts[len(ts) // 2], 1)
    print(json.dumps(dict(tag=sys.argv[1], device=device, us=res)))


if __name__ == "__main__":
    main()
