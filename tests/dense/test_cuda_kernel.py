"""The CUDA kernels behind torch.ops.flexdma.fwd / bwd, tested against the float64 reference with
FlashAttention's tolerance rule: output and LSE, dq / dk / dv / dbias, for bf16 / fp16, head dims
32 / 64 / 96 / 128 / 192 / 256 (those the build has), GQA, every broadcast layout of mask and bias,
causal with Q != K, odd lengths, rows with no key, softcap; plus bitwise-deterministic backward and
outputs that are fully written."""

from __future__ import annotations

import math

import pytest
import torch
from utils import assert_close_to_ref, make_mask_bias, make_qkv

import flexdma  # noqa: F401  (registers the ops)
from flexdma import _ext
from flexdma.dense.naive import attention_ref

pytestmark = pytest.mark.gpu

fwd = torch.ops.flexdma.fwd
bwd = torch.ops.flexdma.bwd
DEV = "cuda"

# (Q, K, is_causal, mask pattern, bias pattern, softcap, empty rows)
CASES = {
    "plain": (128, 128, False, None, None, 0.0, False),
    "per_key_causal": (97, 203, True, ("1", "1", "1", "K"), ("1", "1", "1", "K"), 0.0, False),
    "per_row_causal_q_gt_k": (203, 97, True, ("1", "1", "Q", "K"), ("1", "1", "Q", "K"), 0.0, False),
    "full_empty_rows": (77, 130, False, ("B", "H", "Q", "K"), ("B", "H", "Q", "K"), 0.0, True),
    "kv_heads_softcap": (150, 150, True, ("B", "KVH", "Q", "K"), ("1", "KVH", "Q", "K"), 5.0, False),
    "bias_over_keys": (70, 200, False, ("1", "1", "Q", "K"), ("1", "1", "Q", "1"), 0.0, False),
    "one_query": (1, 300, True, None, ("1", "1", "1", "K"), 0.0, False),
    "long_per_row": (600, 700, True, ("1", "1", "Q", "K"), ("1", "1", "Q", "K"), 0.0, False),
    # Mask shared by the heads, bias per query head: heads that share K / V must not share a bias
    # tile (the staged paired-heads forward checks both planes).
    "per_head_bias": (130, 190, True, ("1", "1", "Q", "K"), ("B", "H", "Q", "K"), 0.0, False),
    # Few query tiles, many keys: the forward splits the keys over CTAs and merges the partials.
    "split_keys": (5, 3000, True, ("1", "1", "Q", "K"), ("1", "1", "Q", "K"), 0.0, False),
}


def _head_dims(*dims):
    # A dev build (FLEXDMA_HEAD_DIMS=64,128) lacks some dims: those cases skip, not fail.
    info = _ext.BUILD_INFO
    built = set(info.CUDA_HEAD_DIMS) if info is not None else set()
    return [
        d if d in built else pytest.param(d, marks=pytest.mark.skip(reason=f"head_dim {d} not built")) for d in dims
    ]


def _poison(*shapes_dtypes):
    # NaN-filled blocks freed just before the op: its outputs of the same sizes reuse them, so
    # an element the kernel never writes shows up as NaN.
    bufs = [torch.full(s, float("nan"), dtype=dt, device=DEV) for s, dt in shapes_dtypes]
    del bufs


def _ref(q, k, v, mask, bias, dout, causal, scale, softcap, dtype):
    """(out, lse, dq, dk, dv, dbias) of the reference run in `dtype`."""
    qq, kk, vv = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    bb = bias.detach().to(dtype).requires_grad_(True) if bias is not None else None
    out, lse = attention_ref(qq, kk, vv, mask, bb, is_causal=causal, softmax_scale=scale, softcap=softcap)
    ins = [qq, kk, vv] + ([bb] if bb is not None else [])
    grads = torch.autograd.grad(out, ins, dout.to(dtype))
    db = grads[3] if bb is not None else None
    return out, lse, grads[0], grads[1], grads[2], db


def _dbias_at_out(q, k, v, mask, bias, dout, causal, scale, softcap, out, resid, dbias64):
    """The float64 dbias of the bwd op's own contract: its row term is delta = rowsum(dout (out +
    out_resid)) of the `out` it is given, not the exact rowsum(P dP). The forward's P.V product
    takes P in the input dtype (FlashAttention's design), so out + out_resid is off by ~2^-9 of
    |out| (measured 2e-3 relative), and delta with it; a dbias summed over a few rows of one key
    (one query, a bias broadcast over heads and batch) gathers that into errors up to ~2.2x the
    bf16 eager computation's, while with the float64 out the kernel's dbias is at the CPU kernel's
    accuracy. dS = P (dP - delta - e) with e = dout . (out - out64) a row, so the dbias at the
    given out is dbias64 - d(sum e lse) / d bias (d lse / d bias = P)."""
    qq, kk, vv = (t.detach().cpu().double() for t in (q, k, v))
    bb = bias.detach().cpu().double().requires_grad_(True)
    m = None if mask is None else mask.cpu()
    out64, lse = attention_ref(qq, kk, vv, m, bb, is_causal=causal, softmax_scale=scale, softcap=softcap)
    e = (dout.cpu().double() * (out.cpu().double() + resid.cpu().double() - out64.detach())).sum(-1).transpose(1, 2)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    (g,) = torch.autograd.grad((e * lse).sum(), bb)
    return dbias64.cpu() - g


def _lse_check(lse, lse64, lse_lowp, name):
    lse, lse64, lse_lowp = lse.cpu().double(), lse64.cpu().double(), lse_lowp.cpu().double()
    fin = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(lse), fin), f"{name}: -inf rows differ"
    assert (lse[~fin] == lse64[~fin]).all(), f"{name}: non-finite values differ"
    err = (lse[fin] - lse64[fin]).abs().max().item() if fin.any() else 0.0
    ref_err = (lse_lowp[fin] - lse64[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= 2 * ref_err + 1e-3, f"{name}: lse error {err:.3e} > 2 * {ref_err:.3e} + 1e-3"


def _run_case(dtype, D, H, KVH, spec, B=2):
    Q, K, causal, mp, bp, softcap, empty = spec
    q, k, v = make_qkv(B, Q, K, H, KVH, D, dtype=dtype, device=DEV)
    mask, bias = make_mask_bias(mp, bp, B=B, H=H, KVH=KVH, Q=Q, K=K, dtype=dtype, device=DEV, empty_rows=empty)
    dout = torch.randn(B, Q, H, D, device=DEV).to(dtype)
    scale = 1.0 / math.sqrt(D)
    # Two blocks of out's size: out and out_resid.
    _poison(((B, Q, H, D), dtype), ((B, Q, H, D), dtype), ((B, H, Q), torch.float32))
    out, lse, resid = fwd(q, k, v, mask, bias, scale, causal, softcap, True)
    assert resid.shape == out.shape and resid.dtype == dtype and torch.isfinite(resid).all()
    # dbias too: where the kernel stores it in the bias dtype the buffer comes unfilled.
    _poison(
        ((B, Q, H, D), dtype),
        ((B, K, KVH, D), dtype),
        ((B, K, KVH, D), dtype),
        *([(tuple(bias.shape), dtype)] if bias is not None else []),
    )
    dq, dk, dv, db = bwd(
        dout, q, k, v, mask, bias, out, lse, scale, causal, softcap, bias is not None, True, out_resid=resid
    )
    r64 = _ref(q, k, v, mask, bias, dout, causal, scale, softcap, torch.float64)
    rlo = _ref(q, k, v, mask, bias, dout, causal, scale, softcap, dtype)
    factor = 3.0 if softcap > 0 else 2.0
    assert_close_to_ref(out, r64[0], rlo[0], "out", factor=factor)
    _lse_check(lse, r64[1], rlo[1], "lse")
    for name, got, i in (("dq", dq, 2), ("dk", dk, 3), ("dv", dv, 4)):
        assert_close_to_ref(got, r64[i], rlo[i], name, factor=factor)
    if bias is not None:
        assert db.shape == bias.shape
        at_out = _dbias_at_out(q, k, v, mask, bias, dout, causal, scale, softcap, out, resid, r64[5])
        assert_close_to_ref(db, at_out, rlo[5], "dbias", factor=factor)
    return q, k, v, mask, bias, dout, out, lse, scale, causal, softcap, resid


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", [(2, 1), (2, 2)], ids=["gqa2", "mha"])
@pytest.mark.parametrize("D", _head_dims(32, 64, 96, 128, 192, 256))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fwd_bwd_vs_reference(dtype, D, heads, case):
    _run_case(dtype, D, heads[0], heads[1], CASES[case])


# The warp-specialized forward (D = 64 / 128) gives a CTA 64 rows of two query heads where both
# read one kv head, every operand is broadcast over them (heads per kv head even; mask, bias and
# tile bits each broadcast over an even number of query heads) and 128-row tiles of one head would
# fill the GPU (9 query tiles x 6 or 8 heads x B=3 >= 132 SMs). Pairs across groups of 4 and of 2,
# groups of 3 (never paired), a bias per query head (not paired), and one query (keys split over
# CTAs: not paired).
PAIR_CASES = {
    "model_like": (1100, 1100, True, ("B", "KVH", "Q", "K"), ("B", "KVH", "1", "K"), 0.0, False),
    "kv_heads_softcap": (1100, 1130, True, ("B", "KVH", "Q", "K"), ("1", "KVH", "Q", "K"), 5.0, False),
    "no_mask": (1100, 1100, True, None, None, 0.0, False),
    "per_head_bias": (1100, 1000, True, ("1", "1", "Q", "K"), ("B", "H", "Q", "K"), 0.0, False),
    "one_query": CASES["one_query"],
}


@pytest.mark.parametrize("case", list(PAIR_CASES))
@pytest.mark.parametrize("heads", [(8, 2), (6, 2), (6, 3)], ids=["g4", "g3", "g2x3"])
@pytest.mark.parametrize("D", _head_dims(64, 128))
def test_gqa_head_pairs(D, heads, case):
    _run_case(torch.bfloat16, D, heads[0], heads[1], PAIR_CASES[case], B=3)


def test_block_sparse_mask_skips_tiles_correctly():
    # Whole 64x64 tiles switched off (the kernel skips them without loading K/V) mixed with
    # partially kept tiles.
    B, H, KVH, Q, K, D, dtype = 1, 4, 2, 256, 320, 128, torch.bfloat16
    q, k, v = make_qkv(B, Q, K, H, KVH, D, dtype=dtype, device=DEV)
    blocks = torch.rand(1, 1, Q // 64, (K + 63) // 64, device=DEV) < 0.5
    mask = blocks.repeat_interleave(64, 2).repeat_interleave(64, 3)[..., :K] & (
        torch.rand(1, 1, Q, K, device=DEV) < 0.7
    )
    bias = torch.randn(1, 1, Q, K, device=DEV).to(dtype)
    dout = torch.randn(B, Q, H, D, device=DEV).to(dtype)
    out, lse, resid = fwd(q, k, v, mask, bias, 0.1, True, 0.0, True)
    dq, dk, dv, db = bwd(dout, q, k, v, mask, bias, out, lse, 0.1, True, 0.0, True, True, out_resid=resid)
    r64 = _ref(q, k, v, mask, bias, dout, True, 0.1, 0.0, torch.float64)
    rlo = _ref(q, k, v, mask, bias, dout, True, 0.1, 0.0, dtype)
    assert_close_to_ref(out, r64[0], rlo[0], "out")
    _lse_check(lse, r64[1], rlo[1], "lse")
    for name, got, i in (("dq", dq, 2), ("dk", dk, 3), ("dv", dv, 4), ("dbias", db, 5)):
        assert_close_to_ref(got, r64[i], rlo[i], name)


@pytest.mark.parametrize(
    "shape,Q,K,causal",
    [
        ((1, 1, 256, 320), 256, 320, True),
        ((2, 2, 130, 4000), 130, 4000, False),
        ((1, 1, 1, 70001), 3, 70001, True),
        ((1, 1, 200, 1), 200, 150, True),
    ],
)
def test_tile_meta_cuda_matches_the_host_op(shape, Q, K, causal):
    # (Named without "cpu": the GPU suite deselects tests by `-k "not cpu"`.)
    # Sparse masks with whole empty tiles; a strided (non-contiguous) copy exercises the
    # byte-by-byte path of the CUDA kernel.
    mask = torch.rand(shape) < 0.003
    for m in (mask, mask.transpose(2, 3).contiguous().transpose(2, 3)):
        want = torch.ops.flexdma.tile_meta(m, Q, K, causal)
        got = torch.ops.flexdma.tile_meta(m.to(DEV), Q, K, causal)
        assert torch.equal(got.cpu(), want)


def test_kernels_skip_tiles_by_the_given_tile_meta():
    # The kernels trust the bits: a meta claiming a kept tile is empty makes them skip it. So the
    # result with the true bits must match the reference, and a doctored meta must change it
    # (the bits are read, not recomputed from the mask).
    B, H, KVH, Q, K, D, dtype = 1, 2, 1, 256, 256, 128, torch.bfloat16
    q, k, v = make_qkv(B, Q, K, H, KVH, D, dtype=dtype, device=DEV)
    mask = torch.rand(1, 1, Q, K, device=DEV) < 0.3
    meta = torch.ops.flexdma.tile_meta(mask, Q, K, False)
    out, lse, resid = fwd(q, k, v, mask, None, 0.1, False, 0.0, True, meta)
    out2, lse2, resid2 = fwd(q, k, v, mask, None, 0.1, False, 0.0, True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2) and torch.equal(resid, resid2)
    cut = meta.clone()
    cut[..., 0] &= ~1  # key tile 0 "empty" for every query tile
    out3, _, _ = fwd(q, k, v, mask, None, 0.1, False, 0.0, True, cut)
    keep = mask.clone()
    keep[..., :64] = False
    out4, _, _ = fwd(q, k, v, keep, None, 0.1, False, 0.0, True)
    assert torch.equal(out3, out4) and not torch.equal(out3, out)
    dout = torch.randn_like(out)
    g_meta = bwd(dout, q, k, v, mask, None, out, lse, 0.1, False, 0.0, False, True, meta, out_resid=resid)
    g_none = bwd(dout, q, k, v, mask, None, out, lse, 0.1, False, 0.0, False, True, out_resid=resid)
    for a, b in zip(g_meta[:3], g_none[:3]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("K", [4096, 70001])
@pytest.mark.parametrize("Q", [1, 3])
def test_decode_with_sparse_broadcast_mask(Q, K):
    # Decoding shape: one or a few queries, a mask broadcast over queries that keeps ~1% of the
    # keys in long runs of empty tiles (the forward skips those by the tile activity bits), key splits,
    # and a key length that is not a multiple of the tile.
    B, H, KVH, D, dtype = 1, 4, 1, 128, torch.bfloat16
    q, k, v = make_qkv(B, Q, K, H, KVH, D, dtype=dtype, device=DEV)
    bias = torch.randn(1, KVH, 1, K, device=DEV).to(dtype)
    mask = torch.zeros(1, 1, 1, K, dtype=torch.bool, device=DEV)
    mask[..., torch.randperm(K, device=DEV)[: max(1, K // 100)]] = True
    mask[..., -1] = True  # the tail tile
    _poison(((B, Q, H, D), dtype), ((B, Q, H, D), dtype), ((B, H, Q), torch.float32))
    out, lse, _ = fwd(q, k, v, mask, bias, 0.1, True, 0.0, True)
    r64 = _ref(q, k, v, mask, bias, torch.randn_like(out), True, 0.1, 0.0, torch.float64)
    rlo = _ref(q, k, v, mask, bias, torch.randn_like(out), True, 0.1, 0.0, dtype)
    assert_close_to_ref(out, r64[0], rlo[0], "out")
    _lse_check(lse, r64[1], rlo[1], "lse")


@pytest.mark.parametrize("case", ["per_key_causal", "per_row_causal_q_gt_k", "bias_over_keys"])
@pytest.mark.parametrize("D", _head_dims(128, 256))  # 256: dK and dV in two passes
def test_backward_is_bitwise_deterministic(case, D):
    args = _run_case(torch.bfloat16, D, 4, 1, CASES[case])
    q, k, v, mask, bias, dout, out, lse, scale, causal, softcap, resid = args
    bias_grad = bias is not None
    first = bwd(dout, q, k, v, mask, bias, out, lse, scale, causal, softcap, bias_grad, True, out_resid=resid)
    for _ in range(3):
        again = bwd(dout, q, k, v, mask, bias, out, lse, scale, causal, softcap, bias_grad, True, out_resid=resid)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


def test_forward_without_resid_for_inference():
    # keep_resid=False (no backward will follow) skips out's rounding error and nothing else.
    q, k, v = make_qkv(1, 200, 200, 2, 1, 64, dtype=torch.bfloat16, device=DEV)
    out, lse, resid = fwd(q, k, v, None, None, 0.125, True, 0.0, False)
    out2, lse2, resid2 = fwd(q, k, v, None, None, 0.125, True, 0.0, False, keep_resid=False)
    assert resid.shape == out.shape and resid2.numel() == 0
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    # The residual is out's rounding error: |resid| <= half an ulp of out.
    assert (resid.float().abs() <= out.float().abs() * 2.0**-8 + 1e-30).all()


@pytest.mark.parametrize("dtype,D", [(torch.float32, 64), (torch.bfloat16, 80)])
def test_unsupported_calls_raise(dtype, D):
    q, k, v = make_qkv(1, 8, 8, 2, 1, D, dtype=dtype, device=DEV)
    with pytest.raises(RuntimeError, match="does not support"):
        fwd(q, k, v, None, None, 0.1, False, 0.0, False)


@pytest.mark.parametrize("K", [300, 320], ids=["k300", "k320"])
@pytest.mark.parametrize("heads", [(4, 1), (4, 2)], ids=["gqa4", "gqa2x2"])
def test_dbias_in_bias_dtype_sums_query_heads(heads, K):
    # B = 1 and a bias (1, 1 | KVH, Q, K): nothing is left to sum after the kernel, so the dkv
    # kernel stores dbias in the bias dtype itself, after summing dS over the query heads of a
    # plane in shared memory, into a buffer nobody zero-filled (poisoned here): the tiles that no
    # head keeps are zeroed by the kernels too. Per-head masks with whole 64x64 tiles off make the
    # heads of one query tile skip differently (first / last head of a tile vary); an empty row;
    # odd lengths; K = 320 has 16-byte aligned dbias rows, K = 300 not.
    H, KVH = heads
    B, Q, D, dtype = 1, 203, 128, torch.bfloat16
    q, k, v = make_qkv(B, Q, K, H, KVH, D, dtype=dtype, device=DEV)
    blocks = torch.rand(1, H, (Q + 63) // 64, (K + 63) // 64, device=DEV) < 0.6
    mask = blocks.repeat_interleave(64, 2).repeat_interleave(64, 3)[:, :, :Q, :K]
    mask = mask & (torch.rand(1, H, Q, K, device=DEV) < 0.7)
    mask[0, 1, 7] = False
    bias = torch.randn(1, 1 if KVH == 1 else KVH, Q, K, device=DEV).to(dtype)
    dout = torch.randn(B, Q, H, D, device=DEV).to(dtype)
    out, lse, resid = fwd(q, k, v, mask, bias, 0.1, True, 0.0, True)
    _poison(((B, Q, H, D), dtype), ((B, K, KVH, D), dtype), ((B, K, KVH, D), dtype), (tuple(bias.shape), dtype))
    first = bwd(dout, q, k, v, mask, bias, out, lse, 0.1, True, 0.0, True, True, out_resid=resid)
    assert first[3].dtype == dtype and first[3].shape == bias.shape
    r64 = _ref(q, k, v, mask, bias, dout, True, 0.1, 0.0, torch.float64)
    rlo = _ref(q, k, v, mask, bias, dout, True, 0.1, 0.0, dtype)
    for name, got, i in (("dq", first[0], 2), ("dk", first[1], 3), ("dv", first[2], 4), ("dbias", first[3], 5)):
        assert_close_to_ref(got, r64[i], rlo[i], name)
    for _ in range(2):
        again = bwd(dout, q, k, v, mask, bias, out, lse, 0.1, True, 0.0, True, True, out_resid=resid)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


def _peak_over(fn):
    """(result, bytes the call's peak allocation reached above what was allocated before it)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    return result, torch.cuda.max_memory_allocated() - before


@pytest.mark.parametrize("D", _head_dims(128))
def test_workspaces_come_from_torchs_allocator(D):
    # The backward's float dQ accumulator (Q x H x D floats) and the split forward's partial rows
    # are tensors of the caching allocator: they show in its peak, and running out of memory for
    # them is torch.OutOfMemoryError, not an illegal address.
    B, Q, K, H = 1, 4096, 4096, 2
    q, k, v = (torch.randn(B, n, H, D, device=DEV, dtype=torch.bfloat16) for n in (Q, K, K))
    scale = D**-0.5
    (out, lse, resid), _ = _peak_over(lambda: fwd(q, k, v, None, None, scale, True, 0.0, False))
    dout = torch.randn_like(out)
    grads, peak = _peak_over(
        lambda: bwd(dout, q, k, v, None, None, out, lse, scale, True, 0.0, False, False, None, resid)
    )
    outputs = sum(g.numel() * g.element_size() for g in grads)
    acc = B * H * Q * D * 4
    assert peak >= outputs + acc, (peak, outputs, acc)
    del grads
    # Decode: one query row over many keys splits the keys; the partial rows are the workspace.
    q1 = q[:, :1]
    _, peak = _peak_over(lambda: fwd(q1, k, v, None, None, scale, True, 0.0, False, None, False))
    assert peak >= 2 * B * H * (D + 1) * 4, peak  # two splits at least
    # A limit below the dQ accumulator: the allocation fails in torch, before any kernel runs.
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    # The allocator's limit counts reserved memory: room for the outputs, not for the accumulator.
    room = torch.cuda.memory_reserved() + outputs + acc // 4
    torch.cuda.set_per_process_memory_fraction(room / total)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            bwd(dout, q, k, v, None, None, out, lse, scale, True, 0.0, False, False, None, resid)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    # And the op still works afterwards (no sticky CUDA error).
    torch.cuda.synchronize()
    fwd(q, k, v, None, None, scale, True, 0.0, False)
    torch.cuda.synchronize()
