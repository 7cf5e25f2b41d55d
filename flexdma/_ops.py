"""Python side of the torch.ops.flexdma op family: fake (meta) kernels and autograd.

The schemas and the CPU/CUDA kernels are registered by the C++ extension (ops/); everything
here is device-independent and registered once.
"""
from __future__ import annotations

import torch

from . import _C  # loads the library that defines torch.ops.flexdma.*

__all__ = ["fwd", "bwd", "tile_meta"]

fwd = torch.ops.flexdma.fwd
bwd = torch.ops.flexdma.bwd
tile_meta = torch.ops.flexdma.tile_meta


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("flexdma::fwd")
def _fwd_fake(q, k, v, attn_mask, attn_bias, softmax_scale, is_causal, softcap, deterministic, tile_meta=None):
    B, Q, H, _ = q.shape
    out = q.new_empty(q.shape)
    lse = q.new_empty((B, H, Q), dtype=_acc_dtype(q.dtype))
    return out, lse


@torch.library.register_fake("flexdma::bwd")
def _bwd_fake(grad_out, q, k, v, attn_mask, attn_bias, out, lse, softmax_scale, is_causal, softcap,
              bias_requires_grad, deterministic, tile_meta=None):
    dq = q.new_empty(q.shape)
    dk = k.new_empty(k.shape)
    dv = v.new_empty(v.shape)
    if bias_requires_grad and attn_bias is not None:
        dbias = attn_bias.new_empty(attn_bias.shape)
    else:
        dbias = q.new_empty((0,))
    return dq, dk, dv, dbias


@torch.library.register_fake("flexdma::tile_meta")
def _tile_meta_fake(attn_mask, seqlen_q, seqlen_k, is_causal):
    # One int32 word per TILES_PER_WORD key tiles, per query tile, per mask (batch, head).
    tile, per_word = _C.TILE_SIZE, _C.TILES_PER_WORD
    words = (-(-seqlen_k // tile) + per_word - 1) // per_word
    return attn_mask.new_empty((attn_mask.shape[0], attn_mask.shape[1], -(-seqlen_q // tile), words),
                               dtype=torch.int32)


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, attn_bias, softmax_scale, is_causal, softcap, deterministic, tile_meta = inputs
    out, lse = output
    # The forward's tile activity bits serve the backward too: one pass over the mask per step.
    ctx.save_for_backward(q, k, v, attn_mask, attn_bias, out, lse, tile_meta)
    ctx.softmax_scale = softmax_scale
    ctx.is_causal = is_causal
    ctx.softcap = softcap
    ctx.deterministic = deterministic
    # LSE is an output for inspection (and for merging partial results), not a differentiable one.
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, attn_mask, attn_bias, out, lse, tile_meta = ctx.saved_tensors
    bias_grad = attn_bias is not None and ctx.needs_input_grad[4]
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    dq, dk, dv, dbias = bwd(grad_out, q, k, v, attn_mask, attn_bias, out, lse, ctx.softmax_scale, ctx.is_causal,
                            ctx.softcap, bias_grad, ctx.deterministic, tile_meta)
    return dq, dk, dv, None, (dbias if bias_grad else None), None, None, None, None, None


torch.library.register_autograd("flexdma::fwd", _backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise NotImplementedError("flexdma: double backward (gradients of gradients) is not supported")


# Without this, differentiating through flexdma::bwd would silently give zero second derivatives.
torch.library.register_autograd("flexdma::bwd", _no_double_backward, setup_context=lambda ctx, inputs, output: None)
