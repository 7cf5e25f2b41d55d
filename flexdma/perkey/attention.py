"""The per-key (keep_window_size) attention: route, select, run the routed forward."""

from __future__ import annotations

import torch

from .. import _dispatch
from . import contract, naive, ops, route


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
    Q, K, H = query.shape[1], key.shape[1], query.shape[2]
    contract.check_operands(attn_mask, attn_bias, K)
    name = _select_backend(backend, query, key, value, attn_bias, is_causal, softcap)
    mask_heads = 1 if attn_mask is None else attn_mask.shape[1]
    r = route.decide(name, query, key, attn_bias.shape[1], mask_heads)
    scores = contract.selection_scores(attn_bias.detach(), attn_mask, H)
    sel = contract.select(scores, window, Q, is_causal, r.tile_rows)
    if r.backend in ("cuda", "cpu"):
        out, lse, _ = ops.topk_fwd(
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
            sel.tile_keys if r.backend == "cuda" else None,
        )
        return out, lse
    if r.backend == "flex":
        flex, _ = _dispatch._flex_module()
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
    return naive.attention(query, key, value, attn_bias, sel, scale=scale, is_causal=is_causal, softcap=softcap)


def _select_backend(backend, q, k, v, bias, is_causal, softcap) -> str:
    training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, bias))

    def why_not(name):
        if name == "cuda":
            return route.cuda_unsupported_reason(q)
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
