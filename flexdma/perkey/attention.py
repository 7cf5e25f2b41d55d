"""The per-key (keep_window_size) path's entry from the dispatcher (flexdma/_dispatch.py): the
route, then the selection with the route's tile rows, then the routed forward."""

from __future__ import annotations

from . import contract, naive, ops, route


def run(backend: str, call, query, key, value, attn_mask, attn_bias, scale: float, deterministic: bool, *, flex=None):
    """(out, lse) of attention over each row's top `call.keep_window_size` keys by the per-key
    attn_bias, on the backend the dispatcher picked; inputs validated by flexdma.api (`flex`: the
    flexdma.flex module where FlexAttention loaded). No Q x K tensor on the cuda, cpu and flex
    backends."""
    r = route.decide(backend, call)
    scores = contract.selection_scores(attn_bias.detach(), attn_mask, call.num_heads)
    sel = contract.select(scores, call.keep_window_size, call.seqlen_q, call.is_causal, r.tile_rows)
    return _FORWARDS[r.forward](r, call, sel, query, key, value, attn_bias, scale, deterministic, flex)


def _op(r, call, sel, query, key, value, attn_bias, scale, deterministic, flex):
    # flexdma::topk_fwd: on CUDA route.cuda_fwd (the C++ sm_90a kernel or Triton), on CPU the C++ op.
    out, lse, _ = ops.topk_fwd(
        query,
        key,
        value,
        attn_bias,
        sel.key_rank,
        sel.row_thr,
        scale,
        call.is_causal,
        call.softcap,
        bool(deterministic),
        sel.tile_keys if r.backend == "cuda" else None,
    )
    return out, lse


def _flex(r, call, sel, query, key, value, attn_bias, scale, deterministic, flex):
    return flex.flex_topk_attention(
        query,
        key,
        value,
        attn_bias,
        sel.key_rank,
        sel.row_thr,
        is_causal=call.is_causal,
        softmax_scale=scale,
        softcap=call.softcap,
        training=call.requires_grad,
    )


def _reference(r, call, sel, query, key, value, attn_bias, scale, deterministic, flex):
    return naive.attention(
        query, key, value, attn_bias, sel, scale=scale, is_causal=call.is_causal, softcap=call.softcap
    )


_FORWARDS = {"sm90": _op, "triton": _op, "cpu": _op, "flex": _flex, "reference": _reference}
