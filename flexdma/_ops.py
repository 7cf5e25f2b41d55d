"""Python side of the torch.ops.flexdma op family: fake (meta) kernels and autograd.

The schemas and the CPU/CUDA kernels are registered by the C++ extension (ops/); everything
here is device-independent and registered once.
"""

from __future__ import annotations

import importlib.util

import torch

from . import (
    _C,  # loads the library that defines torch.ops.flexdma.*
    topk,
)

__all__ = ["fwd", "bwd", "tile_meta", "topk_select", "topk_fwd", "topk_bwd"]

fwd = torch.ops.flexdma.fwd
bwd = torch.ops.flexdma.bwd
tile_meta = torch.ops.flexdma.tile_meta
topk_select = torch.ops.flexdma.topk_select
topk_fwd = torch.ops.flexdma.topk_fwd
topk_bwd = torch.ops.flexdma.topk_bwd


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _keeps_residual(q) -> bool:
    # The CUDA kernels return out rounded and its rounding error (see the schemas' comments).
    return q.device.type == "cuda"


@torch.library.register_fake("flexdma::fwd")
def _fwd_fake(
    q, k, v, attn_mask, attn_bias, softmax_scale, is_causal, softcap, deterministic, tile_meta=None, keep_resid=True
):
    B, Q, H, _ = q.shape
    out = q.new_empty(q.shape)
    lse = q.new_empty((B, H, Q), dtype=_acc_dtype(q.dtype))
    resid = q.new_empty(q.shape) if keep_resid and _keeps_residual(q) else q.new_empty((0,))
    return out, lse, resid


@torch.library.register_fake("flexdma::bwd")
def _bwd_fake(
    grad_out,
    q,
    k,
    v,
    attn_mask,
    attn_bias,
    out,
    lse,
    softmax_scale,
    is_causal,
    softcap,
    bias_requires_grad,
    deterministic,
    tile_meta=None,
    out_resid=None,
):
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
    return attn_mask.new_empty((attn_mask.shape[0], attn_mask.shape[1], -(-seqlen_q // tile), words), dtype=torch.int32)


@torch.library.register_fake("flexdma::topk_select")
def _topk_select_fake(scores, window, seqlen_q, is_causal, tile_rows):
    P1, P2, K = scores.shape
    cap = topk.list_cap(K, window, tile_rows)
    n_tiles = (seqlen_q + tile_rows - 1) // tile_rows
    return (
        scores.new_empty((P1, P2, K), dtype=torch.int32),
        scores.new_empty((P1, P2, seqlen_q), dtype=torch.int32),
        scores.new_empty((P1, P2, n_tiles * (1 + cap)), dtype=torch.int32),
    )


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, attn_bias, softmax_scale, is_causal, softcap, deterministic, tile_meta, _ = inputs
    out, lse, resid = output
    # The forward's tile activity bits serve the backward too: one pass over the mask per step.
    ctx.save_for_backward(q, k, v, attn_mask, attn_bias, out, lse, tile_meta, resid)
    ctx.softmax_scale = softmax_scale
    ctx.is_causal = is_causal
    ctx.softcap = softcap
    ctx.deterministic = deterministic
    # LSE is an output for inspection (and for merging partial results), not a differentiable one;
    # out_resid only feeds the backward's row sums.
    ctx.mark_non_differentiable(lse, resid)


def _backward(ctx, grad_out, grad_lse, grad_resid):
    q, k, v, attn_mask, attn_bias, out, lse, tile_meta, resid = ctx.saved_tensors
    bias_grad = attn_bias is not None and ctx.needs_input_grad[4]
    if grad_out.stride(-1) != 1:
        # clone, not contiguous(): an empty grad_out (seqlen_q = 0, e.g. from out.sum()) counts
        # as contiguous whatever its strides, and the kernels check head_dim's stride.
        grad_out = grad_out.clone(memory_format=torch.contiguous_format)
    dq, dk, dv, dbias = bwd(
        grad_out,
        q,
        k,
        v,
        attn_mask,
        attn_bias,
        out,
        lse,
        ctx.softmax_scale,
        ctx.is_causal,
        ctx.softcap,
        bias_grad,
        ctx.deterministic,
        tile_meta,
        resid,
    )
    return dq, dk, dv, None, (dbias if bias_grad else None), None, None, None, None, None, None


torch.library.register_autograd("flexdma::fwd", _backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise NotImplementedError("flexdma: double backward (gradients of gradients) is not supported")


# Without this, differentiating through flexdma::bwd would silently give zero second derivatives.
torch.library.register_autograd("flexdma::bwd", _no_double_backward, setup_context=lambda ctx, inputs, output: None)


# ---- topk_fwd / topk_bwd: fwd / bwd with the per-key selection's keep rule (key_rank, row_thr) ----


@torch.library.register_fake("flexdma::topk_fwd")
def _topk_fwd_fake(
    q, k, v, attn_bias, key_rank, row_thr, softmax_scale, is_causal, softcap, deterministic, tile_keys=None
):
    B, Q, H, _ = q.shape
    resid = q.new_empty(q.shape) if _keeps_residual(q) else q.new_empty((0,))
    return q.new_empty(q.shape), q.new_empty((B, H, Q), dtype=_acc_dtype(q.dtype)), resid


@torch.library.register_fake("flexdma::topk_bwd")
def _topk_bwd_fake(
    grad_out,
    q,
    k,
    v,
    attn_bias,
    key_rank,
    row_thr,
    out,
    lse,
    softmax_scale,
    is_causal,
    softcap,
    bias_requires_grad,
    deterministic,
    tile_keys=None,
    out_resid=None,
):
    dbias = attn_bias.new_empty(attn_bias.shape) if bias_requires_grad else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


@torch.library.register_fake("flexdma::topk_fwd_sm90")
def _topk_fwd_sm90_fake(q, k, v, attn_bias, key_rank, row_thr, tile_keys, tile_rows, softmax_scale, is_causal, softcap):
    B, Q, H, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, H, Q), dtype=torch.float32), q.new_empty(q.shape)


def _topk_setup_context(ctx, inputs, output):
    q, k, v, attn_bias, key_rank, row_thr, softmax_scale, is_causal, softcap, deterministic, tile_keys = inputs
    out, lse, resid = output
    ctx.save_for_backward(q, k, v, attn_bias, key_rank, row_thr, out, lse, tile_keys, resid)
    ctx.softmax_scale = softmax_scale
    ctx.is_causal = is_causal
    ctx.softcap = softcap
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse, resid)


def _topk_backward(ctx, grad_out, grad_lse, grad_resid):
    q, k, v, attn_bias, key_rank, row_thr, out, lse, tile_keys, resid = ctx.saved_tensors
    bias_grad = ctx.needs_input_grad[3]
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    dq, dk, dv, dbias = topk_bwd(
        grad_out,
        q,
        k,
        v,
        attn_bias,
        key_rank,
        row_thr,
        out,
        lse,
        ctx.softmax_scale,
        ctx.is_causal,
        ctx.softcap,
        bias_grad,
        ctx.deterministic,
        tile_keys,
        resid,
    )
    return dq, dk, dv, (dbias if bias_grad else None), None, None, None, None, None, None, None


torch.library.register_autograd("flexdma::topk_fwd", _topk_backward, setup_context=_topk_setup_context)
torch.library.register_autograd(
    "flexdma::topk_bwd", _no_double_backward, setup_context=lambda ctx, inputs, output: None
)

# The per-key path's GPU kernels are Triton (flexdma/_topk_triton.py), registered here as the CUDA
# implementations of the op family's schemas; topk_fwd hands the calls the C++ sm_90a kernel
# takes to flexdma::topk_fwd_sm90. Triton is imported by the first call, not by `import flexdma`.
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _triton_kernel(name):
    def run(*args, **kwargs):
        from . import _topk_triton

        return getattr(_topk_triton, name)(*args, **kwargs)

    return run


if HAVE_TRITON:
    torch.library.register_kernel("flexdma::topk_select", "cuda", _triton_kernel("select"))
    torch.library.register_kernel("flexdma::topk_fwd", "cuda", _triton_kernel("fwd_op"))
    torch.library.register_kernel("flexdma::topk_bwd", "cuda", _triton_kernel("bwd"))
