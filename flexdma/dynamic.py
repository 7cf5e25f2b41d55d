"""Dynamic mask attention: keys are scored from the value states, the top ones are attended to."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .api import flash_dma_attention
from .masks import create_mask


def dynamic_bias(value: torch.Tensor, dt_proj: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """Per-key importance `exp(A * softplus(v_flat @ dt_proj.T))` as a (B, KVH, 1, K) bias: the
    dynamic mask scores of the seed design and of transformers' Doge (`dt_states`)."""
    B, K, KVH, D = value.shape
    if dt_proj.shape != (KVH, KVH * D):
        raise ValueError(f"dt_proj must have shape {(KVH, KVH * D)}, got {tuple(dt_proj.shape)}")
    if A.shape != (KVH,):
        raise ValueError(f"A must have shape {(KVH,)}, got {tuple(A.shape)}")
    # Computed directly in (B, KVH, K) layout: elementwise ops on a transposed view get output
    # strides in eager that differ from the ones torch.compile's tracing predicts for their backward.
    dt = F.softplus(dt_proj.to(value.dtype) @ value.reshape(B, K, KVH * D).transpose(1, 2))  # (B, KVH, K)
    return torch.exp(A.to(value.dtype)[:, None] * dt).unsqueeze(2)


def dynamic_mask_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dt_proj: torch.Tensor,
    A: torch.Tensor,
    *,
    keep_window_size: int = 2048,
    is_causal: bool = True,
    attn_mask: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention over the `keep_window_size` most important keys of each query.

    Args:
        query: (batch, seqlen_q, num_heads, head_dim).
        key, value: (batch, seqlen_k, num_kv_heads, head_dim).
        dt_proj: (num_kv_heads, num_kv_heads * head_dim), projects the value states to key scores.
        A: (num_kv_heads,), per-head scale of the scores.
        keep_window_size: keys kept per query row.
        is_causal: bottom-right aligned causal mask.
        attn_mask: optional bool padding mask, (batch, seqlen_k) or 4-D broadcastable, True = real key.
        softmax_scale: default 1/sqrt(head_dim).
        backend: passed to flash_dma_attention.

    The scores are also added to the attention logits, so dt_proj and A get gradients; the choice
    of keys itself is not differentiable.
    """
    for name, t in (("query", query), ("key", key), ("value", value), ("dt_proj", dt_proj), ("A", A)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if value.dim() != 4:
        raise ValueError(f"value must be 4-D (batch, seqlen_k, num_kv_heads, head_dim), got {tuple(value.shape)}")
    bias = dynamic_bias(value, dt_proj, A).to(query.dtype)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise TypeError(f"attn_mask must be a bool tensor, got {attn_mask.dtype}")
    if attn_mask is not None and attn_mask.dim() == 2:  # (batch, seqlen_k) padding mask
        attn_mask = attn_mask[:, None, None, :]
    if attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[2] > 1:
        # A mask that differs by row (nn.MultiheadAttention's attn_mask): the selection depends on
        # it row by row, so it is built densely.
        mask = create_mask(
            bias.detach(), keep_window_size, attn_mask=attn_mask, is_causal=is_causal, query_len=query.shape[1]
        )
        return flash_dma_attention(
            query, key, value, mask, bias, is_causal=is_causal, softmax_scale=softmax_scale, backend=backend
        )
    # The scores are per key: the selection is implicit (flexdma/perkey/), no Q x K mask is built.
    return flash_dma_attention(
        query,
        key,
        value,
        attn_mask,
        bias,
        is_causal=is_causal,
        softmax_scale=softmax_scale,
        backend=backend,
        keep_window_size=keep_window_size,
    )
