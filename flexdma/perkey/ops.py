"""The per-key ops' Python side: fake (meta) kernels and autograd of flexdma::perkey_select,
perkey_fwd and perkey_bwd and fake kernels of the decode steps decode_step, decode_append and
perkey_last_row, whose schemas and CPU / CUDA kernels are the C++ extension's (ops/; the CUDA ones
are the C++ per-key kernels); and the Triton kernels (perkey/triton.py) as the ops
flexdma_triton::perkey_fwd / perkey_bwd: the internal implementation that runs the CUDA calls the
C++ kernels do not take (perkey/route.py decides which), with perkey_fwd's arguments and the
lists' tile rows. Nothing is registered without the extension.

`perkey_fwd_autograd` and `triton_fwd_autograd` are the forwards as the API calls them (the route
picks one: perkey/attention.py): each forward op's autograd runs its own backward op, and eager
calls of the Triton one run its kernels without the dispatcher's hop into Python
(flexdma/_ops.py's Direct).
"""

from __future__ import annotations

import torch

from .. import _ext, _ops
from .contract import list_cap

LOADED = _ext.LOAD_ERROR is None
perkey_fwd = torch.ops.flexdma.perkey_fwd if LOADED else None
perkey_bwd = torch.ops.flexdma.perkey_bwd if LOADED else None


def _perkey_select_fake(
    scores, window, seqlen_q, is_causal, tile_rows, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
    max_seqlen_k=0,
):  # fmt: skip
    if cu_seqlens_q is not None:  # packed: scores (heads, Tk)
        heads, Tk = scores.shape
        # Tq // tile_rows + the sequences' count rows (a sequence's tiles start a row), given to the
        # trace as a size of this op's own: the count is often a data-dependent size already (offsets
        # from nonzero, one per layer), and a saved tensor whose shape names another op's unbacked
        # size loses it where the partitioner merges those ops (Inductor: "u1 not in {u0: ...}").
        n_lists = torch.library.get_ctx().new_dynamic_size()
        return (
            scores.new_empty((heads, Tk), dtype=torch.int32),
            scores.new_empty((heads, seqlen_q), dtype=torch.int32),
            scores.new_empty((heads, n_lists, 1 + list_cap(max_seqlen_k, window, tile_rows)), dtype=torch.int32),
        )
    P1, P2, K = scores.shape
    cap = list_cap(K, window, tile_rows)
    n_tiles = (seqlen_q + tile_rows - 1) // tile_rows
    return (
        scores.new_empty((P1, P2, K), dtype=torch.int32),
        scores.new_empty((P1, P2, seqlen_q), dtype=torch.int32),
        scores.new_empty((P1, P2, n_tiles * (1 + cap)), dtype=torch.int32),
    )


# ---- perkey_fwd / perkey_bwd: fwd / bwd with the per-key selection's keep rule (key_rank, row_thr) ----
# The fakes of both implementations (flexdma_triton's take the tile rows last).


def _perkey_fwd_fake(
    q, k, v, attn_bias, key_rank, row_thr, softmax_scale, is_causal, softcap, deterministic, tile_keys=None, *extra
):  # fmt: skip
    # extra: flexdma's packed form (offsets, lengths), or the Triton op's tile rows.
    return _ops.out_like(q)


def _perkey_bwd_fake(
    grad_out, q, k, v, attn_bias, key_rank, row_thr, out, lse, softmax_scale, is_causal, softcap, bias_requires_grad,
    deterministic, tile_keys=None, out_resid=None, *extra,
):  # fmt: skip
    return _ops.grads_like(q, k, v, attn_bias, bias_requires_grad)


# ---- flexdma_triton: the Triton kernels as ops ----

_TRITON_FWD = (
    "(Tensor q, Tensor k, Tensor v, Tensor attn_bias, Tensor key_rank, Tensor row_thr, "
    "float softmax_scale, bool is_causal, float softcap, bool deterministic, Tensor tile_keys, int tile_rows) "
    "-> (Tensor out, Tensor lse, Tensor out_resid)"
)
_TRITON_BWD = (
    "(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor attn_bias, Tensor key_rank, "
    "Tensor row_thr, Tensor out, Tensor lse, float softmax_scale, bool is_causal, float softcap, "
    "bool bias_requires_grad, bool deterministic, Tensor tile_keys, Tensor? out_resid, int tile_rows) "
    "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias)"
)
_kernels = None


def triton_kernels():
    """flexdma/perkey/triton.py, loaded by the first call that runs it (it imports triton, an
    optional dependency: not loaded by `import flexdma`)."""
    global _kernels
    if _kernels is None:
        from . import triton as kernels

        _kernels = kernels
    return _kernels


def _triton_fwd(*args):
    return triton_kernels().fwd(*args)


def _triton_bwd(*args):
    return triton_kernels().bwd(*args)


def _direct_takes(args) -> bool:
    # The Triton op's operands: q, k, v, attn_bias, key_rank, row_thr, then the scalars, then tile_keys.
    return _ops.plain_eager(args[:6] + args[10:11])


def run_forward(route, *args):
    """The routed forward op, without autograd, on flexdma::perkey_fwd's arguments (tile_keys included)."""
    if route.forward == "triton":
        return torch.ops.flexdma_triton.perkey_fwd(*args, route.tile_rows)
    return perkey_fwd(*args)


def run_backward(route, *args):
    """The routed backward op on flexdma::perkey_bwd's arguments (tile_keys and out_resid included)."""
    if route.backward == "triton":
        return torch.ops.flexdma_triton.perkey_bwd(*args, route.tile_rows)
    return perkey_bwd(*args)


def _decode_step_fake(q, *args):
    return q.new_empty(q.shape)


if LOADED:
    torch.library.register_fake("flexdma::perkey_select")(_perkey_select_fake)
    # The decode steps' output is q's shape; the kept set (and decode_append's caches) change in place.
    torch.library.register_fake("flexdma::decode_step")(_decode_step_fake)
    torch.library.register_fake("flexdma::decode_append")(_decode_step_fake)
    torch.library.register_fake("flexdma::perkey_last_row")(_decode_step_fake)
    torch.library.register_fake("flexdma::perkey_fwd")(_perkey_fwd_fake)
    torch.library.register_fake("flexdma::perkey_bwd")(_perkey_bwd_fake)
    # perkey_bwd looked up when the backward runs (a test spies on it).
    # The backward takes the forward's packed-form arguments (inputs 11-14) after its out_resid.
    perkey_fwd_autograd = _ops.register_autograd(
        "flexdma::perkey_fwd", lambda *args: perkey_bwd(*args), n_tensors=6, bias_index=3, bwd_extra=slice(11, 15)
    )
    _ops.forbid_double_backward("flexdma::perkey_bwd")

    tags = (torch.Tag.pt2_compliant_tag,)
    torch.library.define("flexdma_triton::perkey_fwd", _TRITON_FWD, tags=tags)
    torch.library.define("flexdma_triton::perkey_bwd", _TRITON_BWD, tags=tags)
    torch.library.register_fake("flexdma_triton::perkey_fwd")(_perkey_fwd_fake)
    torch.library.register_fake("flexdma_triton::perkey_bwd")(_perkey_bwd_fake)
    if _ext.HAVE_TRITON:
        torch.library.register_kernel("flexdma_triton::perkey_fwd", "cuda", _triton_fwd)
        torch.library.register_kernel("flexdma_triton::perkey_bwd", "cuda", _triton_bwd)
    triton_fwd_autograd = _ops.register_autograd(
        "flexdma_triton::perkey_fwd",
        lambda *args: torch.ops.flexdma_triton.perkey_bwd(*args),
        n_tensors=6,
        bias_index=3,
        direct=_ops.Direct(_direct_takes, _triton_fwd, _triton_bwd),
        bwd_extra=slice(11, 12),
    )
    _ops.forbid_double_backward("flexdma_triton::perkey_bwd")
