"""Cases of the per-key decode step (flexdma::decode_step / decode_append, C++ kernels): the kept
set it updates in place against flexdma.perkey.decode.append, bit for bit, and the new row's
output against the float64 reference over the new kept set (FlashAttention's rule: at most twice
the error of the same computation in the inputs' dtype, plus 1e-3; float64 inputs within 1e-12),
for single steps and a short decode loop, on any device. tests/perkey/test_perkey.py runs them on
the CPU and on CUDA."""

import math

import torch

from flexdma.dense.naive import attention_ref
from flexdma.perkey import decode

NAN, INF = float("nan"), float("inf")


def make(B, H, KVH, W, D, n, dtype, *, score_dtype=None, special=False, transposed=False, seed=0, device="cpu"):
    """q (B, 1, H, D) (not contiguous), a cache of n keys and room for more (k, v (B, Kcap, KVH, D),
    views of (B, KVH, Kcap, D) buffers where `transposed`), and the kept set of its last row with
    its slots shuffled (append takes any slot order). `special`: ties, NaN / -inf / signed-zero
    scores."""
    g = torch.Generator().manual_seed(seed)
    cap = n + 9
    q = torch.randn(H, B, D, generator=g).to(dtype).transpose(0, 1)[:, None]
    kv = [torch.randn(B, KVH, cap, D, generator=g).to(dtype) for _ in range(2)]
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
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    assert torch.equal(a.view(bits)[~a.isnan()], b.view(bits)[~b.isnan()]), f"kept score bits differ: {case}"


def reference(q, k, v, kept, scale, softcap, dtype):
    """attention_ref over the kept set, computed in `dtype` (float64: the truth); q (B, 1, H, D),
    k, v (B, Kcap, KVH, D)."""
    B, KVH, W = kept.idx.shape
    rows = kept.idx.clamp(0, k.shape[1] - 1).transpose(1, 2)[..., None].expand(B, W, KVH, q.shape[-1])
    ks, vs = (t.gather(1, rows).to(dtype) for t in (k, v))
    bias = kept.score[:, :, None, :]
    out, _ = attention_ref(
        q.to(dtype),
        ks,
        vs,
        kept.valid[:, :, None, :],
        bias.double() if dtype == torch.float64 else bias,
        softmax_scale=scale,
        softcap=softcap,
    )
    return out


def check_out(out, q, k, v, kept, scale, softcap, case):
    truth = reference(q, k, v, kept, scale, softcap, torch.float64)
    low = reference(q, k, v, kept, scale, softcap, q.dtype).double()
    assert out.shape == q.shape and out.dtype == q.dtype, case
    assert torch.equal(out.isnan(), truth.isnan()), f"NaN pattern differs: {case}"
    fin = truth.isfinite()
    assert torch.equal(out.isfinite(), fin), f"non-finite pattern differs: {case}"
    if fin.any():
        err = (out.double() - truth)[fin].abs().max().item()
        bound = 1e-12 if q.dtype == torch.float64 else 2 * (low - truth)[fin].abs().max().item() + 1e-3
        assert err <= bound, f"error {err} > {bound}: {case}"


def step(q, k, v, kept, s_new, position, eligible, scale, softcap, tensor_pos):
    """The op's step against decode.append and the reference; returns the new kept set."""
    case = f"{tuple(q.shape)} kv={tuple(k.shape)} W={kept.idx.shape[-1]} {q.dtype} score={kept.score.dtype} "
    case += f"pos={position} softcap={softcap} {q.device.type}"
    want = decode.append(kept, s_new, position, eligible)
    got = decode.KeptSet(*(t.clone() for t in kept))
    pos = torch.tensor([position], device=q.device) if tensor_pos else position
    out = decode.attend_one(q, k, v, got, s_new, pos, eligible, scale, softcap)
    check_kept(got, want, case)
    check_out(out, q, k, v, want, scale, softcap, case)
    return want


def check_step(B, H, KVH, W, D, n, dtype, *, score_dtype=None, s_dtype=None, special=False, transposed=False,
               tensor_pos=False, softcap=0.0, seed=0, device="cpu"):  # fmt: skip
    q, k, v, kept = make(B, H, KVH, W, D, n, dtype, score_dtype=score_dtype, special=special,
                         transposed=transposed, seed=seed, device=device)  # fmt: skip
    s_new, eligible = new_key(kept, s_dtype or kept.score.dtype, seed + 1, special)
    step(q, k, v, kept, s_new, n, eligible, 1 / math.sqrt(D), softcap, tensor_pos)


def check_zeros(dtype, device="cpu"):
    """-0.0 ties +0.0: a full set whose worst scores are -0.0 (key 2) and +0.0 (key 7). +0.0 does
    not outrank them (plane 0); 0.5 replaces key 7, the higher index of the tie (plane 1)."""
    q, k, v, _ = make(1, 2, 2, 4, 64, 12, dtype, seed=11, device=device)
    idx = torch.tensor([[[0, 2, 7, 9]] * 2], device=device)
    score = torch.tensor([[[1.0, -0.0, 0.0, 2.0]] * 2], dtype=dtype, device=device)
    kept = decode.KeptSet(idx, torch.ones_like(idx, dtype=torch.bool), score)
    s_new = torch.tensor([[0.0, 0.5]], dtype=dtype, device=device)
    eligible = torch.ones(1, 2, dtype=torch.bool, device=device)
    want = step(q, k, v, kept, s_new, 12, eligible, 0.125, 0.0, False)
    assert want.idx[0, :, 2].tolist() == [7, 12], "the test's premise"


def check_empty_batch(dtype, device="cpu"):
    """A batch of 0 rows: an empty output, nothing written."""
    q, k, v, kept = make(1, 4, 2, 8, 64, 20, dtype, device=device)
    q, k, v = q[:0], k[:0], v[:0]
    kept = decode.KeptSet(*(t[:0] for t in kept))
    out = decode.attend_one(q, k, v, kept, kept.score[..., 0], 20, kept.valid[..., 0], 0.125)
    assert out.shape == (0, 1, 4, 64) and out.dtype == dtype


def check_loop(B, H, KVH, W, D, n, steps, dtype, *, seed=0, device="cpu"):
    """A decode loop: key after key, each step's kept set and output checked."""
    q, k, v, _ = make(B, H, KVH, W, D, n + steps, dtype, transposed=True, seed=seed, device=device)
    scores = (torch.randn(B, KVH, n, generator=torch.Generator().manual_seed(seed)) * 2).round() / 2  # ties
    scores = scores.to(dtype).to(device)
    kept = decode.last_row(scores, W)
    for t in range(steps):
        s_new, eligible = new_key(kept, dtype, seed + 10 + t, special=t % 3 == 2)
        kept = step(q, k, v, kept, s_new, n + t, eligible, 0.1, 0.0, t % 2 == 1)


def check_all(device):
    """Every case on `device`; the CPU kernel also in float32 and float64."""
    bf16, fp16 = torch.bfloat16, torch.float16
    check_step(1, 1, 1, 1, 64, 1, bf16, device=device)  # one slot, full
    check_step(3, 4, 2, 5, 96, 3, fp16, special=True, tensor_pos=True, device=device)  # free slots
    check_step(3, 8, 2, 64, 128, 64, bf16, special=True, transposed=True, device=device)  # full, ties
    check_step(1, 4, 1, 300, 64, 500, bf16, special=True, softcap=5.0, tensor_pos=True, device=device)
    check_step(3, 2, 2, 300, 96, 200, fp16, score_dtype=torch.float32, transposed=True, device=device)
    check_step(3, 4, 4, 5, 64, 40, fp16, special=True, softcap=5.0, seed=3, device=device)  # NaN / -inf / 0
    check_step(3, 2, 1, 1, 128, 7, bf16, special=True, seed=5, s_dtype=torch.float32, device=device)
    check_step(1, 4, 2, 64, 64, 30, fp16, score_dtype=bf16, s_dtype=torch.float32, seed=7, device=device)
    check_step(1, 2, 1, 300, 128, 1000, bf16, special=True, softcap=5.0, seed=9, device=device)
    check_step(2, 64, 2, 100, 32, 120, bf16, seed=11, device=device)  # 32 query heads a kv head
    check_step(1, 32, 8, 2048, 64, 5000, bf16, seed=1, device=device)  # many splits a plane
    check_step(2, 16, 1, 700, 16, 900, bf16, s_dtype=torch.float32, seed=5, device=device)
    check_step(1, 2, 2, 1000, 256, 1500, bf16, softcap=5.0, seed=7, device=device)
    check_zeros(bf16, device=device)
    check_empty_batch(fp16, device=device)
    check_loop(1, 4, 2, 130, 64, 120, 14, bf16, device=device)  # free slots fill, then replacements
    check_loop(3, 2, 1, 5, 64, 2, 10, fp16, seed=1, device=device)
    if device == "cpu":
        for dt in (torch.float32, torch.float64):
            check_step(3, 4, 2, 64, 128, 64, dt, special=True, transposed=True, device=device)
            check_step(2, 6, 3, 40, 48, 100, dt, softcap=5.0, seed=2, device=device)
            check_zeros(dt, device=device)
            check_loop(2, 4, 2, 20, 32, 15, 8, dt, seed=3, device=device)
