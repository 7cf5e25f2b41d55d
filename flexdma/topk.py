"""Per-key top-W selection: the dynamic mask of Doge-style layers without a Q x K tensor.

When the importance of a key does not depend on the query (a bias of shape
({1|B}, {1|KVH|H}, 1, K)), row i keeps the W best keys by (score desc, key index asc) among
the keys it may see (causal cut, attn_mask). Causality makes the kept sets nest, so the whole
mask fits in O(Q + K) per selection plane (see the per-key selection design note):

- `key_rank[p, j]`: rank of key j in its plane, 0-based, in that order, among eligible keys
  (allowed by attn_mask and with a score other than -inf); `NEVER` (int32 max) for the others.
- `row_thr[p, i]`: the largest rank row i keeps, -1 when it keeps nothing. Row i keeps key j iff
  `key_rank[p, j] <= row_thr[p, i]` and, when causal, `j <= i + K - Q` (bottom-right aligned).
- `tile_keys[p, t]`: for the query tile t of `tile_rows` rows, the number n of keys some row of
  the tile keeps, then those n key indices in rank order (at most W + tile_rows - 1 of them). The
  GPU kernels gather K / V rows from it; the CPU kernel and FlexAttention need only the first two.

This is the mask `create_mask(attn_bias, W, attn_mask=..., is_causal=..., query_len=Q)` builds
densely, entry for entry (tests/test_topk.py checks it). A plane is one (batch, head) entry of the
broadcast of the bias's and the mask's batch / head dims.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .reference import causal_mask, expand_heads

NEVER = 2147483647

# Query rows per tile of the CPU selection's lists (the CPU kernel does not read the lists).
CPU_TILE_ROWS = 64


class Selection(NamedTuple):
    key_rank: torch.Tensor  # int32 (P1, P2, K)
    row_thr: torch.Tensor  # int32 (P1, P2, Q)
    tile_keys: torch.Tensor  # int32 (P1, P2, n_tiles, 1 + cap)


def selection_scores(attn_bias: torch.Tensor, attn_mask: Optional[torch.Tensor], num_heads: int) -> torch.Tensor:
    """(P1, P2, K) float32 scores of the selection planes: the per-key bias with the keys the
    mask drops set to -inf. Planes are the broadcast of the bias's and the mask's (batch, head)."""
    s = attn_bias[:, :, 0, :].float()
    if attn_mask is None:
        return s
    m = attn_mask[:, :, 0, :]
    if s.shape[1] != m.shape[1] and s.shape[1] > 1 and m.shape[1] > 1:
        # One is per kv head and the other per query head: both onto the query heads.
        s, m = expand_heads(s.unsqueeze(2), num_heads).squeeze(2), expand_heads(m.unsqueeze(2), num_heads).squeeze(2)
    return s.masked_fill(~m, float("-inf"))


def tile_rows_for(query: torch.Tensor, key: torch.Tensor, plane_heads: int) -> int:
    """Rows per query tile of the selection lists, as the kernels of query's device read them."""
    if query.device.type == "cuda":
        from . import _topk_triton

        return _topk_triton.tile_rows_for(query.shape[2], key.shape[2], plane_heads)
    return CPU_TILE_ROWS


def select(scores: torch.Tensor, window: int, seqlen_q: int, is_causal: bool, tile_rows: int) -> Selection:
    from . import _ops

    return Selection(*_ops.topk_select(scores, window, seqlen_q, is_causal, tile_rows))


def keep_mask(sel: Selection, seqlen_q: int, seqlen_k: int, is_causal: bool) -> torch.Tensor:
    """The dense (P1, P2, Q, K) bool mask the selection stands for (the reference path and tests
    only: it is Q x K)."""
    keep = sel.key_rank[:, :, None, :] <= sel.row_thr[:, :, :, None]
    if is_causal:
        keep = keep & causal_mask(seqlen_q, seqlen_k, device=keep.device)
    return keep
