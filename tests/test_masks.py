"""create_mask's per-key path (flexdma.perkey's selection, then a comparison against the row
thresholds) is bitwise the dense top-k it replaced: a frozen copy of that implementation is the oracle."""

from typing import Optional

import pytest
import torch
from utils import LargestTensor, make_qkv

import flexdma
from flexdma import _tilebits
from flexdma.dense.naive import causal_mask


def old_create_mask(attn_bias, window_size, *, attn_mask=None, is_causal=False, query_len=None):
    """create_mask as it was before the per-key path (a top-k over a (Q, K) score matrix per row),
    block_size=None; kept verbatim in substance as the oracle."""

    def topk_rows(scores, k):
        thr = torch.topk(scores, k, dim=-1, sorted=True).values[..., -1:]
        above = scores > thr
        need = k - above.sum(-1, keepdim=True, dtype=torch.int32)
        at = scores == thr
        return above | (at & (torch.cumsum(at, dim=-1, dtype=torch.int32) <= need))

    Bb, Hb, Qb, K = attn_bias.shape
    Q = Qb if query_len is None else int(query_len)
    allowed: Optional[torch.Tensor] = None
    if attn_mask is not None:
        allowed = attn_mask[:, None, None, :] if attn_mask.dim() == 2 else attn_mask
        while allowed.dim() < 4:
            allowed = allowed.unsqueeze(0)
    if is_causal:
        c = causal_mask(Q, K)[None, None]
        allowed = c if allowed is None else allowed & c
    out_shape = torch.broadcast_shapes(attn_bias.shape, allowed.shape if allowed is not None else (1, 1, 1, 1))
    if window_size >= K:
        if allowed is None:
            return torch.ones(out_shape, dtype=torch.bool)
        return allowed.expand(out_shape).contiguous()
    # float64 ranked in float64; the other dtypes in float32, which holds their values exactly.
    scores = (attn_bias if attn_bias.dtype == torch.float64 else attn_bias.float()).expand(out_shape)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return topk_rows(scores, window_size) & (scores != float("-inf"))


def _random_case(g):
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=g))  # noqa: E731
    B, H, K = r(1, 3), r(1, 4), r(1, 80)
    Q = r(1, 90)
    W = r(1, K + 3)
    bias = torch.randn(
        B if r(0, 1) else 1,
        H if r(0, 1) else 1,
        1,
        K,
        generator=g,
        dtype=(torch.float32, torch.float64, torch.bfloat16)[r(0, 2)],
    )
    if r(0, 1):  # ties
        bias[..., r(0, K - 1) :: r(2, 7)] = bias[..., :1].clone()
    if bias.dtype == torch.float64 and r(0, 1):  # scores that tie only once rounded to float32
        near = bias[..., r(0, K - 1) :: r(2, 7)]
        near.copy_(bias[..., :1] + 1e-12 * torch.randn(near.shape, generator=g, dtype=torch.float64))
    if r(0, 2) == 0:
        bias[..., r(0, K - 1) :: r(2, 5)] = float("-inf")
    mask = None
    kind = r(0, 3)
    if kind == 1:
        mask = torch.rand(B, K, generator=g) < 0.7
        if r(0, 3) == 0:
            mask[0] = False  # a batch entry with nothing to see
    elif kind == 2:
        mask = torch.rand(B if r(0, 1) else 1, H if r(0, 1) else 1, 1, K, generator=g) < 0.6
    elif kind == 3:
        mask = torch.rand(1, K, generator=g) < 0.6  # a lower-dim mask is left-padded
    causal = bool(r(0, 1))
    return bias, W, mask, causal, Q


@pytest.mark.parametrize("seed", range(6))
def test_per_key_create_mask_is_the_dense_topk(seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(60):
        bias, W, mask, causal, Q = _random_case(g)
        kw = dict(attn_mask=mask, is_causal=causal, query_len=Q)
        want = old_create_mask(bias, W, **kw)
        got = flexdma.create_mask(bias, W, **kw)
        assert got.shape == want.shape and got.dtype == torch.bool, (tuple(bias.shape), W, causal, Q)
        assert torch.equal(got, want), (tuple(bias.shape), W, causal, Q, None if mask is None else mask.shape)


def test_per_key_create_mask_uses_the_selection(monkeypatch):
    # The per-key call must not do a top-k over (Q, K) scores.
    from flexdma import masks

    def no_dense(*a, **k):
        raise AssertionError("dense top-k used for a per-key bias")

    monkeypatch.setattr(masks, "_topk_rows", no_dense)
    bias = torch.randn(2, 2, 1, 50)
    m = flexdma.create_mask(bias, 7, attn_mask=torch.rand(2, 50) < 0.8, is_causal=True, query_len=40)
    assert m.shape == (2, 2, 40, 50)


def test_per_key_create_mask_peak_is_the_mask():
    L = 2048
    bias = torch.randn(1, 1, 1, L)
    with LargestTensor() as mode:
        m = flexdma.create_mask(bias, 64, is_causal=True, query_len=L)
    # The bool mask itself is the largest tensor (the dense path had float32 (Q, K) scores).
    assert m.numel() == L * L and mode.nbytes == L * L


def test_create_mask_under_compile_and_export():
    # Under compile/export create_mask keeps the dense top-k (the selection op's fake sizes do not
    # take a dynamic key length); the results are the same.
    class M(torch.nn.Module):
        def forward(self, bias, pad):
            return flexdma.create_mask(bias, 5, attn_mask=pad, is_causal=True, query_len=bias.shape[-1])

    bias, pad = torch.randn(2, 2, 1, 30), torch.rand(2, 30) < 0.8
    eager = M()(bias, pad)
    assert torch.equal(eager, old_create_mask(bias, 5, attn_mask=pad, is_causal=True, query_len=30))
    torch._dynamo.reset()
    assert torch.equal(torch.compile(M(), fullgraph=True, backend="aot_eager")(bias, pad), eager)
    k = torch.export.Dim("k", min=8, max=64)
    ep = torch.export.export(M(), (bias, pad), dynamic_shapes={"bias": {3: k}, "pad": {1: k}})
    for K in (12, 30, 41):
        b, p = torch.randn(2, 2, 1, K), torch.rand(2, K) < 0.8
        assert torch.equal(ep.module()(b, p), old_create_mask(b, 5, attn_mask=p, is_causal=True, query_len=K))


def _tile_flags(bits: torch.Tensor, key_tiles: int) -> torch.Tensor:
    """flexdma::tile_meta's int32 words as one bool per key tile."""
    words = bits.to(torch.int64) & 0xFFFFFFFF
    return ((words[..., None] >> torch.arange(32)) & 1).flatten(-2)[..., :key_tiles].bool()


@pytest.mark.parametrize("seed", range(4))
def test_selection_tile_meta_matches_the_mask(seed):
    # The bits of a per-key create_mask mask, from its selection, against flexdma::tile_meta's pass
    # over the mask: every tile that keeps something has its bit, and off the causal diagonal the
    # bits are equal (a tile the cut crosses may keep its bit without keeping a key).

    g = torch.Generator().manual_seed(seed)
    T = flexdma._C.TILE_SIZE
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    for _ in range(8):
        B, H, Q, K = r(1, 2), r(1, 3), r(1, 700), r(2, 700)
        bias = torch.randn(B, H, 1, K, generator=g)
        pad = torch.rand(B, K, generator=g) < 0.8 if r(0, 1) else None
        mask_causal = bool(r(0, 1))
        attn_causal = mask_causal or bool(r(0, 1))
        mask = flexdma.create_mask(bias, r(1, K // 8 + 1), attn_mask=pad, is_causal=mask_causal, query_len=Q)
        got = _tilebits.tile_meta_of(mask, Q, K, attn_causal)
        want = torch.ops.flexdma.tile_meta(mask, Q, K, attn_causal)
        assert got is not None and got.dtype == torch.int32 and got.is_contiguous() and got.shape == want.shape
        qt, kt = -(-Q // T), -(-K // T)
        have, need = _tile_flags(got, kt), _tile_flags(want, kt)
        assert not (need & ~have).any(), (B, H, Q, K, mask_causal, attn_causal)
        crossed = torch.zeros(qt, kt, dtype=torch.bool)
        if attn_causal:
            rows, keys = torch.arange(qt) * T, torch.arange(kt) * T
            first_seen = rows + K - Q  # the last key the tile's first row sees
            last_seen = torch.clamp(rows + T, max=Q) - 1 + K - Q
            crossed = (keys[None, :] <= last_seen[:, None]) & (
                torch.clamp(keys + T, max=K)[None, :] - 1 > first_seen[:, None]
            )
        assert torch.equal(have & ~crossed, need & ~crossed), (B, H, Q, K, mask_causal, attn_causal)


@pytest.mark.parametrize("chunk", [None, 64 * 64 * 6, 1000], ids=["one_chunk", "tile_chunks", "row_chunks"])
def test_row_topk_create_mask_tile_meta_matches_the_mask(chunk, monkeypatch):
    # create_mask's row-wise top-k (a bias with a query dim, or block_size) gathers the tiles of each
    # row chunk it writes: against flexdma::tile_meta's pass over the mask, equal where the call's
    # causality is the mask's, a superset on the diagonal tiles where only the call is causal.
    # Chunks smaller than a query tile do not align with the tiles: no bits (the op's pass then).
    from flexdma import masks

    if chunk is not None:
        monkeypatch.setattr(masks, "_CHUNK_ELEMS", chunk)
    g = torch.Generator().manual_seed(7)
    T = flexdma._C.TILE_SIZE
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    for i in range(8):
        B, H, Q, K = r(1, 2), r(1, 3), r(1, 400), r(2, 400)
        bias = torch.randn(B, H, Q if i % 4 else 1, K, generator=g)
        mask_causal = bool(i % 2)
        attn_causal = mask_causal or bool(r(0, 1))
        mask = flexdma.create_mask(
            bias, r(1, K // 4 + 1), is_causal=mask_causal, query_len=Q, block_size=None if i % 4 else 16
        )
        got = _tilebits.tile_meta_of(mask, Q, K, attn_causal)
        step = (chunk or masks._CHUNK_ELEMS) // (mask.shape[0] * mask.shape[1] * K)
        if step < T and mask.shape[2] > step:
            assert got is None
            continue
        want = torch.ops.flexdma.tile_meta(mask, Q, K, attn_causal)
        assert got is not None and got.dtype == torch.int32 and got.is_contiguous() and got.shape == want.shape
        have, need = _tile_flags(got, -(-K // T)), _tile_flags(want, -(-K // T))
        assert not (need & ~have).any(), (B, H, Q, K, mask_causal, attn_causal)
        if attn_causal == mask_causal:
            assert torch.equal(have, need), (B, H, Q, K, mask_causal)


def test_selection_tile_meta_only_for_the_mask_it_describes():

    bias = torch.randn(1, 2, 1, 300)
    mask = flexdma.create_mask(bias, 20, is_causal=True, query_len=200)
    bits = _tilebits.tile_meta_of(mask, 200, 300, True)
    assert bits is not None and _tilebits.tile_meta_of(mask, 200, 300, True) is bits  # computed once
    assert _tilebits.tile_meta_of(mask.clone(), 200, 300, True) is None  # not create_mask's tensor
    assert _tilebits.tile_meta_of(mask, 100, 300, True) is None  # other lengths
    mask[0, 0, 5, 7] = True  # changed after create_mask: its selection no longer describes it
    assert _tilebits.tile_meta_of(mask, 200, 300, True) is None


def test_create_mask_carries_its_tiles():
    """The tile activity travels with the mask as `mask.flexdma_tiles`, not through a registry; a
    saved or copied mask loads as a plain mask (weights_only too) without it."""
    import copy
    import io

    from flexdma import _tilebits

    bias = torch.randn(1, 2, 1, 300)
    mask = flexdma.create_mask(bias, 20, is_causal=True, query_len=200)
    assert isinstance(mask.flexdma_tiles, _tilebits.TileActivity)
    # Without the causal cut the per-key selection's tile bits are exact (with it, a tile the
    # diagonal crosses may keep a bit its entries do not).
    flat = flexdma.create_mask(bias, 20, query_len=200)
    assert torch.equal(
        _tilebits.tile_meta_of(flat, 200, 300, False), torch.ops.flexdma.tile_meta(flat, 200, 300, False)
    )
    assert _tilebits.tile_meta_of(mask, 200, 300, True) is not None
    assert _tilebits.tile_meta_of(mask[:, :1], 200, 300, True) is None  # a view: another tensor
    buf = io.BytesIO()
    torch.save(mask, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert torch.equal(loaded, mask) and _tilebits.tile_meta_of(loaded, 200, 300, True) is None
    assert _tilebits.tile_meta_of(copy.deepcopy(mask), 200, 300, True) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scores_rows", [1, 1000], ids=["scores_per_key", "scores_per_row"])
@pytest.mark.parametrize("bias_rows", [1, 1000], ids=["bias_per_key", "bias_per_row"])
def test_selection_tile_meta_changes_nothing_on_cuda(bias_rows, scores_rows):
    # The API hands create_mask's bits (a per-key selection's, or a row-wise top-k's) to the
    # kernels for its mask and computes them from the bytes for a copy of it: same outputs and (deterministic) gradients, bit for bit. A
    # full bias takes the backward's dbias in the bias dtype, whose tiles nobody keeps (the ones a
    # set bit on the causal diagonal leaves unkept too) are zeroed by the kernel.
    if "cuda" not in flexdma.available_backends():
        pytest.skip("flexdma CUDA kernels not built")
    torch.manual_seed(0)
    B, L, H, KVH, D = 1, 1000, 4, 2, 64
    q, k, v = (torch.randn(B, L, h, D, device="cuda", dtype=torch.bfloat16) for h in (H, KVH, KVH))
    scores = torch.randn(B, KVH, scores_rows, L, device="cuda", dtype=torch.bfloat16)
    mask = flexdma.create_mask(scores, 100, is_causal=True, query_len=L)
    bias = (
        scores if bias_rows == scores_rows else torch.randn(B, KVH, bias_rows, L, device="cuda", dtype=torch.bfloat16)
    )

    assert _tilebits.tile_meta_of(mask, L, L, True) is not None
    runs = []
    for m in (mask, mask.clone()):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out = flexdma.flash_dma_attention(
            *leaves[:3], attn_mask=m, attn_bias=leaves[3], is_causal=True, backend="cuda", deterministic=True
        )
        out.backward(torch.ones_like(out))
        runs.append([out] + [t.grad for t in leaves])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    if bias_rows > 1:  # no gradient where the mask keeps nothing: every unkept element written, as 0
        assert not runs[0][4].masked_select(~mask).any()


# ------------------------------------------------------------------ scores that tie only in float32
def _near_tie_bias(K: int, group, seed: int) -> torch.Tensor:
    """A float64 per-key bias (1, 2, 1, K): random scores, and in each head the keys of `group`
    1 + (a few 1e-12) apart, rising with the key index: one float32 value, so the float32 rule
    (ties to the lower index) and the float64 order (the highest index first) keep different keys."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(1, 2, 1, K, generator=g, dtype=torch.float64)
    steps = torch.rand(2, len(group), generator=g, dtype=torch.float64).add(0.5).cumsum(-1)
    bias[0, :, 0, list(group)] = 3.0 + 1e-12 * steps  # above every other score: the window's top
    assert (bias[0, :, 0, list(group)].float() == 3.0).all()
    return bias


def _top_by_sort(bias_row, window: int, visible: int):
    """The window best of the first `visible` keys of one row by (score desc, index asc), by
    Python's sort of the float64 values."""
    vals = bias_row[:visible].tolist()
    return set(sorted(range(visible), key=lambda j: (-vals[j], j))[:window])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_float64_scores_that_tie_only_in_float32(causal):
    K, Q, W = 48, 40, 5
    group = range(10, 40, 3)  # 10 keys; the window takes 5 of them
    bias = _near_tie_bias(K, group, seed=1 + causal)
    want = torch.zeros(1, 2, Q, K, dtype=torch.bool)
    for h in range(2):
        for i in range(Q):
            visible = i + 1 + (K - Q) if causal else K
            want[0, h, i, list(_top_by_sort(bias[0, h, 0], W, visible))] = True
    per_key = flexdma.create_mask(bias, W, is_causal=causal, query_len=Q)
    dense = flexdma.create_mask(bias.expand(1, 2, Q, K), W, is_causal=causal)
    # Without causality the per-key mask keeps its query dim of 1.
    assert torch.equal(per_key.expand_as(want), want) and torch.equal(dense, want)
    # The last row's kept keys are the 5 highest indices of the group, not the 5 lowest.
    assert per_key[0, 0, -1].nonzero().flatten().tolist() == list(group)[-W:]
    # float32 keeps its rule: equal scores, the lower index.
    b32 = bias.float()
    assert (
        flexdma.create_mask(b32, W, is_causal=causal, query_len=Q)[0, 0, -1].nonzero().flatten().tolist()
        == (list(group)[:W])
    )
    assert torch.equal(
        flexdma.create_mask(b32.expand(1, 2, Q, K), W, is_causal=causal),
        flexdma.create_mask(b32, W, is_causal=causal, query_len=Q).expand(1, 2, Q, K),
    )


def test_float64_block_selection_ranks_blocks_in_float64():
    # block_size keeps the blocks with the best scores: their best scores tie only in float32.
    bias = torch.zeros(1, 1, 1, 32, dtype=torch.float64)
    bias[..., 3], bias[..., 9], bias[..., 17] = 1.0, 1.0 + 1e-12, 1.0 + 2e-12
    m = flexdma.create_mask(bias, 16, block_size=8)[0, 0, 0]
    assert m.nonzero().flatten().tolist() == list(range(8, 24))
    m32 = flexdma.create_mask(bias.float(), 16, block_size=8)[0, 0, 0]
    assert m32.nonzero().flatten().tolist() == list(range(0, 16))


@pytest.mark.parametrize("backend", [b for b in ("cpu", "flex", "reference") if b in flexdma.available_backends()])
@pytest.mark.parametrize("Q", [40, 3], ids=["selection", "few_rows"])
def test_keep_window_size_float64_ranks_in_float64(backend, Q):
    """flash_dma_attention's per-key path selects on the float64 scores: the output is attention
    over the float64 mask (1e-12), not over the keys float32's tie rule would keep. On the cpu
    backend Q = 3 after 48 keys takes the few-rows route (kept sets updated key by key) instead of
    the selection."""
    K, W = 48, 5
    bias = _near_tie_bias(K, range(10, 40, 3), seed=7)
    torch.manual_seed(0)
    q, k, v = make_qkv(1, Q, K, 4, 2, 64, dtype=torch.float64)
    out = flexdma.flash_dma_attention(q, k, v, None, bias, is_causal=True, keep_window_size=W, backend=backend)
    mask = flexdma.create_mask(bias, W, is_causal=True, query_len=Q)
    ref, _ = flexdma.attention_ref(q, k, v, mask, bias, is_causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    wrong, _ = flexdma.attention_ref(q, k, v, flexdma.create_mask(bias.float(), W, is_causal=True, query_len=Q), bias)
    assert (wrong - ref).abs().max() > 1e-3  # the float32 rule's keys give another output


def test_varlen_keep_window_size_float64_ranks_in_float64():
    """The packed form of the per-key ops (the CPU selection) selects each sequence on
    its float64 scores: output and gradients are attention over the float64 mask (1e-12)."""
    W, lens = 5, (48, 41)
    biases = [_near_tie_bias(n, range(10, 40, 3), seed=7 + i)[0, :, 0] for i, n in enumerate(lens)]
    bias = torch.cat(biases, -1).requires_grad_()  # (heads, total_k)
    torch.manual_seed(0)
    q, k, v = (t[0].requires_grad_() for t in make_qkv(1, sum(lens), sum(lens), 4, 2, 64, dtype=torch.float64))
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    out = flexdma.flash_dma_attention_varlen(
        q, k, v, cu, cu, max(lens), max(lens), bias, is_causal=True, keep_window_size=W
    )
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, bias), dout)
    refs, wrongs = [], []
    for i, n in enumerate(lens):
        rows = slice(sum(lens[:i]), sum(lens[: i + 1]))
        qi, ki, vi, bi = q[rows][None], k[rows][None], v[rows][None], bias[:, rows][None, :, None]
        mask = flexdma.create_mask(bi.detach(), W, is_causal=True, query_len=n)
        refs.append(flexdma.attention_ref(qi, ki, vi, mask, bi, is_causal=True)[0][0])
        mask32 = flexdma.create_mask(bi.detach().float(), W, is_causal=True, query_len=n)
        wrongs.append(flexdma.attention_ref(qi, ki, vi, mask32, bi, is_causal=True)[0][0])
    ref = torch.cat(refs)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, torch.autograd.grad(ref, (q, k, v, bias), dout)):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    # The float32 rule's keys give another output in every sequence.
    for i, wrong in enumerate(wrongs):
        assert (wrong - refs[i]).abs().max() > 1e-3
