"""Argument checks shared by every public entry point.

Errors are raised here, before any kernel runs, and name the argument, what it got and what it
needs. The C++ binding checks again, as a last line for direct torch.ops.flexdma.* callers.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def check_tensor(name: str, t, *, ndim: Optional[int] = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D (batch, seqlen, heads, head_dim), got shape {_shape(t)}")


def check_qkv(query, key, value) -> None:
    # Each attribute read once: this runs on every eager call, a decode step's too.
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            check_tensor(name, t, ndim=4)
    dt = query.dtype
    if dt not in FLOAT_DTYPES or key.dtype != dt or value.dtype != dt:
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dtype not in FLOAT_DTYPES:
                raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
        raise TypeError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    dev = query.device
    if key.device != dev or value.device != dev:
        raise ValueError(f"query, key and value must be on one device, got {dev}, {key.device}, {value.device}")
    qs, ks = query.shape, key.shape
    if ks != value.shape:
        raise ValueError(f"key and value must have the same shape, got {_shape(key)} and {_shape(value)}")
    B, Q, H, D = qs
    if ks[0] != B:
        raise ValueError(f"key batch {ks[0]} does not match query batch {B} (query {_shape(query)}, key {_shape(key)})")
    if ks[3] != D:
        raise ValueError(f"key head_dim {ks[3]} does not match query head_dim {D}")
    if D == 0:
        raise ValueError(f"head_dim must be positive, got query shape {_shape(query)}")
    KVH = ks[2]
    if KVH == 0 or H % KVH != 0:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({KVH}) for GQA/MQA")


def _to_4d(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dim() > 4:
        raise ValueError(
            f"{name} must have at most 4 dims ({{1|B}}, {{1|KVH|H}}, {{1|Q}}, {{1|K}}), got shape {_shape(t)}"
        )
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t


def check_broadcast(name: str, t: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Validate a mask/bias against ({1|B}, {1|KVH|H}, {1|Q}, {1|K}); return it as a 4-D view."""
    t = _to_4d(name, t)
    B, Q, H, _ = query.shape
    _, K, KVH, _ = key.shape
    b, h, q, k = shape = t.shape
    if not ((b == 1 or b == B) and (h == 1 or h == KVH or h == H) and (q == 1 or q == Q) and (k == 1 or k == K)):
        allowed = ((1, B), (1, KVH, H), (1, Q), (1, K))
        dims = ("batch", "heads", "query", "key")
        for i, (got, ok) in enumerate(zip(shape, allowed)):
            if got not in ok:
                need = " or ".join(str(x) for x in sorted(set(ok)))
                raise ValueError(
                    f"{name} of shape {_shape(t)} does not broadcast to (batch={B}, heads={H} (kv heads {KVH}), "
                    f"query={Q}, key={K}): its {dims[i]} dim is {got}, needs {need}"
                )
    if t.device != query.device:
        raise ValueError(f"{name} is on {t.device} but query is on {query.device}")
    # Kernels read the key dim with unit stride; only other dims may be strided or broadcast.
    if k > 1 and t.stride(3) != 1:
        t = t.contiguous()
    return t


def padding_mask_2d(attn_mask: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """A 2-D mask of batch rows is a (batch, key) padding mask; other 2-D masks are (query, key)."""
    B, Q = query.shape[0], query.shape[1]
    if attn_mask.dim() != 2 or attn_mask.shape[0] != B or B == 1:
        return attn_mask
    if B == Q:
        raise ValueError(
            f"attn_mask of shape {_shape(attn_mask)} is ambiguous: batch and seqlen_q are both {B}; pass "
            f"attn_mask[:, None, None, :] for a (batch, key) padding mask or attn_mask[None, None] for a "
            f"(query, key) mask"
        )
    return attn_mask[:, None, None, :]


def check_mask(attn_mask, query, key) -> Optional[torch.Tensor]:
    if attn_mask is None:
        return None
    check_tensor("attn_mask", attn_mask)
    if attn_mask.dtype != torch.bool:
        hint = (
            "pass additive float values as attn_bias"
            if attn_mask.is_floating_point()
            else "a 0/1 padding mask becomes one with attn_mask.bool()"
        )
        raise TypeError(f"attn_mask must be a bool tensor (True = attend), got {attn_mask.dtype}; {hint}")
    return check_broadcast("attn_mask", padding_mask_2d(attn_mask, query), query, key)


def check_bias(attn_bias, query, key) -> Optional[torch.Tensor]:
    if attn_bias is None:
        return None
    check_tensor("attn_bias", attn_bias)
    if attn_bias.dtype != query.dtype:
        raise TypeError(f"attn_bias dtype {attn_bias.dtype} must match query dtype {query.dtype}")
    return check_broadcast("attn_bias", attn_bias, query, key)


def check_scalars(head_dim: int, softmax_scale, softcap, is_causal) -> Tuple[float, float]:
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    # Finite as comparisons (NaN fails both), not math.isfinite: under torch.compile(dynamic=True)
    # the scale (from a dynamic head_dim) and softcap can be symbolic floats, which math.isfinite
    # cannot take in a traced graph.
    if (
        isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, (int, float))
        or not 0 < softmax_scale < math.inf
    ):
        raise ValueError(f"softmax_scale must be a positive finite float or None, got {softmax_scale!r}")
    if softcap is None:
        softcap = 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 <= softcap < math.inf:
        raise ValueError(f"softcap must be a finite float >= 0 (0 disables it), got {softcap!r}")
    return float(softmax_scale), float(softcap)


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
