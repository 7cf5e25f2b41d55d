"""The eager reference: the definition of flexdma attention that every backend is tested against.

It materialises the (B, H, Q, K) score matrix, so it is for tests and small problems only. It runs
in the dtype it is given: float64 inputs give the ground truth; bf16/fp16 inputs give "the same
computation in low precision", whose error sets the tolerance of the fast kernels
(FlashAttention's rule).

Conventions defined here (the kernels in csrc/ follow them, see csrc/flash_dma_params.h):
- layout (batch, seqlen, heads, head_dim); GQA: query head h uses kv head h // (H // KVH);
- score = softcap(scale * q.k) + bias, softcap(x) = c * tanh(x / c) when c > 0;
- keys are dropped where the mask is False and, with ``is_causal``, where key j > i + (K - Q):
  causal is aligned to the bottom-right corner when Q != K;
- a row whose scores are all -inf (every key masked, causally hidden, or given a -inf bias) gives
  output 0 and LSE -inf, and no gradient flows from it;
- NaN and Inf are never absorbed: a NaN / Inf in a query row, in a key or value the row attends to,
  or in the row's bias at a key it attends to makes the row's output non-finite and its LSE NaN
  (+inf for a +inf bias), the way SDPA and FlashAttention propagate them. A -inf score is a
  masked key, not an error. A non-finite *value* at a key the row does not attend to may still
  reach the row through 0 * NaN in P V: here through the dense product, in the tiled kernels when
  the key shares a tile with keys the row attends to (SDPA and FlashAttention do the same);
- mask and bias broadcast as ({1|B}, {1|KVH|H}, {1|Q}, {1|K}); autograd returns dbias in the
  bias's own shape (summed over its broadcast dims).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

__all__ = ["attention_ref", "causal_mask", "expand_heads"]


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """(Q, K) bool, True where key j is visible to query i under bottom-right alignment."""
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    return j <= i + (seqlen_k - seqlen_q)


def expand_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Map a 4-D mask/bias head dim of 1, KVH or H onto H query heads (a view or a repeat)."""
    h = x.shape[1]
    if h == 1 or h == num_heads:
        return x
    if num_heads % h != 0:
        raise ValueError(f"head dim {h} does not divide num_heads {num_heads}")
    # Query heads of one kv head are consecutive, so repeat each kv head's slice.
    return x.repeat_interleave(num_heads // h, dim=1)


def attention_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    attn_bias: Optional[torch.Tensor] = None,
    *,
    is_causal: bool = False,
    softmax_scale: Optional[float] = None,
    softcap: float = 0.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Return (out (B, Q, H, D) in query's dtype, lse (B, H, Q) float32, float64 for float64).

    Differentiable by autograd in every input, the bias included.
    """
    B, Q, H, D = query.shape
    K, KVH = key.shape[1], key.shape[2]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32

    q = query.transpose(1, 2)  # (B, H, Q, D)
    k = key.transpose(1, 2).repeat_interleave(H // KVH, dim=1)
    v = value.transpose(1, 2).repeat_interleave(H // KVH, dim=1)

    scores = torch.matmul(q, k.transpose(-1, -2)).to(acc) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if attn_bias is not None:
        scores = scores + expand_heads(attn_bias, H).to(acc)

    keep = None
    if attn_mask is not None:
        keep = expand_heads(attn_mask, H)
    if is_causal:
        c = causal_mask(Q, K, device=query.device)
        keep = c if keep is None else keep & c
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))

    # Rows whose scores are all -inf get a constant 0 in place of their scores for the logsumexp,
    # so neither the forward nor the backward ever sees (-inf) - (-inf). "Not all -inf" rather than
    # "any finite": a row of NaN (a NaN query) or +inf scores must come out NaN, not empty.
    row_ok = (scores != float("-inf")).any(dim=-1, keepdim=True)
    lse = torch.logsumexp(scores.masked_fill(~row_ok, 0.0), dim=-1, keepdim=True)
    p = torch.exp(scores - lse)
    p = p.masked_fill(~row_ok, 0.0)
    out = torch.matmul(p.to(value.dtype), v)
    lse = lse.masked_fill(~row_ok, float("-inf")).squeeze(-1)
    return out.transpose(1, 2).to(query.dtype), lse
