"""A cache step of the per-key path: a few new query rows against cached keys, decided and run in
one place for its three callers: the API (flash_dma_attention with keep_window_size, a few query
rows after a long context; flexdma/perkey/attention.py), nn.DynamicMaskAttention's cached steps
(nn.DMACache) and patch_doge's (flexdma/integrations/transformers.py).

`route` decides, once a step and from sizes and flags only (before any data moves), how it runs:
- ONE_KERNEL: one new row against the caller's kept sets, without autograd: the kept set's O(W)
  update in place and the row's attention over it in one op call (flexdma::decode_step through
  decode.attend_one; nn.DMACache calls flexdma::decode_append, which also writes the new key into
  its buffers);
  An API call of one query row without autograd and without its LSE (a decode step through
  flash_dma_attention) also routes here: the op flexdma::perkey_last_row selects the row's kept set from every key's score
  and attends over it, one call (`last_row_reason` says where its kernels take the call);
- KEPT_SETS: each row's kept set among the old slots and the new keys, one O(W) update a key
  (decode.append_rows; the API, which carries no kept sets, first sorts the keys its first row
  sees: `few_rows`), then the entries' K / V rows and biases gathered and one dense-mask call;
- SELECTION: the selection over every key, which the caller runs: what it is differs (the API's
  per-key implementation; the layers' forward over the whole cache, which also rebuilds their
  kept sets).
`attend` runs a step routed to ONE_KERNEL or KEPT_SETS.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..dense.naive import expand_heads
from . import contract, decode
from .kept import KeptSet

ONE_KERNEL, KEPT_SETS, SELECTION = "one kernel", "kept sets", "selection"

# New rows a step takes through carried kept sets (a few tokens: speculative decoding, small
# prefill chunks); one O(W) update a key, so longer chunks run the full selection.
MAX_ROWS = 64
# Query rows an API call takes through kept sets built for it (`few_rows`) at most: its later rows'
# updates run one after another (on CUDA in one program a plane, a few microseconds each), so past
# a few rows the selection costs less.
FEW_ROWS = 16


def route(
    query: torch.Tensor,
    key: torch.Tensor,
    kept: Optional[KeptSet] = None,
    window: Optional[int] = None,
    *,
    grad: bool = False,
    gathers_bias: bool = False,
    call=None,
    dense_reason: Optional[Callable] = None,
) -> str:
    """How the query rows (B, T, H, D) of a step against the keys (B, K, KVH, D) run.

    A layer's step: `kept`, the kept sets (B, KVH, `window`) of its newest cached row (None where
    it has none for this step), `grad` whether autograd records the step, `gathers_bias` whether
    the caller hands `attend` its cached biases (gradients reach them through the gather; without,
    the step attends with the kept sets' detached scores, so a step autograd records runs the
    selection, which scores every key again). The kept sets take at most MAX_ROWS rows; one row
    without autograd takes the one op where decode.one_kernel_reason allows it.

    An API call: `call` (flexdma._dispatch.Call) and `dense_reason(call)`, why its backend's dense
    path cannot take a call (None: the backend gathers no kept entries). Kept sets built for the
    call take it where few_rows_ok does and that dense path takes the gathered call; one row
    without autograd and without its LSE (the op returns none), the one op where last_row_reason
    allows it."""
    if call is not None:
        if dense_reason is None or not few_rows_ok(call):
            return SELECTION
        one_row = statically_known_true(call.seqlen_q == 1) and not call.requires_grad and not call.need_lse
        if one_row and last_row_reason(call) is None:
            return ONE_KERNEL
        return KEPT_SETS if dense_reason(gathered_call(call)) is None else SELECTION
    B, T = query.shape[:2]
    if (
        kept is None
        or T > MAX_ROWS
        or tuple(kept.idx.shape) != (B, key.shape[2], window)
        or (grad and not gathers_bias)
    ):
        return SELECTION
    if T == 1 and not grad and decode.one_kernel_reason(query, key, window, kept.score.dtype) is None:
        return ONE_KERNEL
    return KEPT_SETS


def attend(
    how: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: Optional[torch.Tensor],
    *,
    dense: Callable,
    scale: Optional[float] = None,
    kept: Optional[KeptSet] = None,
    scores: Optional[torch.Tensor] = None,
    start: Union[int, torch.Tensor, None] = None,
    eligible: Optional[torch.Tensor] = None,
):
    """A step that `route` sent to ONE_KERNEL or KEPT_SETS: the query rows (B, T, H, D) against
    the keys and values (B, K, KVH, D), any strides. Returns what `dense(query, key, value, mask,
    bias)`, the caller's dense-mask attention, returns (ONE_KERNEL: the output (B, 1, H, D)).

    A layer's step: the new keys are K's last T, from `start` (an int, or a static cache's
    one-element device tensor), with `scores` (B, KVH, T) and `eligible` (B, T) (False: padding);
    `kept` is updated in place to the last row's kept set; `bias` (B, KVH, 1, K) the cached biases
    to gather, or None (the kept sets' scores); `scale` the one op's softmax scale.

    An API call carries no kept sets: flexdma/perkey/attention.py's few_rows builds them
    (`few_rows`), gathers their entries (`gather`) and runs the dense call itself."""
    if how == ONE_KERNEL:
        B, P = kept.idx.shape[:2]
        return decode.attend_one(query, key, value, kept, scores[..., 0], start, eligible[:, :1].expand(B, P), scale)
    if how != KEPT_SETS:
        raise ValueError(f"attend runs the routes {ONE_KERNEL!r} and {KEPT_SETS!r}, got {how!r}")
    rows = decode.append_rows(kept, scores, start, eligible[:, None, :].expand(scores.shape))
    return dense(query, *gather(query, key, value, bias, rows.idx, rows.score, rows.keep))


def last_row_reason(call) -> Optional[str]:
    """Why flexdma::perkey_last_row cannot take an API call of one row (None: it can), asked with
    its attention planes a batch row (a kept set per query head where the selection planes are)."""
    H, KVH = call.num_heads, call.num_kv_heads
    mask_heads = 1 if call.mask_shape is None else call.mask_shape[1]
    planes = H if contract.plane_heads(H, call.bias_shape[1], mask_heads) == H else KVH
    return decode.kernels_reason(
        call.device, call.batch, H, planes, call.head_dim, call.keep_window_size, call.seqlen_k, call.dtype,
        call.bias_dtype,
    )  # fmt: skip


def last_row(call, query, key, value, attn_mask, attn_bias, scale: float) -> torch.Tensor:
    """An API call that `route` sent to ONE_KERNEL: the row's kept set from every key's score and
    its attention over it, one op call (flexdma::perkey_last_row). Returns the output (B, 1, H, D)."""
    # No detach: `route` sends here only calls that record no backward.
    scores = contract.selection_scores(attn_bias, attn_mask, call.num_heads, float64_ranks=False)
    return torch.ops.flexdma.perkey_last_row(query, key, value, scores, call.keep_window_size, scale, call.softcap)


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


def few_rows(call, attn_mask: Optional[torch.Tensor], attn_bias: torch.Tensor) -> tuple:
    """The kept sets of an API call's query rows without the selection over all K keys: (idx
    (P1, P2, E) the entries' key indices, keep (P1, P2, Q or 1, E) the entries each row keeps), E
    at most W + Q - 1. The kept set of the first row (one sort of the keys it sees:
    decode.last_row), then one O(W) update a later row's new key (decode.append_rows, causal only:
    without causality every row keeps the first row's set). The same kept sets as the selection
    (tests/perkey/test_perkey.py)."""
    Q, K = call.seqlen_q, call.seqlen_k
    scores = contract.selection_scores(attn_bias.detach(), attn_mask, call.num_heads)  # (P1, P2, K)
    first = K - Q + 1 if call.is_causal else K  # the keys the first row sees: more than W
    kept = decode.last_row(scores[..., :first], call.keep_window_size)
    if not (call.is_causal and Q > 1):
        return kept.idx, kept.valid[:, :, None]
    first_keep = kept.valid.clone()  # append_rows updates `kept` in place
    new = scores[..., first:]
    rows = decode.append_rows(kept, new, first, torch.ones_like(new, dtype=torch.bool))
    pad = first_keep.new_zeros(*first_keep.shape[:2], Q - 1)
    return rows.idx, torch.cat((torch.cat((first_keep, pad), -1)[:, :, None], rows.keep), 2)


def gathered_call(call):
    """The Call (flexdma._dispatch.Call) of the dense-mask call that `attend` makes for an API
    call's few rows, from the call's sizes alone: what the dispatcher's support check reads
    before any data moves, and what the dense implementation runs."""
    H, Q, W = call.num_heads, call.seqlen_q, call.keep_window_size
    bias_shape, mask_shape = call.bias_shape, call.mask_shape
    # The selection planes (contract.selection_scores): the bias's and the mask's broadcast.
    P1 = mask_shape[0] if mask_shape is not None and bias_shape[0] == 1 else bias_shape[0]
    P2 = contract.plane_heads(H, bias_shape[1], 1 if mask_shape is None else mask_shape[1])
    rows = Q if call.is_causal and Q > 1 else 1
    E = W + rows - 1
    # A new record, not call._replace: dynamo before torch 2.13 cannot trace _replace. The fields
    # not named here (with defaults) describe per-key operands only: a dense call has the defaults.
    return type(call)(
        device=call.device,
        dtype=call.dtype,
        batch=call.batch,
        seqlen_q=Q,
        num_heads=H,
        head_dim=call.head_dim,
        seqlen_k=E,
        num_kv_heads=H if P2 == H else call.num_kv_heads,
        is_causal=False,
        softcap=call.softcap,
        mask_shape=(P1, P2, rows, E),
        bias_shape=(P1, P2, 1, E),
        requires_grad=call.requires_grad,
        keep_window_size=None,
        need_lse=call.need_lse,
    )


def gather(query, key, value, bias, idx, score, keep) -> tuple:
    """The dense-mask call's key, value, mask and bias over the entries idx (P1, P2, E): the
    entries' K / V rows, one set per plane where the planes are the query heads, else per kv head
    ((B, E, heads, D)); their biases gathered from `bias` (gradients reach it), or without one the
    entries' scores."""
    B, H, KVH = query.shape[0], query.shape[2], key.shape[2]
    P1, P2 = idx.shape[:2]
    heads = H if P2 == H else KVH
    c = torch.arange(heads, device=idx.device)
    kv = c // (H // KVH) if heads == H else c
    plane = c if P2 == heads else c * P2 // heads
    rows_of = idx[:, plane].transpose(1, 2)  # (P1, E, heads)
    b = torch.arange(B, device=idx.device)[:, None, None]
    k, v = key[b, rows_of, kv], value[b, rows_of, kv]
    if bias is None:
        return k, v, keep, score[:, :, None, :].to(query.dtype)
    bias = expand_heads(bias, P2) if bias.shape[1] not in (1, P2) else bias
    return k, v, keep, bias.expand(P1, P2, 1, bias.shape[-1]).gather(-1, idx[:, :, None, :])
