"""The per-key (keep_window_size) path's implementations, one per (layout, kernels) of
flexdma/_dispatch.py's table: the selection with the route's tile rows, then the routed forward
(whose autograd runs the routed backward with the same selection). A padded call (`run`), a packed
one on the op family's kernels (`packed`: the C++ kernels on CUDA, the CPU kernels), and a few
query rows after a long context over kept sets (`few_rows`, flexdma/perkey/cache.py)."""

from __future__ import annotations

from ..dense import attention as dense_attention
from . import cache, contract, naive, ops

_flex = None


def _flex_attention():
    """flexdma/perkey/flex.py's attention, loaded where it runs a call (it imports torch's
    FlexAttention, which `import flexdma` does not load)."""
    global _flex
    if _flex is None:
        from . import flex

        _flex = flex.attention
    return _flex


def run(plan, query, key, value, attn_mask, attn_bias, scale: float, deterministic: bool, need_lse: bool):
    """(out, lse) of attention over each row's top `keep_window_size` keys by the per-key attn_bias,
    on the route's kernels. No Q x K tensor on the cuda, cpu and flex backends."""
    call, r = plan.call, plan.route
    scores = contract.selection_scores(attn_bias.detach(), attn_mask, call.num_heads)
    sel = contract.select(scores, call.keep_window_size, call.seqlen_q, call.is_causal, r.tile_rows)
    operands = (query, key, value, attn_bias, sel.key_rank, sel.row_thr)
    if r.forward == "triton":
        out, lse, _ = ops.triton_fwd_autograd(
            *operands, scale, call.is_causal, call.softcap, deterministic, sel.tile_keys, r.tile_rows
        )
    elif r.forward in ("cuda", "cpu"):
        # The lists go to every device's kernel (the CPU one reads none), so that a traced call is
        # the same graph on each.
        out, lse, _ = ops.perkey_fwd_autograd(
            *operands, scale, call.is_causal, call.softcap, deterministic, sel.tile_keys
        )
    elif r.forward == "flex":
        out, lse = _flex_attention()(
            *operands, is_causal=call.is_causal, softmax_scale=scale, softcap=call.softcap,
            training=call.requires_grad,
        )  # fmt: skip
    else:
        out, lse = naive.attention(
            query, key, value, attn_bias, sel, scale=scale, is_causal=call.is_causal, softcap=call.softcap
        )
    return out, lse


def packed(plan, query, key, value, cu_q, cu_k, attn_bias, scale: float, deterministic: bool, need_lse: bool):
    """A packed call (q (Tq, H, D), attn_bias (heads, Tk)) on the op family's kernels: one selection
    of every sequence, then one forward; on CUDA one launch each, the offsets read on the device."""
    call, r = plan.call, plan.route
    # The selection's scores as a padded call's of one sequence holding every row: a float64 bias
    # ranked by its order over all of them keeps each sequence's order.
    scores = contract.selection_scores(attn_bias.detach()[None, :, None, :], None, call.num_heads)[0]
    lengths = (cu_q, cu_k, call.seqlen_q, call.seqlen_k)
    sel = contract.select(scores, call.keep_window_size, call.total_q, call.is_causal, r.tile_rows, lengths)
    out, lse, _ = ops.perkey_fwd_autograd(
        query, key, value, attn_bias, sel.key_rank, sel.row_thr, scale, call.is_causal, call.softcap, deterministic,
        sel.tile_keys, *lengths,
    )  # fmt: skip
    return out, lse


def few_rows(plan, query, key, value, attn_mask, attn_bias, scale: float, deterministic: bool, need_lse: bool):
    """A few query rows after a long context (the plan's "cache" layout): their kept sets from one
    sort of the keys and O(W) updates (cache.few_rows), their entries' K / V rows and biases
    gathered, then the backend's dense kernels over them. One row without autograd and without
    its LSE (a decode step), where the route says so: one op call (cache.last_row)."""
    call = plan.call
    if plan.route == cache.ONE_KERNEL:
        return cache.last_row(call, query, key, value, attn_mask, attn_bias, scale), None
    idx, keep = cache.few_rows(call, attn_mask, attn_bias)
    operands = cache.gather(query, key, value, attn_bias, idx, None, keep)
    # The dense call's plan, from the sizes alone (cache.gathered_call): a new record (dynamo before
    # torch 2.13 cannot trace NamedTuple._replace).
    dense_plan = type(plan)(cache.gathered_call(call), plan.backend, "padded", None, dense_attention.op)
    return dense_attention.op(dense_plan, query, *operands, scale, deterministic, need_lse)
