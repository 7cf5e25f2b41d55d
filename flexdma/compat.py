"""The seed project's (flash-dmattn) names, so its code runs by changing the import:

    from flexdma.compat import flash_dmattn_func_auto, create_mask, get_available_backends
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from ._dispatch import available_backends
from .api import flash_dma_attention
from .dynamic import dynamic_mask_attention
from .reference import causal_mask as _causal
from .masks import create_mask as _create_mask

__all__ = ["flash_dmattn_func", "flash_dmattn_func_auto", "get_available_backends", "create_mask",
           "apply_dynamic_mask_attention"]

# The seed called the FlexAttention path "flex" and its own kernels "cuda"/"triton"; flexdma has
# no Triton kernel of its own, so "triton" maps to FlexAttention (Triton-generated).
_SEED_BACKENDS = {"cuda": "cuda", "triton": "flex", "flex": "flex", "auto": "auto", "cpu": "cpu",
                  "reference": "reference"}


def flash_dmattn_func(query, key, value, attn_mask=None, attn_bias=None, scale=None, is_causal=None,
                      softcap=None, deterministic=None, return_attn_probs=None, *, softmax_scale=None,
                      backend: str = "auto"):
    """flash-dmattn's function: (batch, seqlen, heads, head_dim) tensors, returns the output."""
    if return_attn_probs:
        raise ValueError("return_attn_probs=True is not supported: attention probabilities are never materialised")
    if scale is not None and softmax_scale is not None and scale != softmax_scale:
        raise ValueError(f"scale={scale} and softmax_scale={softmax_scale} disagree")
    return flash_dma_attention(query, key, value, attn_mask, attn_bias, is_causal=bool(is_causal),
                               softmax_scale=softmax_scale if softmax_scale is not None else scale,
                               softcap=softcap or 0.0, deterministic=bool(deterministic), backend=backend)


def flash_dmattn_func_auto(backend: Optional[str] = None, **kwargs) -> Callable:
    """Return flash_dmattn_func bound to a backend (None = "auto")."""
    name = "auto" if backend is None else backend
    if name not in _SEED_BACKENDS:
        raise ValueError(f"backend must be one of {sorted(_SEED_BACKENDS)}, got {backend!r}")
    mapped = _SEED_BACKENDS[name]
    if mapped != "auto" and mapped not in available_backends():
        raise RuntimeError(f"backend {backend!r} is not available here; available: {get_available_backends()}")

    def func(*args, **kw):
        kw.setdefault("backend", mapped)
        return flash_dmattn_func(*args, **kw)

    return func


def get_available_backends() -> List[str]:
    names = available_backends()
    return [n for n in names if n != "reference"] or names


def create_mask(attention_bias: torch.Tensor, attention_mask: Optional[torch.Tensor], batch_size: int,
                query_len: int, key_len: int, window_size: int, min_dtype: Optional[float] = None,
                block_size: Optional[int] = None, is_causal: bool = False) -> torch.Tensor:
    """The seed's create_mask signature. `min_dtype` is accepted and unused: flexdma masks are bool.

    As in the seed, a float attention_mask is read as additive (keys with min_dtype / -inf are
    masked) and a bool one as True = keep.
    """
    if attention_bias.shape[-1] != key_len:
        raise ValueError(f"attention_bias key dim {attention_bias.shape[-1]} != key_len {key_len}")
    if attention_bias.shape[0] not in (1, batch_size):
        raise ValueError(f"attention_bias batch dim {attention_bias.shape[0]} must be 1 or batch_size {batch_size}")
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        floor = torch.finfo(attention_mask.dtype).min if min_dtype is None else min_dtype
        attention_mask = attention_mask > floor
    return _create_mask(attention_bias, window_size, attn_mask=attention_mask, is_causal=is_causal,
                        query_len=query_len, block_size=block_size)


def apply_dynamic_mask_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dt_proj: torch.Tensor,
                                 A: torch.Tensor, causal_mask: Optional[torch.Tensor] = None,
                                 keep_window_size: int = 2048, is_causal: bool = True, *,
                                 softmax_scale: float = 1.0, backend: str = "auto") -> torch.Tensor:
    """The seed's dynamic mask attention, (batch, heads, seqlen, head_dim) in and out.

    query (B, H, Q, D); key, value (B, KVH, K, D); dt_proj (KVH, KVH * D); A (KVH,). Each key gets
    the score exp(softplus(v_flat @ dt_proj.T) * A); each query row attends to its
    `keep_window_size` best-scoring allowed keys (all of them when K <= keep_window_size), with the
    score added to the logits. causal_mask: optional float (B, 1, Q|1, K), 0 = keep, anything else
    (-inf, the dtype's min) = masked; is_causal adds the bottom-right causal cut. A row with no
    allowed key gives 0. The seed's code takes the plain dot product q.k as the logit, hence
    softmax_scale=1.0 (pass 1/sqrt(D) for the usual scaling).

    It runs on the keep_window_size path (no Q x K tensor) when causal_mask has a query dim of 1
    or is the causal cut of one padding row (the usual causal_mask & padding); another causal_mask
    varies by row and is applied through a dense create_mask.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D (batch, heads, seqlen, head_dim) tensor")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    Q, K = q.shape[1], k.shape[1]
    allowed = None
    if causal_mask is not None:
        if not isinstance(causal_mask, torch.Tensor) or not causal_mask.is_floating_point():
            raise TypeError("causal_mask must be a float tensor, 0 = keep and -inf (or the dtype's min) = masked, "
                            "as in the seed")
        if causal_mask.dim() != 4 or causal_mask.shape[1] != 1 or causal_mask.shape[2] not in (1, Q):
            raise ValueError(f"causal_mask must be (batch, 1, {Q} or 1, key_len), got {tuple(causal_mask.shape)}")
        allowed = causal_mask[..., :K] == 0
        if allowed.shape[2] > 1:
            # The usual seed mask is causal & padding: its last row is the padding (the last row sees
            # every key) and every row is that row cut causally. Then the keys allowed are per-key
            # plus the causal cut, which is what the keep_window_size path takes.
            vis = _causal(Q, K, device=allowed.device)
            eff = allowed & vis if is_causal else allowed
            last = eff[:, :, -1:, :]
            if torch.equal(eff, last & vis):
                allowed, is_causal = last, True
            elif torch.equal(eff, last.expand_as(eff)):
                allowed = last
    return dynamic_mask_attention(q, k, v, dt_proj, A, keep_window_size=keep_window_size, is_causal=is_causal,
                                  attn_mask=allowed, softmax_scale=softmax_scale, backend=backend).transpose(1, 2)
