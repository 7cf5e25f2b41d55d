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

On CUDA the kernels do the updates: `attend_one` (flexdma/perkey/triton_decode.py) one new row's
update in place and its attention over the updated set in one kernel, `append_rows` a few rows'
updates in one kernel (flexdma/perkey/triton_rows.py). Both modules import triton: `kernels`
loads them, on the first CUDA step.
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
    if isinstance(start, int) and kept.score.dtype != torch.float64 and _one_kernel_ok(kept.idx.device):
        return kernels()[1].append_rows(kept, s_new, start, eligible)
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


def _one_kernel_ok(device: torch.device, traced: bool = False) -> bool:
    """Whether the decode kernels can run here. While torch.compile traces, only those whose
    launch is a traceable op (`traced`: the one-row step's); the others' torch ops trace (and
    replay in a CUDA graph) as they are."""
    return (
        device.type == "cuda"
        and _ext.HAVE_TRITON
        and not _ext.LOAD_ERROR
        and (traced or not torch.compiler.is_compiling())
    )


def one_kernel_reason(q: torch.Tensor, kv_dtype: torch.dtype) -> Optional[str]:
    """Why a step of one new row (q (B, H, D)) cannot take the one-kernel decode step (None: it can)."""
    if q.device.type != "cuda":
        return f"inputs are on {q.device.type}"
    if not _one_kernel_ok(q.device, traced=True):
        return "the one-kernel step needs triton and the built extension"
    if q.dtype not in (torch.float16, torch.bfloat16) or kv_dtype != q.dtype:
        return f"dtype {q.dtype} (it takes float16 and bfloat16)"
    D = q.shape[-1]
    if D % 16 or not 16 <= D <= 256:
        return f"head_dim {D} (it takes multiples of 16 from 16 to 256)"
    return None


def kernels() -> tuple:
    """(triton_decode, triton_rows): the decode kernels' modules, loaded here (the one place) by
    the first CUDA step: they import triton, which `import flexdma` does not load. Both import
    their types from kept.py, not from this module: no cycle."""
    from . import triton_decode, triton_rows

    return triton_decode, triton_rows


def attend_one(*args, **kwargs) -> torch.Tensor:
    """One new row on CUDA in one kernel: flexdma/perkey/triton_decode.py's decode_step (the kept
    set updated in place to append(kept, s_new, position, eligible), and the row's attention over
    it)."""
    return kernels()[0].decode_step(*args, **kwargs)
