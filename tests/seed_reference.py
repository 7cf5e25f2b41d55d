"""The seed project's (flash-dmattn) semantics, written out for the tests as eager PyTorch: what its
equivalence benchmarks took as the truth for its kernels. Layout (batch, heads, seqlen, head_dim),
as the seed's benchmarks; the mask fill is the dtype's most negative finite value, as theirs.

- `doge_scores`: its per-key scores exp(softplus(v_flat @ dt_proj.T) * A).
- `causal_fill`: its additive causal mask (0 = keep, fill = masked), bottom-right aligned.
- `select_topk`: its dynamic mask: each row's keep_window_size best scores by torch.topk (ties in
  torch.topk's own order) once K exceeds keep_window_size, every key otherwise; the bias keeps the
  scores there and the fill elsewhere.
- `block_smooth`: its block smoothing of a selection.
- `attention`: softmax(scale * q.k + bias) @ v over repeated kv heads.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def fill_value(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).min


def doge_scores(value: torch.Tensor, dt_proj: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """value (B, KVH, K, D), dt_proj (KVH, KVH * D), A (KVH,) -> scores (B, KVH, K)."""
    B, KVH, K, D = value.shape
    x = value.transpose(1, 2).reshape(B, K, KVH * D) @ dt_proj.T  # (B, K, KVH)
    return torch.exp(F.softplus(x) * A).transpose(1, 2)


def causal_fill(Q: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, Q, K): 0 where query i (at position K - Q + i) sees key j, the fill after it."""
    pos = torch.arange(K - Q, K)[:, None]
    return torch.zeros(Q, K, dtype=dtype).masked_fill(torch.arange(K) > pos, fill_value(dtype))[None, None]


def select_topk(
    scores: torch.Tensor, window: int, query_len: int, additive: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-key scores (B, KVH, K) as rows (B, KVH, Q, K), dropped where `additive` is not 0; then
    (bias, keep): keep the rows' top `window` entries that are not the fill (every entry when
    K <= window), bias the rows with the fill where not kept."""
    fill = fill_value(scores.dtype)
    rows = scores[:, :, None, :].expand(-1, -1, query_len, -1)
    if additive is not None:
        rows = rows.masked_fill(additive != 0, fill)
    if rows.shape[-1] <= window:
        return rows, torch.ones_like(rows, dtype=torch.bool)
    top = torch.topk(rows, window, dim=-1, largest=True, sorted=False)
    keep = torch.zeros_like(rows, dtype=torch.bool).scatter(-1, top.indices, top.values != fill)
    return rows.masked_fill(~keep, fill), keep


def block_smooth(keep: torch.Tensor, block_size: int) -> torch.Tensor:
    """Aligned key blocks of `block_size` (the last one shorter) kept whole where more than half of
    their entries are kept, dropped whole otherwise."""
    out = keep.clone()
    for b0 in range(0, keep.shape[-1], block_size):
        blk = keep[..., b0 : b0 + block_size]
        out[..., b0 : b0 + block_size] = (2 * blk.sum(-1, keepdim=True) > blk.shape[-1]).expand_as(blk)
    return out


def attention(q, k, v, bias, scale: float) -> torch.Tensor:
    """q (B, H, Q, D), k / v (B, KVH, K, D), bias (B, KVH|H, Q, K) -> out (B, Q, H, D)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if bias.shape[1] != q.shape[1]:
        bias = bias.repeat_interleave(q.shape[1] // bias.shape[1], 1)
    p = torch.softmax(q @ k.transpose(-1, -2) * scale + bias, dim=-1)
    return (p @ v).transpose(1, 2)
