"""The torch.ops.flexdma op family itself: registration checks (opcheck), float64 gradcheck of the
CPU kernel including the bias gradient, and bitwise-deterministic backward."""

from __future__ import annotations

import pytest
import torch
from utils import make_mask_bias, make_qkv

import flexdma  # noqa: F401  (registers fake kernels and autograd)

fwd = torch.ops.flexdma.fwd
bwd = torch.ops.flexdma.bwd


def _inputs(
    with_mask,
    with_bias,
    *,
    dtype=torch.float32,
    B=2,
    Q=5,
    K=7,
    H=4,
    KVH=2,
    D=16,
    mask_pattern=("B", "1", "Q", "K"),
    bias_pattern=("1", "KVH", "Q", "K"),
    requires_grad=True,
    bias_requires_grad=True,
):
    q, k, v = make_qkv(B, Q, K, H, KVH, D, dtype=dtype, requires_grad=requires_grad)
    mask, bias = make_mask_bias(
        mask_pattern if with_mask else None,
        bias_pattern if with_bias else None,
        B=B,
        H=H,
        KVH=KVH,
        Q=Q,
        K=K,
        dtype=dtype,
        bias_requires_grad=bias_requires_grad and with_bias,
    )
    return q, k, v, mask, bias


MASK_BIAS = [(False, False), (True, False), (False, True), (True, True)]


@pytest.mark.parametrize("with_mask,with_bias", MASK_BIAS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_opcheck_fwd(with_mask, with_bias, is_causal):
    q, k, v, mask, bias = _inputs(with_mask, with_bias)
    torch.library.opcheck(fwd, (q, k, v, mask, bias, 0.25, is_causal, 0.0, False))


@pytest.mark.parametrize("with_mask,with_bias", MASK_BIAS)
@pytest.mark.parametrize("bias_requires_grad", [False, True])
def test_opcheck_bwd(with_mask, with_bias, bias_requires_grad):
    # The backward op has no derivative of its own (no double backward), so its inputs do not
    # require grad here.
    q, k, v, mask, bias = _inputs(with_mask, with_bias, requires_grad=False, bias_requires_grad=False)
    out, lse, _ = fwd(q, k, v, mask, bias, 0.25, True, 0.0, False)
    grad_out = torch.randn_like(out)
    torch.library.opcheck(bwd, (grad_out, q, k, v, mask, bias, out, lse, 0.25, True, 0.0, bias_requires_grad, False))


def test_bwd_returns_empty_dbias_when_not_requested():
    q, k, v, mask, bias = _inputs(True, True, requires_grad=False)
    out, lse, _ = fwd(q, k, v, mask, bias, 0.25, False, 0.0, False)
    *_, dbias = bwd(torch.randn_like(out), q, k, v, mask, bias, out, lse, 0.25, False, 0.0, False, False)
    assert dbias.shape == (0,)
    *_, dbias = bwd(torch.randn_like(out), q, k, v, mask, bias, out, lse, 0.25, False, 0.0, True, False)
    assert dbias.shape == bias.shape


def test_cpu_fwd_returns_no_out_resid_and_bwd_needs_none():
    # out_resid serves the CUDA backward's row sums; the CPU backward computes its own, so the CPU
    # forward returns it empty and the backward gives the same bits with or without one.
    q, k, v, mask, bias = _inputs(True, True, requires_grad=False, bias_requires_grad=False)
    out, lse, resid = fwd(q, k, v, mask, bias, 0.25, True, 0.0, False)
    assert resid.shape == (0,) and resid.dtype == q.dtype
    args = (torch.randn_like(out), q, k, v, mask, bias, out, lse, 0.25, True, 0.0, True, True)
    plain = bwd(*args)
    for given in (None, resid, q.new_empty((0,))):
        got = bwd(*args, out_resid=given)
        for a, b, name in zip(plain, got, ("dq", "dk", "dv", "dbias")):
            assert torch.equal(a, b), f"{name} differs with out_resid={given}"
    torch.library.opcheck(bwd, args + (None, resid))
    # keep_resid=False (no backward will follow) changes nothing else.
    out2, lse2, resid2 = fwd(q, k, v, mask, bias, 0.25, True, 0.0, False, keep_resid=False)
    assert torch.equal(out, out2) and torch.equal(lse, lse2) and resid2.shape == (0,)
    torch.library.opcheck(fwd, (q, k, v, mask, bias, 0.25, True, 0.0, False, None, False))


GRADCHECK_CASES = [
    # (name, kwargs for _inputs, is_causal, softcap)
    ("plain", dict(with_mask=False, with_bias=False), False, 0.0),
    ("mask+bias", dict(with_mask=True, with_bias=True), False, 0.0),
    ("causal-Q>K", dict(with_mask=True, with_bias=True, Q=9, K=6), True, 0.0),
    ("causal-Q<K-softcap", dict(with_mask=False, with_bias=True, Q=4, K=9), True, 3.0),
    ("bias-1xHx1xK", dict(with_mask=False, with_bias=True, bias_pattern=("1", "H", "1", "K")), True, 0.0),
    ("bias-Bx1xQx1", dict(with_mask=True, with_bias=True, bias_pattern=("B", "1", "Q", "1")), False, 0.0),
    (
        "bias-1x1x1x1-mqa",
        dict(with_mask=True, with_bias=True, bias_pattern=("1", "1", "1", "1"), H=3, KVH=1),
        False,
        0.0,
    ),
    ("mask-empty-rows", dict(with_mask=True, with_bias=True, mask_pattern=("1", "H", "Q", "1")), False, 0.0),
]


@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=[c[0] for c in GRADCHECK_CASES])
def test_gradcheck_fp64(case):
    _, kw, is_causal, softcap = case
    kw = dict(kw)
    kw.setdefault("D", 8)
    q, k, v, mask, bias = _inputs(dtype=torch.float64, **kw)
    inputs = (q, k, v) + ((bias,) if bias is not None else ())

    def f(q, k, v, *b):
        out, _, _ = fwd(q, k, v, mask, b[0] if b else None, 0.375, is_causal, softcap, False)
        return out

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_fp64_several_tiles():
    # More than one 64-wide query and key tile; the bias is broadcast over keys, whose gradient
    # is summed across key tiles in a fixed order.
    q, k, v, mask, bias = _inputs(
        True,
        True,
        dtype=torch.float64,
        B=1,
        Q=70,
        K=131,
        H=2,
        KVH=1,
        D=4,
        mask_pattern=("1", "1", "Q", "K"),
        bias_pattern=("1", "H", "Q", "1"),
    )

    def f(q, k, v, b):
        return fwd(q, k, v, mask, b, 0.5, True, 0.0, False)[0]

    assert torch.autograd.gradcheck(f, (q, k, v, bias), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def _backward_once(q, k, v, mask, bias, grad_out, is_causal, softcap):
    out, lse, resid = fwd(q, k, v, mask, bias, 0.2, is_causal, softcap, True)
    return bwd(grad_out, q, k, v, mask, bias, out, lse, 0.2, is_causal, softcap, True, True, out_resid=resid)


@pytest.mark.parametrize(
    "bias_pattern", [("B", "H", "Q", "K"), ("1", "KVH", "1", "K"), ("1", "1", "Q", "1")], ids=lambda p: "x".join(p)
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_is_bitwise_deterministic(bias_pattern, dtype):
    q, k, v, mask, bias = _inputs(
        True, True, dtype=dtype, B=2, Q=150, K=200, H=8, KVH=2, D=64, bias_pattern=bias_pattern, requires_grad=False
    )
    grad_out = torch.randn(q.shape).to(dtype)
    first = _backward_once(q, k, v, mask, bias, grad_out, True, 0.0)
    again = _backward_once(q, k, v, mask, bias, grad_out, True, 0.0)
    # The work split must not matter either: the order of every sum is fixed per work item.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = _backward_once(q, k, v, mask, bias, grad_out, True, 0.0)
    finally:
        torch.set_num_threads(threads)
    for a, b, c, name in zip(first, again, single, ("dq", "dk", "dv", "dbias")):
        assert torch.equal(a, b), f"{name} differs between two runs"
        assert torch.equal(a, c), f"{name} differs between thread counts"


@pytest.mark.parametrize(
    "bias_pattern", [("1", "KVH", "1", "K"), ("1", "1", "Q", "1"), ("1", "H", "Q", "K")], ids=lambda p: "x".join(p)
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_backward_schedules_give_the_same_bits(bias_pattern, dtype):
    # The CPU backward runs fused (one work item per (batch, kv head)) when B * KVH >= 2 x the
    # thread count, else split in two passes: B * KVH = 2 takes the fused schedule on 1 thread
    # and the split one on 3. Both must give the same bits.
    q, k, v, mask, bias = _inputs(
        True,
        True,
        dtype=dtype,
        B=1,
        Q=150,
        K=200,
        H=4,
        KVH=2,
        D=32,
        mask_pattern=("1", "H", "Q", "K"),
        bias_pattern=bias_pattern,
        requires_grad=False,
    )
    grad_out = torch.randn(q.shape, dtype=dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        fused = _backward_once(q, k, v, mask, bias, grad_out, True, 0.0)
        torch.set_num_threads(3)
        split = _backward_once(q, k, v, mask, bias, grad_out, True, 0.0)
    finally:
        torch.set_num_threads(threads)
    for a, b, name in zip(fused, split, ("dq", "dk", "dv", "dbias")):
        assert torch.equal(a, b), f"{name} differs between the fused and the split backward"


# ---- tile activity bits (flexdma::tile_meta) ----


def tile_meta_ref(mask: torch.Tensor, Q: int, K: int, is_causal: bool) -> torch.Tensor:
    """The bits spelled out: word w of row (b, h, qt) has bit i set iff the 64 x 64 tile
    (qt, 32 w + i) keeps some (q, k) of the mask broadcast to Q x K, under bottom-right causality."""
    m = mask.expand(mask.shape[0], mask.shape[1], Q, K).cpu()
    if is_causal:
        m = m & (torch.arange(K)[None, :] <= torch.arange(Q)[:, None] + (K - Q))
    nq, nk = -(-Q // 64), -(-K // 64)
    tiles = torch.zeros(*mask.shape[:2], nq * 64, nk * 64, dtype=torch.bool)
    tiles[..., :Q, :K] = m
    active = tiles.view(*mask.shape[:2], nq, 64, nk, 64).any(dim=(3, 5))  # (B, H, nq, nk)
    words = torch.zeros(*mask.shape[:2], nq, -(-nk // 32), dtype=torch.int64)
    for kt in range(nk):
        words[..., kt // 32] |= active[..., kt].long() << (kt % 32)
    return words.to(torch.int64)


def _as_uint(meta: torch.Tensor) -> torch.Tensor:
    return meta.to(torch.int64) & 0xFFFFFFFF


TILE_META_CASES = [
    # (mask shape, Q, K, causal)
    ((1, 1, 130, 200), 130, 200, False),
    ((2, 3, 130, 200), 130, 200, True),  # Q < K: bottom-right diagonal
    ((1, 2, 300, 97), 300, 97, True),  # Q > K: leading rows see nothing
    ((2, 1, 1, 3000), 5, 3000, True),  # broadcast over queries, > 32 key tiles (2 words)
    ((1, 1, 70, 1), 70, 150, False),  # broadcast over keys
    ((1, 1, 1, 4100), 1, 4100, True),  # decoding row
]


@pytest.mark.parametrize("shape,Q,K,causal", TILE_META_CASES)
def test_tile_meta_matches_reference(shape, Q, K, causal):
    torch.manual_seed(0)
    # Sparse masks, so that whole tiles are empty; plus one all-false plane.
    mask = torch.rand(shape) < 0.002
    mask[0, 0] = False
    got = torch.ops.flexdma.tile_meta(mask, Q, K, causal)
    assert got.dtype == torch.int32 and got.shape == tile_meta_ref(mask, Q, K, causal).shape
    assert torch.equal(_as_uint(got), tile_meta_ref(mask, Q, K, causal))
    dense = torch.ones(shape, dtype=torch.bool)
    assert torch.equal(_as_uint(torch.ops.flexdma.tile_meta(dense, Q, K, causal)), tile_meta_ref(dense, Q, K, causal))


def test_opcheck_tile_meta_and_fwd_bwd_with_it():
    q, k, v, mask, bias = _inputs(True, True, Q=70, K=90, requires_grad=False, bias_requires_grad=False)
    torch.library.opcheck(torch.ops.flexdma.tile_meta, (mask, 70, 90, True))
    meta = torch.ops.flexdma.tile_meta(mask, 70, 90, True)
    torch.library.opcheck(fwd, (q, k, v, mask, bias, 0.25, True, 0.0, False, meta))
    out, lse, _ = fwd(q, k, v, mask, bias, 0.25, True, 0.0, False, meta)
    out0, lse0, _ = fwd(q, k, v, mask, bias, 0.25, True, 0.0, False)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)
    torch.library.opcheck(
        bwd, (torch.randn_like(out), q, k, v, mask, bias, out, lse, 0.25, True, 0.0, True, False, meta)
    )


def test_tile_meta_that_does_not_fit_the_mask_is_refused():
    q, k, v, mask, bias = _inputs(True, False, Q=70, K=90, requires_grad=False)
    wrong = torch.ops.flexdma.tile_meta(mask[:, :, :5], 5, 90, False)  # another query length
    with pytest.raises(RuntimeError, match="tile_meta must be a contiguous int32 tensor of shape"):
        fwd(q, k, v, mask, None, 0.25, False, 0.0, False, wrong)
    with pytest.raises(RuntimeError, match="tile_meta given without attn_mask"):
        fwd(q, k, v, None, None, 0.25, False, 0.0, False, torch.ops.flexdma.tile_meta(mask, 70, 90, False))
    with pytest.raises(RuntimeError, match="4-D bool attn_mask"):
        torch.ops.flexdma.tile_meta(mask.float(), 70, 90, False)
    with pytest.raises(RuntimeError, match="does not broadcast to"):
        torch.ops.flexdma.tile_meta(mask, 71, 90, False)


def test_autograd_hands_the_forward_tile_meta_to_the_backward(monkeypatch):
    # The API computes the bits once (on CUDA) and autograd keeps them for bwd; on CPU the op
    # takes them as an optional input the same way.
    from flexdma.dense import ops as dense_ops

    q, k, v, mask, bias = _inputs(True, True, Q=70, K=90)
    meta = torch.ops.flexdma.tile_meta(mask, 70, 90, True)
    seen = []
    real_bwd = dense_ops.bwd

    def spy(*args):
        seen.append(args[13])  # tile_meta (out_resid follows it)
        return real_bwd(*args)

    monkeypatch.setattr(dense_ops, "bwd", spy)
    out, _, _ = fwd(q, k, v, mask, bias, 0.25, True, 0.0, False, meta)
    out.sum().backward()
    assert len(seen) == 1 and seen[0] is not None and torch.equal(seen[0], meta)
    grads = [t.grad.clone() for t in (q, k, v, bias)]
    for t in (q, k, v, bias):
        t.grad = None
    fwd(q, k, v, mask, bias, 0.25, True, 0.0, False)[0].sum().backward()
    for g, t in zip(grads, (q, k, v, bias)):
        assert torch.equal(g, t.grad)


# ---- the kernel's baseline copy (CPUs without AVX2) ----

_BASELINE_SCRIPT = r"""
import sys
import torch
sys.path.insert(0, sys.argv[2])
import flexdma  # noqa: F401
from utils import make_mask_bias, make_qkv

torch.manual_seed(0)
runs = []
for dtype in (torch.float32, torch.float64, torch.bfloat16):
    for causal, softcap in ((True, 0.0), (False, 3.0)):
        # D = 40 and Q = 70: partial vector blocks and partial 6-row blocks of the tile GEMMs.
        q, k, v = make_qkv(2, 70, 131, 4, 2, 40, dtype=dtype, requires_grad=True)
        mask, bias = make_mask_bias(("B", "1", "Q", "K"), ("1", "KVH", "1", "K"), B=2, H=4, KVH=2, Q=70, K=131,
                                    dtype=dtype, bias_requires_grad=True, empty_rows=True)
        out, lse, _ = torch.ops.flexdma.fwd(q, k, v, mask, bias, 0.25, causal, softcap, False)
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v, bias), grad_out)
        runs.append(dict(inputs=[t.detach() for t in (q, k, v)] + [mask, bias.detach(), grad_out], causal=causal,
                         softcap=softcap, got=dict(zip(("out", "lse", "dq", "dk", "dv", "dbias"),
                                                       [out.detach(), lse, *grads]))))
torch.save(runs, sys.argv[1])
"""


def _cpu_has_avx2_fma():
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


def test_baseline_copy_matches_reference(tmp_path):
    # FLEXDMA_CPU_NO_AVX2=1 makes the kernel run the copy compiled for the build's baseline
    # target, the one CPUs without AVX2 (and non-x86 CPUs) always run.
    import os
    import subprocess
    import sys

    from utils import assert_close_to_ref, reference_with_grads

    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # utils.py's folder
    path = tmp_path / "baseline.pt"
    subprocess.run(
        [sys.executable, "-c", _BASELINE_SCRIPT, str(path), tests_dir],
        check=True,
        timeout=900,
        env=dict(os.environ, FLEXDMA_CPU_NO_AVX2="1"),
    )
    differs = False
    for run in torch.load(path):
        q, k, v, mask, bias, grad_out = run["inputs"]
        kw = dict(is_causal=run["causal"], softcap=run["softcap"], softmax_scale=0.25, bias_grad=True)
        ref = reference_with_grads(q, k, v, mask, bias, grad_out, dtype=torch.float64, **kw)
        low = (
            None
            if q.dtype != torch.bfloat16
            else reference_with_grads(q, k, v, mask, bias, grad_out, dtype=q.dtype, **kw)
        )
        for name, t in run["got"].items():
            assert_close_to_ref(
                t, ref[name], None if low is None else low[name], name, factor=3.0 if run["softcap"] else 2.0
            )
        if q.dtype == torch.float32:
            out, _, _ = fwd(q, k, v, mask, bias, 0.25, run["causal"], run["softcap"], False)
            differs |= not torch.equal(out, run["got"]["out"])
    if _cpu_has_avx2_fma():
        # This process runs the AVX2 copy (other rounding: fused multiply-adds): the variable took effect.
        assert differs, "FLEXDMA_CPU_NO_AVX2=1 gave the AVX2 copy's bits"


def test_bias_constant_along_keys_has_zero_gradient():
    # Softmax ignores a per-row shift: the op returns that gradient as exact zeros in the bias's
    # shape and dtype (summed from dS it would be rounding noise), and the other gradients are
    # those of the same call without the bias.
    q, k, v, mask, _ = _inputs(True, False, requires_grad=False, bias_requires_grad=False)
    bias = torch.randn(q.shape[0], q.shape[2], q.shape[1], 1, dtype=q.dtype)
    out, lse, resid = fwd(q, k, v, mask, bias, 0.25, True, 0.0, False)
    dout = torch.randn_like(out)
    dq, dk, dv, dbias = bwd(dout, q, k, v, mask, bias, out, lse, 0.25, True, 0.0, True, False)
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype and not dbias.any()
    out0, lse0, _ = fwd(q, k, v, mask, None, 0.25, True, 0.0, False)
    ref = bwd(dout, q, k, v, mask, None, out0, lse0, 0.25, True, 0.0, False, False)
    for name, a, b in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[:3]):
        torch.testing.assert_close(a, b, msg=name)
