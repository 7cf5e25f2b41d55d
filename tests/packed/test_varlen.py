"""flexdma.flash_dma_attention_varlen: packed sequences equal the same sequences run one by one
(out, LSE and every gradient), on random lengths including 0 and 1, GQA, causal and not, no bias
and a per-key bias with and without the per-key selection; rejected inputs."""

import pytest
import torch
from utils import assert_graph_replays, poison_allocator

import flexdma
from flexdma.dense.naive import attention_ref

BACKENDS = ["cpu", "reference"]


def _pack(lengths_q, lengths_k, H, KVH, D, bias_heads, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lengths_q), sum(lengths_k)
    q = torch.randn(tq, H, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    k = torch.randn(tk, KVH, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    v = torch.randn(tk, KVH, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    bias = None
    if bias_heads:
        bias = (torch.randn(bias_heads, tk, generator=g, dtype=torch.float64) * 2).to(dtype).requires_grad_()
    cu = lambda ls: torch.tensor([0] + torch.tensor(ls).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    return q, k, v, bias, cu(lengths_q), cu(lengths_k)


def _packed_plan(q, k, v, bias, cq, lq, lk, causal, W, backend="auto"):
    """The dispatch's plan of a packed call, as flash_dma_attention_varlen makes it."""
    from flexdma import _dispatch

    call = _dispatch.Call.packed(q, k, v, bias, cq, max(lq), max(lk), is_causal=causal, softcap=0.0, keep_window_size=W)
    return _dispatch.plan(backend, call, False)


def _runs_packed(plan) -> bool:
    """Whether the plan runs the op family's packed form (not sequence by sequence)."""
    from flexdma.dense import attention as dense_attention
    from flexdma.perkey import attention as perkey_attention

    return plan.layout == "packed" and plan.run in (dense_attention.packed_op, perkey_attention.packed)


# opcheck's checks: all of them, or those that compare no outputs.
_NO_COMPARE = ("test_schema", "test_faketensor", "test_autograd_registration")
_ALL = _NO_COMPARE + ("test_aot_dispatch_static", "test_aot_dispatch_dynamic")


def _packed_forward(q, k, v, bias, cq, ck, max_q, max_k, scale, causal, W, tile_rows):
    """The op family's packed forward as the dispatch runs it: (op, args, opcheck's checks) of the
    selection (with a window) and of the forward op, and the forward's outputs."""
    lengths = (cq, ck, max_q, max_k)
    if not W:
        args = (q, k, v, None, bias, scale, causal, 0.0, False, None, True, *lengths)
        return [(torch.ops.flexdma.fwd, args, _ALL)], torch.ops.flexdma.fwd(*args), None
    sel_args = (bias, W, q.shape[0], causal, tile_rows, *lengths)
    rank, thr, lists = torch.ops.flexdma.perkey_select(*sel_args)
    args = (q, k, v, bias, rank, thr, scale, causal, 0.0, False, lists, *lengths)
    # The lists' row count is a size of the op's own (a data-dependent size to the trace: no static
    # AOT check), and the CUDA selection leaves each list's entries past its length unspecified: its
    # outputs are not compared (eager against traced) there.
    sel_utils = _NO_COMPARE + (("test_aot_dispatch_dynamic",) if q.device.type == "cpu" else ())
    ops = [(torch.ops.flexdma.perkey_select, sel_args, sel_utils), (torch.ops.flexdma.perkey_fwd, args, _ALL)]
    return ops, torch.ops.flexdma.perkey_fwd(*args), (rank, thr, lists)


def _packed_backward_args(do, q, k, v, bias, cq, ck, max_q, max_k, scale, causal, W, fwd, sel, deterministic=False):
    out, lse, resid = fwd
    lengths = (cq, ck, max_q, max_k)
    if not W:
        return torch.ops.flexdma.bwd, (
            do, q, k, v, None, bias, out, lse, scale, causal, 0.0, bias is not None, deterministic, None, resid,
            *lengths,
        )  # fmt: skip
    rank, thr, lists = sel
    return torch.ops.flexdma.perkey_bwd, (
        do, q, k, v, bias, rank, thr, out, lse, scale, causal, 0.0, True, deterministic, lists, resid, *lengths,
    )  # fmt: skip


def _reference(q, k, v, bias, lq, lk, causal, W):
    """The documents one by one through the float64 reference (a dense mask for the selection)."""
    outs, lses = [], []
    oq = ok = 0
    for nq, nk in zip(lq, lk):
        qs, ks, vs = q[None, oq : oq + nq], k[None, ok : ok + nk], v[None, ok : ok + nk]
        b = None if bias is None else bias[None, :, None, ok : ok + nk]
        mask = None
        if W is not None:
            mask = flexdma.create_mask(b.detach(), W, is_causal=causal, query_len=nq)
        o, lse = attention_ref(qs, ks, vs, mask, b, is_causal=causal)
        outs.append(o[0])
        lses.append(lse[0])
        oq, ok = oq + nq, ok + nk
    return torch.cat(outs), torch.cat(lses, 1)


CASES = [
    # (lengths q, lengths k, H, KVH, bias heads, causal, W)
    ([5, 0, 1, 9, 3], [5, 0, 1, 9, 3], 4, 2, 0, True, None),
    ([5, 0, 1, 9, 3], [5, 0, 1, 9, 3], 4, 2, 2, False, None),
    ([7, 1, 12], [7, 1, 12], 2, 1, 1, True, 4),  # W below some documents' lengths, above others
    ([3, 6, 0, 11], [5, 6, 2, 11], 4, 4, 4, True, 3),  # Q < K per document: bottom-right causal
    ([4, 10], [4, 10], 4, 2, 2, False, 20),  # W above every length
    ([1], [1], 2, 2, 2, True, 1),
]
# Queries without keys: their rows are 0 with LSE -inf.
NO_KEYS = [([2, 3, 1], [0, 4, 0], 2, 1, 1, True, 2), ([2, 3], [0, 4], 4, 2, 0, False, None)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES + NO_KEYS)
def test_packed_equals_documents_one_by_one(backend, case):
    lq, lk, H, KVH, bh, causal, W = case
    q, k, v, bias, cq, ck = _pack(lq, lk, H, KVH, 16, bh, torch.float64, seed=len(lq) + H)
    out, lse = flexdma.flash_dma_attention_varlen(
        q, k, v, cq, ck, max(lq), max(lk), bias, is_causal=causal, keep_window_size=W, return_lse=True, backend=backend
    )
    assert out.shape == q.shape and lse.shape == (H, sum(lq))
    ref, ref_lse = _reference(q, k, v, bias, lq, lk, causal, W)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)
    leaves = [t for t in (q, k, v, bias) if t is not None]
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, do)
    want = torch.autograd.grad(ref, leaves, do)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_bf16_within_the_rule(device):
    # bf16 against the float64 reference: error at most ~2x the bf16 reference's, plus a floor.
    lq = [6, 1, 20, 0, 13]
    q, k, v, bias, cq, ck = _pack(lq, lq, 4, 2, 16, 2, torch.float64, seed=3)
    ref, _ = _reference(q, k, v, bias, lq, lq, True, 8)
    lo = [t.detach().to(torch.bfloat16) for t in (q, k, v, bias)]
    dev = [t.to(device) for t in lo]
    out = flexdma.flash_dma_attention_varlen(
        *dev[:3], cq.to(device), ck.to(device), 20, 20, dev[3], is_causal=True, keep_window_size=8
    ).cpu()
    ref_lo, _ = _reference(*lo[:3], lo[3], lq, lq, True, 8)
    err, err_ref = (out.double() - ref).abs().max(), (ref_lo.double() - ref).abs().max()
    assert err <= 2 * err_ref + 1e-3, (err, err_ref)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(cu_seqlens_q=torch.tensor([0, 3, 5])), "int32"),
        (dict(cu_seqlens_q=torch.tensor([0, 3, 4], dtype=torch.int32)), "end at the token count"),
        (dict(cu_seqlens_q=torch.tensor([0, 6, 5], dtype=torch.int32), max_seqlen_q=9), "decrease"),
        (dict(cu_seqlens_k=torch.tensor([0, 5], dtype=torch.int32)), "same sequences"),
        (dict(max_seqlen_q=2), "longer than max_seqlen"),
        (dict(max_seqlen_k=torch.tensor(5)), "Python int"),
        (dict(attn_bias=torch.randn(2, 5, 5)), "per-key attn_bias"),
        (dict(attn_bias=torch.randn(3, 5)), "per-key attn_bias"),
        (dict(keep_window_size=2), "needs|by attn_bias"),
        (dict(query=torch.randn(1, 5, 4, 8)), "3-D"),
    ],
)
def test_rejected_inputs(change, match):
    kw = dict(
        query=torch.randn(5, 4, 8),
        key=torch.randn(5, 2, 8),
        value=torch.randn(5, 2, 8),
        cu_seqlens_q=torch.tensor([0, 3, 5], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 3, 5], dtype=torch.int32),
        max_seqlen_q=3,
        max_seqlen_k=3,
    )
    kw.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        flexdma.flash_dma_attention_varlen(**kw)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_opcheck_and_compile_and_export(device):
    # The packed call runs the op family's packed form (the selection and flexdma::perkey_fwd,
    # flexdma::fwd without a window) on the CPU and, where its kernels take the call (bf16, a built
    # head dim), on CUDA: opcheck, torch.compile with fullgraph, and torch.export with a dynamic
    # token count and number of sequences.
    dtype, D = (torch.float32, 16) if device == "cpu" else (torch.bfloat16, 64)
    # `f` below is one code object for both devices: after the other device's compile, Dynamo would
    # trace the head dim as a symbol (automatic dynamic shapes) and fullgraph stops at the scale check.
    torch._dynamo.reset()

    lq = [5, 0, 3, 8]
    q, k, v, bias, cq, ck = (
        t.detach().to(device).requires_grad_(t.is_floating_point()) for t in _pack(lq, lq, 4, 2, D, 2, dtype, seed=5)
    )
    tile_rows = 128 if device == "cuda" else 64
    for window in (0, 4):
        ops, fwd, sel = _packed_forward(q, k, v, bias, cq, ck, 8, 8, 0.25, True, window, tile_rows)
        for op, args, checks in ops:
            torch.library.opcheck(op, args, test_utils=checks)

    def f(q, k, v, cq, ck, bias):
        return flexdma.flash_dma_attention_varlen(q, k, v, cq, ck, 8, 8, bias, is_causal=True, keep_window_size=4)

    eager = f(q, k, v, cq, ck, bias)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, cq, ck, bias)
    torch.testing.assert_close(compiled, eager)

    class M(torch.nn.Module):
        def forward(self, q, k, v, cq, ck, bias):
            return f(q, k, v, cq, ck, bias)

    total, seqs = torch.export.Dim("total", min=2, max=4096), torch.export.Dim("seqs", min=2, max=1024)
    ep = torch.export.export(
        M(),
        (q, k, v, cq, ck, bias),
        dynamic_shapes=({0: total}, {0: total}, {0: total}, {0: seqs}, {0: seqs}, {1: total}),
    )
    torch.testing.assert_close(ep.module()(q, k, v, cq, ck, bias), eager)
    lq2 = [2, 8, 6]  # another token count and another number of sequences
    q2, k2, v2, b2, cq2, ck2 = (
        t.detach().to(device).requires_grad_(t.is_floating_point()) for t in _pack(lq2, lq2, 4, 2, D, 2, dtype, seed=6)
    )
    want = f(q2, k2, v2, cq2, ck2, b2)
    torch.testing.assert_close(ep.module()(q2, k2, v2, cq2, ck2, b2), want)


@pytest.mark.parametrize("case", CASES + NO_KEYS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_packed_cpu_ops_equal_their_padded_form_sequence_by_sequence(case, dtype):
    # The CPU kernels' packed form (flexdma::perkey_select / perkey_fwd / perkey_bwd, fwd / bwd with
    # offsets) against the same ops' padded form on each sequence's views: bit for bit the
    # selection, out, LSE and every gradient; the backward reads the forward's selection.
    from flexdma.perkey import contract

    lq, lk, H, KVH, bh, causal, W = case
    q, k, v, bias, cq, ck = (
        None if t is None else t.detach() for t in _pack(lq, lk, H, KVH, 16, bh, dtype, seed=7 * len(lq) + H)
    )
    T, lengths = 64, (cq, ck, max(lq), max(lk))
    do = torch.randn(q.shape, dtype=torch.float64).to(dtype)
    if W:
        # The selection ranks a float64 bias by its order, as the API hands it.
        scores = contract.float64_order(bias[None])[0] if dtype == torch.float64 else bias
        rank, thr, lists = torch.ops.flexdma.perkey_select(scores, W, q.shape[0], causal, T, *lengths)
        out, lse, resid = torch.ops.flexdma.perkey_fwd(
            q, k, v, bias, rank, thr, 0.25, causal, 0.0, False, lists, *lengths
        )
        grads = torch.ops.flexdma.perkey_bwd(
            do, q, k, v, bias, rank, thr, out, lse, 0.25, causal, 0.0, True, False, lists, resid, *lengths
        )
    else:
        out, lse, resid = torch.ops.flexdma.fwd(q, k, v, None, bias, 0.25, causal, 0.0, False, None, True, *lengths)
        grads = torch.ops.flexdma.bwd(
            do, q, k, v, None, bias, out, lse, 0.25, causal, 0.0, bias is not None, False, None, resid, *lengths
        )
    oq = ok = 0
    for nq, nk in zip(lq, lk):
        qs, ks, vs, ds = q[None, oq : oq + nq], k[None, ok : ok + nk], v[None, ok : ok + nk], do[None, oq : oq + nq]
        b = None if bias is None else bias[None, :, None, ok : ok + nk]
        if nq and nk and W:
            want = torch.ops.flexdma.perkey_select(scores[None, :, ok : ok + nk], W, nq, causal, T)
            rk, th = rank[None, :, ok : ok + nk], thr[None, :, oq : oq + nq]
            assert torch.equal(rk, want[0]) and torch.equal(th, want[1])
            o, ls, r = torch.ops.flexdma.perkey_fwd(qs, ks, vs, b, want[0], want[1], 0.25, causal, 0.0, False)
            g = torch.ops.flexdma.perkey_bwd(
                ds, qs, ks, vs, b, want[0], want[1], o, ls, 0.25, causal, 0.0, True, False, None, r
            )
        elif nq and nk:
            o, ls, r = torch.ops.flexdma.fwd(qs, ks, vs, None, b, 0.25, causal, 0.0, False, None, True)
            g = torch.ops.flexdma.bwd(ds, qs, ks, vs, None, b, o, ls, 0.25, causal, 0.0, b is not None, False, None, r)
        if nq and nk:
            assert torch.equal(out[oq : oq + nq], o[0]) and torch.equal(lse[:, oq : oq + nq], ls[0])
            assert torch.equal(grads[0][oq : oq + nq], g[0][0])
            assert torch.equal(grads[1][ok : ok + nk], g[1][0]) and torch.equal(grads[2][ok : ok + nk], g[2][0])
            if b is not None:
                assert torch.equal(grads[3][:, ok : ok + nk], g[3].reshape(-1, nk))
        elif nq:  # rows without keys: 0, LSE -inf, no gradient
            assert not out[oq : oq + nq].any() and (lse[:, oq : oq + nq] == float("-inf")).all()
            assert not grads[0][oq : oq + nq].any()
        oq, ok = oq + nq, ok + nk


# ---- the packed per-key kernels (the per-key ops' packed form), on a GPU ----

# (lengths q, lengths k, H, KVH, bias heads, causal, W): several 128-row query tiles and 4096-key
# selection chunks in one sequence, empty and one-token sequences, queries without keys, Q < K.
PACKED_CASES = [
    ([300, 0, 1, 4500, 129, 77], [300, 0, 1, 4500, 129, 77], 4, 2, 2, True, 200),
    ([300, 0, 1, 4500, 129, 77], [300, 0, 1, 4500, 129, 77], 4, 2, 1, False, 16),
    ([128, 5, 1000, 0, 260], [128, 9, 1000, 3, 300], 4, 1, 4, True, 64),
    ([1, 2, 3], [1, 0, 3], 2, 2, 2, True, 1),
]


def _cpp_perkey_ok(D):
    """Whether the C++ per-key kernels (forward and backward) take bf16 calls of head dim D here."""
    if not torch.cuda.is_available():
        return False
    from flexdma import _dispatch
    from flexdma.perkey import route

    q, k, v = (torch.empty(1, 128, 2, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    bias = torch.empty(1, 2, 1, 128, dtype=torch.bfloat16, device="cuda")
    call = _dispatch.Call.of(q, k, v, None, bias, is_causal=True, softcap=0.0, keep_window_size=8, requires_grad=True)
    return route.kernels_reason(call, True, False) is None


def _documents(q, k, v, bias, do, lq, lk, run):
    """The documents one by one through run(qs, ks, vs, b, dos) on views ((1, n, heads, D), the bias
    (1, heads, 1, nk) or None) -> (out, lse, (dq, dk, dv, dbias)): out, LSE and the gradients of q,
    k, v and the bias (None without one) in the packed layout."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out, lse = torch.zeros_like(q), torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device, dtype=acc)
    grads = [None if t is None else torch.zeros_like(t) for t in (q, k, v, bias)]
    oq = ok = 0
    for nq, nk in zip(lq, lk):
        if nq and nk:
            qs, ks, vs, ds = q[None, oq : oq + nq], k[None, ok : ok + nk], v[None, ok : ok + nk], do[None, oq : oq + nq]
            b = None if bias is None else bias[None, :, None, ok : ok + nk]
            o, ls, g = run(qs, ks, vs, b, ds)
            out[oq : oq + nq], lse[:, oq : oq + nq] = o[0], ls[0]
            grads[0][oq : oq + nq], grads[1][ok : ok + nk], grads[2][ok : ok + nk] = g[0][0], g[1][0], g[2][0]
            if b is not None:
                grads[3][:, ok : ok + nk] = g[3].reshape(-1, nk)
        oq, ok = oq + nq, ok + nk
    return out, lse, grads


def _documents_cpp(q, k, v, bias, do, lq, lk, causal, W):
    """_documents through the padded path's per-key ops on CUDA, the C++ kernels (perkey_select with
    their 128-row tiles, perkey_fwd, perkey_bwd)."""
    T = 128

    def run(qs, ks, vs, b, ds):
        rank, thr, lists = torch.ops.flexdma.perkey_select(b[:, :, 0], W, qs.shape[1], causal, T)
        o, ls, r = torch.ops.flexdma.perkey_fwd(qs, ks, vs, b, rank, thr, 0.125, causal, 0.0, False, lists)
        return (
            o,
            ls,
            torch.ops.flexdma.perkey_bwd(
                ds, qs, ks, vs, b, rank, thr, o, ls, 0.125, causal, 0.0, True, False, lists, r
            ),
        )

    return _documents(q, k, v, bias, do, lq, lk, run)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", PACKED_CASES)
def test_cuda_packed_kernels_equal_documents(case, D):
    # One selection and one forward launch for all sequences (offsets read on the device) against the
    # per-document ops: the same selection and tiles, so out and LSE agree up to the rounding of the
    # key splits a short document's own call takes (the packed call splits none), and the gradients
    # up to that and the order of the backward's float adds.
    if not _cpp_perkey_ok(D):
        pytest.skip("needs the sm_90a per-key kernels at this head dim")
    lq, lk, H, KVH, bh, causal, W = case
    q, k, v, bias, cq, ck = (
        t.detach().cuda().requires_grad_(t.is_floating_point())
        for t in _pack(lq, lk, H, KVH, D, bh, torch.bfloat16, seed=sum(lq) + D)
    )
    leaves = (q, k, v, bias)
    assert _runs_packed(_packed_plan(q, k, v, bias, cq, lq, lk, causal, W))
    poison_allocator([q, torch.empty(H, q.shape[0], device="cuda")])
    out, lse = flexdma.flash_dma_attention_varlen(
        q, k, v, cq, ck, max(lq), max(lk), bias, is_causal=causal, keep_window_size=W, return_lse=True,
        softmax_scale=0.125,
    )  # fmt: skip
    do = torch.randn_like(out)
    poison_allocator([q, k, v, bias, *(torch.empty(t.numel(), device="cuda") for t in (k, v, bias))])
    got = torch.autograd.grad(out, leaves, do)
    with torch.no_grad():
        ref, ref_lse, want = _documents_cpp(*(t.detach() for t in leaves), do, lq, lk, causal, W)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, ref, atol=1.6e-2, rtol=1.6e-2)  # two bf16 steps
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert not a.isnan().any(), name
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.gpu
def test_cuda_packed_kernels_within_the_rule():
    # bf16 packed kernels against the float64 reference of the documents: error at most ~2x the
    # bf16 reference's, plus a floor, for out and every gradient.
    if not _cpp_perkey_ok(128):
        pytest.skip("needs the sm_90a per-key kernels at head dim 128")
    _assert_packed_within_the_rule([700, 1, 0, 333, 1500], 128, 96, seed=11)


def _assert_packed_within_the_rule(lq, D, W, seed, backend="auto"):
    """The bf16 packed call on the GPU (causal, GQA, a per-key bias; window W or None) against the
    float64 reference of the documents: error at most ~2x the bf16 reference's, plus a floor, for
    out and every gradient."""
    q, k, v, bias, cq, ck = _pack(lq, lq, 4, 2, D, 2, torch.float64, seed=seed)
    ref, _ = _reference(q, k, v, bias, lq, lq, True, W)
    do = torch.randn(ref.shape, dtype=torch.float64)
    want = torch.autograd.grad(ref, (q, k, v, bias), do)
    lo = [t.detach().to(torch.bfloat16).requires_grad_() for t in (q, k, v, bias)]
    ref_lo, _ = _reference(*lo[:3], lo[3], lq, lq, True, W)
    lo_grads = torch.autograd.grad(ref_lo, lo, do.to(torch.bfloat16))
    dev = [t.detach().cuda().requires_grad_() for t in lo]
    out = flexdma.flash_dma_attention_varlen(
        *dev[:3], cq.cuda(), ck.cuda(), max(lq), max(lq), dev[3], is_causal=True, keep_window_size=W, backend=backend
    )
    grads = torch.autograd.grad(out, dev, do.to(torch.bfloat16).cuda())
    for name, a, a_lo, w in zip(
        ("out", "dq", "dk", "dv", "dbias"), (out,) + grads, (ref_lo,) + lo_grads, (ref,) + want
    ):
        err, err_ref = (a.cpu().double() - w).abs().max(), (a_lo.double() - w).abs().max()
        assert err <= 2 * err_ref + 1e-3 * w.abs().max(), (name, err, err_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("W", [64, None], ids=["per-key", "dense"])
def test_cuda_packed_graph_replays_forward_and_backward(W):
    # The packed training call (the per-key path's both selections, forward, backward) captured in
    # one CUDA graph (the offsets are never read by the host), replayed on new values, against
    # eager calls.
    if not (_cpp_perkey_ok(128) if W else _dense_built(128)):
        pytest.skip("needs the CUDA kernels of this path at head dim 128")
    lq = [400, 0, 1, 900, 129]

    def inputs(seed):
        q, k, v, bias, cq, ck = _pack(lq, lq, 4, 2, 128, 2, torch.bfloat16, seed=seed)
        return [t.detach().cuda() for t in (q, k, v, bias)] + [torch.randn(q.shape).bfloat16().cuda(), cq.cuda()]

    def call(q, k, v, bias, do, cu):
        out = flexdma.flash_dma_attention_varlen(q, k, v, cu, cu, 900, 900, bias, is_causal=True, keep_window_size=W)
        return (out,) + torch.autograd.grad(out, (q, k, v, bias), do)

    assert_graph_replays(call, inputs, n_leaves=4)


@pytest.mark.gpu
@pytest.mark.parametrize("W", [8, 0], ids=["per-key", "dense"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_opcheck_packed_cuda_ops(W, with_bias):
    # The op family's packed form on CUDA: the selection, the forward and the backward (whose float
    # adds come in any order: its outputs are compared with a tolerance).
    if W and not with_bias:
        pytest.skip("the per-key path needs its bias")
    if not (_cpp_perkey_ok(64) if W else _dense_built(64)):
        pytest.skip("needs the CUDA kernels of this path at head dim 64")
    lq = [130, 0, 1, 77]
    q, k, v, bias, cq, ck = (t.detach().cuda() for t in _pack(lq, lq, 4, 2, 64, 2, torch.bfloat16, seed=9))
    bias = bias if with_bias else None
    ops, fwd, sel = _packed_forward(q, k, v, bias, cq, ck, 130, 130, 0.125, True, W, 128)
    for op, args, checks in ops:
        torch.library.opcheck(op, args, test_utils=checks)
    # The dense backward in its deterministic mode (bitwise reproducible, so its outputs compare
    # exactly); the per-key one has none.
    do = torch.randn_like(fwd[0])
    op, args = _packed_backward_args(do, q, k, v, bias, cq, ck, 130, 130, 0.125, True, W, fwd, sel, not W)
    torch.library.opcheck(op, args, test_utils=_NO_COMPARE if W else _ALL)


_BAD_OFFSETS = """
import torch, flexdma
q = torch.randn(12, 4, 64, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(12, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in "kv")
bias = torch.randn(2, 12, device="cuda", dtype=torch.bfloat16)
cq = torch.tensor({cq}, dtype=torch.int32, device="cuda")
out = flexdma.flash_dma_attention_varlen(q, k, v, cq, cq, {max_q}, {max_q}, bias, is_causal=True, keep_window_size={W})
torch.cuda.synchronize()
print("no error")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("W", [4, None], ids=["per-key", "dense"])
@pytest.mark.parametrize("cq,max_q", [([0, 7, 5, 12], 7), ([0, 7, 12], 6), ([0, 5, 11], 7)])
def test_cuda_packed_offsets_are_checked_on_the_device(cq, max_q, W):
    # Decreasing offsets, a sequence longer than max_seqlen (where max_seqlen x sequences still
    # covers the tokens, so the host's check passes), offsets that end short of the tokens: the
    # device path never reads them on the host, and stops at a device-side assert naming them
    # before any kernel reads or writes past a tensor. In a process of its own (the assert ends its
    # CUDA context).
    import subprocess
    import sys

    if not _cpp_perkey_ok(64):
        pytest.skip("needs the sm_90a per-key kernels at head dim 64")
    r = subprocess.run(
        [sys.executable, "-c", _BAD_OFFSETS.format(cq=cq, max_q=max_q, W=W)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0 and "no error" not in r.stdout
    assert "flexdma: cu_seqlens_q / cu_seqlens_k must start at 0" in r.stdout + r.stderr, r.stderr[-2000:]


# ---- the packed dense kernels (flexdma::fwd / bwd's packed form), on a GPU ----

# (lengths q, lengths k, H, KVH, bias heads, causal): several 64-row tiles in one sequence, empty
# and one-token sequences, queries without keys, Q != K per sequence, keys not on 16-byte boundaries.
DENSE_PACKED_CASES = [
    ([300, 0, 1, 700, 129, 77], [300, 0, 1, 700, 129, 77], 4, 2, 2, True),
    ([300, 0, 1, 700, 129, 77], [300, 0, 1, 700, 129, 77], 4, 2, 0, False),
    ([128, 5, 400, 0, 260], [128, 9, 400, 3, 300], 4, 1, 4, True),
    ([64, 3, 200], [1, 67, 190], 6, 2, 1, False),
    ([1, 2, 3], [1, 0, 3], 2, 2, 2, True),
]


def _dense_built(D):
    from flexdma import _ext

    return torch.cuda.is_available() and _ext.with_cuda() and D in tuple(_ext.BUILD_INFO.CUDA_HEAD_DIMS)


def _documents_dense(q, k, v, bias, do, lq, lk, causal):
    """_documents through the padded path's dense ops (flexdma::fwd / bwd)."""

    def run(qs, ks, vs, b, ds):
        o, ls, r = torch.ops.flexdma.fwd(qs, ks, vs, None, b, 0.125, causal, 0.0, False, None, True)
        return (
            o,
            ls,
            torch.ops.flexdma.bwd(ds, qs, ks, vs, None, b, o, ls, 0.125, causal, 0.0, b is not None, False, None, r),
        )

    return _documents(q, k, v, bias, do, lq, lk, run)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("case", DENSE_PACKED_CASES)
def test_cuda_dense_packed_kernels_equal_documents(case, D):
    # One forward (the offsets' check, then the kernel) and one backward (pre, main, post) for all
    # sequences, offsets read on the device, against the per-document ops: out and LSE agree up to the rounding of the key splits a
    # short document's own call takes (the packed call splits none), the gradients up to that and
    # the order of the dQ adds. Every output element written (poisoned memory first).
    if not _dense_built(D):
        pytest.skip(f"head dim {D} not built")
    lq, lk, H, KVH, bh, causal = case
    q, k, v, bias, cq, ck = (
        None if t is None else t.detach().cuda().requires_grad_(t.is_floating_point())
        for t in _pack(lq, lk, H, KVH, D, bh, torch.bfloat16, seed=sum(lq) + D + bh)
    )
    leaves = tuple(t for t in (q, k, v, bias) if t is not None)
    assert _runs_packed(_packed_plan(q, k, v, bias, cq, lq, lk, causal, None))
    poison_allocator([q, torch.empty(H, q.shape[0], device="cuda")])
    out, lse = flexdma.flash_dma_attention_varlen(
        q, k, v, cq, ck, max(lq), max(lk), bias, is_causal=causal, return_lse=True, softmax_scale=0.125
    )
    gen = torch.Generator(device="cuda").manual_seed(sum(lk) + D)
    do = torch.randn(out.shape, generator=gen, device="cuda", dtype=out.dtype)
    poison_allocator([q, k, v, *(torch.empty(t.numel(), device="cuda") for t in leaves)])
    got = torch.autograd.grad(out, leaves, do)
    with torch.no_grad():
        ref, ref_lse, want = _documents_dense(q.detach(), k.detach(), v.detach(),
                                              None if bias is None else bias.detach(), do, lq, lk, causal)  # fmt: skip
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, ref, atol=1.6e-2, rtol=1.6e-2)  # two bf16 steps
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), got, [w for w in want if w is not None]):
        assert not a.isnan().any(), name
        # dK, dV and dbias sum hundreds of products of bf16-rounded P / dS: the two calls' LSEs differ
        # in the last float bits, which flips some of those roundings, so a small element of a sum of
        # large terms moves by a few steps of the terms' size. The floor scales with the gradient's
        # largest element (a missing or misplaced sequence moves elements by their own size).
        floor = 1e-2 * b.float().abs().max().item()
        torch.testing.assert_close(a, b, atol=max(2e-2, floor), rtol=2e-2, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 96, 128])
def test_cuda_dense_packed_within_the_rule(D):
    # bf16 packed dense kernels against the float64 reference of the documents: error at most ~2x
    # the bf16 reference's, plus a floor, for out and every gradient (a per-key bias, GQA, causal).
    if not _dense_built(D):
        pytest.skip(f"head dim {D} not built")
    _assert_packed_within_the_rule([300, 1, 0, 133, 500], D, None, seed=13)


@pytest.mark.gpu
def test_cuda_dense_packed_deterministic_backward_is_bitwise_reproducible():
    if not _dense_built(128):
        pytest.skip("head dim 128 not built")
    lq = [700, 1, 0, 333, 1100]
    q, k, v, bias, cq, ck = (t.detach().cuda() for t in _pack(lq, lq, 8, 2, 128, 2, torch.bfloat16, seed=5))
    _, fwd, _ = _packed_forward(q, k, v, bias, cq, ck, 1100, 1100, 0.125, True, 0, 128)
    do = torch.randn_like(fwd[0])
    op, args = _packed_backward_args(do, q, k, v, bias, cq, ck, 1100, 1100, 0.125, True, 0, fwd, None, True)
    first = op(*args)
    for _ in range(3):
        for a, b in zip(first, op(*args)):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("W", [4, None], ids=["per-key", "dense"])
def test_cuda_packed_max_seqlen_below_the_tokens_is_rejected(W):
    # max_seqlen sizes the kernels' grids: one that leaves no tile (0 here) would leave the offsets
    # unchecked on the device and the outputs unwritten; the op's host check names it first.
    if not (_cpp_perkey_ok(64) if W else _dense_built(64)):
        pytest.skip("needs the CUDA kernels of this path at head dim 64")
    q, k, v, bias, cq, ck = (t.detach().cuda() for t in _pack([5, 7], [5, 7], 4, 2, 64, 2, torch.bfloat16, seed=2))
    with pytest.raises(ValueError, match="longer than max_seqlen"):
        flexdma.flash_dma_attention_varlen(q, k, v, cq, ck, 0, 7, bias, is_causal=True, keep_window_size=W)


FLEX_CASES = [c for c in CASES + NO_KEYS if c[-1] is None] + [
    # Documents across several 128-row tiles, tiles holding several documents, Q != K per document.
    ([300, 0, 1, 129, 77, 140], [300, 0, 1, 129, 77, 140], 4, 2, 2, True, None),
    ([128, 5, 260, 0, 3], [130, 9, 200, 3, 0], 4, 1, 4, True, None),
    ([40, 200], [250, 10], 2, 2, 1, False, None),
]


@pytest.mark.parametrize("case", FLEX_CASES)
def test_flex_packed_is_one_call_with_a_document_mask(case, monkeypatch):
    # backend="flex" without a window: one FlexAttention call over the packed rows (a document mask
    # from the offsets, built on their device), not a call per document; equal to the float64
    # reference of the documents one by one, out, LSE and every gradient (the CPU backward is the
    # bwd op's packed form).
    from flexdma.dense import flex

    calls = []
    real = flex.flex_varlen_attention
    monkeypatch.setattr(flex, "flex_varlen_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    lq, lk, H, KVH, bh, causal, _ = case
    q, k, v, bias, cq, ck = _pack(lq, lk, H, KVH, 16, bh, torch.float64, seed=len(lq) + H + 5)
    out, lse = flexdma.flash_dma_attention_varlen(
        q, k, v, cq, ck, max(lq), max(lk), bias, is_causal=causal, return_lse=True, backend="flex"
    )
    assert calls == [1]
    ref, ref_lse = _reference(q, k, v, bias, lq, lk, causal, None)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)
    leaves = [t for t in (q, k, v, bias) if t is not None]
    do = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, leaves, do), torch.autograd.grad(ref, leaves, do)):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_flex_packed_tiles_cover_every_kept_pair():
    # The tiles the document mask visits (built from the offsets) hold every (query, key) pair a
    # document keeps, causal or not, on random packings.
    from flexdma.dense.flex import BLOCK, _varlen_tiles

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        n = int(torch.randint(1, 9, (1,), generator=g))
        lq = torch.randint(0, 300, (n,), generator=g).tolist()
        lk = torch.randint(0, 300, (n,), generator=g).tolist()
        cq, ck = (torch.tensor([0] + torch.tensor(x).cumsum(0).tolist(), dtype=torch.int32) for x in (lq, lk))
        for causal in (True, False):
            tiles = _varlen_tiles(cq, ck, sum(lq), sum(lk), causal)[0, 0]
            keep = torch.zeros(sum(lq), sum(lk), dtype=torch.bool)
            for i in range(n):
                rows, cols = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
                m = torch.ones(lq[i], lk[i], dtype=torch.bool)
                keep[rows, cols] = m.tril(lk[i] - lq[i]) if causal else m
            for r, c in keep.nonzero().tolist():
                assert tiles[r // BLOCK, c // BLOCK], (lq, lk, causal, r, c)
    # And it skips: two documents of 300 keep nothing of each other's 128-key tiles past the shared one.
    cu = torch.tensor([0, 300, 600], dtype=torch.int32)
    tiles = _varlen_tiles(cu, cu, 600, 600, False)[0, 0]
    assert tiles[0, :3].all() and not tiles[0, 3:].any() and not tiles[4, :2].any() and tiles[4, 2:].all()
    causal = _varlen_tiles(cu, cu, 600, 600, True)[0, 0]
    assert causal[0, 0] and not causal[0, 1:].any() and not causal[2, 3:].any()


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_cuda_flex_packed_within_the_rule(D):
    # backend="flex" on the GPU: one compiled FlexAttention call with the document mask (forward and
    # FlexAttention's own backward, the bias a captured buffer with its gradient).
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _assert_packed_within_the_rule([300, 1, 0, 133, 500], D, None, seed=17, backend="flex")
