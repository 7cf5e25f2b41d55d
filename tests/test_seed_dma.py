"""flexdma.compat.apply_dynamic_mask_attention against a float64 transcription of the seed's
dynamic mask attention loop (per batch, kv head and query: masked scores set to 0, top-k,
attention over the non-zero entries of the dynamic mask)."""

import pytest
import torch
import torch.nn.functional as F

import flexdma
from flexdma import dynamic
from flexdma.compat import apply_dynamic_mask_attention


def seed_dma(query_states, key_states, value_states, dt_proj, A, causal_mask, keep_window_size, is_causal):
    B, H, Q, D = query_states.shape
    KVH, K = key_states.shape[1], key_states.shape[2]
    G = H // KVH
    dt_result = torch.matmul(value_states.transpose(-2, -3).reshape(B, K, -1), dt_proj.T)
    zero_hold_states = torch.exp(F.softplus(dt_result) * A).transpose(-1, -2).unsqueeze(-2).expand(-1, -1, Q, -1)
    if causal_mask is not None:  # a query dim of 1 stands for every row
        causal_mask = causal_mask.expand(-1, -1, Q, -1)
    rows = []
    for b_idx in range(B):
        for kv_idx in range(KVH):
            for q_idx in range(Q):
                zero_hold_state = zero_hold_states[b_idx, kv_idx, q_idx, :]
                if causal_mask is not None:
                    zero_hold_state = zero_hold_state.masked_fill(causal_mask[b_idx, 0, q_idx, :] != 0, 0)
                if is_causal:  # the causal cut, bottom-right aligned
                    zero_hold_state = zero_hold_state.masked_fill(torch.arange(K) > q_idx + K - Q, 0)
                if K > keep_window_size:
                    topk_values, topk_indices = torch.topk(zero_hold_state, keep_window_size, dim=-1)
                    dynamic_mask = torch.zeros_like(zero_hold_state).scatter(-1, topk_indices, topk_values)
                else:
                    dynamic_mask = zero_hold_state
                mask_indices = dynamic_mask.nonzero().flatten()
                for q_group_idx in range(G):
                    h_idx = kv_idx * G + q_group_idx
                    if len(mask_indices) == 0:
                        rows.append(((b_idx, h_idx, q_idx), torch.zeros(D, dtype=query_states.dtype)))
                        continue
                    k_vecs = key_states[b_idx, kv_idx, mask_indices, :]
                    v_vecs = value_states[b_idx, kv_idx, mask_indices, :]
                    q_vec = query_states[b_idx, h_idx, q_idx, :]
                    attn_weight = torch.sum(q_vec.unsqueeze(0) * k_vecs, dim=-1)
                    attn_weight = attn_weight + dynamic_mask[mask_indices]
                    attn_weight = F.softmax(attn_weight, dim=-1)
                    rows.append(((b_idx, h_idx, q_idx), torch.sum(attn_weight.unsqueeze(1) * v_vecs, dim=0)))
    out = torch.stack([r for _, r in sorted(rows, key=lambda x: x[0])]).view(B, H, Q, D)
    return out


def _inputs(B, H, KVH, Q, K, D=8):
    q = (torch.randn(B, H, Q, D, dtype=torch.float64) * 0.5).requires_grad_()
    k = (torch.randn(B, KVH, K, D, dtype=torch.float64) * 0.5).requires_grad_()
    v = torch.randn(B, KVH, K, D, dtype=torch.float64).requires_grad_()
    dt = (torch.randn(KVH, KVH * D, dtype=torch.float64) * 0.4).requires_grad_()
    A = torch.randn(KVH, dtype=torch.float64).requires_grad_()
    return q, k, v, dt, A


def _float_mask(keep):
    return torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, float("-inf"))


# (Q, K, W, mask kind, is_causal)
CASES = [
    (12, 12, 5, "none", True),
    (12, 12, 5, "causal_padding", True),
    (12, 12, 5, "causal_padding", False),  # the mask carries the causality itself
    (12, 12, 40, "causal_padding", True),  # W >= K
    (4, 15, 6, "causal_padding", True),  # Q < K: the query rows are the last ones
    (12, 12, 4, "per_key", False),
    (10, 10, 4, "rows", True),  # a mask that varies by row: the dense route
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_seed_loop(case, monkeypatch):
    Q, K, W, kind, is_causal = case
    B, H, KVH = 2, 4, 2
    q, k, v, dt, A = _inputs(B, H, KVH, Q, K)
    mask = None
    if kind == "causal_padding":
        pad = torch.ones(B, K, dtype=torch.bool)
        pad[1, :3] = False
        mask = _float_mask(flexdma.dense.naive.causal_mask(Q, K)[None, None] & pad[:, None, None, :])
    elif kind == "per_key":
        mask = _float_mask(torch.rand(B, 1, 1, K) < 0.7)
    elif kind == "rows":
        mask = _float_mask(torch.rand(B, 1, Q, K) < 0.7)
    if kind != "rows":
        # Per-key masks take the keep_window_size path: no dense mask is built.
        monkeypatch.setattr(dynamic, "create_mask", lambda *a, **kw: pytest.fail("dense create_mask used"))
    out = apply_dynamic_mask_attention(q, k, v, dt, A, causal_mask=mask, keep_window_size=W, is_causal=is_causal)
    ref = seed_dma(q, k, v, dt, A, mask, W, is_causal)
    assert out.shape == (B, H, Q, 8)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-9)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, dt, A), g)
    want = torch.autograd.grad(ref, (q, k, v, dt, A), g)
    for name, a, b in zip("q k v dt_proj A".split(), got, want):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-8, msg=lambda m: f"d{name}: {m}")


def test_softmax_scale_and_errors():
    q, k, v, dt, A = _inputs(1, 2, 1, 6, 6)
    out = apply_dynamic_mask_attention(q, k, v, dt, A, keep_window_size=3, softmax_scale=0.5)
    ref = seed_dma(q * 0.5, k, v, dt, A, None, 3, True)
    torch.testing.assert_close(out, ref)
    with pytest.raises(TypeError, match="causal_mask must be a float tensor"):
        apply_dynamic_mask_attention(q, k, v, dt, A, causal_mask=torch.ones(1, 1, 6, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="causal_mask must be"):
        apply_dynamic_mask_attention(q, k, v, dt, A, causal_mask=torch.zeros(1, 2, 6, 6, dtype=torch.float64))
