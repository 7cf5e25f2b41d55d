"""The seed project's (flash-dmattn) names, so its code runs by changing the import:

    from flexdma.compat import flash_dmattn_func_auto, create_mask, get_available_backends
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from ._dispatch import available_backends
from .api import flash_dma_attention
from .masks import create_mask as _create_mask

__all__ = ["flash_dmattn_func", "flash_dmattn_func_auto", "get_available_backends", "create_mask"]

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
