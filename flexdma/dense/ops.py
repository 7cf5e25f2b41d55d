"""The dense ops' Python side: fake (meta) kernels and autograd of flexdma::fwd, bwd and tile_meta,
whose schemas and CPU / CUDA kernels are the C++ extension's (ops/). fwd and bwd take a padded call
or, given the offsets, a packed one (flexdma/_ops.py). Nothing is registered without the extension."""

from __future__ import annotations

import torch

from .. import _ext, _ops

LOADED = _ops.LOADED
fwd = torch.ops.flexdma.fwd if LOADED else None
bwd = torch.ops.flexdma.bwd if LOADED else None
tile_meta = torch.ops.flexdma.tile_meta if LOADED else None


def _fwd_fake(
    q, k, v, attn_mask, attn_bias, softmax_scale, is_causal, softcap, deterministic, tile_meta=None, keep_resid=True,
    cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
):  # fmt: skip
    return _ops.out_like(q, keep_resid)


def _bwd_fake(
    grad_out, q, k, v, attn_mask, attn_bias, out, lse, softmax_scale, is_causal, softcap, bias_requires_grad,
    deterministic, tile_meta=None, out_resid=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
    max_seqlen_k=0,
):  # fmt: skip
    return _ops.grads_like(q, k, v, attn_bias, bias_requires_grad)


def _tile_meta_fake(attn_mask, seqlen_q, seqlen_k, is_causal):
    # One int32 word per TILES_PER_WORD key tiles, per query tile, per mask (batch, head).
    tile, per_word = _ext.TILE_SIZE, _ext.TILES_PER_WORD
    words = (-(-seqlen_k // tile) + per_word - 1) // per_word
    return attn_mask.new_empty((attn_mask.shape[0], attn_mask.shape[1], -(-seqlen_q // tile), words), dtype=torch.int32)


if LOADED:
    torch.library.register_fake("flexdma::fwd")(_fwd_fake)
    torch.library.register_fake("flexdma::bwd")(_bwd_fake)
    torch.library.register_fake("flexdma::tile_meta")(_tile_meta_fake)
    # bwd looked up when the backward runs (a test spies on it). The backward takes the forward's
    # packed-form arguments (inputs 11-14: offsets and lengths) after its out_resid.
    fwd_autograd = _ops.register_autograd(
        "flexdma::fwd", lambda *args: bwd(*args), n_tensors=5, bias_index=4, bwd_extra=slice(11, 15)
    )
    _ops.forbid_double_backward("flexdma::bwd")
