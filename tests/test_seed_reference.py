"""The seed project's (flash-dmattn) equivalence checks, run against flexdma.compat in float64 on
the CPU at the seed's configurations: its forward and backward benchmarks (B=1, H=2, KVH=1,
lengths 128 to 4096, keep_window_size 1024, Doge's per-key scores as the bias), its gradient
benchmark (1 x 1 x 64 x 64 x 64, keep_window_size 32, gradients to dt_proj and A) and its first
README's low-level call (compat.fwd, keep_window_size 64). The truth is the seed's semantics as
tests/seed_reference.py writes them; flexdma agrees within 1e-10 (relative above 1).

Where flexdma selects the keys itself (compat.create_mask, apply_dynamic_mask_attention), the seed's
torch.topk and flexdma may keep different keys among equal scores (flexdma: the lower key index).
`_flexdma_ties` checks that every such difference is a tie and the reference then takes flexdma's
keys: only the documented tie rule may decide. Scores that differ, however little, are never a tie
(a float64 bias is ranked in float64).

Head dim 64 (scale 1/8): the CPU kernels hold softmax_scale as a float32, so a scale that float32
does not hold exactly (1/sqrt(32), 1/sqrt(128)) would move float64 results by ~1e-8; the other head
dims here pass a power-of-two scale.
"""

import math

import pytest
import seed_reference as seed
import torch

from flexdma import compat

F64 = torch.float64
# 1e-10, relative above 1: the gradients to dt_proj and A reach the hundreds.
EXACT = dict(rtol=1e-10, atol=1e-10)
B, H, KVH = 1, 2, 1  # the seed's benchmark shapes


def _scale(D: int) -> float:
    """1/sqrt(D) where float32 holds it exactly, else the power of two below it."""
    return D**-0.5 if math.log2(D) % 2 == 0 else 2.0 ** math.floor(math.log2(D**-0.5))


def _inputs(L: int, D: int, A_sign: float, seed_: int, *, heads=(H, KVH)):
    g = torch.Generator().manual_seed(seed_)
    h, kvh = heads
    q = torch.randn(B, h, L, D, generator=g, dtype=F64)
    k = torch.randn(B, kvh, L, D, generator=g, dtype=F64)
    v = torch.randn(B, kvh, L, D, generator=g, dtype=F64)
    dt_proj = torch.randn(kvh, kvh * D, generator=g, dtype=F64)
    # The seed draws A from randn; its sign decides the regime: A < 0 gives scores in (0, 1], A > 0
    # scores up to exp(30 A) that make rows nearly one-hot, A = 0 (Doge's init) all scores 1.
    A = A_sign * torch.randn(kvh, generator=g, dtype=F64).abs()
    return [q, k, v, dt_proj, A]


def _flexdma_ties(flexdma_keep: torch.Tensor, seed_keep: torch.Tensor, zoh: torch.Tensor, causal: bool) -> torch.Tensor:
    """flexdma's kept entries, after checking they differ from the seed's only among equal scores:
    in each row the two keep as many keys, and every key one keeps and the other does not has the
    score of the row's last kept key (the tie that torch.topk and flexdma break their own ways)."""
    Q, K = seed_keep.shape[-2:]
    fill = seed.fill_value(zoh.dtype)
    rows = zoh[:, :, None, :].expand(seed_keep.shape)
    if causal:
        rows = rows.masked_fill(seed.causal_fill(Q, K, zoh.dtype) != 0, fill)
    # The seed keeps every key when K <= keep_window_size and leaves the causal cut to the fill in
    # the bias; flexdma's mask drops those keys itself.
    seed_keep = seed_keep & (rows != fill)
    flexdma_keep = flexdma_keep.expand_as(seed_keep)
    diff = flexdma_keep != seed_keep
    if not diff.any():
        return flexdma_keep
    assert torch.equal(flexdma_keep.sum(-1), seed_keep.sum(-1)), "flexdma keeps another number of keys"
    boundary = rows.masked_fill(~seed_keep, float("inf")).amin(-1, keepdim=True).expand_as(rows)
    assert (rows[diff] == boundary[diff]).all() and (rows[diff] != fill).all(), (
        "flexdma and the seed keep different keys whose scores differ"
    )
    return flexdma_keep


def _seed_selection(v, dt_proj, A, window: int, query_len: int, causal: bool):
    """The seed's per-key scores (B, KVH, K) and its selection: bias rows (B, KVH, Q, K) with the
    fill where not kept, and the kept entries."""
    zoh = seed.doge_scores(v, dt_proj, A)
    additive = seed.causal_fill(query_len, v.shape[2], F64) if causal else None
    return (zoh, *seed.select_topk(zoh, window, query_len, additive))


def _bias_rows(zoh: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The seed's bias rows for the entries `keep` (B, KVH, Q, K): the scores, the fill elsewhere."""
    return zoh[:, :, None, :].expand(keep.shape).masked_fill(~keep, seed.fill_value(zoh.dtype))


def _bshd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


# (L, causal, input seed). At 4096 the seed's inputs give scores that float32 rounds to ties in 2
# rows' selections (the test checks that it does), so float64 ranking is needed there.
FORWARD = [(128, False, 0), (128, True, 0), (1024, False, 0), (1024, True, 0), (2048, False, 0), (2048, True, 0)]
FORWARD += [(4096, True, 1)]


@pytest.mark.parametrize("L, causal, seed_", FORWARD, ids=[f"L{L}-{'causal' if c else 'full'}" for L, c, _ in FORWARD])
def test_forward_equivalence(L, causal, seed_):
    """The seed's forward benchmark (A < 0; a peaked A > 0 is the gradient benchmark's): its float
    0/1 attn_mask and bias rows through flash_dmattn_func; flexdma's own selection
    (compat.create_mask) against the seed's, every row; the seed's whole layer
    (compat.apply_dynamic_mask_attention). At 4096 the dense-mask calls are left out and the
    outputs compared on every 4th row (the selection is still compared on all of them), to keep
    the reference's time in the seconds."""
    D, W = 64, 1024
    q, k, v, dt_proj, A = _inputs(L, D, -1.0, seed_=seed_)
    scale = _scale(D)
    zoh, bias, keep = _seed_selection(v, dt_proj, A, W, L, causal)
    rows = slice(None, None, 4 if L > 2048 else 1)

    mask = compat.create_mask(zoh[:, :, None, :], None, B, L, L, W, min_dtype=seed.fill_value(F64), is_causal=causal)
    kept = _flexdma_ties(mask, keep, zoh, causal)
    if L == 4096:
        as_float32 = compat.create_mask(zoh.float()[:, :, None, :], None, B, L, L, W, is_causal=causal)
        assert not torch.equal(as_float32, kept), "these inputs were picked for float32 ties; they have none"
    seed_out = seed.attention(q[:, :, rows], k, v, bias[:, :, rows], scale)
    want = seed_out
    if not torch.equal(kept, keep & (bias != seed.fill_value(F64))):
        want = seed.attention(q[:, :, rows], k, v, _bias_rows(zoh, kept)[:, :, rows], scale)

    if L <= 2048:
        out = compat.flash_dmattn_func(
            _bshd(q), _bshd(k), _bshd(v), attn_mask=keep.to(F64), attn_bias=bias, is_causal=causal, scale=scale
        )
        # The seed's own selection: against its own output, whatever its ties.
        torch.testing.assert_close(out, seed_out, **EXACT)
        out = compat.flash_dmattn_func(
            _bshd(q), _bshd(k), _bshd(v), mask, zoh[:, :, None, :], is_causal=causal, scale=scale
        )
        torch.testing.assert_close(out, want, **EXACT)

    causal_mask = seed.causal_fill(L, L, F64) if causal else None
    out = compat.apply_dynamic_mask_attention(
        q, k, v, dt_proj, A, causal_mask, keep_window_size=W, is_causal=causal, softmax_scale=scale
    )
    torch.testing.assert_close(_bshd(out)[:, rows], want, **EXACT)


@pytest.mark.parametrize("D", [32, 128])
def test_forward_equivalence_head_dims(D):
    L, W = 1536, 1024
    q, k, v, dt_proj, A = _inputs(L, D, -1.0, seed_=D)
    scale = _scale(D)
    zoh, bias, keep = _seed_selection(v, dt_proj, A, W, L, True)
    mask = compat.create_mask(zoh[:, :, None, :], None, B, L, L, W, is_causal=True)
    kept = _flexdma_ties(mask, keep, zoh, True)
    out = compat.apply_dynamic_mask_attention(
        q, k, v, dt_proj, A, seed.causal_fill(L, L, F64), keep_window_size=W, softmax_scale=scale
    )
    torch.testing.assert_close(_bshd(out), seed.attention(q, k, v, _bias_rows(zoh, kept), scale), **EXACT)


BACKWARD = [(128, False), (128, True), (1024, False), (1024, True)]
GRADS = ["out", "dq", "dk", "dv", "ddt_proj", "dA"]


def _grads(run, leaves):
    """out and the gradients of out.sum() to q, k, v, dt_proj, A (and whatever else `run` returns
    to differentiate, retained) on fresh copies of the leaves."""
    ls = [t.detach().clone().requires_grad_() for t in leaves]
    out, *extra = run(*ls)
    for t in extra:
        t.retain_grad()
    out.sum().backward()
    return [out] + [t.grad for t in ls] + [t.grad for t in extra]


def _assert_grads(got, want, names):
    for name, g, w in zip(names, got, want):
        torch.testing.assert_close(g, w, **EXACT, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("L, causal", BACKWARD, ids=[f"L{L}-{'causal' if c else 'full'}" for L, c in BACKWARD])
def test_backward_equivalence(L, causal):
    """The seed's backward benchmark: out.sum()'s dq, dk, dv (v also through the scores) and the
    gradient of the bias rows, through flash_dmattn_func with the seed's mask and bias; then the
    layer's gradients to q, k, v, dt_proj and A through apply_dynamic_mask_attention, flexdma
    selecting. A < 0."""
    D, W = 64, 1024
    scale = _scale(D)
    leaves = _inputs(L, D, -1.0, seed_=100 + L + causal)

    def seed_layer(q, k, v, dt_proj, A, keep=None):
        zoh, bias, _ = _seed_selection(v, dt_proj, A, W, L, causal)
        bias = bias if keep is None else _bias_rows(zoh, keep)
        return seed.attention(q, k, v, bias, scale), bias

    def flash(q, k, v, dt_proj, A):
        _, bias, keep = _seed_selection(v, dt_proj, A, W, L, causal)
        out = compat.flash_dmattn_func(
            query=_bshd(q), key=_bshd(k), value=_bshd(v), attn_mask=keep.to(F64), attn_bias=bias,
            is_causal=causal, scale=scale, softcap=0.0, deterministic=False, return_attn_probs=False,
        )  # fmt: skip
        return out, bias

    want = _grads(seed_layer, leaves)
    _assert_grads(_grads(flash, leaves), want, GRADS + ["dbias"])

    zoh, bias, keep = (t.detach() for t in _seed_selection(*leaves[2:], W, L, causal))
    mask = compat.create_mask(zoh[:, :, None, :], None, B, L, L, W, is_causal=causal)
    kept = _flexdma_ties(mask, keep, zoh, causal)
    if not torch.equal(kept, keep & (bias != seed.fill_value(F64))):
        want = _grads(lambda *ls: seed_layer(*ls, keep=kept), leaves)
    causal_mask = seed.causal_fill(L, L, F64) if causal else None

    def layer(q, k, v, dt_proj, A):
        out = compat.apply_dynamic_mask_attention(
            q, k, v, dt_proj, A, causal_mask, keep_window_size=W, is_causal=causal, softmax_scale=scale
        )
        return (_bshd(out),)

    _assert_grads(_grads(layer, leaves), want, GRADS)


@pytest.mark.parametrize("A_sign", [-1.0, 0.0, 1.0], ids=["A<0", "A=0", "A>0"])
def test_gradient_benchmark(A_sign):
    """The seed's gradient benchmark: 1 x 1 x 64 x 64 x 64, keep_window_size 32, its additive causal
    mask, the layer's gradients to q, k, v, dt_proj and A. A = 0 (Doge's init) makes every score 1:
    which 32 keys a row keeps is the tie rule's alone (flexdma: the lowest indices), and the
    reference takes flexdma's. A > 0 makes rows nearly one-hot (scores up to exp(30 A))."""
    L, D, W = 64, 64, 32
    scale = _scale(D)
    leaves = _inputs(L, D, A_sign, seed_=42, heads=(1, 1))
    zoh, bias, keep = (t.detach() for t in _seed_selection(*leaves[2:], W, L, True))
    mask = compat.create_mask(zoh[:, :, None, :], None, 1, L, L, W, is_causal=True)
    kept = _flexdma_ties(mask, keep, zoh, True)
    assert (A_sign == 0) == (not torch.equal(kept, keep & (bias != seed.fill_value(F64))))

    def seed_layer(q, k, v, dt_proj, A):
        z = seed.doge_scores(v, dt_proj, A)
        return (seed.attention(q, k, v, _bias_rows(z, kept), scale),)

    def layer(q, k, v, dt_proj, A):
        out = compat.apply_dynamic_mask_attention(
            q, k, v, dt_proj, A, seed.causal_fill(L, L, F64), keep_window_size=W, softmax_scale=scale
        )
        return (_bshd(out),)

    want = _grads(seed_layer, leaves)
    # A = 0 leaves dt_proj out of the scores (exp(0 * softplus) = 1): its gradient is 0 there.
    assert all(g.abs().max() > 0 for n, g in zip(GRADS, want) if A_sign or n != "ddt_proj"), "nothing to compare"
    _assert_grads(_grads(layer, leaves), want, GRADS)


LOW_LEVEL = [(128, False), (128, True), (1024, True), (2048, False)]


@pytest.mark.parametrize("L, causal", LOW_LEVEL, ids=[f"L{L}-{'causal' if c else 'full'}" for L, c in LOW_LEVEL])
def test_low_level_fwd_equivalence(L, causal):
    """The seed's first forward benchmark, the README's low-level call: per-key scores as zoh rows
    (B, KVH, Q, K), the top keep_window_size = 64 of the causally masked rows as a float 0/1
    active_mask, compat.fwd in the extension's positional order; out and softmax_lse against the
    seed's attention. Head dim 32 as there, with scale 1/8 (see the module's note)."""
    D, W = 32, 64
    scale = _scale(D)
    q, k, v, dt_proj, A = _inputs(L, D, -1.0, seed_=7 + L + causal)
    zoh, bias, keep = _seed_selection(v, dt_proj, A, W, L, causal)
    out, lse, p, rng_state = compat.fwd(
        _bshd(q), _bshd(k), _bshd(v), zoh[:, :, None, :].expand(B, KVH, L, L), keep.to(F64),
        None, 0.0, scale, causal, W, 0.0, False, None,
    )  # fmt: skip
    torch.testing.assert_close(out, seed.attention(q, k, v, bias, scale), **EXACT)
    scores = q @ k.transpose(-1, -2).repeat_interleave(H // KVH, 1) * scale + bias
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), **EXACT)
    assert p.numel() == 0 and torch.equal(rng_state, torch.zeros(2, dtype=torch.int64))
