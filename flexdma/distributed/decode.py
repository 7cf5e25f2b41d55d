"""Decoding over a cache sharded by rank: the new rows attend over every rank's cached keys,
exchanging the ranks' top-W lists and one partial output per rank, never the cache.

The rows of a decode step see every cached key, so each keeps the same W keys: the W best of all
keys by (score desc, global index asc). Those are among the union of the ranks' own W best (a key
outranked by W keys of its own rank is outranked by W keys overall), so:
1. the ranks agree on the call (one small all-gather; bad input raises on every rank);
2. each rank all-gathers its W best (score, global index) per selection plane: P·W entries;
3. every rank finds the W-th best of all (the kept set's threshold) and keeps its own keys that
   rank at or above it;
4. each rank attends its kept keys (split-K: an output and a log-sum-exp per row), and the P
   partial outputs merge by their log-sum-exp, which is exact: softmax over a union of disjoint
   key sets.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import _checks
from ..api import flash_dma_attention
from ..perkey import contract as perkey
from . import _group
from .attention import _NEG_INF, SIGNATURE, signature

# Positions of the padding entries of a short list: above every cached key's.
_MAX_INDEX = (1 << 62) - 1


def _check_local(query, key, value, attn_bias, attn_mask, key_index, keep_window_size, softmax_scale, softcap):
    _checks.check_qkv(query, key, value)
    window = perkey.check_window(keep_window_size)
    K = key.shape[1]
    bias = _checks.check_bias(attn_bias, query[:, :1], key)
    perkey.check_operands(None, bias, K)
    if bias.shape[3] != K:
        raise ValueError(f"attn_bias must have one score per cached key ({K}), got shape {tuple(attn_bias.shape)}")
    _checks.check_tensor("key_index", key_index)
    if key_index.shape != (K,) or key_index.dtype != torch.int64 or key_index.device != key.device:
        raise ValueError(
            f"key_index must be the int64 global positions of this rank's {K} cached keys, shape ({K},) on "
            f"{key.device}, got {key_index.dtype} of shape {tuple(key_index.shape)} on {key_index.device}"
        )
    if attn_mask is not None:
        _checks.check_tensor("attn_mask", attn_mask)
        if attn_mask.dtype != torch.bool or attn_mask.shape != (query.shape[0], K) or attn_mask.device != key.device:
            raise ValueError(
                f"attn_mask must be a bool (batch, cached keys) = {(query.shape[0], K)} padding mask on {key.device}, "
                f"got {attn_mask.dtype} of shape {tuple(attn_mask.shape)} on {attn_mask.device}"
            )
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, bias)):
        raise ValueError("context_parallel_decode is inference-only (no autograd): call it under torch.no_grad()")
    scale, softcap = _checks.check_scalars(query.shape[-1], softmax_scale, softcap, False)
    return bias, window, scale, softcap


def _order(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Positions along the last dim in (score desc, index asc) order: the per-key selection's."""
    by_index = index.argsort(dim=-1, stable=True)
    by_score = scores.gather(-1, by_index).argsort(dim=-1, descending=True, stable=True)
    return by_index.gather(-1, by_score)


def context_parallel_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor,
    *,
    keep_window_size: int,
    key_index: torch.Tensor,
    group=None,
    attn_mask: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """A decode step over a KV cache sharded by rank, equal to the one-process per-key call over
    the whole cache (`flash_dma_attention(query, K, V, mask, bias, is_causal=True,
    keep_window_size=W)` with the query rows after every key; rows that each see every key).

    Args:
        query: (batch, rows, heads, head_dim), the same on every rank (the new token's query).
        key, value: this rank's cached keys, (batch, K_local, kv_heads, head_dim); K_local may
            differ between ranks (and be 0).
        attn_bias: their per-key scores ({1|B}, {1|KVH|H}, 1, K_local), query's dtype.
        keep_window_size: W, the keys each row keeps.
        key_index: (K_local,) int64 global positions of the local keys (distinct over the ranks;
            ties in score go to the lower position).
        attn_mask: optional bool (batch, K_local) padding mask of the local keys.
        group, softmax_scale, softcap: as in `context_parallel_attention`.

    Returns the output (batch, rows, heads, head_dim) on every rank. Per call a rank sends its
    W-entry top list per selection plane and one partial output and log-sum-exp per row: O(P·W)
    entries, never a cached row. Inference only (no autograd)."""
    pg = _group.resolve(group)
    fields = dict.fromkeys(SIGNATURE + ("query_rows",), 0)
    device = key.device if isinstance(key, torch.Tensor) else torch.device("cpu")
    with _group.agreement(pg, _group.comm_device(pg, device), fields):
        bias, W, scale, softcap = _check_local(
            query, key, value, attn_bias, attn_mask, key_index, keep_window_size, softmax_scale, softcap
        )
        _group.check_device(pg, device, "key")
        fields.update(signature(query, key, bias, attn_mask, W, scale, softcap), query_rows=query.shape[1])
    _group.count_call()
    with torch.no_grad():
        return _decode(pg, query, key, value, bias, attn_mask, key_index, W, scale, softcap)


def _decode(pg, query, key, value, bias, attn_mask, key_index, W, scale, softcap):
    world, device = dist.get_world_size(pg), key.device
    B, Q, H, D = query.shape
    K, KVH = key.shape[1], key.shape[2]
    Hb = bias.shape[1]
    Hk = H if Hb == H and H != KVH else KVH

    # 1. This rank's W best per plane, padded to W entries (score -inf: never kept).
    scores = bias[:, :, 0, :].to(torch.float64 if bias.dtype == torch.float64 else torch.float32)
    if attn_mask is not None:
        scores = torch.where(attn_mask[:, None, :], scores, _NEG_INF)
    Bs = scores.shape[0]
    pad = max(W - K, 0)
    pad_index = _MAX_INDEX - torch.arange(pad, device=device)  # distinct, above every position
    s_all = torch.cat([scores, scores.new_full((Bs, Hb, pad), _NEG_INF)], dim=-1)
    i_all = torch.cat([key_index, pad_index]).expand(Bs, Hb, K + pad)
    order = _order(s_all, i_all)[..., :W]
    top_s, top_i = s_all.gather(-1, order), i_all.gather(-1, order)
    top_slot = torch.where(order < K, order, -1)  # the local key of each entry, -1 for padding

    # 2. All ranks' lists; 3. the W-th best of all is the kept set's threshold.
    payload = torch.cat([top_s.double().reshape(-1).view(torch.int64), top_i.reshape(-1)])
    gathered = _group.all_gather(pg, payload, "forward").view(world, 2, -1)
    all_s = gathered[:, 0].view(torch.float64).to(top_s.dtype).view(world, Bs, Hb, W).permute(1, 2, 0, 3)
    all_i = gathered[:, 1].view(world, Bs, Hb, W).permute(1, 2, 0, 3)
    all_s, all_i = all_s.reshape(Bs, Hb, world * W), all_i.reshape(Bs, Hb, world * W)
    worst = _order(all_s, all_i)[..., W - 1 : W]
    thr_s, thr_i = all_s.gather(-1, worst), all_i.gather(-1, worst)
    kept = ((top_s > thr_s) | ((top_s == thr_s) & (top_i <= thr_i))) & (top_s > _NEG_INF) & (top_slot >= 0)

    # 4. This rank's kept keys (W slots, the others masked) and its partial output.
    kept = kept.expand(B, Hk, W)
    if K:
        rows = top_slot.clamp(min=0).expand(B, Hk, W)
        batch = torch.arange(B, device=device)[:, None, None]
        kv_head = torch.arange(Hk, device=device) // (Hk // KVH)
        k_sel = key[batch, rows.transpose(1, 2), kv_head]  # (B, W, Hk, D)
        v_sel = value[batch, rows.transpose(1, 2), kv_head]
        b_sel = bias[:, :, 0, :].expand(B, Hk, K).gather(-1, rows)
    else:  # an empty shard keeps nothing
        k_sel = v_sel = key.new_zeros((B, W, Hk, D))
        b_sel = bias.new_zeros((B, Hk, W))
    b_sel = torch.where(kept, b_sel, _NEG_INF)
    out, lse = flash_dma_attention(
        query, k_sel, v_sel, None, b_sel.unsqueeze(2), softmax_scale=scale, softcap=softcap, return_lse=True
    )

    # 5. Merge the ranks' partial outputs by their log-sum-exp.
    acc = lse.dtype
    outs = _group.all_gather(pg, out.to(acc), "forward")  # (world, B, Q, H, D)
    lses = _group.all_gather(pg, lse, "forward")  # (world, B, H, Q)
    total = torch.logsumexp(lses, dim=0)
    weight = torch.exp(lses - total).nan_to_num(0.0)  # rows that keep nothing anywhere: 0
    merged = (weight.permute(0, 1, 3, 2)[..., None] * outs).sum(0)
    return merged.to(query.dtype)
