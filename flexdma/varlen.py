"""Packed sequences (varlen): many documents in one row of tokens, each attending only within itself,
in FlashAttention's varlen layout (`flash_attn_varlen_func`).

On the CPU (backend "auto" or "cpu") one op, flexdma::varlen_fwd / varlen_bwd (ops/flexdma_ops.cpp),
runs the C++ kernels sequence by sequence on views of the packed rows: no padded copy, no host
decision in Python, so torch.compile and torch.export take it whole. Elsewhere (CUDA, FlexAttention,
the reference) each sequence is one flash_dma_attention call on views, after the offsets are read
on the host (on CUDA a device wait per call): the CUDA kernels do not read offsets yet. Either way
nothing attends across a boundary, and the per-key selection runs within each sequence.
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch

from . import _checks, _ops
from ._warnings import warn_once
from .api import flash_dma_attention
from .perkey import contract as perkey


def _check_offsets(name: str, cu: torch.Tensor, device: torch.device) -> None:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be a 1-D int32 tensor of batch + 1 offsets, got {cu.dtype} {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device}, the tokens on {device}")


def _offsets(name: str, cu: torch.Tensor, total: int, max_seqlen: int) -> List[int]:
    offs = cu.tolist()  # the per-document loop needs them on the host
    if offs[0] != 0 or offs[-1] != total:
        raise ValueError(f"{name} must start at 0 and end at the token count {total}, got {offs[0]} ... {offs[-1]}")
    lengths = [b - a for a, b in zip(offs, offs[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} must not decrease, got {offs}")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"a sequence of {max(lengths)} tokens is longer than max_seqlen {max_seqlen} ({name})")
    return offs


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
    if query.device.type == "cpu" and backend in ("auto", "cpu") and _ops.LOADED:
        out, lse = torch.ops.flexdma.varlen_fwd(
            *(_checks.last_dim_contiguous(t) for t in (query, key, value)),
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            attn_bias,
            scale,
            bool(is_causal),
            softcap,
            keep_window_size or 0,
        )
        return (out, lse) if return_lse else out
    offs_q = _offsets("cu_seqlens_q", cu_seqlens_q, query.shape[0], max_seqlen_q)
    offs_k = _offsets("cu_seqlens_k", cu_seqlens_k, key.shape[0], max_seqlen_k)
    if query.device.type == "cuda":
        warn_once(
            "flash_dma_attention_varlen: the CUDA kernels do not read sequence offsets yet; packed "
            "sequences run one flash_dma_attention call per sequence",
        )
    outs, lses = [], []
    for (q0, q1), (k0, k1) in zip(zip(offs_q, offs_q[1:]), zip(offs_k, offs_k[1:])):
        bias = None if attn_bias is None else attn_bias[None, :, None, k0:k1]
        res = flash_dma_attention(
            query[None, q0:q1],
            key[None, k0:k1],
            value[None, k0:k1],
            None,
            bias,
            is_causal=is_causal,
            softmax_scale=scale,
            softcap=softcap,
            return_lse=True,
            backend=backend,
            deterministic=deterministic,
            keep_window_size=keep_window_size,
        )
        outs.append(res[0][0])
        lses.append(res[1][0])
    if outs:
        out = torch.cat(outs, 0)
        lse = torch.cat(lses, 1)
    else:  # no sequences: no tokens
        out = query.new_zeros(query.shape)
        lse = query.new_zeros((H, 0), dtype=torch.float64 if query.dtype == torch.float64 else torch.float32)
    return (out, lse) if return_lse else out


# ---- flexdma::varlen_fwd / varlen_bwd: fake kernels and autograd (schemas and CPU kernels: ops/) ----


def _varlen_fwd_fake(q, k, v, cu_q, cu_k, max_q, max_k, attn_bias, softmax_scale, is_causal, softcap, window):
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=_ops.acc_dtype(q.dtype))
    return q.new_empty(q.shape), lse


def _varlen_bwd_fake(
    grad_out, q, k, v, cu_q, cu_k, max_q, max_k, attn_bias, out, lse, softmax_scale, is_causal, softcap, window, want
):
    return _ops.grads_like(q, k, v, attn_bias, want)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, bias = inputs[:8]
    ctx.save_for_backward(q, k, v, cu_q, cu_k, bias, *output)
    ctx.cfg = (max_q, max_k) + tuple(inputs[8:])
    ctx.mark_non_differentiable(output[1])  # lse: for inspection and merging, not differentiated


def _backward(ctx, grad_out, grad_lse):
    q, k, v, cu_q, cu_k, bias, out, lse = ctx.saved_tensors
    max_q, max_k, scale, causal, softcap, window = ctx.cfg
    want = bias is not None and ctx.needs_input_grad[7]
    dq, dk, dv, dbias = torch.ops.flexdma.varlen_bwd(
        grad_out.contiguous(), q, k, v, cu_q, cu_k, max_q, max_k, bias, out, lse, scale, causal, softcap, window, want
    )
    return dq, dk, dv, None, None, None, None, dbias if want else None, None, None, None, None


if _ops.LOADED:
    torch.library.register_fake("flexdma::varlen_fwd")(_varlen_fwd_fake)
    torch.library.register_fake("flexdma::varlen_bwd")(_varlen_bwd_fake)
    torch.library.register_autograd("flexdma::varlen_fwd", _backward, setup_context=_setup_context)
    _ops.forbid_double_backward("flexdma::varlen_bwd")
