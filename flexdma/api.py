"""The public attention function."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from . import _checks, _dispatch
from .perkey import contract as perkey


def flash_dma_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    attn_bias: Optional[torch.Tensor] = None,
    *,
    is_causal: bool = False,
    softmax_scale: Optional[float] = None,
    softcap: float = 0.0,
    return_lse: bool = False,
    backend: str = "auto",
    deterministic: bool = False,
    keep_window_size: Optional[int] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Attention with an additive bias and a boolean key mask, FlashAttention layout.

    Args:
        query: (batch, seqlen_q, num_heads, head_dim).
        key, value: (batch, seqlen_k, num_kv_heads, head_dim); num_heads % num_kv_heads == 0 (GQA/MQA).
        attn_mask: bool, True = attend; broadcastable as ({1|B}, {1|KVH|H}, {1|Q}, {1|K}), fewer
            dims are left-padded with 1, except a 2-D mask of B rows (B > 1): that is a (batch, key)
            padding mask. Never expanded to full size.
        attn_bias: added to the scores (after softcap), same dtype as query, same broadcast rules.
            Gets a gradient in its own shape when it requires grad.
        is_causal: causal mask aligned to the bottom-right corner when seqlen_q != seqlen_k.
        softmax_scale: default 1/sqrt(head_dim).
        softcap: > 0 applies softcap * tanh(scores / softcap) before the bias is added.
        return_lse: also return the log-sum-exp (batch, num_heads, seqlen_q), float32
            (float64 for float64 inputs); -inf for rows that attend to nothing (their output is 0).
        backend: "auto", "cuda", "flex", "cpu" or "reference" (see available_backends()).
        deterministic: bitwise reproducible gradients, at a cost in time. Without it the CUDA
            backward adds dq's per-key-tile parts with float atomics (and, on the per-key path,
            keep_window_size, dk / dv / dbias too); with it they are summed in a fixed order.
            The CPU kernel is deterministic either way.
        keep_window_size: each query row keeps the `keep_window_size` keys with the highest
            attn_bias among the keys it may see (causal cut, attn_mask), ties to the lower key
            index: the mask `create_mask(attn_bias, keep_window_size, ...)` would build, without
            building it. Needs a per-key attn_bias ({1|B}, {1|KVH|H}, 1, K); attn_mask may only drop
            keys for every row ((B, K) or a query dim of 1). Memory O(Q + K) per bias plane, and
            the CUDA kernels visit only the kept keys (flexdma/perkey/).
    """
    _checks.check_qkv(query, key, value)
    attn_mask = _checks.check_mask(attn_mask, query, key)
    attn_bias = _checks.check_bias(attn_bias, query, key)
    scale, softcap = _checks.check_scalars(query.shape[-1], softmax_scale, softcap, is_causal)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    query, key, value = (_checks.last_dim_contiguous(t) for t in (query, key, value))
    if keep_window_size is not None:
        keep_window_size = perkey.check_window(keep_window_size)
        perkey.check_operands(attn_mask, attn_bias, key.shape[1])
    # The call, described once: every backend decision below reads it (whether a backward follows, or
    # the LSE is wanted, too).
    call = _dispatch.Call.of(
        query, key, value, attn_mask, attn_bias, is_causal=is_causal, softcap=softcap, keep_window_size=keep_window_size,
        need_lse=bool(return_lse),
    )  # fmt: skip
    # How it runs, decided once (backend, route, layout), then the implementation itself.
    plan = _dispatch.plan(backend, call, bool(deterministic))
    out, lse = plan.run(plan, query, key, value, attn_mask, attn_bias, scale, bool(deterministic), return_lse)
    return (out, lse) if return_lse else out
