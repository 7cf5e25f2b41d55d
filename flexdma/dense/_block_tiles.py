"""Triton kernel for the BlockMask tile classification of a dense bool mask.

One program per (batch*head, q-tile, k-tile) reads its 128x128 tile of the mask once and writes
two flags: `partial` (some but not all entries kept) and `full` (every entry kept: inside Q/K,
on or below the bottom-right causal diagonal, and True in the mask). Bounds and causality are
applied per element, so tiles cut by the sequence end or by the diagonal come out exact without a
second pass, and nothing here needs a host sync. Tiles entirely above the diagonal are not read.

Importing this module needs triton; flex.py falls back to torch when it is missing.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl


@triton.jit
def _tile_flags_kernel(
    m_ptr,
    partial_ptr,
    full_ptr,
    Q,
    K,
    off,
    nq,
    nk,
    n_heads,
    s_b,
    s_h,
    s_q,
    s_k,
    HAS_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    EARLY_EXIT: tl.constexpr,
):
    kt = tl.program_id(0)
    qt = tl.program_id(1)
    bh = tl.program_id(2)
    q0 = qt * BLOCK
    k0 = kt * BLOCK
    out = (bh.to(tl.int64) * nq + qt) * nk + kt
    any_ = tl.zeros([], tl.int32)
    all_ = tl.zeros([], tl.int32)
    # Last query row of the tile; k0 beyond its diagonal means nothing in the tile is visible.
    q_last = tl.minimum(q0 + BLOCK - 1, Q - 1)
    visible = k0 < K
    if CAUSAL:
        visible = k0 <= q_last + off
    if visible:
        b = bh // n_heads
        h = bh % n_heads
        base = m_ptr + b.to(tl.int64) * s_b + h.to(tl.int64) * s_h
        cols = k0 + tl.arange(0, BLOCK)
        col_off = cols.to(tl.int64) * s_k
        acc_any = tl.zeros([ROWS, BLOCK], tl.int32)
        acc_all = tl.full([ROWS, BLOCK], 1, tl.int32)
        # Most tiles lie inside Q/K and wholly below the diagonal: they load without a mask, since a
        # per-element causal mask on the load would split it into single-byte accesses.
        interior = (q0 + BLOCK <= Q) & (k0 + BLOCK <= K)
        if CAUSAL:
            interior = interior & (k0 + BLOCK - 1 <= q0 + off)
        if interior and EARLY_EXIT:
            # A tile is partial as soon as it shows both a kept and a dropped entry: for top-k
            # masks that is settled by the first chunk, so most of the tile is never read.
            seen_any = tl.zeros([], tl.int32)
            seen_all = tl.full([], 1, tl.int32)
            r = 0
            while (r < BLOCK) & ((seen_any == 0) | (seen_all != 0)):
                rows = q0 + r + tl.arange(0, ROWS)
                if HAS_MASK:
                    keep = (tl.load(base + rows[:, None].to(tl.int64) * s_q + col_off[None, :]) != 0).to(tl.int32)
                else:
                    keep = tl.full([ROWS, BLOCK], 1, tl.int32)
                seen_any = tl.maximum(seen_any, tl.max(tl.max(keep, axis=1), axis=0))
                seen_all = tl.minimum(seen_all, tl.min(tl.min(keep, axis=1), axis=0))
                r += ROWS
            acc_any = tl.maximum(acc_any, seen_any)
            acc_all = tl.minimum(acc_all, seen_all)
        elif interior:
            # Unrolled so that all row chunks' loads are in flight together.
            for r in tl.static_range(0, BLOCK, ROWS):
                rows = q0 + r + tl.arange(0, ROWS)
                if HAS_MASK:
                    keep = (tl.load(base + rows[:, None].to(tl.int64) * s_q + col_off[None, :]) != 0).to(tl.int32)
                else:
                    keep = tl.full([ROWS, BLOCK], 1, tl.int32)
                acc_any = tl.maximum(acc_any, keep)
                acc_all = tl.minimum(acc_all, keep)
        else:
            for r in tl.static_range(0, BLOCK, ROWS):
                rows = q0 + r + tl.arange(0, ROWS)
                valid = (rows[:, None] < Q) & (cols[None, :] < K)
                if CAUSAL:
                    valid = valid & (cols[None, :] <= rows[:, None] + off)
                if HAS_MASK:
                    ptrs = base + rows[:, None].to(tl.int64) * s_q + col_off[None, :]
                    # Masked-off entries are not fetched: the part of a cut tile above the diagonal
                    # costs nothing.
                    keep = (tl.load(ptrs, mask=valid, other=0) != 0).to(tl.int32)
                else:
                    keep = valid.to(tl.int32)
                acc_any = tl.maximum(acc_any, keep)
                acc_all = tl.minimum(acc_all, keep)
        any_ = tl.max(tl.max(acc_any, axis=1), axis=0)
        all_ = tl.min(tl.min(acc_all, axis=1), axis=0)
    tl.store(partial_ptr + out, (any_ & (1 - all_)).to(tl.uint8))
    tl.store(full_ptr + out, all_.to(tl.uint8))


# Launch configuration (module level so that scripts/dev/flex_probe.py can sweep it).
ROWS, NUM_WARPS, EARLY_EXIT = 16, 4, True


def tile_flags(
    mask: Optional[torch.Tensor],
    Q: int,
    K: int,
    is_causal: bool,
    *,
    device=None,
    block: int = 128,
    rows: Optional[int] = None,
    num_warps: Optional[int] = None,
    early_exit: Optional[bool] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) bool tensors of shape (b, h, nq, nk) for a (b, h, {1|Q}, {1|K}) bool mask
    (None = all kept; then b = h = 1 and `device` says where). Any strides, 0-strides included."""
    rows = ROWS if rows is None else rows
    num_warps = NUM_WARPS if num_warps is None else num_warps
    early_exit = EARLY_EXIT if early_exit is None else early_exit
    nq, nk = -(-Q // block), -(-K // block)
    if mask is None:
        b = h = 1
        dev = torch.device(device) if device is not None else torch.device("cuda")
        strides = (0, 0, 0, 0)
    else:
        b, h = mask.shape[0], mask.shape[1]
        dev = mask.device
        # Size-1 dims broadcast: stride 0 reads the single entry for every index.
        strides = tuple(s if n > 1 else 0 for s, n in zip(mask.stride(), mask.shape))
    partial = torch.empty(b, h, nq, nk, dtype=torch.uint8, device=dev)
    full = torch.empty(b, h, nq, nk, dtype=torch.uint8, device=dev)
    m = mask.view(torch.uint8) if mask is not None else partial
    _tile_flags_kernel[(nk, nq, b * h)](
        m,
        partial,
        full,
        Q,
        K,
        K - Q,
        nq,
        nk,
        h,
        *strides,
        HAS_MASK=mask is not None,
        CAUSAL=bool(is_causal),
        BLOCK=block,
        ROWS=rows,
        EARLY_EXIT=bool(early_exit),
        num_warps=num_warps,
    )
    return partial.view(torch.bool), full.view(torch.bool)


@triton.jit
def _ordered_kernel(flags_ptr, num_ptr, idx_ptr, n_heads, R, C, s_b, s_h, s_r, s_c, CP: tl.constexpr):
    row = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    c = tl.arange(0, CP)
    inside = c < C
    ptrs = flags_ptr + b.to(tl.int64) * s_b + h.to(tl.int64) * s_h + row.to(tl.int64) * s_r + c.to(tl.int64) * s_c
    sel = (tl.load(ptrs, mask=inside, other=0) != 0).to(tl.int32)
    upto = tl.cumsum(sel, 0)  # selected entries in [0, c]
    num = tl.sum(sel, 0)
    # The order of a stable sort on "not selected": selected first, then the rest, each in index order.
    pos = tl.where(sel != 0, upto - 1, num + c - upto)
    out = (bh.to(tl.int64) * R + row) * C
    tl.store(idx_ptr + out + pos, c, mask=inside)
    tl.store(num_ptr + bh.to(tl.int64) * R + row, num)


def ordered(blocks: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(num int32 (b, h, R), indices int32 (b, h, R, C)) of a (b, h, R, C) bool tensor, any strides:
    the True entries first, each part in index order (what BlockMask stores)."""
    b, h, R, C = blocks.shape
    strides = tuple(s if n > 1 else 0 for s, n in zip(blocks.stride(), blocks.shape))
    num = torch.empty(b, h, R, dtype=torch.int32, device=blocks.device)
    idx = torch.empty(b, h, R, C, dtype=torch.int32, device=blocks.device)
    _ordered_kernel[(R, b * h)](blocks.view(torch.uint8), num, idx, h, R, C, *strides, CP=triton.next_power_of_2(C))
    return num, idx
