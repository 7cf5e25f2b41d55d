"""Decoding on the per-key path in O(W) a step: the kept set of the newest row, updated as keys arrive.

The newest row sees every cached key, so it keeps the W best eligible keys by (score desc, index
asc), the order of the selection's contract (flexdma/perkey/contract.py: NaN first, -0.0 ties
+0.0, -inf never kept). When one key is appended, that set is the W best of the old set and the
new key (fact 5 of the per-key selection design note): the new key enters if a slot is free or it
outranks the worst kept key, which it then replaces. A step reads W keys, not K.

`KeptSet` (flexdma/perkey/kept.py) holds, per (batch, plane), W slots: key index, whether the slot
holds a key, and the key's score (the bias value the attention adds). Used by flexdma.nn.DMACache
and by flexdma.integrations.transformers' patched Doge layers, whose steps flexdma/perkey/cache.py
routes and runs.

One new row's update in place and its attention over the updated set are one op call,
`attend_one` (flexdma::decode_step, C++ kernels on the CPU and CUDA). On CUDA a few rows' updates
are one Triton kernel (`append_rows`, flexdma/perkey/triton_rows.py, which imports triton:
`rows_kernel` loads it on the first such step).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .. import _ext
from .kept import KeptSet, Rows, order_key


def last_row(scores: torch.Tensor, window: int) -> KeptSet:
    """The kept set of a row that sees all K keys: scores (B, P, K), -inf where a key is not
    eligible (padding). Slots past the eligible keys are free."""
    B, P, K = scores.shape
    # Stable: equal scores in index order; descending puts NaN first and -inf last.
    # Contiguous: a decode step updates the slots in place, and a view would pin the whole sort.
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :window].contiguous()
    score = scores.gather(-1, order)
    valid = score != float("-inf")
    if order.shape[-1] < window:  # fewer keys than slots: the rest are free
        free = window - order.shape[-1]
        order = torch.cat((order, order.new_zeros(B, P, free)), -1)
        valid = torch.cat((valid, valid.new_zeros(B, P, free)), -1)
        score = torch.cat((score, score.new_zeros(B, P, free)), -1)
    return KeptSet(order, valid, score)


def append(kept: KeptSet, s_new: torch.Tensor, position: int, eligible: torch.Tensor) -> KeptSet:
    """The kept set after key `position` (the newest, so the highest index) arrives with scores
    s_new (B, P); `eligible` (B, P) is False where it is padding. A tie keeps the older key."""
    s_new = s_new.to(kept.score.dtype)
    eligible = eligible & (s_new != float("-inf"))
    order = order_key(kept.score)
    # The worst kept key: the lowest score, among equal ones the highest index.
    worst = order.masked_fill(~kept.valid, torch.iinfo(order.dtype).max).min(-1, keepdim=True).values
    worst_slot = kept.idx.masked_fill(~(kept.valid & (order == worst)), -1).argmax(-1)
    free = ~kept.valid.all(-1)
    slot = torch.where(free, (~kept.valid).int().argmax(-1), worst_slot)
    enter = eligible & (free | (order_key(s_new) > worst[..., 0]))
    upd = (torch.arange(kept.idx.shape[-1], device=kept.idx.device) == slot[..., None]) & enter[..., None]
    return KeptSet(
        torch.where(upd, position, kept.idx),
        kept.valid | upd,
        torch.where(upd, s_new[..., None], kept.score),
    )


def append_rows(kept: KeptSet, s_new: torch.Tensor, start: Union[int, torch.Tensor], eligible: torch.Tensor) -> Rows:
    """T new keys at positions start .. start + T - 1 with scores s_new (B, P, T), `eligible`
    (B, P, T) False for padding, and the T rows that end at them: row t sees the old keys and new
    keys 0 .. t, so its kept set is the one after appending keys 0 .. t, one O(W) update each. A
    key that leaves never returns (fact 2), so every row's set lies in the old slots plus the new
    keys (fact 3): W + T entries. `start` is an int, or a one-element device tensor (a static
    cache's position). `kept` is updated in place (Rows.kept is it: a step consumes the kept set it
    extends): on CUDA with an int start by one kernel (flexdma/perkey/triton_rows.py), else by
    torch ops, which then write their result back (under transformers' compiled generation the set
    so stays in the buffers the prefill allocated: a CUDA graph's outputs are overwritten by its
    next replay). float64 scores take the torch ops: the kernel ranks in float32, and a float64
    set is ranked in float64 (order_key)."""
    if isinstance(start, int) and kept.score.dtype != torch.float64 and _rows_kernel_ok(kept.idx.device):
        return rows_kernel().append_rows(kept, s_new, start, eligible)
    B, P, W = kept.idx.shape
    T = s_new.shape[-1]
    first = kept
    # Which union entry each slot holds: the old slots are entries 0 .. W - 1, new key u is W + u.
    entry = torch.arange(W, device=kept.idx.device).expand(B, P, W)
    keep = []
    for t in range(T):
        after = append(kept, s_new[..., t], start + t, eligible[..., t])
        entered = after.idx != kept.idx
        entry = torch.where(entered | (after.valid & ~kept.valid), W + t, entry)
        kept = after
        keep.append(torch.zeros(B, P, W + T, dtype=torch.bool, device=entry.device).scatter_(-1, entry, kept.valid))
    new_idx = (start + torch.arange(T, device=kept.idx.device)).expand(B, P, T)
    rows = Rows(
        torch.cat((first.idx, new_idx), -1),
        torch.cat((first.score, s_new.to(first.score.dtype)), -1),
        torch.stack(keep, 2),
        first,
    )
    for old, new in zip(first, kept):
        old.copy_(new)
    return rows


def select_batch(kept: KeptSet, index: torch.Tensor) -> KeptSet:
    """The kept sets of the batch rows `index` (a cache reordered or filtered by batch)."""
    return KeptSet(*(t.index_select(0, index.to(t.device)) for t in kept))


def _rows_kernel_ok(device: torch.device) -> bool:
    """Whether the few-rows Triton kernel can run here (not while torch.compile traces: the
    torch ops trace, and replay in a CUDA graph, as they are)."""
    return device.type == "cuda" and _ext.HAVE_TRITON and not torch.compiler.is_compiling()


def one_kernel_reason(q: torch.Tensor, key: torch.Tensor, window: int, score_dtype: torch.dtype) -> Optional[str]:
    """Why a step of one new row (q (B, 1, H, D) against the keys (B, K, KVH, D) and kept sets of
    `window` slots with scores of `score_dtype`) cannot take flexdma::decode_step (None: it can)."""
    B, _, H, D = q.shape
    dtype = q.dtype if key.dtype == q.dtype else None
    return kernels_reason(q.device, B, H, key.shape[2], D, window, key.shape[1], dtype, score_dtype)


def kernels_reason(device, batch, heads, planes, head_dim, window, keys, dtype, score_dtype) -> Optional[str]:
    """Why the decode ops' kernels cannot take a step of these sizes (`planes` attention planes a
    batch row: the kv heads, or the query heads where each has a kept set) on `device` (None: they
    can): the CPU kernel takes every float dtype, the CUDA kernels answer their own check."""
    if _ext.LOAD_ERROR is not None:
        return "the built extension did not load"
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"inputs are on {device.type}"
    key = (
        _ext.known_size(batch), heads, planes, head_dim, window, _ext.known_size(keys),
        _ext.DTYPE_CODES.get(dtype, -1), _ext.DTYPE_CODES.get(score_dtype, -1),
    )  # fmt: skip
    return _ext.kernels_reason("decode_unsupported_reason", key)


def rows_kernel():
    """flexdma/perkey/triton_rows.py, loaded here (the one place) by the first CUDA step of a few
    rows: it imports triton, which `import flexdma` does not load. It imports its types from
    kept.py, not from this module: no cycle."""
    from . import triton_rows

    return triton_rows


def attend_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kept: KeptSet,
    s_new: torch.Tensor,
    position: Union[int, torch.Tensor],
    eligible: torch.Tensor,
    softmax_scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One new row in one op call (flexdma::decode_step): `kept` updated in place to append(kept,
    s_new, position, eligible) and the row's attention over it. q (B, 1, H, D); k, v (B, Kcap,
    KVH, D), the new key already at `position` (any strides but a contiguous head dim); s_new
    (B, KVH) (converted to the kept scores' dtype, as append does), eligible (B, KVH) bool;
    position an int or a one-element integer tensor on the device (read there: no host
    synchronisation). Returns (B, 1, H, D)."""
    at = None
    if isinstance(position, torch.Tensor):
        at, position = position.reshape(1).to(torch.int64), 0
    return torch.ops.flexdma.decode_step(
        q, k, v, kept.idx, kept.valid, kept.score, s_new.to(kept.score.dtype), eligible, position, at,
        softmax_scale, softcap,
    )  # fmt: skip


def append_one(q, key, value, bias, padding, buffers, kept: KeptSet, position: int, softmax_scale: float):
    """nn.DMACache's one-row step in one op call (flexdma::decode_append): the new key's rows key,
    value (B, 1, KVH, D), its bias (B, KVH, 1, 1) and padding (B, 1) written at `position` of the
    buffers (key, value (B, Kcap, KVH, D), bias (B, KVH, Kcap), padding (B, Kcap)), `kept` updated
    in place as append does, and the row q (B, 1, H, D) attended over it. Returns (B, 1, H, D)."""
    return torch.ops.flexdma.decode_append(
        q, key, value, bias, padding, *buffers, *kept, position, softmax_scale, 0.0
    )  # fmt: skip
