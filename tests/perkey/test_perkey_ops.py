"""flexdma::perkey_fwd / perkey_bwd on CPU: the top-k rank keep rule (key_rank, row_thr) against the
float64 reference run with the dense bool mask it stands for, plus opcheck and input checks."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Tuple

import pytest
import torch
from utils import assert_close_to_ref, assert_no_nan, make_qkv, reference_with_grads

import flexdma  # noqa: F401  (registers fake kernels and autograd)
from flexdma.dense.naive import causal_mask

perkey_fwd = torch.ops.flexdma.perkey_fwd
perkey_bwd = torch.ops.flexdma.perkey_bwd

INT32_MAX = 2**31 - 1


# ------------------------------------------------------------------------ the rank planes, slowly
def rank_planes(
    scores: torch.Tensor, eligible: torch.Tensor, W: int, Q: int, is_causal: bool, empty_rows=()
) -> Tuple[torch.Tensor, torch.Tensor]:
    """key_rank (Bs, Hs, K) and row_thr (Bs, Hs, Q) int32 of a per-row top-W selection.

    scores / eligible are (Bs, Hs, K). In each plane the eligible keys are ordered by
    (score desc, index asc); a key's rank is its position in that order, INT32_MAX if ineligible.
    Row i keeps the W first keys of that order among those it may see (all, or j <= i + K - Q
    under causality), so its threshold is the rank of the last of them; -1 if it keeps none.
    Rows listed in empty_rows keep nothing.
    """
    Bs, Hs, K = scores.shape
    key_rank = [[[INT32_MAX] * K for _ in range(Hs)] for _ in range(Bs)]
    row_thr = [[[-1] * Q for _ in range(Hs)] for _ in range(Bs)]
    sc, el = scores.tolist(), eligible.tolist()
    for b in range(Bs):
        for h in range(Hs):
            order = sorted((j for j in range(K) if el[b][h][j]), key=lambda j: (-sc[b][h][j], j))
            for r, j in enumerate(order):
                key_rank[b][h][j] = r
            for i in range(Q):
                if i in empty_rows:
                    continue
                seen = [key_rank[b][h][j] for j in order if not is_causal or j <= i + K - Q][:W]
                if seen:
                    row_thr[b][h][i] = seen[-1]
    return torch.tensor(key_rank, dtype=torch.int32), torch.tensor(row_thr, dtype=torch.int32)


def dense_keep(key_rank: torch.Tensor, row_thr: torch.Tensor) -> torch.Tensor:
    """The 4-D bool mask the rule stands for: keep[b, h, i, j] = key_rank[b, h, j] <= row_thr[b, h, i].
    Planes of different (batch, head) extents broadcast like mask operands."""
    return key_rank[:, :, None, :].long() <= row_thr[:, :, :, None].long()


def random_scores(Bs, Hs, K, *, monotone=False):
    """Per-key scores with ties (few distinct values), never all equal; eligibility ~85%.
    monotone: score = -index, so each row keeps its first keys and whole key tiles drop out."""
    if monotone:
        scores = -torch.arange(K, dtype=torch.float64).expand(Bs, Hs, K).clone()
    else:
        scores = torch.randint(0, max(3, K // 4), (Bs, Hs, K)).double()
        scores[..., 0], scores[..., -1] = 1e6, -1e6  # not all equal even at K = 2
    eligible = torch.rand(Bs, Hs, K) < 0.85
    eligible[..., 0] = True
    return scores, eligible


def test_rank_planes_describe_the_top_w_of_each_row():
    # The compact form against a per-row top-W by sorting each row's visible keys directly.
    Q, K, W = 9, 13, 4
    for is_causal in (False, True):
        scores, eligible = random_scores(2, 3, K)
        key_rank, row_thr = rank_planes(scores, eligible, W, Q, is_causal, empty_rows=(5,))
        keep = dense_keep(key_rank, row_thr)
        if is_causal:  # the kernels apply causality on top of the rule
            keep = keep & causal_mask(Q, K)
        for b in range(2):
            for h in range(3):
                for i in range(Q):
                    vis = [j for j in range(K) if eligible[b, h, j] and (not is_causal or j <= i + K - Q)]
                    want = set() if i == 5 else set(sorted(vis, key=lambda j: (-scores[b, h, j].item(), j))[:W])
                    got = {j for j in range(K) if keep[b, h, i, j]}
                    assert got == want, (is_causal, b, h, i)
    # Ties are resolved by index: two equal best scores, W = 1 keeps the lower index.
    key_rank, row_thr = rank_planes(
        torch.tensor([[[1.0, 5.0, 5.0]]]), torch.ones(1, 1, 3, dtype=torch.bool), 1, 1, False
    )
    assert key_rank.tolist() == [[[2, 0, 1]]] and row_thr.tolist() == [[[0]]]


# ------------------------------------------------------------------------ against the reference
@dataclass(frozen=True)
class Case:
    id: str
    B: int = 1
    Q: int = 37
    K: int = 100
    H: int = 2
    KVH: int = 2
    plane: Tuple[str, str] = ("1", "H")  # (Bs, Hs) of key_rank / row_thr
    bias: Tuple[str, str] = ("1", "KVH")  # (batch, heads) of the (., ., 1, K) bias
    causal: bool = False
    W: int = 20
    monotone: bool = False
    empty_rows: Tuple[int, ...] = ()
    softcap: float = 0.0
    D: int = 16


CASES = [
    Case("plain"),
    Case("causal-Q<K", causal=True),
    Case("causal-Q=K", Q=100, K=100, causal=True),
    Case("causal-Q>K", Q=100, K=37, causal=True, W=9),
    Case("decode-Q1", Q=1, K=100, W=30),
    Case("decode-Q1-causal", Q=1, K=100, causal=True, W=30),
    Case("gqa-plane-per-kvh", H=4, KVH=2, plane=("1", "KVH"), bias=("1", "H")),
    Case("gqa-plane-per-h-causal", H=4, KVH=2, plane=("1", "H"), causal=True),
    Case("gqa-plane-broadcast", H=4, KVH=2, plane=("1", "1"), bias=("1", "1")),
    Case("batch-plane-broadcast", B=2, H=4, KVH=2, plane=("1", "KVH"), bias=("B", "KVH"), causal=True),
    Case("batch-plane-per-batch", B=2, H=4, KVH=2, plane=("B", "H"), bias=("B", "H")),
    Case("empty-rows", Q=37, K=100, empty_rows=(0, 17, 36), causal=True),
    Case("tiles-skipped", Q=150, K=300, W=40, monotone=True, plane=("1", "1")),
    Case(
        "tiles-skipped-causal-gqa", B=2, Q=130, K=200, H=4, KVH=2, W=70, monotone=True, plane=("B", "KVH"), causal=True
    ),
    Case("softcap", softcap=5.0, causal=True),
    Case("W-above-eligible", W=1000, causal=True),
]


def _sizes(spec, *, B, H, KVH):
    return tuple({"1": 1, "B": B, "H": H, "KVH": KVH}[s] for s in spec)


def _make(case: Case, dtype, requires_grad=True):
    q, k, v = make_qkv(case.B, case.Q, case.K, case.H, case.KVH, case.D, dtype=dtype, requires_grad=requires_grad)
    Bs, Hs = _sizes(case.plane, B=case.B, H=case.H, KVH=case.KVH)
    scores, eligible = random_scores(Bs, Hs, case.K, monotone=case.monotone)
    key_rank, row_thr = rank_planes(scores, eligible, case.W, case.Q, case.causal, case.empty_rows)
    bb, bh = _sizes(case.bias, B=case.B, H=case.H, KVH=case.KVH)
    bias = (2 * torch.randn(bb, bh, 1, case.K)).to(dtype).requires_grad_(requires_grad)
    return q, k, v, bias, key_rank, row_thr


def _params():
    for c in CASES:
        yield pytest.param(torch.float64, c, id=f"float64-{c.id}")
        yield pytest.param(torch.float32, c, id=f"float32-{c.id}")
    for c in CASES[::3] + [CASES[-5]]:
        yield pytest.param(torch.bfloat16, c, id=f"bfloat16-{c.id}")


@pytest.mark.parametrize("dtype,case", list(_params()))
def test_matches_reference_with_the_dense_mask(dtype, case):
    q, k, v, bias, key_rank, row_thr = _make(case, dtype)
    scale = 1.0 / math.sqrt(case.D)
    out, lse, _ = perkey_fwd(q, k, v, bias, key_rank, row_thr, scale, case.causal, case.softcap, False)
    grad_out = torch.randn_like(out)
    dq, dk, dv, dbias = torch.autograd.grad(out, (q, k, v, bias), grad_out)
    got = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, dbias=dbias)
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
    for name, t in got.items():
        if name != "lse":
            assert_no_nan(name, t)

    mask = dense_keep(key_rank, row_thr)
    kw = dict(is_causal=case.causal, softcap=case.softcap, softmax_scale=scale, bias_grad=True)
    ref = reference_with_grads(q, k, v, mask, bias, grad_out, dtype=torch.float64, **kw)
    if dtype == torch.float64:
        for name, t in got.items():
            fin = torch.isfinite(ref[name])
            assert torch.equal(torch.isfinite(t), fin), name
            torch.testing.assert_close(t[fin], ref[name][fin], rtol=1e-9, atol=1e-9, msg=name)
    else:
        low = None if dtype == torch.float32 else reference_with_grads(q, k, v, mask, bias, grad_out, dtype=dtype, **kw)
        for name, t in got.items():
            assert_close_to_ref(
                t, ref[name], None if low is None else low[name], name, factor=3.0 if case.softcap else 2.0
            )

    empty = torch.isneginf(ref["lse"])
    if case.empty_rows:
        assert empty.any()
    if empty.any():  # rows that keep nothing: out 0, lse -inf, no gradient into q
        assert torch.isneginf(lse[empty]).all()
        assert (out.detach().transpose(1, 2)[empty] == 0).all()
        assert (dq.transpose(1, 2)[empty] == 0).all()


def test_row_thr_minus_one_everywhere_gives_zeros():
    case = Case("all-empty", B=2, H=4, KVH=2, causal=True)
    q, k, v, bias, key_rank, _ = _make(case, torch.float32)
    row_thr = torch.full((1, 4, case.Q), -1, dtype=torch.int32)
    out, lse, _ = perkey_fwd(q, k, v, bias, key_rank, row_thr, 0.25, True, 0.0, False)
    assert (out == 0).all() and torch.isneginf(lse).all()
    grads = torch.autograd.grad(out, (q, k, v, bias), torch.randn_like(out))
    for g in grads:
        assert (g == 0).all()


def test_gradcheck_fp64_bias_and_inputs():
    case = Case(
        "gc", B=2, Q=6, K=9, H=4, KVH=2, plane=("B", "KVH"), bias=("1", "H"), W=4, causal=True, D=4, empty_rows=(1,)
    )
    q, k, v, bias, key_rank, row_thr = _make(case, torch.float64)

    def f(q, k, v, b):
        return perkey_fwd(q, k, v, b, key_rank, row_thr, 0.375, True, 2.0, False)[0]

    assert torch.autograd.gradcheck(f, (q, k, v, bias), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_backward_is_bitwise_deterministic_across_thread_counts():
    case = Case("det", B=2, Q=150, K=200, H=4, KVH=2, plane=("1", "KVH"), bias=("1", "1"), W=50, causal=True, D=32)
    q, k, v, bias, key_rank, row_thr = _make(case, torch.float32, requires_grad=False)
    out, lse, _ = perkey_fwd(q, k, v, bias, key_rank, row_thr, 0.2, True, 0.0, False)
    grad_out = torch.randn_like(out)
    args = (grad_out, q, k, v, bias, key_rank, row_thr, out, lse, 0.2, True, 0.0, True, True)
    first = perkey_bwd(*args)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = perkey_bwd(*args)
    finally:
        torch.set_num_threads(threads)
    for a, b, name in zip(first, single, ("dq", "dk", "dv", "dbias")):
        assert torch.equal(a, b), f"{name} differs between thread counts"


def test_tile_keys_is_accepted_and_ignored_on_cpu():
    case = Case("tk", Q=70, K=130, causal=True)
    q, k, v, bias, key_rank, row_thr = _make(case, torch.float32, requires_grad=False)
    out0, lse0, _ = perkey_fwd(q, k, v, bias, key_rank, row_thr, 0.25, True, 0.0, False)
    junk = torch.zeros(3, dtype=torch.int32)
    out1, lse1, _ = perkey_fwd(q, k, v, bias, key_rank, row_thr, 0.25, True, 0.0, False, junk)
    assert torch.equal(out0, out1) and torch.equal(lse0, lse1)


# ------------------------------------------------------------------------ opcheck
@pytest.mark.parametrize("is_causal", [False, True])
def test_opcheck_perkey_fwd(is_causal):
    case = Case("oc", B=2, Q=5, K=7, H=4, KVH=2, plane=("1", "KVH"), bias=("B", "1"), W=3, causal=is_causal, D=8)
    q, k, v, bias, key_rank, row_thr = _make(case, torch.float32)
    torch.library.opcheck(perkey_fwd, (q, k, v, bias, key_rank, row_thr, 0.25, is_causal, 0.0, False))


@pytest.mark.parametrize("bias_requires_grad", [False, True])
def test_opcheck_perkey_bwd(bias_requires_grad):
    case = Case("oc", B=2, Q=5, K=7, H=4, KVH=2, plane=("B", "H"), bias=("1", "KVH"), W=3, causal=True, D=8)
    q, k, v, bias, key_rank, row_thr = _make(case, torch.float32, requires_grad=False)
    out, lse, _ = perkey_fwd(q, k, v, bias, key_rank, row_thr, 0.25, True, 0.0, False)
    dbias = perkey_bwd(
        torch.randn_like(out), q, k, v, bias, key_rank, row_thr, out, lse, 0.25, True, 0.0, bias_requires_grad, True
    )[3]
    assert dbias.shape == (bias.shape if bias_requires_grad else (0,))
    torch.library.opcheck(
        perkey_bwd,
        (torch.randn_like(out), q, k, v, bias, key_rank, row_thr, out, lse, 0.25, True, 0.0, bias_requires_grad, True),
    )


def test_no_double_backward():
    case = Case("dd", Q=5, K=7, W=3, D=8)
    q, k, v, bias, key_rank, row_thr = _make(case, torch.float64)
    out = perkey_fwd(q, k, v, bias, key_rank, row_thr, 0.25, False, 0.0, False)[0]
    (dq,) = torch.autograd.grad(out.sum(), (q,), create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        dq.sum().backward()


# ------------------------------------------------------------------------ rejected inputs
def _rejected_inputs():
    B, Q, K, H, KVH = 2, 5, 7, 4, 2
    kr = torch.zeros(1, KVH, K, dtype=torch.int32)
    rt = torch.zeros(1, KVH, Q, dtype=torch.int32)
    bias = torch.zeros(1, KVH, 1, K)
    wide = torch.zeros(1, KVH, 2 * K, dtype=torch.int32)
    return [
        ("key_rank-int64", dict(key_rank=kr.long()), "key_rank must be int32"),
        ("row_thr-float", dict(row_thr=rt.float()), "row_thr must be int32"),
        ("key_rank-4d", dict(key_rank=kr[:, :, None]), r"key_rank must be 3-D \(batch, heads, K\)"),
        ("key_rank-len", dict(key_rank=kr[..., : K - 1]), "key_rank last dim 6 must be K = 7"),
        ("row_thr-len", dict(row_thr=torch.zeros(1, KVH, K, dtype=torch.int32)), "row_thr last dim 7 must be Q = 5"),
        (
            "key_rank-heads",
            dict(key_rank=torch.zeros(1, 3, K, dtype=torch.int32)),
            "key_rank head dim 3 must be 1, 2 or 4",
        ),
        (
            "row_thr-batch",
            dict(row_thr=torch.zeros(3, KVH, Q, dtype=torch.int32)),
            "row_thr batch dim 3 must be 1 or 2",
        ),
        ("key_rank-strided", dict(key_rank=wide[..., ::2]), "key_rank must be contiguous in its last dim"),
        ("bias-per-row", dict(attn_bias=torch.zeros(1, KVH, Q, K)), "per-key bias of shape"),
        ("bias-dtype", dict(attn_bias=bias.double()), "attn_bias dtype"),
        ("bias-heads", dict(attn_bias=torch.zeros(1, 3, 1, K)), "attn_bias head dim 3 must be 1, 2 or 4"),
    ], dict(B=B, Q=Q, K=K, H=H, KVH=KVH, key_rank=kr, row_thr=rt, attn_bias=bias)


_REJECTED, _GOOD = _rejected_inputs()


@pytest.mark.parametrize("which", ["fwd", "bwd"])
@pytest.mark.parametrize("name,override,message", _REJECTED, ids=[r[0] for r in _REJECTED])
def test_rejected_inputs(which, name, override, message):
    g = _GOOD
    q, k, v = make_qkv(g["B"], g["Q"], g["K"], g["H"], g["KVH"], 8)
    kw = dict(attn_bias=g["attn_bias"], key_rank=g["key_rank"], row_thr=g["row_thr"])
    out, lse, _ = perkey_fwd(
        q, k, v, kw["attn_bias"], kw["key_rank"], kw["row_thr"], 0.25, False, 0.0, False
    )  # valid as given
    kw.update(override)
    with pytest.raises(RuntimeError, match=message):
        if which == "fwd":
            perkey_fwd(q, k, v, kw["attn_bias"], kw["key_rank"], kw["row_thr"], 0.25, False, 0.0, False)
        else:
            perkey_bwd(
                torch.randn_like(out),
                q,
                k,
                v,
                kw["attn_bias"],
                kw["key_rank"],
                kw["row_thr"],
                out,
                lse,
                0.25,
                False,
                0.0,
                True,
                True,
            )


def _cuda_operands(D, seed=0, offset=0):
    """A causal GQA call on CUDA (bf16) and its selection with `tile_rows`-row lists: the operands of
    perkey_fwd, q starting `offset` elements into its storage."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    B, L, H, KVH, W = 2, 200, 4, 2, 50
    q = torch.randn(B * L * H * D + offset, device=dev, generator=g).bfloat16()[offset:].view(B, L, H, D)
    k, v = (torch.randn(B, L, KVH, D, device=dev, generator=g).bfloat16() for _ in range(2))
    bias = torch.randn(B, KVH, 1, L, device=dev, generator=g).bfloat16()
    return q, k, v, bias, W


def _call(q, k, v, bias, W, softcap=0.0, requires_grad=True):
    from flexdma import _dispatch

    return _dispatch.Call.of(
        q, k, v, None, bias, is_causal=True, softcap=softcap, keep_window_size=W, requires_grad=requires_grad
    )


@pytest.mark.gpu
@pytest.mark.parametrize("bias_requires_grad", [False, True])
def test_opcheck_cuda_ops(bias_requires_grad):
    # perkey_fwd / perkey_bwd's CUDA kernels (the C++ ones): schema, fake kernels and dispatch, on
    # lists from perkey_select with the kernels' 128-row tiles.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from flexdma.perkey import route

    q, k, v, bias, W = _cuda_operands(64)
    why = route.kernels_reason(_call(q, k, v, bias, W), True, False)
    if why is not None:
        pytest.skip(f"the C++ per-key kernels do not run here: {why}")
    assert route.decide("cuda", _call(q, k, v, bias, W)) == route.Route("cuda", "cuda", "cuda", 128)
    rank, thr, keys = torch.ops.flexdma.perkey_select(bias[:, :, 0], W, q.shape[1], True, 128)
    fwd_args = (q, k, v, bias, rank, thr, 0.125, True, 0.0, False, keys)
    torch.library.opcheck(perkey_fwd, fwd_args)
    out, lse, resid = perkey_fwd(*fwd_args)
    bwd_args = (torch.randn_like(out), q, k, v, bias, rank, thr, out, lse, 0.125, True, 0.0, bias_requires_grad)
    torch.library.opcheck(perkey_bwd, bwd_args + (False, keys, resid))


@pytest.mark.gpu
@pytest.mark.parametrize("bias_requires_grad", [False, True])
def test_opcheck_triton_ops(bias_requires_grad):
    # The Triton kernels' ops (flexdma_triton::perkey_fwd / perkey_bwd) with the route's tile rows:
    # head dim 32, which the C++ kernels do not take.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    from flexdma.perkey import route

    q, k, v, bias, W = _cuda_operands(32)
    r = route.decide("cuda", _call(q, k, v, bias, W))
    assert (r.forward, r.backward) == ("triton", "triton"), r
    rank, thr, keys = torch.ops.flexdma.perkey_select(bias[:, :, 0], W, q.shape[1], True, r.tile_rows)
    fwd_args = (q, k, v, bias, rank, thr, 0.125, True, 0.0, False, keys, r.tile_rows)
    torch.library.opcheck(torch.ops.flexdma_triton.perkey_fwd, fwd_args)
    out, lse, resid = torch.ops.flexdma_triton.perkey_fwd(*fwd_args)
    bwd_args = (torch.randn_like(out), q, k, v, bias, rank, thr, out, lse, 0.125, True, 0.0, bias_requires_grad)
    torch.library.opcheck(torch.ops.flexdma_triton.perkey_bwd, bwd_args + (False, keys, resid, r.tile_rows))


@pytest.mark.gpu
def test_cuda_ops_refuse_what_their_check_refuses():
    # The C++ kernels' check (flexdma._C.perkey_unsupported_reason) is the one the ops run before
    # launching: a softcap or the deterministic mode in the backward, q rows off 16 bytes, a bias in
    # another dtype; each refused by the op with the check's reason, and routed to Triton.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from flexdma.perkey import route

    q, k, v, bias, W = _cuda_operands(64)
    if route.kernels_reason(_call(q, k, v, bias, W), True, False) is not None:
        pytest.skip("the C++ per-key kernels do not run here")
    rank, thr, keys = torch.ops.flexdma.perkey_select(bias[:, :, 0], W, q.shape[1], True, 128)
    out, lse, resid = perkey_fwd(q, k, v, bias, rank, thr, 0.125, True, 0.0, False, keys)
    dout = torch.randn_like(out)

    def bwd(softcap=0.0, deterministic=False):
        return perkey_bwd(dout, q, k, v, bias, rank, thr, out, lse, 0.125, True, softcap, True, deterministic, keys)

    call = _call(q, k, v, bias, W, softcap=5.0)
    why = route.kernels_reason(call, True, False)
    assert "softcap" in why and route.kernels_reason(call, False, False) is None
    with pytest.raises(ValueError, match=re.escape(why)):
        bwd(softcap=5.0)
    why = route.kernels_reason(_call(q, k, v, bias, W), True, True)
    assert "deterministic" in why
    with pytest.raises(ValueError, match=re.escape(why)):
        bwd(deterministic=True)
    prev, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert route.kernels_reason(_call(q, k, v, bias, W), True, False) == why
        with pytest.raises(ValueError, match=re.escape(why)):
            bwd()
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=warn)
    q_off = _cuda_operands(64, offset=4)[0]
    why = route.kernels_reason(_call(q_off, k, v, bias, W), False, False)
    assert "16-byte" in why
    with pytest.raises(ValueError, match=re.escape(why)):
        perkey_fwd(q_off, k, v, bias, rank, thr, 0.125, True, 0.0, False, keys)
    assert "bias" in route.kernels_reason(_call(q, k, v, bias.float(), W), False, False)
    for call in (_call(q_off, k, v, bias, W), _call(q, k, v, bias, W, softcap=5.0)):
        if flexdma._ext.HAVE_TRITON:
            r = route.decide("cuda", call)
            assert (r.forward, r.backward) == ("triton", "triton"), r


def test_perkey_check_takes_the_routes_arguments():
    # flexdma._C.perkey_unsupported_reason parses the argument list route.kernels_reason hands it (a
    # CPU build answers that it has no CUDA kernels); a short list is a TypeError.
    from flexdma import _ext

    check = _ext.C.perkey_unsupported_reason
    key = (2, 8, 2, 64, 300, 300, 2, 2, 0.0, True, 1024, 90, True, False)
    why = check(*key)
    with pytest.raises(TypeError):
        check(*key[:-1])
    if not _ext.with_cuda():
        assert why == "flexdma was built without CUDA kernels"
        return
    refused = check(*key[:8], 5.0, *key[9:])  # the backward under a softcap
    assert refused is not None and ("softcap" in refused or refused == why), (why, refused)


def test_route_pairs_the_forward_with_its_backward(monkeypatch):
    # A call a backward follows takes the C++ forward only where the C++ backward takes it too (each
    # forward op's autograd runs its own backward op): decide asks the C++ check with the
    # backward's conditions, the deterministic flag and torch's deterministic mode among them.
    # Simulated on CPU: an sm_90 build and device, and a C++ check that refuses the deterministic
    # backward.
    from flexdma import _dispatch, _ext
    from flexdma.perkey import route

    asked = []

    def check(name, key):
        assert name == "perkey_unsupported_reason"
        asked.append(key)
        backward, deterministic = key[-2:]
        return "the per-key backward is not deterministic" if backward and deterministic else None

    monkeypatch.setattr(_ext, "kernels_reason", check)
    monkeypatch.setattr(_ext, "with_cuda", lambda: True)
    monkeypatch.setattr(route, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(_ext, "HAVE_TRITON", True)
    q, k, v = make_qkv(1, 300, 300, 4, 2, 64, dtype=torch.bfloat16)
    bias = torch.randn(1, 2, 1, 300).bfloat16()
    call = _dispatch.Call.of(q, k, v, None, bias, is_causal=True, softcap=0.0, keep_window_size=40, requires_grad=True)
    call = call._replace(device=torch.device("cuda", 0))
    assert route.decide("cuda", call) == route.Route("cuda", "cuda", "cuda", 128)
    assert asked[-1][-2:] == (True, False)
    r = route.decide("cuda", call, deterministic=True)
    assert (r.forward, r.backward) == ("triton", "triton") and r.tile_rows == route.triton_tiles(4, 2, 2, 64)[1]
    prev, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert route.decide("cuda", call).forward == "triton"
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=warn)
    # No backward follows: the C++ forward, whatever the backward would need.
    assert route.decide("cuda", call._replace(requires_grad=False), deterministic=True).forward == "cuda"
    assert asked[-1][-2:] == (False, True)
    monkeypatch.setattr(_ext, "HAVE_TRITON", False)
    with pytest.raises(ValueError, match="triton is not installed"):
        route.decide("cuda", call, deterministic=True)


# ------------------------------------------------------------------------ eager calls' direct path
class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_plain_eager_refuses_modes_transforms_and_subclasses():
    # The eager calls that skip the dispatcher's hop (flexdma._ops.Direct) are only those where the
    # dispatcher would send them to the tensors' device kernel.
    from flexdma import _ops

    x = torch.ones(3)
    assert _ops.plain_eager((x, torch.nn.Parameter(torch.ones(2))))
    with _Recorder():
        assert not _ops.plain_eager((x,))
    with torch.overrides.TorchFunctionMode():
        assert not _ops.plain_eager((x,))
    seen = []
    torch.vmap(lambda t: seen.append(_ops.plain_eager((t,))) or t)(torch.ones(2, 3))
    assert seen == [False]

    class Sub(torch.Tensor):
        pass

    assert not _ops.plain_eager((x.as_subclass(Sub),))
    # Traced by torch.compile it is False without a graph break (the checks are not traceable).
    torch._dynamo.reset()
    f = torch.compile(lambda t: t * (2 if _ops.plain_eager((t,)) else 3), fullgraph=True, backend="eager")
    assert torch.equal(f(x), torch.full((3,), 3.0))
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 32])
@pytest.mark.parametrize("bias_requires_grad", [False, True])
def test_eager_cuda_call_runs_the_routed_kernels(D, bias_requires_grad):
    # An eager per-key call on CUDA runs the route's ops: the C++ kernels (flexdma::perkey_fwd /
    # perkey_bwd, registered in C++) where they take the call, else the Triton kernels without the
    # dispatcher's hop into their Python-registered ops (under a dispatch mode it goes through the
    # ops: flexdma_triton::perkey_fwd / perkey_bwd). Both give the same outputs and gradients.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from torch.profiler import ProfilerActivity, profile

    from flexdma.perkey import route

    torch.manual_seed(0)
    B, L, H, KVH, W = 1, 700, 4, 2, 128
    q, k, v = make_qkv(B, L, L, H, KVH, D, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    bias = torch.randn(B, KVH, 1, L, device="cuda").exp().bfloat16().requires_grad_(bias_requires_grad)
    leaves = (q, k, v, bias) if bias_requires_grad else (q, k, v)
    g = torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16)
    r = route.decide("cuda", _call(q, k, v, bias, W))
    if r.forward == "triton":
        pytest.importorskip("triton")
    ns = "flexdma" if r.forward == "cuda" else "flexdma_triton"

    def step():
        out = flexdma.flash_dma_attention(q, k, v, None, bias, is_causal=True, keep_window_size=W)
        return (out, *torch.autograd.grad(out, leaves, g))

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        direct = step()
    names = {e.name for e in prof.events()}
    if r.forward == "cuda":
        assert {"flexdma::perkey_fwd", "flexdma::perkey_bwd"} <= names, sorted(names)
        assert not any(n.startswith("flexdma_triton::") for n in names), sorted(names)
    else:
        assert "flexdma_triton::perkey_fwd" not in names and "flexdma_triton::perkey_bwd" not in names, sorted(names)
    with _Recorder() as rec:
        through_ops = step()
    assert f"{ns}.perkey_fwd.default" in rec.ops and f"{ns}.perkey_bwd.default" in rec.ops, rec.ops
    torch.testing.assert_close(direct[0], through_ops[0], atol=0, rtol=0)
    for a, b in zip(direct[1:], through_ops[1:]):  # float atomics: the same sums in other orders
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
