"""The per-key (keep_window_size) path's entry from the dispatcher (flexdma/_dispatch.py): the
route, then the selection with the route's tile rows, then the routed forward; and the route of
calls with a few query rows (`few_rows`): the kept sets of decode.py and one dense-mask call."""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..reference import expand_heads
from . import contract, decode, naive, ops, route


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
        return flex.flex_topk_attention(
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


# Query rows `few_rows` takes at most: its later rows' updates run one after another (on CUDA in
# one program a plane, a few microseconds each), so past a few rows the selection costs less.
FEW_ROWS = 16


def few_rows_ok(call) -> bool:
    """Whether `few_rows` takes the call: at most FEW_ROWS query rows whose first row sees more
    than W keys (causal: K - Q + 1 of them): a decode step or a short chunk after a long context.
    Shorter contexts (a prefill, a short training sequence) keep the selection: it is cheap there,
    and their rows would be a chain of one update each."""
    seen = call.seqlen_k - call.seqlen_q + 1 if call.is_causal else call.seqlen_k
    # Decided only where the sizes settle it: traced with symbolic sizes (torch.export, dynamic
    # shapes) a branch on them would add guards, narrowing the range the graph holds for.
    conditions = (seen > call.keep_window_size, call.seqlen_q > 0, call.seqlen_q <= FEW_ROWS)
    return all(statically_known_true(c) for c in conditions)


def few_rows(call, query, key, value, attn_mask, attn_bias) -> tuple:
    """A few query rows against K keys without the selection over all of them, as the operands of
    one dense-mask call (q, k, v, mask, bias) over at most W + Q - 1 gathered entries: the kept set
    of the first row (one sort of the keys it sees: decode.last_row), then one O(W) update a later
    row's new key (decode.append_rows, causal only: without causality every row keeps the first
    row's set), the kept entries' K / V rows and biases gathered. The same kept sets as the
    selection (tests/test_perkey.py); gradients reach q, k, v and the bias through the gathers."""
    B, Q, H, _ = query.shape
    K, KVH = key.shape[1], key.shape[2]
    scores = contract.selection_scores(attn_bias.detach(), attn_mask, H)  # (P1, P2, K)
    P1, P2 = scores.shape[:2]
    first = K - Q + 1 if call.is_causal else K  # the keys the first row sees: more than W
    kept = decode.last_row(scores[..., :first], call.keep_window_size)
    if call.is_causal and Q > 1:
        first_keep = kept.valid.clone()  # append_rows updates `kept` in place
        new = scores[..., first:]
        rows = decode.append_rows(kept, new, first, torch.ones_like(new, dtype=torch.bool))
        idx = rows.idx
        pad = first_keep.new_zeros(*first_keep.shape[:2], Q - 1)
        keep = torch.cat((torch.cat((first_keep, pad), -1)[:, :, None], rows.keep), 2)
    else:
        idx, keep = kept.idx, kept.valid[:, :, None]
    # The gathered K / V heads: one per plane where the planes are the query heads, else the kv heads.
    heads = H if P2 == H else KVH
    c = torch.arange(heads, device=idx.device)
    kv = c // (H // KVH) if heads == H else c
    plane = c if P2 == heads else c * P2 // heads
    rows_of = idx[:, plane].transpose(1, 2)  # (P1, E, heads)
    b = torch.arange(B, device=idx.device)[:, None, None]
    k_g, v_g = key[b, rows_of, kv], value[b, rows_of, kv]  # (B, E, heads, D)
    bias = expand_heads(attn_bias, P2) if attn_bias.shape[1] not in (1, P2) else attn_bias
    bias = bias.expand(P1, P2, 1, K).gather(-1, idx[:, :, None, :])
    return query, k_g, v_g, keep, bias
