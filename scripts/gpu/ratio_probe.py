import sys

import torch

sys.path.insert(0, "tests")
import test_topk as T

import flexdma
from flexdma.reference import attention_ref

case = (1, 1, 90, 4, 4, 16, True, "KVH", True, False)
for D in (64, 128):
    worst = []
    for seed in range(12):
        torch.manual_seed(seed)
        q, k, v, bias, pad = T._inputs(case, "cuda", torch.bfloat16, D=D)
        mask = T._dense(bias, pad, 16, 1, True)
        grad = torch.randn(1, 1, 4, D, dtype=torch.float64, device="cuda")
        ref = {}
        for prec in (torch.float64, torch.bfloat16):
            ins = [t.detach().to(prec).requires_grad_() for t in (q, k, v, bias)]
            o, lse = attention_ref(ins[0], ins[1], ins[2], mask, ins[3], is_causal=True)
            ref[prec] = (o,) + torch.autograd.grad(o, ins, grad.to(prec))
        ins = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
        out = flexdma.flash_dma_attention(ins[0], ins[1], ins[2], pad, ins[3], is_causal=True, keep_window_size=16)
        got = (out,) + torch.autograd.grad(out, ins, grad.to(torch.bfloat16))
        r = []
        for n, g, a, lo in zip(("out", "dq", "dk", "dv", "db"), got, ref[torch.float64], ref[torch.bfloat16]):
            e = (g.double() - a).abs().max().item()
            l = (lo.double() - a).abs().max().item()
            r.append(f"{n}:{e / max(l, 1e-12):.2f}({e:.4f}/{l:.4f})")
        print(D, seed, " ".join(r), flush=True)
