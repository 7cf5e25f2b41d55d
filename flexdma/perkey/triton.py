"""Triton kernels of the per-key top-W path (flexdma/perkey/contract.py states the contract they
implement; docs/kernels.md describes them), and their launchers: the implementation of
flexdma_triton::perkey_fwd / perkey_bwd (flexdma/perkey/ops.py), which runs the CUDA calls the C++
kernels do not take. Imports triton: loaded by the first call that runs them (ops.triton_kernels),
not by `import flexdma`. Which calls come here and the selection's tile rows are
flexdma/perkey/route.py's.

- the selection they read: flexdma::perkey_select's CUDA kernel (csrc/cuda/perkey_select.cu).
- `fwd` / `bwd`: one program per (batch, query tile, pack of query heads that share a kv head and
  a selection plane). The pack's rows share every gathered K / V tile; each element still gets the
  exact keep test (rank <= the row's threshold, causal cut), so the union list costs compute but
  never changes the result. dq is owned by the program; dk, dv and the per-key dbias are sums over
  the query tiles that list a key, accumulated in float32 with atomics, or (deterministic) stored
  per program and list entry and added in a fixed order.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .._ext import LOG2E  # log2(e), csrc/flash_dma_constants.h's kLog2e
from .contract import NEVER, WIDE_FROM, block_m, pack_size  # NEVER: key_rank of a key no row keeps

# The same, as the compile-time constants kernels may read.
_NEVER = tl.constexpr(NEVER)
_LOG2E = tl.constexpr(LOG2E)

# Launch configurations (module level so scripts/dev/perkey_dev.py can sweep them).
FWD_CONFIG = dict(BN=128, num_warps=4, num_stages=2)
BWD_CONFIG = dict(BN=64, num_warps=8, num_stages=3)
# Head dims above WIDE_FROM (contract.py, with the rows per program): half the rows per program, fewer
# keys a step and fewer stages, so that q / dO, the dQ accumulator and the K / V stages fit one SM
# (the narrow dims' tiles need more than an H100's 227 KiB of shared memory at head dim 256).
WIDE_FWD_CONFIG = dict(BN=64, num_warps=4, num_stages=2)
WIDE_BWD_CONFIG = dict(BN=32, num_warps=4, num_stages=2)


def configs(head_dim: int) -> tuple:
    """(forward, backward) launch configuration for this head dim."""
    return (WIDE_FWD_CONFIG, WIDE_BWD_CONFIG) if head_dim > WIDE_FROM else (FWD_CONFIG, BWD_CONFIG)


# ----------------------------------------------------------------------------------- attention
@triton.jit
def _tile_setup(
    pid_t,
    pid_bh,
    k_ptr,
    v_ptr,
    bias_ptr,
    rank_ptr,
    thr_ptr,
    keys_ptr,
    skb,
    skh,
    svb,
    svh,
    sbb,
    sbh,
    H,
    G,
    PLANE_H,
    PLANE_RATIO,
    plane_b_on,
    BIAS_RATIO,
    bias_b_on,
    Q,
    K,
    off,
    n_tiles,
    cap,
    PACK: tl.constexpr,
    TILE_ROWS: tl.constexpr,
):
    """One program's rows and operands: PACK query heads (sharing a kv head and a selection plane)
    x TILE_ROWS rows of query tile pid_t; their thresholds, causal limits, the tile's key list, and
    the K / V / bias rows of the batch and kv head."""
    heads_per = H // PACK
    b = pid_bh // heads_per
    h0 = (pid_bh % heads_per) * PACK
    kvh = h0 // G
    plane = (b * plane_b_on * PLANE_H + h0 // PLANE_RATIO).to(tl.int64)
    r = tl.arange(0, PACK * TILE_ROWS)
    i = pid_t * TILE_ROWS + r % TILE_ROWS
    h = h0 + r // TILE_ROWS
    row_ok = i < Q
    thr = tl.load(thr_ptr + plane * Q + i, mask=row_ok, other=-1)
    head = keys_ptr + (plane * n_tiles + pid_t) * (1 + cap)
    kb = k_ptr + b.to(tl.int64) * skb + kvh * skh
    vb = v_ptr + b.to(tl.int64) * svb + kvh * svh
    bb = bias_ptr + (b * bias_b_on).to(tl.int64) * sbb + (h0 // BIAS_RATIO) * sbh
    return b, h0, kvh, i, h, row_ok, thr, i + off, head, tl.load(head), rank_ptr + plane * K, kb, vb, bb


@triton.jit
def _within(mask, d, D: tl.constexpr, DP: tl.constexpr):
    """mask, and where the head dim is padded (D < DP) the real columns: the padding loads as 0
    and is never stored. Unpadded head dims compile without the column test."""
    if D == DP:
        return mask
    else:
        return mask & (d[None, :] < D)


@triton.jit
def _chunk(head, ranks, kb, bb, n0, n, skn, sbk, D: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr):
    """Listed keys [n0, n0 + BN) of a tile: list positions, validity, key indices, ranks, the
    gathered K rows (head dim padded to DP with zeros) and the keys' biases."""
    e = n0 + tl.arange(0, BN)
    ev = e < n
    kidx = tl.load(head + 1 + e, mask=ev, other=0)
    rk = tl.load(ranks + kidx, mask=ev, other=_NEVER)
    d = tl.arange(0, DP)
    k = tl.load(kb + kidx[:, None].to(tl.int64) * skn + d[None, :], mask=_within(ev[:, None], d, D, DP), other=0.0)
    bias_v = tl.load(bb + kidx.to(tl.int64) * sbk, mask=ev, other=0.0).to(tl.float32)
    return e, ev, kidx, rk, k, bias_v


@triton.jit
def _tanh(x):
    # Overflow-safe for large |x|: exp2 of a large positive argument gives inf, and 2 / inf = 0.
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * _LOG2E)) + 1.0)


@triton.jit
def _scores(q, k, bias_v, rk, kidx, ev, thr, p_row, scale_log2, cap, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr):
    """Scores in the log2 domain with the keep test applied (-inf where dropped), and the tanh
    values of the softcap (for the backward)."""
    s = tl.dot(q, tl.trans(k))
    if SOFTCAP:
        th = _tanh(s * (scale_log2 / _LOG2E / cap))
        s = th * (cap * _LOG2E)
    else:
        th = s
        s = s * scale_log2
    s += bias_v[None, :] * _LOG2E
    # A NaN score becomes +inf, so the row's max and sum turn NaN and the row comes out NaN (as
    # in the reference) instead of the max skipping it.
    s = tl.where(s != s, float("inf"), s)
    keep = ev[None, :] & (rk[None, :] <= thr[:, None])
    if CAUSAL:
        keep = keep & (kidx[None, :] <= p_row[:, None])
    return tl.where(keep, s, float("-inf")), th


@triton.jit
def _fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bias_ptr,
    rank_ptr,
    thr_ptr,
    keys_ptr,
    o_ptr,
    lse_ptr,
    res_ptr,
    sqb,
    sqm,
    sqh,
    skb,
    skn,
    skh,
    svb,
    svn,
    svh,
    sob,
    som,
    soh,
    sbb,
    sbh,
    sbk,
    H,
    G,
    PLANE_H,
    PLANE_RATIO,
    plane_b_on,
    BIAS_RATIO,
    bias_b_on,
    Q,
    K,
    off,
    n_tiles,
    cap,
    scale_log2,
    softcap,
    D: tl.constexpr,
    DP: tl.constexpr,
    PACK: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    BN: tl.constexpr,
    CAUSAL: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    pid_t = tl.program_id(0)
    b, h0, kvh, i, h, row_ok, thr, p_row, head, n, ranks, kb, vb, bb = _tile_setup(
        pid_t,
        tl.program_id(1),
        k_ptr,
        v_ptr,
        bias_ptr,
        rank_ptr,
        thr_ptr,
        keys_ptr,
        skb,
        skh,
        svb,
        svh,
        sbb,
        sbh,
        H,
        G,
        PLANE_H,
        PLANE_RATIO,
        plane_b_on,
        BIAS_RATIO,
        bias_b_on,
        Q,
        K,
        off,
        n_tiles,
        cap,
        PACK,
        TILE_ROWS,
    )
    BM: tl.constexpr = PACK * TILE_ROWS
    # Head dims that are not a power of two run padded to DP (_within).
    d = tl.arange(0, DP)
    rm = _within(row_ok[:, None], d, D, DP)
    q = tl.load(
        q_ptr + b.to(tl.int64) * sqb + i[:, None].to(tl.int64) * sqm + h[:, None] * sqh + d[None, :],
        mask=rm,
        other=0.0,
    )

    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DP], tl.float32)
    for n0 in range(0, n, BN):
        e, ev, kidx, rk, k, bias_v = _chunk(head, ranks, kb, bb, n0, n, skn, sbk, D, DP, BN)
        s, _ = _scores(q, k, bias_v, rk, kidx, ev, thr, p_row, scale_log2, softcap, CAUSAL, SOFTCAP)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vb + kidx[:, None].to(tl.int64) * svn + d[None, :], mask=_within(ev[:, None], d, D, DP), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) / _LOG2E)
    o_off = b.to(tl.int64) * sob + i[:, None].to(tl.int64) * som + h[:, None] * soh + d[None, :]
    out_lo = out.to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + o_off, out_lo, mask=rm)
    # out's rounding error, so the backward's rowsum(dout * out) sees out in float.
    tl.store(res_ptr + o_off, (out - out_lo.to(tl.float32)).to(o_ptr.dtype.element_ty), mask=rm)
    tl.store(lse_ptr + (b.to(tl.int64) * H + h) * Q + i, lse, mask=row_ok)


@triton.jit
def _bwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bias_ptr,
    rank_ptr,
    thr_ptr,
    keys_ptr,
    do_ptr,
    lse_ptr,
    o_ptr,
    res_ptr,
    dq_ptr,
    dk_ptr,
    dv_ptr,
    db_ptr,
    sqb,
    sqm,
    sqh,
    skb,
    skn,
    skh,
    svb,
    svn,
    svh,
    sdb,
    sdm,
    sdh,
    sbb,
    sbh,
    sbk,
    sgb,
    sgh,
    H,
    G,
    PLANE_H,
    PLANE_RATIO,
    plane_b_on,
    BIAS_RATIO,
    bias_b_on,
    Q,
    K,
    off,
    n_tiles,
    cap,
    scale_log2,
    softcap,
    tile_base,
    D: tl.constexpr,
    DP: tl.constexpr,
    PACK: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    BN: tl.constexpr,
    CAUSAL: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DBIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
):
    # dk / dv / db are float32 (B, K, KVH, D) / (B, K, KVH, D) / (bias batch, bias heads, K)
    # accumulators, added to with atomics; with PARTIAL they are per-program slices instead,
    # (slot, list entry, D) / (slot, list entry), slot = (tile - tile_base) * programs a tile + pid:
    # plain stores, summed afterwards in a fixed order (the deterministic mode). dq is written in
    # q's dtype with q's strides.
    pid_t = tl.program_id(0) + tile_base
    b, h0, kvh, i, h, row_ok, thr, p_row, head, n, ranks, kb, vb, bb = _tile_setup(
        pid_t,
        tl.program_id(1),
        k_ptr,
        v_ptr,
        bias_ptr,
        rank_ptr,
        thr_ptr,
        keys_ptr,
        skb,
        skh,
        svb,
        svh,
        sbb,
        sbh,
        H,
        G,
        PLANE_H,
        PLANE_RATIO,
        plane_b_on,
        BIAS_RATIO,
        bias_b_on,
        Q,
        K,
        off,
        n_tiles,
        cap,
        PACK,
        TILE_ROWS,
    )
    BM: tl.constexpr = PACK * TILE_ROWS
    d = tl.arange(0, DP)  # padded head dims as in the forward
    rm = _within(row_ok[:, None], d, D, DP)
    row_off = b.to(tl.int64) * sqb + i[:, None].to(tl.int64) * sqm + h[:, None] * sqh + d[None, :]
    q = tl.load(q_ptr + row_off, mask=rm, other=0.0)
    do_off = b.to(tl.int64) * sdb + i[:, None].to(tl.int64) * sdm + h[:, None] * sdh + d[None, :]
    do = tl.load(do_ptr + do_off, mask=rm, other=0.0)
    # delta = rowsum(dO * O), the row term of dS = P * (dP - delta); out and dout share strides.
    o = tl.load(o_ptr + do_off, mask=rm, other=0.0).to(tl.float32)
    o += tl.load(res_ptr + do_off, mask=rm, other=0.0).to(tl.float32)
    delta = tl.sum(do.to(tl.float32) * o, 1)
    lse = tl.load(lse_ptr + (b.to(tl.int64) * H + h) * Q + i, mask=row_ok, other=float("-inf"))
    # Rows that keep nothing have lse -inf and every score -inf: p must come out 0, not NaN.
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * _LOG2E)
    KVH = H // G
    acc_row = (b.to(tl.int64) * K) * KVH * D + kvh * D
    dbb = db_ptr + (b * bias_b_on).to(tl.int64) * sgb + (h0 // BIAS_RATIO) * sgh
    if PARTIAL:
        slot = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)).to(tl.int64)
        part_row = slot * cap * D
        dbb = db_ptr + slot * cap
    scale = scale_log2 / _LOG2E

    dq = tl.zeros([BM, DP], tl.float32)
    for n0 in range(0, n, BN):
        e, ev, kidx, rk, k, bias_v = _chunk(head, ranks, kb, bb, n0, n, skn, sbk, D, DP, BN)
        em = _within(ev[:, None], d, D, DP)
        v = tl.load(vb + kidx[:, None].to(tl.int64) * svn + d[None, :], mask=em, other=0.0)
        s, th = _scores(q, k, bias_v, rk, kidx, ev, thr, p_row, scale_log2, softcap, CAUSAL, SOFTCAP)
        p = tl.exp2(s - lse2[:, None])
        if PARTIAL:
            acc_off = part_row + e[:, None].to(tl.int64) * D + d[None, :]
            tl.store(dv_ptr + acc_off, tl.dot(tl.trans(p.to(do.dtype)), do), mask=em)
        else:
            acc_off = acc_row + kidx[:, None].to(tl.int64) * KVH * D + d[None, :]
            tl.atomic_add(dv_ptr + acc_off, tl.dot(tl.trans(p.to(do.dtype)), do), mask=em, sem="relaxed")
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        if DBIAS:
            if PARTIAL:
                tl.store(dbb + e, tl.sum(ds, 0), mask=ev)
            else:
                tl.atomic_add(dbb + kidx.to(tl.int64), tl.sum(ds, 0), mask=ev, sem="relaxed")
        if SOFTCAP:
            ds = ds * (1.0 - th * th) * scale
        else:
            ds = ds * scale
        dsl = ds.to(q.dtype)
        dq += tl.dot(dsl, k)
        if PARTIAL:
            tl.store(dk_ptr + acc_off, tl.dot(tl.trans(dsl), q), mask=em)
        else:
            tl.atomic_add(dk_ptr + acc_off, tl.dot(tl.trans(dsl), q), mask=em, sem="relaxed")
    tl.store(dq_ptr + row_off, dq.to(dq_ptr.dtype.element_ty), mask=rm)


# ----------------------------------------------------------------------------------- launchers
def _geometry(q, k, bias, key_rank, tile_keys, tile_rows):
    B, Q, H, D = q.shape
    K, KVH = k.shape[1], k.shape[2]
    P1, P2 = key_rank.shape[0], key_rank.shape[1]
    # A program's rows are `pack` query heads x tile_rows: heads that share a kv head and a plane.
    rows = block_m(D)
    pack = rows // tile_rows if tile_rows > 0 else 0
    if pack < 1 or pack * tile_rows != rows or pack > pack_size(H, KVH, P2):
        raise ValueError(
            f"tile_rows must be {rows} divided by a power of two up to {pack_size(H, KVH, P2)} (the query heads "
            f"a program may serve here, head_dim {D}), got {tile_rows}"
        )
    n_tiles = -(-Q // tile_rows)
    if n_tiles == 0 or tile_keys.shape[2] % n_tiles:
        raise ValueError(
            f"tile_keys of shape {tuple(tile_keys.shape)} does not hold {n_tiles} lists of query tiles "
            f"of {tile_rows} rows (these kernels' tiles): select with tile_rows={tile_rows}"
        )
    return dict(
        args=(
            H,
            H // KVH,
            P2,
            H // P2,
            int(P1 > 1),
            H // bias.shape[1],
            int(bias.shape[0] > 1),
            Q,
            K,
            K - Q,
            n_tiles,
            tile_keys.shape[2] // n_tiles - 1,
        ),
        meta=dict(D=D, DP=triton.next_power_of_2(D), PACK=pack, TILE_ROWS=tile_rows),
        grid=(n_tiles, B * H // pack),
    )


def _strides(t):
    return t.stride(0), t.stride(1), t.stride(2)


def fwd(q, k, v, bias, key_rank, row_thr, softmax_scale, is_causal, softcap, deterministic, tile_keys, tile_rows):
    """(out, lse, out's rounding error) of the per-key top-W attention: flexdma_triton::perkey_fwd
    (flexdma::perkey_fwd's arguments, then the lists' tile rows)."""
    B, Q, H, D = q.shape
    out = torch.empty_like(q)
    resid = torch.empty_like(q)
    lse = torch.empty(B, H, Q, dtype=torch.float32, device=q.device)
    if q.numel() == 0:
        return out, lse, resid
    g = _geometry(q, k, bias, key_rank, tile_keys, tile_rows)
    _fwd_kernel[g["grid"]](
        q,
        k,
        v,
        bias,
        key_rank,
        row_thr,
        tile_keys,
        out,
        lse,
        resid,
        *_strides(q),
        *_strides(k),
        *_strides(v),
        *_strides(out),
        bias.stride(0),
        bias.stride(1),
        bias.stride(3),
        *g["args"],
        softmax_scale * LOG2E,
        softcap,
        **g["meta"],
        CAUSAL=bool(is_causal),
        SOFTCAP=softcap > 0,
        **configs(triton.next_power_of_2(D))[0],
    )
    return out, lse, resid


# The deterministic backward's per-program partial sums are bounded to this many bytes at a time.
PARTIAL_BYTES = 256 << 20


@contextlib.contextmanager
def _deterministic_algorithms():
    # index_put_(accumulate=True) sorts its indices and sums each row in a fixed order only in
    # this mode.
    prev, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=warn)


def bwd(
    dout,
    q,
    k,
    v,
    bias,
    key_rank,
    row_thr,
    out,
    lse,
    softmax_scale,
    is_causal,
    softcap,
    bias_requires_grad,
    deterministic,
    tile_keys,
    out_resid,
    tile_rows,
):
    """(dq, dk, dv, dbias) of the per-key top-W attention: flexdma_triton::perkey_bwd
    (flexdma::perkey_bwd's arguments, then the lists' tile rows)."""
    deterministic = bool(deterministic)
    B, Q, H, D = q.shape
    K, KVH = k.shape[1], k.shape[2]
    Bb, Hb = bias.shape[0], bias.shape[1]
    dev = q.device
    dq = torch.empty_like(q)
    # One spare row at the end of each accumulator takes the deterministic path's unused slots.
    # The three accumulators are one buffer: one fill instead of three.
    nk = (B * K * KVH + 1) * D
    acc = torch.zeros(2 * nk + Bb * Hb * K + 1, dtype=torch.float32, device=dev)
    dk, dv, db = acc[:nk].view(-1, D), acc[nk : 2 * nk].view(-1, D), acc[2 * nk :]
    if q.numel() > 0 and k.numel() > 0:
        if out_resid is None or out_resid.numel() == 0:
            out_resid = torch.zeros_like(out)
        # The kernel reads the three with one set of strides.
        if not dout.stride() == out.stride() == out_resid.stride():
            dout, out, out_resid = (t.contiguous() for t in (dout, out, out_resid))
        g = _geometry(q, k, bias, key_rank, tile_keys, tile_rows)
        n_tiles, n_bh = g["grid"]

        def launch(grid, tile_base, dk_, dv_, db_, partial):
            _bwd_kernel[grid](
                q,
                k,
                v,
                bias,
                key_rank,
                row_thr,
                tile_keys,
                dout,
                lse,
                out,
                out_resid,
                dq,
                dk_,
                dv_,
                db_,
                *_strides(q),
                *_strides(k),
                *_strides(v),
                *_strides(dout),
                bias.stride(0),
                bias.stride(1),
                bias.stride(3),
                Hb * K,
                K,
                *g["args"],
                softmax_scale * LOG2E,
                softcap,
                tile_base,
                **g["meta"],
                CAUSAL=bool(is_causal),
                SOFTCAP=softcap > 0,
                DBIAS=bool(bias_requires_grad),
                PARTIAL=partial,
                **configs(triton.next_power_of_2(D))[1],
            )

        if not deterministic:
            launch(g["grid"], 0, dk, dv, db, False)
        else:
            _bwd_deterministic(launch, q, k, bias, key_rank, tile_keys, g, dk, dv, db, bias_requires_grad)
    else:
        dq.zero_()
    dbias = db[:-1].view(bias.shape).to(bias.dtype) if bias_requires_grad else q.new_empty((0,))
    return dq, dk[:-1].view(k.shape).to(k.dtype), dv[:-1].view(v.shape).to(v.dtype), dbias


def _bwd_deterministic(launch, q, k, bias, key_rank, tile_keys, g, dk, dv, db, bias_requires_grad):
    """Chunks of query tiles: each program stores its dk / dv / dbias terms per list entry, then
    index_put_ adds them to the accumulators in a fixed order. Bitwise reproducible; the stores
    and the sort cost time the atomics do not."""
    B, Q, H, D = q.shape
    K, KVH = k.shape[1], k.shape[2]
    Bb, Hb = bias.shape[0], bias.shape[1]
    dev = q.device
    n_tiles, n_bh = g["grid"]
    pack = g["meta"]["PACK"]
    cap = g["args"][-1]
    P2 = key_rank.shape[1]
    bh = torch.arange(n_bh, device=dev)
    b_of, h0 = bh // (H // pack), (bh % (H // pack)) * pack
    kvh = h0 // (H // KVH)
    plane = b_of * int(key_rank.shape[0] > 1) * P2 + h0 // (H // P2)
    brow = b_of * int(Bb > 1) * Hb + h0 // (H // Hb)
    lists = tile_keys.reshape(-1, n_tiles, 1 + cap)[plane]  # (programs a tile, tiles, 1 + cap)
    entry = torch.arange(cap, device=dev)
    chunk = max(1, min(n_tiles, PARTIAL_BYTES // max(1, n_bh * cap * (2 * D + 1) * 4)))
    for t0 in range(0, n_tiles, chunk):
        nt = min(chunk, n_tiles - t0)
        part_k = torch.empty(nt * n_bh, cap, D, dtype=torch.float32, device=dev)
        part_v = torch.empty_like(part_k)
        part_b = torch.empty(nt * n_bh, cap, dtype=torch.float32, device=dev)
        launch((nt, n_bh), t0, part_k, part_v, part_b, True)
        lst = lists[:, t0 : t0 + nt].transpose(0, 1)  # (tiles, programs, 1 + cap): the slots' order
        keys = lst[..., 1:].long()
        unused = entry >= lst[..., :1]
        kv_rows = ((b_of[None, :, None] * K + keys) * KVH + kvh[None, :, None]).masked_fill(unused, dk.shape[0] - 1)
        with _deterministic_algorithms():
            dk.index_put_((kv_rows.flatten(),), part_k.view(-1, D), accumulate=True)
            dv.index_put_((kv_rows.flatten(),), part_v.view(-1, D), accumulate=True)
            if bias_requires_grad:
                b_rows = (brow[None, :, None] * K + keys).masked_fill(unused, db.shape[0] - 1)
                db.index_put_((b_rows.flatten(),), part_b.flatten(), accumulate=True)
