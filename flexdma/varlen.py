"""Packed sequences (varlen): many documents in one row of tokens, each attending only within itself,
in FlashAttention's varlen layout (`flash_attn_varlen_func`).

This module is the public function and its argument checks; the call is then a `Call` of the
"packed" layout (flexdma/_dispatch.py) and runs through the same dispatch as a padded one: the
op family's kernels take the packed form (flexdma/_ops.py): on CUDA one launch for all sequences
(the dense kernels, and the per-key ones with their selection), reading the offsets on the device
with no host synchronisation (the kernel that reads them first checks them and stops at a
device-side assert on invalid ones, as torch's index checks on CUDA do); on the CPU a loop over
the sequences in the C++ op. Without a window FlexAttention takes a packed call as one call with a
document mask from the offsets. What no kernel takes packed (the per-key Triton kernels, the
reference) runs sequence by sequence on views of the packed rows (`_dispatch.by_sequence`, the
offsets read on the host). Either way nothing attends across a boundary, and the per-key
selection runs within each sequence.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from . import _checks, _dispatch
from .perkey import contract as perkey


def _check_offsets(name: str, cu: torch.Tensor, device: torch.device) -> None:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be a 1-D int32 tensor of batch + 1 offsets, got {cu.dtype} {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device}, the tokens on {device}")


def flash_dma_attention_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    attn_bias: Optional[torch.Tensor] = None,
    *,
    is_causal: bool = False,
    softmax_scale: Optional[float] = None,
    softcap: float = 0.0,
    keep_window_size: Optional[int] = None,
    return_lse: bool = False,
    deterministic: bool = False,
    backend: str = "auto",
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Attention over packed sequences, FlashAttention's varlen layout.

    Args:
        query: (total_q, num_heads, head_dim); key, value: (total_k, num_kv_heads, head_dim).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) offsets of each sequence's tokens (0 first,
            the token count last; empty sequences allowed), on the tokens' device.
        max_seqlen_q, max_seqlen_k: Python ints, at least the longest sequence.
        attn_bias: None, or a per-key bias (num_kv_heads or num_heads, total_k) (Doge's scores of
            packed documents), same dtype as query; gets a gradient in its own shape. A general
            mask or a per-row bias is not taken (pad the batch and call flash_dma_attention).
        is_causal: causal within each sequence, bottom-right aligned where its query and key
            lengths differ.
        keep_window_size: each row keeps the keep_window_size keys of its own sequence with the
            highest bias (the selection never crosses a boundary); needs attn_bias.
        softmax_scale, softcap, deterministic, backend: as flash_dma_attention.
        return_lse: also return the log-sum-exp (num_heads, total_q), float32 (float64 for float64
            inputs), FlashAttention's varlen layout.
    Returns: out (total_q, num_heads, head_dim) [, lse].
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be 3-D (total tokens, heads, head_dim) in the varlen layout, got {tuple(t.shape)}"
            )
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise TypeError(f"{name} must be a non-negative Python int (not a tensor: no sync), got {n!r}")
    _check_offsets("cu_seqlens_q", cu_seqlens_q, query.device)
    _check_offsets("cu_seqlens_k", cu_seqlens_k, query.device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same sequences, got {cu_seqlens_q.numel() - 1} and "
            f"{cu_seqlens_k.numel() - 1}"
        )
    KVH, H = key.shape[1], query.shape[1]
    if attn_bias is not None:
        if not isinstance(attn_bias, torch.Tensor):
            raise TypeError(f"attn_bias must be a tensor or None, got {type(attn_bias).__name__}")
        if attn_bias.dim() != 2 or attn_bias.shape[0] not in (1, KVH, H) or attn_bias.shape[1] != key.shape[0]:
            raise ValueError(
                f"packed sequences take a per-key attn_bias ({{1|num_kv_heads|num_heads}}, total_k) = "
                f"({{1|{KVH}|{H}}}, {key.shape[0]}), got shape {tuple(attn_bias.shape)}; for a general mask or a "
                "per-row bias, pad the batch and call flash_dma_attention"
            )
    if keep_window_size is not None and attn_bias is None:
        raise ValueError("keep_window_size picks the top keys by attn_bias: pass a per-key attn_bias (heads, total_k)")
    # The checks of a padded call, once for every path (dtypes, devices, heads, scale, window).
    _checks.check_qkv(query[None], key[None], value[None])
    if attn_bias is not None and attn_bias.dtype != query.dtype:
        raise TypeError(f"attn_bias must have query's dtype {query.dtype}, got {attn_bias.dtype}")
    scale, softcap = _checks.check_scalars(query.shape[-1], softmax_scale, softcap, is_causal)
    if keep_window_size is not None:
        keep_window_size = perkey.check_window(keep_window_size)
    query, key, value = (_checks.last_dim_contiguous(t) for t in (query, key, value))
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()  # the kernels read them flat
    call = _dispatch.Call.packed(
        query, key, value, attn_bias, cu_seqlens_q, max_seqlen_q, max_seqlen_k, is_causal=bool(is_causal),
        softcap=softcap, keep_window_size=keep_window_size, need_lse=bool(return_lse),
    )  # fmt: skip
    plan = _dispatch.plan(backend, call, bool(deterministic))
    out, lse = plan.run(
        plan, query, key, value, cu_seqlens_q, cu_seqlens_k, attn_bias, scale, bool(deterministic), return_lse
    )
    return (out, lse) if return_lse else out
