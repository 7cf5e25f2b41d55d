"""The per-key (keep_window_size) path's entry from the dispatcher (flexdma/_dispatch.py): the
route, then the selection with the route's tile rows, then the routed forward. Calls with a few
query rows after a long context go through flexdma/perkey/cache.py instead."""

from __future__ import annotations

from . import contract, naive, ops, route


def run(backend: str, call, query, key, value, attn_mask, attn_bias, scale: float, deterministic: bool, *, flex=None):
    """(out, lse) of attention over each row's top `call.keep_window_size` keys by the per-key
    attn_bias, on the backend the dispatcher picked; inputs validated by flexdma.api (`flex`: the
    flexdma.flex module where FlexAttention loaded). No Q x K tensor on the cuda, cpu and flex
    backends."""
    r = route.decide(backend, call, deterministic)
    scores = contract.selection_scores(attn_bias.detach(), attn_mask, call.num_heads)
    sel = contract.select(scores, call.keep_window_size, call.seqlen_q, call.is_causal, r.tile_rows)
    operands = (query, key, value, attn_bias, sel.key_rank, sel.row_thr)
    if r.forward == "flex":
        return flex.flex_perkey_attention(
            *operands,
            is_causal=call.is_causal,
            softmax_scale=scale,
            softcap=call.softcap,
            training=call.requires_grad,
        )
    if r.forward == "reference":
        return naive.attention(
            query, key, value, attn_bias, sel, scale=scale, is_causal=call.is_causal, softcap=call.softcap
        )
    # The route's forward op and, through its autograd, the route's backward op (perkey/ops.py).
    out, lse, _ = ops.FORWARDS[(r.forward, r.backward)](
        *operands,
        scale,
        call.is_causal,
        call.softcap,
        bool(deterministic),
        None if r.forward == "cpu" else sel.tile_keys,  # the CPU kernel reads no lists
        r.tile_rows,
    )
    return out, lse
