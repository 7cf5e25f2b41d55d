"""Per-key top-W selection: the dynamic mask of Doge-style layers without a Q x K tensor.

When the importance of a key does not depend on the query (a bias of shape
({1|B}, {1|KVH|H}, 1, K)), row i keeps the W best keys by (score desc, key index asc) among
the keys it may see (causal cut, attn_mask). Causality makes the kept sets nest, so the whole
mask fits in O(Q + K) per selection plane (see the per-key selection design note):

- `key_rank[p, j]`: rank of key j in its plane, 0-based, in that order, among eligible keys
  (allowed by attn_mask and with a score other than -inf); `NEVER` (int32 max) for the others.
- `row_thr[p, i]`: the largest rank row i keeps, -1 when it keeps nothing. Row i keeps key j iff
  `key_rank[p, j] <= row_thr[p, i]` and, when causal, `j <= i + K - Q` (bottom-right aligned).
- `tile_keys[p]`: for each query tile t of `tile_rows` rows, 1 + cap entries from t * (1 + cap)
  on: the number n of listed keys, then n key indices in rank order: every key some row of the
  tile keeps, and the keys its last row sees up to the tile's largest threshold (at most
  cap = min(K, W + tile_rows - 1); entries past n are unspecified). `tile_lists` views it per
  tile. The GPU kernels gather K / V rows from it; the CPU kernel and FlexAttention need only the
  first two.

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
    tile_keys: torch.Tensor  # int32 (P1, P2, n_tiles * (1 + cap))


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


def list_cap(K: int, window: int, tile_rows: int) -> int:
    """Entries of a tile's list: at most W + tile_rows - 1 keys (and never more than K)."""
    return min(K, window + tile_rows - 1)


def tile_rows_for(query: torch.Tensor, key: torch.Tensor, plane_heads: int) -> int:
    """Rows per query tile of the selection lists, as the kernels of query's device read them."""
    if query.device.type == "cuda":
        from . import _topk_triton

        return _topk_triton.tile_rows_for(query, key, plane_heads)
    return CPU_TILE_ROWS


def select(scores: torch.Tensor, window: int, seqlen_q: int, is_causal: bool, tile_rows: int) -> Selection:
    from . import _ops

    return Selection(*_ops.topk_select(scores, window, seqlen_q, is_causal, tile_rows))


def tile_lists(sel: Selection, seqlen_q: int, tile_rows: int) -> torch.Tensor:
    """tile_keys as (P1, P2, n_tiles, 1 + cap): [..., 0] is each tile's list length."""
    n_tiles = -(-seqlen_q // tile_rows)
    return sel.tile_keys.view(*sel.tile_keys.shape[:2], n_tiles, -1)


def keep_mask(sel: Selection, seqlen_q: int, seqlen_k: int, is_causal: bool) -> torch.Tensor:
    """The dense (P1, P2, Q, K) bool mask the selection stands for (the reference path and tests
    only: it is Q x K)."""
    keep = sel.key_rank[:, :, None, :] <= sel.row_thr[:, :, :, None]
    if is_causal:
        keep = keep & causal_mask(seqlen_q, seqlen_k, device=keep.device)
    return keep


def check_window(keep_window_size) -> int:
    if isinstance(keep_window_size, bool) or not isinstance(keep_window_size, int) or keep_window_size <= 0:
        raise ValueError(f"keep_window_size must be a positive int, got {keep_window_size!r}")
    return keep_window_size


def check_operands(attn_mask: Optional[torch.Tensor], attn_bias: Optional[torch.Tensor], seqlen_k: int) -> None:
    """The per-key path's limits on the (already broadcast-checked, 4-D) mask and bias. With one key
    (a one-token prompt, a cache's first step) a key dim of 1 is the per-key shape."""
    if attn_bias is None:
        raise ValueError(
            "keep_window_size picks the top keys by attn_bias: pass a per-key attn_bias of shape "
            "({1|B}, {1|KVH|H}, 1, K)"
        )
    if attn_bias.shape[2] != 1 or (attn_bias.shape[3] == 1 and seqlen_k > 1):
        raise ValueError(
            f"keep_window_size needs a per-key attn_bias ({{1|B}}, {{1|KVH|H}}, 1, K) (one score per "
            f"key, shared by every query row), got shape {tuple(attn_bias.shape)}; for a bias that "
            "varies by row, build the mask with create_mask and pass it as attn_mask"
        )
    if attn_mask is not None and attn_mask.shape[2] != 1:
        raise ValueError(
            f"with keep_window_size, attn_mask may only drop keys for every row (a (B, K) padding "
            f"mask or a query dim of 1), got shape {tuple(attn_mask.shape)}"
        )


def cuda_unsupported_reason(q: torch.Tensor) -> Optional[str]:
    if q.device.type != "cuda":
        return f"inputs are on {q.device.type}, not cuda"
    from . import _ops

    if not _ops.HAVE_TRITON:  # pragma: no cover - a torch without triton
        return "triton is unavailable (the per-key CUDA kernels are Triton)"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (the per-key CUDA kernels take float16 and bfloat16)"
    d = q.shape[-1]
    if d < 16 or d > 256 or d & (d - 1):
        return f"head_dim {d} (the per-key CUDA kernels take powers of two from 16 to 256)"
    return None


def attention(
    query,
    key,
    value,
    attn_mask,
    attn_bias,
    window: int,
    *,
    scale: float,
    is_causal: bool,
    softcap: float,
    backend: str,
    deterministic: bool,
):
    """(out, lse) of attention over each row's top `window` keys by the per-key attn_bias; inputs
    validated by flexdma.api. No Q x K tensor on the cuda, cpu and flex backends."""
    from . import _dispatch

    Q, K, H = query.shape[1], key.shape[1], query.shape[2]
    check_operands(attn_mask, attn_bias, K)
    name = _select_backend(backend, query, key, value, attn_bias, is_causal, softcap, _dispatch)
    scores = selection_scores(attn_bias.detach(), attn_mask, H)
    sel = select(scores, window, Q, is_causal, tile_rows_for(query, key, scores.shape[1]))
    if name in ("cuda", "cpu"):
        from . import _ops

        out, lse, _ = _ops.topk_fwd(
            query,
            key,
            value,
            attn_bias,
            sel.key_rank,
            sel.row_thr,
            scale,
            is_causal,
            softcap,
            bool(deterministic),
            sel.tile_keys if name == "cuda" else None,
        )
        return out, lse
    if name == "flex":
        from . import flex

        return flex.flex_topk_attention(
            query,
            key,
            value,
            attn_bias,
            sel.key_rank,
            sel.row_thr,
            is_causal=is_causal,
            softmax_scale=scale,
            softcap=softcap,
        )
    from .reference import attention_ref

    return attention_ref(
        query,
        key,
        value,
        keep_mask(sel, Q, K, is_causal),
        attn_bias,
        is_causal=is_causal,
        softmax_scale=scale,
        softcap=softcap,
    )


def _select_backend(backend, q, k, v, bias, is_causal, softcap, _dispatch) -> str:
    training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, bias))

    def why_not(name):
        if name == "cuda":
            return cuda_unsupported_reason(q)
        if name == "flex" and q.device.type == "cpu" and training:
            return "FlexAttention has no CPU backward for the per-key path"
        return _dispatch.unsupported_reason(
            name, q, k, v, None, bias, is_causal=is_causal, softcap=softcap, requires_grad=training
        )

    return _dispatch.select(
        backend,
        q,
        k,
        v,
        None,
        bias,
        is_causal=is_causal,
        softcap=softcap,
        requires_grad=training,
        why_not=why_not,
        what="per-key (keep_window_size) ",
    )
