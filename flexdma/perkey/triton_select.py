"""The per-key selection on CUDA (flexdma::topk_select's CUDA implementation): key_rank, row_thr
and tile_keys of every plane (flexdma/perkey/contract.py states them) in one kernel launch, after
the zero fill of its counters: no sort by torch, no host synchronisation, so a CUDA graph can hold
it. Imports triton: loaded by the first per-key CUDA call, not by `import flexdma`.

One launch runs three kinds of work item, handed out in order by an atomic counter, so an item
waits only for items that running programs already hold (the wait cannot deadlock):

1. sort (per plane and chunk of C keys): each key's (score desc, index asc) as one int64 that
   sorts ascending, sorted inside the chunk (tl.sort).
2. rank (per plane and chunk; waits for the plane's sorts): a key's rank is the number of keys
   before it in that order, i.e. the sum over the plane's sorted chunks of a binary search count.
   Summed over the chunks of a prefix level [0, T_l) (levels are whole chunks), the same count is
   the key's place in that level's rank order: the key is written there. O(K^2 / C log C) loads
   per plane, spread over the plane's chunks.
3. walk (per plane and query tile; waits for the plane's ranks): the tile's candidate list from
   the smallest prefix level that holds its last row's keys, the rows' thresholds, the list cut
   to the keys some row keeps. About 2 W level entries are read whatever the position.

Ineligible keys (score -inf) sort after every eligible key, so eligible ranks do not count them;
their rank is NEVER. NaN scores rank first, -0.0 ties +0.0, ties go to the lower index: the order
of the CPU op and of torch.sort(descending=True, stable=True).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .contract import NEVER, list_cap

_NEVER = tl.constexpr(NEVER)
_PAD = tl.constexpr(2**63 - 1)  # above every key: a masked probe's value
_PAD_DESC = tl.constexpr(0x7FFFFFFF)  # the descending float key of a chunk's slots past K
# -inf's descending float key: eligible keys have a smaller one.
_NEG_INF_DESC = tl.constexpr(0x7F800000)


@triton.jit
def _order(s):
    """The selection's order of float32 scores as int32 (flexdma.perkey.decode._order_key): the
    float's order-preserving integer, -0.0 equal to +0.0, every NaN above +inf."""
    bits = s.to(tl.int32, bitcast=True)
    # Negative floats order backwards as integers: flip their magnitude bits.
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where(s == 0.0, 0, key)
    return tl.where(s != s, 0x7FFFFFFF, key)


@triton.jit
def _sort_key(s, j):
    """(score desc, index asc) as one ascending int64: the order, negated, above the key index."""
    desc = ~_order(s.to(tl.float32))
    return (desc.to(tl.int64) << 32) | j.to(tl.int64)


@triton.jit
def _wait(counter, target):
    # Polled with plain (volatile, uncached) loads: atomics on the one address from every waiting
    # program would queue in front of the publishing ones. Then an acquire: the plane's items
    # published their stores before counting.
    while tl.load(counter, volatile=True) < target:
        pass
    # Then an acquire, its result used: Triton drops an atomic add of 0 whose result is not, and
    # without the acquire (and the L1 invalidation that comes with it) the item's loads could be
    # served from L1 lines cached before the publishing items wrote them.
    while tl.atomic_add(counter, 0, sem="acquire") < target:
        pass
    tl.debug_barrier()


@triton.jit
def _publish(counter):
    # Every thread's stores of this item before the release (the barrier orders them).
    tl.debug_barrier()
    tl.atomic_add(counter, 1, sem="release")


@triton.jit
def _keys_of(score_ptr, ssb, ssh, ssk, p, j, P2, K):
    src = score_ptr + (p // P2).to(tl.int64) * ssb + (p % P2).to(tl.int64) * ssh + j.to(tl.int64) * ssk
    s = tl.load(src, mask=j < K, other=0.0)
    # Slots past K: distinct keys after every real one (the descending float key 0x7FFFFFFF is
    # above -inf's).
    return tl.where(j < K, _sort_key(s, j), (tl.full(j.shape, _PAD_DESC, tl.int64) << 32) | j.to(tl.int64))


@triton.jit
def _sort_block(score_ptr, ssb, ssh, ssk, sorted_ptr, p, c, sub, P2, K, NC, C: tl.constexpr, SB: tl.constexpr):
    # Keys [sub SB, (sub + 1) SB) of chunk c: each key's place in the chunk is the number of the
    # chunk's keys below it (the keys are distinct): SB x SB compares C / SB times, the loads of
    # the blocks independent of each other.
    j = c * C + sub * SB + tl.arange(0, SB)
    key = _keys_of(score_ptr, ssb, ssh, ssk, p, j, P2, K)
    below = tl.zeros([SB], tl.int32)
    for k in tl.static_range(C // SB):
        other = _keys_of(score_ptr, ssb, ssh, ssk, p, c * C + k * SB + tl.arange(0, SB), P2, K)
        below += tl.sum((other[None, :] < key[:, None]).to(tl.int32), 1)
    tl.store(sorted_ptr + (p.to(tl.int64) * NC + c) * C + below, key)


@triton.jit
def _rank_block(
    sorted_ptr,
    rank_ptr,
    order_ptr,
    p,
    c,
    h,
    K,
    NC,
    lvl0,
    n_levels,
    plane_stride,
    C: tl.constexpr,
    LOG2C: tl.constexpr,
    BK: tl.constexpr,
    G: tl.constexpr,
):
    # Keys [h BK, (h + 1) BK) of sorted chunk c: their counts in G chunks at a time (G binary
    # searches side by side, so the chain of dependent loads is NC / G searches long).
    base = sorted_ptr + p.to(tl.int64) * NC * C
    mine = tl.load(base + c * C + h * BK + tl.arange(0, BK))
    desc = (mine >> 32).to(tl.int32)
    valid = desc != _PAD_DESC
    j = (mine & 0xFFFFFFFF).to(tl.int32)
    order = order_ptr + p.to(tl.int64) * plane_stride
    g = tl.arange(0, G)
    cnt = tl.zeros([BK], tl.int32)
    lvl = tl.zeros([], tl.int32)
    lvl_end = tl.where(n_levels == 1, NC, lvl0 // C)  # chunks of level 0
    for c0 in range(0, NC, G):
        live = (c0 + g) < NC
        a = base + (c0 + g).to(tl.int64) * C
        pos = tl.zeros([BK, G], tl.int32)
        for k in tl.static_range(LOG2C):
            probe = tl.load(a[None, :] + pos + ((C >> 1) >> k) - 1, mask=live[None, :], other=_PAD)
            pos = tl.where(probe < mine[:, None], pos + ((C >> 1) >> k), pos)
        pos = tl.where(tl.load(a[None, :] + pos, mask=live[None, :], other=_PAD) < mine[:, None], pos + 1, pos)
        upto = tl.cumsum(pos, 1) + cnt[:, None]  # counts through chunk c0 + g
        # Levels ending in this group: level lvl is [0, T) with T = lvl0 << lvl (the last one: K),
        # and a member's count through its last chunk is its place in the level's rank order.
        # Levels lie side by side in a plane, each starting where the sizes of the ones before end.
        while (lvl < n_levels) & (lvl_end <= c0 + G):
            at = tl.sum(tl.where(g[None, :] == lvl_end - 1 - c0, upto, 0), 1)
            T = tl.where(lvl == n_levels - 1, K, lvl0 << lvl)
            tl.store(order + lvl0 * ((1 << lvl) - 1) + at, j, mask=valid & (j < T))
            lvl += 1
            lvl_end = tl.where(lvl == n_levels - 1, NC, (lvl0 << lvl) // C)
        cnt = tl.sum(tl.where(live[None, :], pos, 0), 1) + cnt
    eligible = desc != _NEG_INF_DESC
    tl.store(rank_ptr + p.to(tl.int64) * K + j, tl.where(eligible, cnt, _NEVER), mask=valid)


@triton.jit
def _walk_tile(
    order_ptr,
    rank_ptr,
    thr_ptr,
    keys_ptr,
    scratch_ptr,
    pl,
    t,
    Q,
    K,
    W,
    off,
    n_tiles,
    cap,
    n_levels,
    lvl0,
    plane_stride,
    CAUSAL: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    SCAN: tl.constexpr,
    WIN: tl.constexpr,
    RB: tl.constexpr,
):
    pl = pl.to(tl.int64)
    r0 = t * TILE_ROWS
    r1 = tl.minimum(r0 + TILE_ROWS, Q) - 1
    if CAUSAL:
        p_first = r0 + off
        p_last = r1 + off
    else:
        p_first = K - 1
        p_last = K - 1
    # The smallest prefix level that holds every key the tile's last row sees: its keys in rank
    # order are the scan's input, so the scan reads about 2 W entries instead of W K / p_first.
    lvl = tl.zeros([], tl.int32)
    size = lvl0
    while (lvl < n_levels - 1) & (size <= p_last):
        lvl += 1
        size = size * 2
    order = order_ptr + pl * plane_stride + lvl0 * ((1 << lvl) - 1)
    n_lvl = tl.minimum(size, K)
    ranks = rank_ptr + pl * K
    head = keys_ptr + (pl * n_tiles + t) * (1 + cap)
    lst = head + 1
    # The tile's scratch: the listed keys' ranks (beside lst), and each new key's list index.
    lst_rank = scratch_ptr + (pl * n_tiles + t) * (cap + TILE_ROWS)
    newidx = lst_rank + cap
    # NEVER where no new key is listed: every slot written before the scan fills some.
    tl.store(newidx + tl.arange(0, TILE_ROWS), tl.full([TILE_ROWS], _NEVER, tl.int32))
    tl.debug_barrier()

    # Candidates, in rank order: until the first row has seen W keys (every row's threshold is at
    # most that rank), the keys the last row can see. A key visible to the last row but not the
    # first ("new", at most TILE_ROWS - 1) also leaves its list index in newidx. A level's
    # ineligible keys (rank NEVER) sort after its eligible ones: the first one ends the scan.
    # Base keys (seen by the first row) are visible to every row and a row sees at most
    # TILE_ROWS - 1 keys more than the first, so every row's threshold lies between the
    # (W - TILE_ROWS + 1)-th base key and the W-th: a window of < 2 TILE_ROWS list entries from
    # `start`, found during the scan (the list index of the base key `before` base keys follow).
    s_need = W - TILE_ROWS + 1
    start = tl.full([], 2147483647, tl.int32)
    last_base = tl.zeros([], tl.int32)
    seen = tl.zeros([], tl.int32)
    n = tl.zeros([], tl.int32)
    r = tl.zeros([], tl.int32)
    more = p_last >= 0
    while more & (r < n_lvl) & (seen < W):
        offs = r + tl.arange(0, SCAN)
        pos = tl.load(order + offs, mask=offs < n_lvl, other=0)
        rk = tl.load(ranks + pos, mask=offs < n_lvl, other=_NEVER)
        valid = (offs < n_lvl) & (rk != _NEVER)
        more = tl.sum(valid.to(tl.int32), 0) == SCAN
        is_base = valid & (pos <= p_first)
        base = is_base.to(tl.int32)
        before = tl.cumsum(base, 0) - base + seen
        ok = before < W
        take = valid & (pos <= p_last) & ok
        take_i = take.to(tl.int32)
        at = n + tl.cumsum(take_i, 0) - 1
        tl.store(lst + at, pos, mask=take)
        tl.store(lst_rank + at, rk, mask=take)
        tl.store(newidx + (pos - p_first - 1), at, mask=take & (pos > p_first))
        taken_base = take & is_base
        start = tl.minimum(start, tl.min(tl.where(taken_base & (before == s_need - 1), at, 2147483647), 0))
        last_base = tl.maximum(last_base, tl.max(tl.where(taken_base, at, 0), 0))
        n += tl.sum(take_i, 0)
        seen += tl.sum(base * ok.to(tl.int32), 0)
        r += SCAN
    tl.debug_barrier()
    full = start < 2147483647
    # W < TILE_ROWS: new keys alone can fill a row, the window starts at the list's start. Fewer
    # base keys than s_need: no row reaches W, each keeps up to its last visible key, and only
    # new keys follow the last base key. `seen`: the listed base keys.
    start = tl.where(s_need <= 0, 0, tl.where(full, start, last_base))
    base_before = tl.where(s_need <= 0, 0, tl.where(full, s_need - 1, tl.maximum(seen - 1, 0)))

    # Row i's threshold is the rank where its count of visible listed keys reaches W (or its last
    # visible one), counted inside the window; the rows in blocks of RB (a TILE_ROWS x WIN block
    # would not fit the registers).
    ew = start + tl.arange(0, WIN)
    evw = ew < n
    posw = tl.load(lst + ew, mask=evw, other=_NEVER)
    rkw = tl.load(lst_rank + ew, mask=evw, other=_NEVER)
    qn = tl.arange(0, TILE_ROWS)
    at_n = tl.load(newidx + qn)
    top = tl.full([], -1, tl.int32)
    for rb in tl.static_range(0, TILE_ROWS, RB):
        rows = r0 + rb + tl.arange(0, RB)
        row_ok = rows < Q
        if CAUSAL:
            p_row = rows + off
        else:
            p_row = rows * 0 + (K - 1)
        # New keys listed before the window, per row: those at positions p_first < q <= p_row.
        early = (at_n[None, :] < start) & (qn[None, :] + p_first + 1 <= p_row[:, None])
        cnt = base_before + tl.sum(early.to(tl.int32), 1)
        vis = (posw[None, :] <= p_row[:, None]) & evw[None, :]
        upto = tl.cumsum(vis.to(tl.int32), 1) + cnt[:, None]
        thr = tl.max(tl.where(vis & (upto <= W), rkw[None, :], -1), 1)
        tl.store(thr_ptr + pl * Q + rows, thr, mask=row_ok)
        top = tl.maximum(top, tl.max(tl.where(row_ok, thr, -1), 0))

    # Keep the prefix of the list some row keeps: the list is in rank order and the largest
    # threshold is the rank of a window entry, so the prefix ends at that entry.
    tl.store(head, tl.max(tl.where(evw & (rkw <= top), ew + 1, 0), 0))


@triton.jit
def _select_kernel(
    score_ptr,
    ssb,
    ssh,
    ssk,
    sorted_ptr,
    order_ptr,
    rank_ptr,
    thr_ptr,
    keys_ptr,
    scratch_ptr,
    counters,
    P,
    P2,
    Q,
    K,
    W,
    off,
    NC,
    n_tiles,
    cap,
    n_levels,
    lvl0,
    plane_stride,
    C: tl.constexpr,
    LOG2C: tl.constexpr,
    SB: tl.constexpr,
    BK: tl.constexpr,
    G: tl.constexpr,
    CAUSAL: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    SCAN: tl.constexpr,
    WIN: tl.constexpr,
    RB: tl.constexpr,
):
    # counters: [0] the next work item; [1, 1 + P) each plane's finished sort blocks; [1 + P,
    # 1 + 2 P) its finished rank blocks.
    item = tl.atomic_add(counters, 1)
    n_sort = P * NC * (C // SB)
    n_rank = P * NC * (C // BK)
    if item < n_sort:
        p = item // (NC * (C // SB))
        i = item % (NC * (C // SB))
        _sort_block(score_ptr, ssb, ssh, ssk, sorted_ptr, p, i // (C // SB), i % (C // SB), P2, K, NC, C, SB)
        _publish(counters + 1 + p)
    elif item < n_sort + n_rank:
        p = (item - n_sort) // (NC * (C // BK))
        i = (item - n_sort) % (NC * (C // BK))
        _wait(counters + 1 + p, NC * (C // SB))
        _rank_block(
            sorted_ptr,
            rank_ptr,
            order_ptr,
            p,
            i // (C // BK),
            i % (C // BK),
            K,
            NC,
            lvl0,
            n_levels,
            plane_stride,
            C,
            LOG2C,
            BK,
            G,
        )
        _publish(counters + 1 + P + p)
    else:
        i = item - n_sort - n_rank
        p = i // n_tiles
        _wait(counters + 1 + P + p, NC * (C // BK))
        _walk_tile(
            order_ptr,
            rank_ptr,
            thr_ptr,
            keys_ptr,
            scratch_ptr,
            p,
            i % n_tiles,
            Q,
            K,
            W,
            off,
            n_tiles,
            cap,
            n_levels,
            lvl0,
            plane_stride,
            CAUSAL,
            TILE_ROWS,
            SCAN,
            WIN,
            RB,
        )


# A sort item's keys (it compares them with every key of its chunk); a rank item's keys and the
# chunks it searches at a time.
SORT_BLOCK, RANK_BLOCK, RANK_GROUP = 128, 128, 32


def chunk_size(K: int) -> int:
    """Keys per sorted chunk, a power of two. A rank item searches K / C chunks, a sort item
    compares its keys with C: past 128K keys the chunks grow to keep the searches at most 128 per
    key."""
    return 1024 if K <= 131072 else 4096


def levels(K: int, window: int, tile_rows: int, chunk: int, is_causal: bool) -> tuple:
    """(first level size, level count) of the prefix levels [0, lvl0 * 2^l), the last one all K.
    The first is a power of two of at least 2 W and 2 tile_rows keys and a whole number of
    chunks; without causality one level, all K."""
    if not is_causal:
        return max(K, 1), 1
    lvl0 = triton.next_power_of_2(max(2 * window, 2 * tile_rows, chunk))
    n = 1
    while (lvl0 << (n - 1)) < K:
        n += 1
    return lvl0, n


def select(scores: torch.Tensor, window: int, seqlen_q: int, is_causal: bool, tile_rows: int):
    """(key_rank, row_thr, tile_keys) of every plane of scores (P1, P2, K), a float tensor of any
    strides (the per-key bias's view)."""
    P1, P2, K = scores.shape
    Q = int(seqlen_q)
    P = P1 * P2
    dev = scores.device
    C = chunk_size(K)
    SB, BK, G = min(SORT_BLOCK, C), min(RANK_BLOCK, C), RANK_GROUP
    NC = -(-K // C)
    lvl0, n_levels = levels(K, window, tile_rows, C, is_causal)
    plane_stride = lvl0 * ((1 << (n_levels - 1)) - 1) + K
    cap = list_cap(K, window, tile_rows)
    n_tiles = -(-Q // tile_rows)
    ranks = torch.empty(P, K, dtype=torch.int32, device=dev)
    thr = torch.empty(P, Q, dtype=torch.int32, device=dev)
    # Entries past a list's length are never read.
    keys = torch.empty(P, n_tiles, 1 + cap, dtype=torch.int32, device=dev)
    items = P * (NC * (C // SB) + NC * (C // BK) + n_tiles)
    if items > 0:
        sorted_keys = torch.empty(P * NC * C, dtype=torch.int64, device=dev)
        orders = torch.empty(P * plane_stride, dtype=torch.int32, device=dev)
        scratch = torch.empty(P * n_tiles * (cap + tile_rows), dtype=torch.int32, device=dev)
        counters = torch.zeros(1 + 2 * P, dtype=torch.int32, device=dev)
        _select_kernel[(items,)](
            scores,
            scores.stride(0),
            scores.stride(1),
            scores.stride(2),
            sorted_keys,
            orders,
            ranks,
            thr,
            keys,
            scratch,
            counters,
            P,
            P2,
            Q,
            K,
            window,
            K - Q,
            NC,
            n_tiles,
            cap,
            n_levels,
            lvl0,
            plane_stride,
            C=C,
            LOG2C=C.bit_length() - 1,
            SB=SB,
            BK=BK,
            G=G,
            CAUSAL=bool(is_causal),
            TILE_ROWS=tile_rows,
            SCAN=1024,
            WIN=2 * tile_rows,
            RB=min(32, tile_rows),
            num_warps=4,
        )
    return ranks.view(P1, P2, K), thr.view(P1, P2, Q), keys.view(P1, P2, n_tiles * (1 + cap))
