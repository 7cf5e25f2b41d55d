// Which scores a tile keeps: operand planes, tile bounds and causality, the tile activity bits
// (FwdParams::tile_meta), and the keep tile (mask & causal & bounds, one byte per element) built
// from the mask or applied to a warp's score fragments.
#pragma once
#include <cuda_runtime.h>
#include <math_constants.h>

#include <cstdint>

#include "../flash_dma_params.h"
#include "constants.cuh"
#include "seq_info.cuh"
#include "smem_layout.cuh"

namespace flexdma {
namespace cuda {

// A broadcast operand (mask, bias, tile_meta) resolved to one (batch, query head) once per CTA or
// work item: element (i, j) lives at base + i * rs + j * cs. Resolving it up front keeps the head
// division (h / head_ratio) out of the tile loops, where a 64-bit one compiled to a call per load.
// Idx is the width of that division: int (32 bits; batch and heads are < kMaxGridDim) where it
// runs per work item (the backward), int64_t where it runs once per CTA.
template <typename E, typename Idx = int64_t>
struct Plane {
  const E* base;
  int64_t rs, cs;
  __device__ inline Plane(const Broadcast4d& t, int64_t b, int64_t h)
      : base(t.ptr ? static_cast<const E*>(t.ptr) + b * t.batch_stride + (Idx)h / (Idx)t.head_ratio * t.head_stride
                   : nullptr),
        rs(t.row_stride),
        cs(t.col_stride) {}
  __device__ inline const E* at(int64_t i, int64_t j) const { return base + i * rs + j * cs; }
  // The same plane from its element (i, j) on: a packed sequence's rows / keys (SeqInfo).
  __device__ inline Plane from(int64_t i, int64_t j) const {
    Plane q = *this;
    if (q.base) q.base += i * rs + j * cs;
    return q;
  }
};

// Last key tile (exclusive) a query tile starting at m0 of sequence s can see.
__device__ inline int64_t key_tile_end(const FwdParams& p, const SeqInfo& s, int64_t m0) {
  int64_t kend = s.len_k(p);
  if (p.is_causal) kend = imin(kend, m0 + kBlockM + s.len_k(p) - s.len_q(p));
  return kend <= 0 ? 0 : ceil_div(kend, kBlockN);
}

// Bounds and causal limits of tile (m0, n0) of sequence s in tile-local coordinates. Most tiles are
// `full` (inside both lengths and entirely below the diagonal) and need no per-element check.
struct TileBounds {
  bool full;
  int lim_r, lim_c, diag;  // kept iff r < lim_r && c < lim_c && c <= r + diag
  // A tile that needs no check.
  __device__ inline TileBounds() : full(true), lim_r(kBlockM), lim_c(kBlockN), diag(2 * kBlockN) {}
  __device__ inline TileBounds(const FwdParams& p, const SeqInfo& s, int64_t m0, int64_t n0) {
    const int64_t shift = s.len_k(p) - s.len_q(p);
    lim_r = (int)imin(kBlockM, s.len_q(p) - m0);
    lim_c = (int)imin(kBlockN, s.len_k(p) - n0);
    diag = p.is_causal ? (int)imax(-2 * kBlockN, imin(2 * kBlockN, m0 + shift - n0)) : 2 * kBlockN;
    full = lim_r == kBlockM && lim_c == kBlockN && kBlockN - 1 <= diag;
  }
  // Whether anything survives bounds and causality (row lim_r - 1 sees the most keys).
  __device__ inline bool any() const { return lim_r > 0 && lim_c > 0 && lim_r - 1 + diag >= 0; }
  // Non-short-circuit &: on a full tile every term is true, and the check compiles to compares
  // and a predicate op instead of a branch per element.
  __device__ inline bool ok(int r, int c) const { return (r < lim_r) & (c < lim_c) & (c <= r + diag); }
};

// Whether the mask tile at n0 is copied raw into a smem slot by cp.async with its K / V tile
// (aligned rows, tile inside both lengths) rather than built when the tile has landed.
// A mask broadcast over queries (row stride 0) reads the same row for every tile row, so a
// query tile cut by seqlen_q (decoding: one query) may copy all 64 rows too.
__device__ inline bool mask_async(const FwdParams& p, const SeqInfo& s, bool mask_vec, int64_t m0, int64_t n0) {
  return p.mask.ptr && mask_vec && (m0 + kBlockM <= s.len_q(p) || p.mask.row_stride == 0) && n0 + kBlockN <= s.len_k(p);
}

// A row of tile activity bits (FwdParams::tile_meta) walked forward: the current word stays in
// a register, so the scan reads memory once per 32 tiles, not once per tile (a dependent load
// in front of every tile's copies). The same in every thread. With a second row (`row2`, the
// next query tile's), a key tile is active when either row's bit is set.
struct ActiveTiles {
  const uint32_t* row;
  const uint32_t* row2;
  int64_t w_idx = -1;
  uint32_t word = 0;
  __device__ explicit ActiveTiles(const uint32_t* r, const uint32_t* r2 = nullptr) : row(r), row2(r2) {}
  // First tile in [t, end) whose bit is set; end if none.
  __device__ inline int64_t next(int64_t t, int64_t end) {
    while (t < end) {
      if ((t >> 5) != w_idx) {
        w_idx = t >> 5;
        word = row[w_idx] | (row2 ? row2[w_idx] : 0u);
      }
      const uint32_t wd = word >> (t & 31);
      if (wd) return imin(end, t + __ffs(wd) - 1);
      t = (t | 31) + 1;
    }
    return end;
  }
};

// Byte e (0..15) of a 16-byte chunk.
__device__ inline uint32_t byte_of(const uint4& v, int e) {
  const uint32_t w = e < 4 ? v.x : e < 8 ? v.y : e < 12 ? v.z : v.w;
  return (w >> (8 * (e % 4))) & 0xffu;
}

// Builds the exact keep tile (mask & causal & bounds; m.base null: bounds only) of (m0, n0)
// and returns whether any element is kept. kBarrier: block-uniform, ends in a barrier and returns
// the CTA's answer; without, the thread's own (the loading warpgroup of the forward publishes the
// tile through its pipeline instead).
template <bool kBarrier = true, typename Idx>
__device__ inline bool build_keep(const TileBounds& tb, const Plane<uint8_t, Idx>& m, uint8_t* keep, bool mask_vec,
                                  int64_t m0, int64_t n0) {
  constexpr int kPer = kBlockM * kBlockN / 16 / kThreads;
  uint4 v[kPer];
  bool direct[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int c = threadIdx.x + u * kThreads, r = c / (kBlockN / 16), col0 = (c % (kBlockN / 16)) * 16;
    direct[u] = m.base && mask_vec && r < tb.lim_r && col0 + 16 <= tb.lim_c;
    v[u] = direct[u] ? *reinterpret_cast<const uint4*>(m.at(m0 + r, n0 + col0)) : make_uint4(0, 0, 0, 0);
  }
  int any = 0;
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int c = threadIdx.x + u * kThreads, r = c / (kBlockN / 16), col0 = (c % (kBlockN / 16)) * 16;
    uint8_t* dst = keep + r * kLdKeep + col0;
    if (direct[u]) {
      uint32_t wds[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        const bool kk = (byte_of(v[u], e) != 0) & tb.ok(r, col0 + e);
        wds[e / 4] |= uint32_t(kk) << (8 * (e % 4));
        any |= kk;
      }
      *reinterpret_cast<uint4*>(dst) = make_uint4(wds[0], wds[1], wds[2], wds[3]);
    } else {
      // Cut tiles and unaligned masks: byte by byte, not unrolled (rare; unrolled, ptxas hoists 16
      // predicated 64-bit-addressed loads, and the kernels lose the registers to them).
#pragma unroll 1
      for (int e = 0; e < 16; ++e) {
        bool kk = tb.ok(r, col0 + e);
        if (kk && m.base) kk = *m.at(m0 + r, n0 + col0 + e) != 0;
        dst[e] = kk;
        any |= kk;
      }
    }
  }
  if constexpr (kBarrier)
    return __syncthreads_or(any) != 0;
  else
    return any != 0;
}

// Drops (-inf) the scores of a warp's C fragments whose keep byte is 0 (rows r0, r0 + 8);
// kBounds also applies the tile's bounds and causal limit.
template <bool kBounds>
__device__ inline void apply_keep(float (&s)[kBlockN / 8][4], const uint8_t* keep, int r0, int qc,
                                  const TileBounds& tb) {
#pragma unroll
  for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = r0 + 8 * hh, col = n * 8 + 2 * qc;
      const uint32_t kv2 = *reinterpret_cast<const uint16_t*>(keep + r * kLdKeep + col);
      bool k0 = (kv2 & 0xffu) != 0, k1 = (kv2 >> 8) != 0;
      if (kBounds) {
        k0 &= tb.ok(r, col);
        k1 &= tb.ok(r, col + 1);
      }
      s[n][2 * hh] = k0 ? s[n][2 * hh] : -CUDART_INF_F;
      s[n][2 * hh + 1] = k1 ? s[n][2 * hh + 1] : -CUDART_INF_F;
    }
}

// A per-key list tile's slot (int32 words), written by the loader (KeyList::issue_slot), read by
// the rank rule: the 64 entries' key indices, their ranks, their biases (float, log2 units), then
// the largest key of each 32-entry half (where the loader writes them).
struct KeySlot {
  static constexpr int kRank = 64, kBias = 128, kTop = 192, kWords = 196;
};

// The per-key rank rule on a warp's C fragments (rows of thr / lim: g and g + 8 of the thread):
// column c of the tile keeps its score iff rank[c] <= thr (the row's largest kept rank) and
// key[c] <= lim (the row's causal limit; INT32_MAX without causality); a kept score becomes
// s * mul + the key's bias (the slot holds it in log2 units, so with mul = scale * log2 e one FFMA
// per element scales and biases). slot: the tile's keys, ranks and biases (KeyList's layout).
// kCut / kRank: whether the causal / the rank compare is needed at all (apply_rank_keep decides
// it for a whole tile).
template <bool kCut, bool kRank = true>
__device__ inline void rank_keep_tile(float (&s)[kBlockN / 8][4], const int32_t* slot, const int (&thr)[2],
                                      const int (&lim)[2], float mul, int qc) {
  const float* bias = reinterpret_cast<const float*>(slot + KeySlot::kBias);
#pragma unroll
  for (int n = 0; n < kBlockN / 8; ++n) {
    const int col = n * 8 + 2 * qc;
    int2 rank = make_int2(0, 0), key = make_int2(0, 0);
    if (kRank) rank = *reinterpret_cast<const int2*>(slot + KeySlot::kRank + col);
    if (kCut) key = *reinterpret_cast<const int2*>(slot + col);
    const float2 bv = *reinterpret_cast<const float2*>(bias + col);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      if (!kRank && !kCut) {
        s[n][2 * hh] = fmaf(s[n][2 * hh], mul, bv.x);
        s[n][2 * hh + 1] = fmaf(s[n][2 * hh + 1], mul, bv.y);
        continue;
      }
      bool k0 = true, k1 = true;
      if (kRank) {
        k0 = rank.x <= thr[hh];
        k1 = rank.y <= thr[hh];
      }
      if (kCut) {
        k0 &= key.x <= lim[hh];
        k1 &= key.y <= lim[hh];
      }
      s[n][2 * hh] = k0 ? fmaf(s[n][2 * hh], mul, bv.x) : -CUDART_INF_F;
      s[n][2 * hh + 1] = k1 ? fmaf(s[n][2 * hh + 1], mul, bv.y) : -CUDART_INF_F;
    }
  }
}

// The warp's strictest row for apply_rank_keep: the smallest thr of its 16 rows (-1 where any row
// keeps nothing).
__device__ inline int rank_thr_warp(const int (&thr)[2]) {
  int t = min(thr[0], thr[1]);
#pragma unroll
  for (int x = 4; x < 32; x *= 2) t = min(t, __shfl_xor_sync(0xffffffffu, t, x));
  return t;
}

// The rank rule with each compare only on the tiles that need it, by warp-uniform branches instead
// of compares per element. Needs the slot's largest keys (KeyList::issue_slot<true>).
// - Causal: where the tile's largest listed key (KeySlot::kTop) is at or below lim_warp, the
//   smallest causal limit of the warp's 16 rows (most tiles: only keys near the diagonal reach a
//   row's limit).
// - Rank: the list is in rank order, so the tile's last entry holds its largest rank (the
//   never-kept rank past the list); where thr_warp, the warp's strictest row (rank_thr_warp),
//   keeps it, every row keeps every entry by rank. Only the tiles holding the rows' thresholds
//   (fewer than 2 x 128 entries at a list's end) take the compare.
__device__ inline void apply_rank_keep(float (&s)[kBlockN / 8][4], const int32_t* slot, const int (&thr)[2],
                                       const int (&lim)[2], int lim_warp, int thr_warp, float mul, int qc) {
  const int2 top = *reinterpret_cast<const int2*>(slot + KeySlot::kTop);
  const bool cut = max(top.x, top.y) > lim_warp;
  const bool rank = slot[KeySlot::kRank + kBlockN - 1] > thr_warp;
  if (!cut && !rank)
    rank_keep_tile<false, false>(s, slot, thr, lim, mul, qc);
  else if (!cut)
    rank_keep_tile<false, true>(s, slot, thr, lim, mul, qc);
  else if (!rank)
    rank_keep_tile<true, false>(s, slot, thr, lim, mul, qc);
  else
    rank_keep_tile<true, true>(s, slot, thr, lim, mul, qc);
}

}  // namespace cuda
}  // namespace flexdma
