"""Runs the per-key path's Triton attention kernels (flexdma/perkey/triton.py: forward and backward,
atomics and deterministic) in Triton's interpreter on the CPU, at head dims that are not a power of
two (padded to the next one) and at a power of two, against the float64 reference over the same
selection. tests/perkey/test_perkey.py runs it in a process of its own (TRITON_INTERPRET=1 is read when triton
is imported). Exits 0 when every case matches."""

import math
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import interpret_patch  # noqa: E402, F401  (the interpreter's NumPy patch)
import torch  # noqa: E402

from flexdma.perkey import contract, naive, route  # noqa: E402
from flexdma.perkey import triton as kernels  # noqa: E402


def check(B, L, H, KVH, D, W, causal, deterministic, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, H, D, generator=g)
    k = torch.randn(B, L, KVH, D, generator=g)
    v = torch.randn(B, L, KVH, D, generator=g)
    bias = torch.randn(B, KVH, 1, L, generator=g) * 2
    dout = torch.randn(B, L, H, D, generator=g)
    tile_rows = route.triton_tiles(H, KVH, KVH, D)[1]  # the Triton kernels' tile rows (the route's on CUDA)
    # The CPU op's selection: the lists the CUDA kernel would give (the same contract).
    sel = contract.select(bias[:, :, 0, :], W, L, causal, tile_rows)
    scale = 1 / math.sqrt(D)
    out, lse, resid = kernels.fwd(
        q, k, v, bias, sel.key_rank, sel.row_thr, scale, causal, 0.0, deterministic, sel.tile_keys, tile_rows
    )
    grads = kernels.bwd(
        dout,
        q,
        k,
        v,
        bias,
        sel.key_rank,
        sel.row_thr,
        out,
        lse,
        scale,
        causal,
        0.0,
        True,
        deterministic,
        sel.tile_keys,
        resid,
        tile_rows,
    )
    ins = [t.double().requires_grad_() for t in (q, k, v, bias)]
    ref_out, ref_lse = naive.attention(*ins[:3], ins[3], sel, scale=scale, is_causal=causal, softcap=0.0)
    ref_grads = torch.autograd.grad(ref_out, ins, dout.double())
    case = f"B={B} L={L} H={H} KVH={KVH} D={D} W={W} causal={causal} deterministic={deterministic}"
    for name, a, b in zip(
        ("out", "lse", "dq", "dk", "dv", "dbias"), (out, lse) + tuple(grads), (ref_out, ref_lse) + ref_grads
    ):
        assert a.shape == b.shape, f"{name} shape {tuple(a.shape)} != {tuple(b.shape)}: {case}"
        fin = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), fin), f"{name} non-finite pattern: {case}"
        err = (a.double() - b)[fin].abs().max().item() if fin.any() else 0.0
        assert err < 2e-4, f"{name} error {err}: {case}"
    print("ok", case, flush=True)


if __name__ == "__main__":
    check(1, 150, 2, 1, 96, 40, True, False, 0)  # padded 96 -> 128
    check(2, 130, 4, 2, 48, 20, True, True, 1)  # padded 48 -> 64, GQA, deterministic
    check(1, 100, 2, 2, 192, 30, False, False, 2)  # padded 192 -> 256 (wide tiles)
    check(1, 90, 2, 1, 64, 16, True, False, 3)  # a power of two, unpadded
    sys.exit(0)
