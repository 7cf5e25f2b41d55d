"""The per-key ops' Python side: fake (meta) kernels and autograd of flexdma::topk_select,
topk_fwd, topk_bwd, topk_fwd_sm90 and topk_bwd_sm90, and the CUDA implementations of topk_fwd /
topk_bwd (flexdma/perkey/route.py's cuda_fwd / cuda_bwd, which pick the C++ sm_90a kernels or
Triton). The schemas, the CPU kernels and the CUDA kernels of topk_select, topk_fwd_sm90 and
topk_bwd_sm90 are the C++ extension's (ops/). Nothing is registered without it.
"""

from __future__ import annotations

import torch

from .. import _ext, _ops
from . import route
from .contract import list_cap

LOADED = _ext.LOAD_ERROR is None
topk_fwd = torch.ops.flexdma.topk_fwd if LOADED else None
topk_bwd = torch.ops.flexdma.topk_bwd if LOADED else None


def _topk_select_fake(scores, window, seqlen_q, is_causal, tile_rows):
    P1, P2, K = scores.shape
    cap = list_cap(K, window, tile_rows)
    n_tiles = (seqlen_q + tile_rows - 1) // tile_rows
    return (
        scores.new_empty((P1, P2, K), dtype=torch.int32),
        scores.new_empty((P1, P2, seqlen_q), dtype=torch.int32),
        scores.new_empty((P1, P2, n_tiles * (1 + cap)), dtype=torch.int32),
    )


# ---- topk_fwd / topk_bwd: fwd / bwd with the per-key selection's keep rule (key_rank, row_thr) ----


def _topk_fwd_fake(
    q, k, v, attn_bias, key_rank, row_thr, softmax_scale, is_causal, softcap, deterministic, tile_keys=None
):
    B, Q, H, _ = q.shape
    resid = q.new_empty(q.shape) if _ops.keeps_residual(q) else q.new_empty((0,))
    return q.new_empty(q.shape), q.new_empty((B, H, Q), dtype=_ops.acc_dtype(q.dtype)), resid


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
    return _ops.grads_like(q, k, v, attn_bias, bias_requires_grad)


def _topk_fwd_sm90_fake(q, k, v, attn_bias, key_rank, row_thr, tile_keys, tile_rows, softmax_scale, is_causal, softcap):
    B, Q, H, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, H, Q), dtype=torch.float32), q.new_empty(q.shape)


def _topk_bwd_sm90_fake(
    grad_out, q, k, v, attn_bias, key_rank, row_thr, tile_keys, tile_rows, out, lse, out_resid, softmax_scale,
    is_causal, bias_requires_grad,
):  # fmt: skip
    return _ops.grads_like(q, k, v, attn_bias, bias_requires_grad)


def _direct_takes(args) -> bool:
    # topk_fwd's operands: q, k, v, attn_bias, key_rank, row_thr, then the scalars, then tile_keys.
    if len(args) < 11 or args[10] is None or args[0].device.type != "cuda":
        return False
    return _ops.plain_eager(args[:6] + args[10:11])


if LOADED:
    torch.library.register_fake("flexdma::topk_select")(_topk_select_fake)
    torch.library.register_fake("flexdma::topk_fwd")(_topk_fwd_fake)
    torch.library.register_fake("flexdma::topk_bwd")(_topk_bwd_fake)
    torch.library.register_fake("flexdma::topk_fwd_sm90")(_topk_fwd_sm90_fake)
    torch.library.register_fake("flexdma::topk_bwd_sm90")(_topk_bwd_sm90_fake)
    # topk_fwd as the API calls it (flexdma/_ops.py's eager_autograd): eager calls on CUDA run its
    # CUDA implementation directly (route.cuda_fwd, and route.cuda_bwd for their backward).
    topk_fwd_autograd = _ops.register_autograd(
        "flexdma::topk_fwd",
        lambda *args: topk_bwd(*args),
        n_tensors=6,
        bias_index=3,
        direct=_ops.Direct(_direct_takes, route.cuda_fwd, route.cuda_bwd) if _ext.HAVE_TRITON else None,
    )
    _ops.forbid_double_backward("flexdma::topk_bwd")
    # topk_fwd's and topk_bwd's CUDA implementations hand the calls the C++ sm_90a kernels take to
    # flexdma::topk_fwd_sm90 / topk_bwd_sm90 (route.cuda_fwd / cuda_bwd), the others to Triton
    # (flexdma/perkey/triton.py).
    if _ext.HAVE_TRITON:
        torch.library.register_kernel("flexdma::topk_fwd", "cuda", route.cuda_fwd)
        torch.library.register_kernel("flexdma::topk_bwd", "cuda", route.cuda_bwd)
