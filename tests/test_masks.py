"""create_mask's per-key path (flexdma.topk's selection, then a comparison against the row
thresholds) is bitwise the dense top-k it replaced: a frozen copy of that implementation is the oracle."""

from typing import Optional

import pytest
import torch
from utils import LargestTensor

import flexdma
from flexdma.reference import causal_mask


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
    scores = attn_bias.float().expand(out_shape)
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
    if r(0, 1):  # ties, also across the float32 rounding of float64 scores
        bias[..., r(0, K - 1) :: r(2, 7)] = bias[..., :1].clone()
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
