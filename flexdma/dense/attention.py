"""The dense path's implementations (attn_mask / attn_bias): one per (layout, backend) of
flexdma/_dispatch.py's table, each `impl(plan, q, k, v, ...)` -> (out, lse) on inputs the public
function validated. The op family's kernels (CUDA and CPU) take both layouts (`op`, `packed_op`);
FlexAttention takes a padded call and a packed one (one call, a document mask from the offsets);
the reference takes a padded call."""

from __future__ import annotations

from .. import _tilebits
from . import ops
from .naive import attention_ref

# FlexAttention loaded on first use, cached by hand (not functools.lru_cache: torch.compile traces
# the dispatch on every call of the API and warns about, and ignores, an lru_cache wrapper; a plain
# module global is read as a constant).
_UNSET = object()
_flex_state = _UNSET


def flex_module():
    """(flexdma.dense.flex, None), or (None, why) where FlexAttention is unavailable."""
    global _flex_state
    if _flex_state is _UNSET:
        try:
            # Optional and heavy (torch's FlexAttention, and triton through dense/_block_tiles.py):
            # loaded by the first call that asks, not by `import flexdma`.
            from . import flex
        except Exception as e:  # pragma: no cover - torch without FlexAttention
            _flex_state = (None, f"FlexAttention is unavailable ({e})")
        else:
            _flex_state = (flex, None)
    return _flex_state


def op(plan, q, k, v, mask, bias, scale, deterministic, need_lse):
    """flexdma::fwd through its autograd (the backward: flexdma::bwd)."""
    call = plan.call
    # The CUDA kernels skip empty tiles by the mask's tile activity bits: computed here once,
    # handed to the forward and kept by autograd for the backward. Without a backward to share
    # them with (inference, decoding) the op computes them itself: one Python op call less a step.
    # The CPU kernel needs none.
    meta = None
    if mask is not None and call.device.type == "cuda":
        # A mask create_mask built carries its tiles' activity (mask.flexdma_tiles): the bits from it.
        meta = _tilebits.tile_meta_of(mask, call.seqlen_q, call.seqlen_k, call.is_causal)
        if meta is None and call.requires_grad:
            meta = ops.tile_meta(mask, call.seqlen_q, call.seqlen_k, call.is_causal)
    # out_resid (kept only where a backward can follow) stays with autograd, which hands it on.
    out, lse, _ = ops.fwd_autograd(
        q, k, v, mask, bias, scale, call.is_causal, call.softcap, deterministic, meta, call.requires_grad
    )
    return out, lse


def packed_op(plan, q, k, v, cu_q, cu_k, bias, scale, deterministic, need_lse):
    """flexdma::fwd in its packed form: one launch for every sequence on CUDA (the kernels read the
    offsets on the device, no host synchronisation), a loop over them in the CPU kernel."""
    call = plan.call
    out, lse, _ = ops.fwd_autograd(
        q, k, v, None, bias, scale, call.is_causal, call.softcap, deterministic, None, call.requires_grad,
        cu_q, cu_k, call.seqlen_q, call.seqlen_k,
    )  # fmt: skip
    return out, lse


def flex(plan, q, k, v, mask, bias, scale, deterministic, need_lse):
    call = plan.call
    return flex_module()[0].flex_dma_attention(
        q, k, v, mask, bias, is_causal=call.is_causal, softmax_scale=scale, softcap=call.softcap, need_lse=need_lse,
        training=call.requires_grad,
    )  # fmt: skip


def packed_flex(plan, q, k, v, cu_q, cu_k, bias, scale, deterministic, need_lse):
    call = plan.call
    return flex_module()[0].flex_varlen_attention(
        q, k, v, cu_q, cu_k, call.seqlen_q, call.seqlen_k, bias, is_causal=call.is_causal, softmax_scale=scale,
        softcap=call.softcap, training=call.requires_grad,
    )  # fmt: skip


def reference(plan, q, k, v, mask, bias, scale, deterministic, need_lse):
    call = plan.call
    return attention_ref(q, k, v, mask, bias, is_causal=call.is_causal, softmax_scale=scale, softcap=call.softcap)
