"""Runs the per-key decode step's Triton kernel (flexdma/perkey/triton_decode.py) in Triton's
interpreter on the CPU: the kept set it updates in place against flexdma.perkey.decode.append, bit
for bit, and the new row's output against the float64 reference over the new kept set
(FlashAttention's rule: at most twice the error of the same computation in the inputs' dtype, plus
1e-3), for single steps and a short decode loop. tests/perkey/test_perkey.py runs it in a process of its own
(TRITON_INTERPRET=1 is read when triton is imported), and its CUDA test imports the checks from
here. Exits 0 when every case matches."""

import math
import os
import sys
import warnings

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import interpret_patch  # noqa: F401  (the interpreter's NumPy patch)

import torch  # noqa: E402


def _patch_bfloat16():
    """Triton's interpreter (3.6) keeps bfloat16 as its uint16 bits: tl.dot multiplies the bits as
    integers, and float32 -> bfloat16 truncates where the GPU (and torch) round to nearest even.
    Both done here as the GPU does them."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as it

    dot, cast = it.InterpreterBuilder.create_dot, it.InterpreterBuilder.cast_impl

    def widen(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        return it.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, *rest):
        return dot(self, widen(a), widen(b), d, *rest)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return it.TensorHandle(bits.numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    it.InterpreterBuilder.create_dot, it.InterpreterBuilder.cast_impl = create_dot, cast_impl


from flexdma.dense.naive import attention_ref  # noqa: E402
from flexdma.perkey import decode  # noqa: E402

NAN, INF = float("nan"), float("inf")


def make(B, H, KVH, W, D, n, dtype, *, score_dtype=None, special=False, transposed=False, seed=0, device="cpu"):
    """q (B, H, D), a cache of n keys and room for more (k, v (B, KVH, Kcap, D), views of (B, Kcap,
    KVH, D) buffers where `transposed`), and the kept set of its last row with its slots shuffled
    (append takes any slot order). `special`: ties, NaN / -inf / signed-zero scores."""
    g = torch.Generator().manual_seed(seed)
    cap = n + 9
    q = torch.randn(H, B, D, generator=g).to(dtype).transpose(0, 1)  # not contiguous
    kv = [torch.randn(B, cap, KVH, D, generator=g).to(dtype) for _ in range(2)]
    k, v = (t.transpose(1, 2) if transposed else t.transpose(1, 2).contiguous() for t in kv)
    scores = torch.randn(B, KVH, n, generator=g)
    if special:
        scores = (scores * 2).round() / 2  # ties
        flat = scores.view(-1)
        pick = torch.randint(0, flat.numel(), (max(1, flat.numel() // 8),), generator=g)
        flat[pick] = torch.tensor([-INF, -0.0, 0.0, -INF])[torch.arange(pick.numel()) % 4]
        scores[0, 0, n // 2] = NAN  # one plane's output turns NaN
        if B * KVH > 1:
            scores[-1, -1] = -INF  # and one keeps no key (below: nor the new one): output 0
    kept = decode.last_row(scores.to(score_dtype or dtype), W)
    perm = torch.rand(B, KVH, W, generator=g).argsort(-1)
    kept = decode.KeptSet(*(t.gather(-1, perm) for t in kept))
    return (q.to(device), k.to(device), v.to(device), decode.KeptSet(*(t.to(device) for t in kept)))


def new_key(kept, s_dtype, seed, special=False):
    """(s_new, eligible) of the next key: random, or (special) NaN, -inf, signed zeros, +inf and a
    tie with the worst kept score, plane by plane."""
    g = torch.Generator().manual_seed(seed)
    B, P, W = kept.idx.shape
    s = torch.randn(B, P, generator=g)
    eligible = torch.rand(B, P, generator=g) > 0.2
    if special:
        worst = kept.score.float().masked_fill(~kept.valid, INF).nan_to_num(nan=INF).min(-1).values.cpu()
        options = torch.stack([torch.full_like(s, x) for x in (NAN, -INF, -0.0, 0.0, INF)] + [worst, s], -1)
        s = options.gather(-1, torch.randint(0, options.shape[-1], (B, P, 1), generator=g))[..., 0]
        eligible[-1, -1] = False
    dev = kept.idx.device
    return s.to(s_dtype).to(dev), eligible.to(dev)


def check_kept(got, want, case):
    assert torch.equal(got.idx, want.idx), f"kept idx differs: {case}"
    assert torch.equal(got.valid, want.valid), f"kept valid differs: {case}"
    a, b = got.score, want.score
    assert a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()), f"kept score NaNs differ: {case}"
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    assert torch.equal(a.view(bits)[~a.isnan()], b.view(bits)[~b.isnan()]), f"kept score bits differ: {case}"


def reference(q, k, v, kept, scale, softcap, dtype):
    """attention_ref over the kept set, computed in `dtype` (float64: the truth)."""
    B, KVH, W = kept.idx.shape
    rows = kept.idx.clamp(0, k.shape[2] - 1)[..., None].expand(B, KVH, W, q.shape[-1])
    ks, vs = (t.gather(2, rows).transpose(1, 2).to(dtype) for t in (k, v))
    bias = kept.score[:, :, None, :]
    out, _ = attention_ref(
        q[:, None].to(dtype),
        ks,
        vs,
        kept.valid[:, :, None, :],
        bias.double() if dtype == torch.float64 else bias,
        softmax_scale=scale,
        softcap=softcap,
    )
    return out[:, 0]


def check_out(out, q, k, v, kept, scale, softcap, case):
    truth = reference(q, k, v, kept, scale, softcap, torch.float64)
    low = reference(q, k, v, kept, scale, softcap, q.dtype).double()
    assert out.shape == q.shape and out.dtype == q.dtype, case
    assert torch.equal(out.isnan(), truth.isnan()), f"NaN pattern differs: {case}"
    fin = truth.isfinite()
    assert torch.equal(out.isfinite(), fin), f"non-finite pattern differs: {case}"
    if fin.any():
        err = (out.double() - truth)[fin].abs().max().item()
        bound = 2 * (low - truth)[fin].abs().max().item() + 1e-3
        assert err <= bound, f"error {err} > {bound}: {case}"


def step(q, k, v, kept, s_new, position, eligible, scale, softcap, tensor_pos, poison, counter=None):
    """The kernel's step against decode.append and the reference; returns the new kept set."""
    from flexdma.perkey.triton_decode import decode_step

    case = f"{tuple(q.shape)} kv={tuple(k.shape)} W={kept.idx.shape[-1]} {q.dtype} score={kept.score.dtype} "
    case += f"pos={position} softcap={softcap}"
    want = decode.append(kept, s_new, position, eligible)
    got = decode.KeptSet(*(t.clone() for t in kept))
    out = torch.full_like(q, NAN) if poison else None  # every element must be written
    pos = torch.tensor([position], device=q.device) if tensor_pos else position
    out = decode_step(q, k, v, got, s_new, pos, eligible, scale, softcap, out=out, counter=counter)
    check_kept(got, want, case)
    check_out(out, q, k, v, want, scale, softcap, case)
    return want, case


def check_step(B, H, KVH, W, D, n, dtype, *, score_dtype=None, s_dtype=None, special=False, transposed=False,
               tensor_pos=False, softcap=0.0, seed=0, device="cpu"):  # fmt: skip
    q, k, v, kept = make(B, H, KVH, W, D, n, dtype, score_dtype=score_dtype, special=special,
                         transposed=transposed, seed=seed, device=device)  # fmt: skip
    s_new, eligible = new_key(kept, s_dtype or kept.score.dtype, seed + 1, special)
    _, case = step(q, k, v, kept, s_new, n, eligible, 1 / math.sqrt(D), softcap, tensor_pos, seed % 2 == 0)
    print("ok", case, flush=True)


def check_zeros(dtype, device="cpu"):
    """-0.0 ties +0.0: a full set whose worst scores are -0.0 (key 2) and +0.0 (key 7). +0.0 does
    not outrank them (plane 0); 0.5 replaces key 7, the higher index of the tie (plane 1)."""
    q, k, v, _ = make(1, 2, 2, 4, 64, 12, dtype, seed=11, device=device)
    idx = torch.tensor([[[0, 2, 7, 9]] * 2], device=device)
    score = torch.tensor([[[1.0, -0.0, 0.0, 2.0]] * 2], dtype=dtype, device=device)
    kept = decode.KeptSet(idx, torch.ones_like(idx, dtype=torch.bool), score)
    s_new = torch.tensor([[0.0, 0.5]], dtype=dtype, device=device)
    eligible = torch.ones(1, 2, dtype=torch.bool, device=device)
    want, case = step(q, k, v, kept, s_new, 12, eligible, 0.125, 0.0, False, True)
    assert want.idx[0, :, 2].tolist() == [7, 12], "the test's premise"
    print("ok signed zeros:", case, flush=True)


def check_empty_batch(dtype, device="cpu"):
    """A batch of 0 rows: an empty output, nothing launched, nothing written."""
    from flexdma.perkey.triton_decode import decode_step

    q, k, v, kept = make(1, 4, 2, 8, 64, 20, dtype, device=device)
    q, k, v = q[:0], k[:0], v[:0]
    kept = decode.KeptSet(*(t[:0] for t in kept))
    out = decode_step(q, k, v, kept, kept.score[..., 0], 20, kept.valid[..., 0], 0.125)
    assert out.shape == (0, 4, 64) and out.dtype == dtype
    print("ok empty batch", flush=True)


def check_loop(B, H, KVH, W, D, n, steps, dtype, *, seed=0, device="cpu"):
    """A decode loop: key after key, each step's kept set and output checked, one counter reused."""
    q, k, v, _ = make(B, H, KVH, W, D, n + steps, dtype, transposed=True, seed=seed, device=device)
    scores = (torch.randn(B, KVH, n, generator=torch.Generator().manual_seed(seed)) * 2).round() / 2  # ties
    scores = scores.to(dtype).to(device)
    kept = decode.last_row(scores, W)
    counter = torch.zeros(B * KVH, dtype=torch.int32, device=device)
    for t in range(steps):
        s_new, eligible = new_key(kept, dtype, seed + 10 + t, special=t % 3 == 2)
        kept, case = step(q, k, v, kept, s_new, n + t, eligible, 0.1, 0.0, t % 2 == 1, True, counter)
        assert not counter.any(), "the counters must be back at 0"
    print("ok loop of", steps, "steps:", case, flush=True)


if __name__ == "__main__":
    from flexdma.perkey import triton_decode

    _patch_bfloat16()
    triton_decode.BW = 128  # the update decision over several blocks of slots at the cases' W
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # NumPy on inf - inf (NaN rows)

    check_step(1, 1, 1, 1, 64, 1, torch.bfloat16)  # one slot, full
    check_step(3, 4, 2, 5, 96, 3, torch.float16, special=True, tensor_pos=True)  # free slots, padded D
    check_step(3, 8, 2, 64, 128, 64, torch.bfloat16, special=True, transposed=True)  # full, ties
    check_step(1, 4, 1, 300, 64, 500, torch.bfloat16, special=True, softcap=5.0, tensor_pos=True)  # 4 splits
    check_step(3, 2, 2, 300, 96, 200, torch.float16, score_dtype=torch.float32, transposed=True)  # free slots
    check_step(3, 4, 4, 5, 64, 40, torch.float16, special=True, softcap=5.0, seed=3)  # NaN / -inf / zeros
    check_step(3, 2, 1, 1, 128, 7, torch.bfloat16, special=True, seed=5, s_dtype=torch.float32)  # s_new rounded
    check_step(1, 4, 2, 64, 64, 30, torch.float16, score_dtype=torch.bfloat16, s_dtype=torch.float32, seed=7)
    sms = triton_decode._sm_count
    triton_decode._sm_count = lambda device: 1  # one program a plane: the blocks in a loop, no partials
    check_step(1, 2, 1, 300, 128, 1000, torch.bfloat16, special=True, softcap=5.0, seed=9)
    triton_decode._sm_count = sms
    check_zeros(torch.bfloat16)
    check_empty_batch(torch.float16)
    check_loop(1, 4, 2, 130, 64, 120, 14, torch.bfloat16)  # 2 splits: free slots fill, then replacements
    check_loop(3, 2, 1, 5, 64, 2, 10, torch.float16, seed=1)
    sys.exit(0)
