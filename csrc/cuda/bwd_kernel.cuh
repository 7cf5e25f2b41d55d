// Backward kernels, FA2-style register design; deterministic, no atomics:
//  - bwd_dq_kernel (launched first): one CTA of 4 warps per (query tile, head, batch), warp w
//    owns query rows [16w, 16w + 16). One pass over the kept key tiles accumulates
//    dQ = P (dP - rowsum(dout * out)) K in registers (FlashAttention's delta, from the bf16 out)
//    and, next to it, the exact delta = rowsum(P * dP) in float, which goes to softmax_d for the
//    dkv kernel: the bf16-out delta is too coarse for a dbias summed over rows or heads (one
//    systematic error per row adds up), and dQ is what FlashAttention computes. The next kept
//    tile's K / bias copies fly during the current tile's products. A dbias stored in the bias
//    dtype is zeroed here where the dkv kernel writes nothing (no fill pass before the kernels).
//  - bwd_dkv_kernel: one CTA per (key tile, kv head, batch), warp w owns keys [16w, 16w + 16);
//    it walks the query tiles and, inside each, the query heads of its kv head in a fixed order,
//    with S^T = K Q^T and dP^T = V dO^T, dV += P^T dO, dK += dS^T Q in registers. dS of the
//    heads that share a dbias plane is summed in a float smem tile and written once per query
//    tile (fixed order, so bitwise reproducible): the float read-modify-write per head was the
//    dominant dbias traffic, and a tile written once can go straight to the bias dtype (16-byte
//    stores). Heads that read one bias / mask plane share one copy and gather of it per query tile.
// S, dP, P and dS live in C fragments (wgmma's or mma.sync's, the same per-warp layout); P / dS
// are repacked as A fragments (no smem round trip). Q, dO, K, V tiles sit in smem, 128-byte
// swizzled and read by wgmma (sm_90a, head dims 64 / 128) or padded to D + 8 and read by
// ldmatrix (head dims 32 / 96). An all-false keep tile (mask & causal & bounds) is skipped
// before any of its operand bytes are requested (tile activity bits); the next kept tile is
// found, and its keep tile requested (raw mask bytes) or built (cut tiles) into a second keep
// slot, while the current tile's cp.async copies are in flight. Mask / bias are resolved to base
// pointers per CTA / work item with a 32-bit head division (BwdPlane): no 64-bit division call
// in the loops. The per-element score math is branch-free: the CTA-uniform choices (softcap,
// bias, keep tile) become selects or loops behind uniform branches.
#pragma once
#include "mma_sm80.cuh"
#include "mma_sm90.cuh"
#include "tile_io.cuh"

namespace flexdma {
namespace cuda {

constexpr int kBwdLdBias = kBlockN + 8;   // 144-byte rows
// Float [key][query] tile of dkv: first the additive term of each score, then dS. 72-word rows:
// a warp's float2 fragment accesses (rows g, columns 2 * (lane % 4)) cover the banks once.
constexpr int kBwdLdDS = kBlockN + 8;

struct BwdFlags {
  bool qkv_vec, mask_vec, bias_vec;
};

// Where a dkv work item adds dS. With the bias broadcast over keys and several key tiles, each
// key tile gets its own slice (tile_stride elements apart) that launch_bwd sums in order.
// in_dtype: ptr holds T and the full (per-row / per-element) tiles are stored as final values;
// the buffer comes unfilled, and the dq kernel zeroes the tiles no head of a plane keeps (the dkv
// kernel never writes them). vec (in_dtype only): contiguous keys and 16-byte aligned rows, so a
// full tile is stored (and an unkept one zeroed) 8 elements a store.
struct BwdDbias {
  void* ptr = nullptr;
  Broadcast4d layout;
  int64_t tile_stride = 0;
  bool in_dtype = false;
  bool vec = false;
};

// A broadcast operand resolved to one (batch, query head): element (i, j) at base + i * rs +
// j * cs. Same as tile_io's Plane, but the head index is divided in 32 bits: the 64-bit
// division compiles to a call of a ~70-instruction routine, and the dkv kernel resolves
// mask / bias once per work item.
template <typename E>
struct BwdPlane {
  const E* base;
  int64_t rs, cs;
  __device__ inline BwdPlane(const Broadcast4d& t, int64_t b, int64_t h)
      : base(t.ptr ? static_cast<const E*>(t.ptr) + b * t.batch_stride + (int)h / (int)t.head_ratio * t.head_stride
                   : nullptr),
        rs(t.row_stride), cs(t.col_stride) {}
  __device__ inline const E* at(int64_t i, int64_t j) const { return base + i * rs + j * cs; }
};

__device__ inline uint32_t bwd_byte_of(const uint4& v, int e) {
  const uint32_t w = e < 4 ? v.x : e < 8 ? v.y : e < 12 ? v.z : v.w;
  return (w >> (8 * (e % 4))) & 0xffu;
}

// Builds the exact keep tile (mask & causal & bounds; m.base null: bounds only) of (m0, n0)
// and returns whether any element is kept; block-uniform (ends in a barrier).
__device__ inline bool bwd_build_keep(const TileBounds& tb, const BwdPlane<uint8_t>& m, uint8_t* keep, bool mask_vec,
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
        const bool kk = (bwd_byte_of(v[u], e) != 0) & tb.ok(r, col0 + e);
        wds[e / 4] |= uint32_t(kk) << (8 * (e % 4));
        any |= kk;
      }
      *reinterpret_cast<uint4*>(dst) = make_uint4(wds[0], wds[1], wds[2], wds[3]);
    } else {
      // Cut tiles and unaligned masks: byte by byte, not unrolled (rare; an unrolled version
      // hoisted 16 predicated 64-bit-addressed loads and cost the kernels their registers).
#pragma unroll 1
      for (int e = 0; e < 16; ++e) {
        bool kk = tb.ok(r, col0 + e);
        if (kk && m.base) kk = *m.at(m0 + r, n0 + col0 + e) != 0;
        dst[e] = kk;
        any |= kk;
      }
    }
  }
  return __syncthreads_or(any) != 0;
}

// The K / V tile of keys [n0, n0 + 64) from a key source (tile_io.cuh); base is row 0 of K or V.
template <typename T, int D, typename Keys>
__device__ inline void bwd_issue_keys(T* dst, const T* base, int64_t rs, const Keys& keys, int64_t n0, int64_t seqlen_k,
                                      bool vec) {
  if constexpr (Keys::kContiguous)
    issue_rows<T, D>(dst, base + n0 * rs, rs, (int)imin(64, seqlen_k - n0), vec);
  else
    issue_key_rows<T, D>(dst, base, rs, keys, n0, seqlen_k, vec);
}

// Requests the bias tile (m0, n0) into smem (row stride kBwdLdBias); entries outside the
// lengths are 0 (never kept).
template <typename T>
__device__ inline void bwd_issue_bias(const TileBounds& tb, const BwdPlane<T>& bb, T* sb, bool vec, int64_t m0, int64_t n0) {
  if (vec && (tb.lim_r == kBlockM || bb.rs == 0) && tb.lim_c == kBlockN) {
    constexpr int kRowsPerPass = kThreads / (kBlockN / 8);
    const int r0 = threadIdx.x / (kBlockN / 8), col0 = (threadIdx.x % (kBlockN / 8)) * 8;
    const T* src = bb.base + (m0 + r0) * bb.rs + n0 + col0;
#pragma unroll
    for (int u = 0; u < kBlockM / kRowsPerPass; ++u)
      cp_async16(sb + (r0 + u * kRowsPerPass) * kBwdLdBias + col0, src + u * kRowsPerPass * bb.rs);
  } else {
    for (int c = threadIdx.x; c < kBlockM * kBlockN; c += kThreads) {
      const int r = c / kBlockN, col = c % kBlockN;
      sb[r * kBwdLdBias + col] = (r < tb.lim_r && col < tb.lim_c) ? *bb.at(m0 + r, n0 + col) : from_float<T>(0.f);
    }
  }
}

// On wgmma (use_wgmma<D>) every product below is one warpgroup MMA per 16-wide k step, issued,
// committed and waited for in place: the tiles are read by the tensor cores from smem (A too,
// for the products of two smem tiles), which is what the mma.sync versions spent their
// ldmatrix traffic and most of their instructions on. The C / A register layouts are the same.

// C[16 x 64] += A[16 rows of sA] * B[64 rows of sB]^T over D (the "QK^T" pattern): A fragments
// by ldmatrix from rows a_row0.., B by non-transposed ldmatrix. Two products share the k loop
// (S and dP have the same shape) so their fragment loads interleave; on wgmma they are one
// group (the whole 64-row tiles, a_row0 unused).
template <typename T, int D, int kUnroll>
__device__ inline void bwd_gemm_nt2(float (&c0)[kBlockN / 8][4], const T* a0, const T* b0, float (&c1)[kBlockN / 8][4],
                                    const T* a1, const T* b1, int a_row0) {
  constexpr int kLd = tile_ld(D);
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) c0[n][e] = c1[n][e] = 0.f;
  if constexpr (use_wgmma<D>()) {
    fence_regs(c0);
    fence_regs(c1);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) wgmma_ss64<T>(c0, desc_k_major<64>(a0, kk), desc_k_major<kBlockN>(b0, kk), kk > 0);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) wgmma_ss64<T>(c1, desc_k_major<64>(a1, kk), desc_k_major<kBlockN>(b1, kk), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(c0);
    fence_regs(c1);
    return;
  }
  const int aoff = (a_row0 + (lane & 15)) * kLd + (lane >> 4) * 8;
  const int boff = ((lane & 7) + ((lane >> 4) << 3)) * kLd + ((lane >> 3) & 1) * 8;
#pragma unroll kUnroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t fa0[4], fa1[4];
    ldmatrix_x4(fa0, a0 + aoff + kk * 16);
    ldmatrix_x4(fa1, a1 + aoff + kk * 16);
#pragma unroll
    for (int np = 0; np < kBlockN / 16; ++np) {
      uint32_t kb[4], vb[4];
      ldmatrix_x4(kb, b0 + boff + np * 16 * kLd + kk * 16);
      ldmatrix_x4(vb, b1 + boff + np * 16 * kLd + kk * 16);
      mma_16816<T>(c0[2 * np], fa0, kb[0], kb[1]);
      mma_16816<T>(c0[2 * np + 1], fa0, kb[2], kb[3]);
      mma_16816<T>(c1[2 * np], fa1, vb[0], vb[1]);
      mma_16816<T>(c1[2 * np + 1], fa1, vb[2], vb[3]);
    }
  }
}

// One product of the same pattern, for the dkv kernel: there S^T and dP^T are computed one
// after the other (dV's GEMM in between), so that they are never both live next to dK and dV.
// kWait = false (wgmma) leaves the product in flight; the caller waits (wgmma_wait<0>, then
// fence_regs(c0)) before reading c0.
template <typename T, int D, bool kWait = true>
__device__ inline void bwd_gemm_nt(float (&c0)[kBlockN / 8][4], const T* a0, const T* b0, int a_row0) {
  constexpr int kLd = tile_ld(D);
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) c0[n][e] = 0.f;
  if constexpr (use_wgmma<D>()) {
    fence_regs(c0);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) wgmma_ss64<T>(c0, desc_k_major<64>(a0, kk), desc_k_major<kBlockN>(b0, kk), kk > 0);
    wgmma_commit();
    if constexpr (kWait) {
      wgmma_wait<0>();
      fence_regs(c0);
    }
    return;
  }
  const int aoff = (a_row0 + (lane & 15)) * kLd + (lane >> 4) * 8;
  const int boff = ((lane & 7) + ((lane >> 4) << 3)) * kLd + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t fa0[4];
    ldmatrix_x4(fa0, a0 + aoff + kk * 16);
#pragma unroll
    for (int np = 0; np < kBlockN / 16; ++np) {
      uint32_t kb[4];
      ldmatrix_x4(kb, b0 + boff + np * 16 * kLd + kk * 16);
      mma_16816<T>(c0[2 * np], fa0, kb[0], kb[1]);
      mma_16816<T>(c0[2 * np + 1], fa0, kb[2], kb[3]);
    }
  }
}

// O[16 x D] += A * B with A the 16 x 64 C fragments `x` repacked to T and B a [64 x D] smem
// tile read transposed (the "PV" pattern).
template <typename T, int D>
__device__ inline void bwd_gemm_pv(float (&o)[D / 8][4], const float (&x)[kBlockN / 8][4], const T* sb) {
  constexpr int kLd = tile_ld(D);
  const int lane = threadIdx.x % 32;
  if constexpr (use_wgmma<D>()) {
    uint32_t a[kBlockN / 16][4];
    c_to_a<T>(x, a);
    fence_regs(o);
    fence_regs(a);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) wgmma_rs_mn<T, D, 64>(o, a[kk], sb, kk);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(o);
    return;
  }
  const int boff = ((lane & 7) + ((lane >> 3) & 1) * 8) * kLd + (lane >> 4) * 8;
#pragma unroll
  for (int kk = 0; kk < kBlockN / 16; ++kk) {
    const uint32_t a[4] = {pack2<T>(x[2 * kk][0], x[2 * kk][1]), pack2<T>(x[2 * kk][2], x[2 * kk][3]),
                           pack2<T>(x[2 * kk + 1][0], x[2 * kk + 1][1]), pack2<T>(x[2 * kk + 1][2], x[2 * kk + 1][3])};
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t vb[4];
      ldmatrix_x4_trans(vb, sb + boff + kk * 16 * kLd + dp * 16);
      mma_16816<T>(o[2 * dp], a, vb[0], vb[1]);
      mma_16816<T>(o[2 * dp + 1], a, vb[2], vb[3]);
    }
  }
}

// Stores a warp's 16 x D float accumulator (rows r0 + g, r0 + g + 8 of dst) times `mul`.
template <typename T, int D>
__device__ inline void bwd_store_acc(T* dst, int64_t rs, const float (&acc)[D / 8][4], float mul, int r0, int valid) {
  const int lane = threadIdx.x % 32, g = lane / 4, qc = lane % 4;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = r0 + g + 8 * hh;
    if (r < valid) {
      T* row = dst + r * rs;
#pragma unroll
      for (int d = 0; d < D / 8; ++d) {
        row[d * 8 + 2 * qc] = from_float<T>(acc[d][2 * hh] * mul);
        row[d * 8 + 2 * qc + 1] = from_float<T>(acc[d][2 * hh + 1] * mul);
      }
    }
  }
}

// K and the bias tile are double buffered (kK2, a second bias slot: the next tile's copies fly
// during this one's products), V is not; 109 KiB at D = 128, still two CTAs per SM.
template <typename T, int D>
struct BwdDqSmem {
  static constexpr int kTile = align128(tile_bytes<D>());
  static constexpr int kQ = 0, kDO = kTile, kK = 2 * kTile, kV = 3 * kTile, kK2 = 4 * kTile;
  static constexpr int kBias = 5 * kTile;
  static constexpr int kBiasSlot = align128(kBlockM * kBwdLdBias * 2);
  static constexpr int kKeepSlot = align128(kBlockM * kLdKeep);
  static constexpr int kKeep = kBias + 2 * kBiasSlot;  // two slots
  static constexpr int kBytes = kKeep + 2 * kKeepSlot + (use_wgmma<D>() ? 1024 : 0);  // + room to align the base to 1024
  static_assert(kBytes <= kMaxSmemPerBlock, "dq smem layout too large");
};

// The dkv kernel must stay <= ~113 KiB at D = 128 for 2 CTAs per SM, and the head-summed dbias
// tile (kDB) needs 16 KiB more: the bias tile, read only by the gather that fills sDS, lives in
// sDS's upper half (rows 32..63, exactly its size), and kDB is unpadded (swizzled, bwd_db_idx).
template <typename T, int D>
struct BwdDkvSmem {
  static constexpr int kTile = align128(tile_bytes<D>());
  static constexpr int kK = 0, kV = kTile, kQ = 2 * kTile, kDO = 3 * kTile;
  static constexpr int kKeepSlot = align128(kBlockM * kLdKeep);
  static constexpr int kKeep = 4 * kTile;  // two slots
  static constexpr int kL2 = kKeep + 2 * kKeepSlot;
  static constexpr int kDelta = kL2 + align128(kBlockM * 4);
  static constexpr int kDS = kDelta + align128(kBlockM * 4);
  static constexpr int kBias = kDS + kBlockN / 2 * kBwdLdDS * 4;
  static constexpr int kDB = kDS + align128(kBlockN * kBwdLdDS * 4);
  // Tile activity bits of the work items, one word per thread (2 x (115712 + 1024) bytes still
  // fit an SM at D = 128).
  static constexpr int kMetaItems = kThreads * 32;
  static constexpr int kMeta = kDB + kBlockN * kBlockM * 4;
  static constexpr int kBytes = kMeta + kThreads * 4 + (use_wgmma<D>() ? 1024 : 0);
  static_assert(kBytes <= kMaxSmemPerBlock, "dk/dv smem layout too large");
  static_assert(kBlockM * kBwdLdBias * 2 <= kBlockN / 2 * kBwdLdDS * 4, "bias tile must fit in sDS's upper half");
};

// Element (key k, query q) of the unpadded float [key][query] dbias tile. The even XOR keeps
// float2 pairs adjacent; the 4 keys of a half-warp's fragment access land in 4 different 8-word
// groups (conflict-free), and a warp reading one query of 32 consecutive keys is 2-way.
__device__ inline int bwd_db_idx(int k, int q) {
  return k * kBlockM + (q ^ (((k & 3) << 3) | (((k >> 2) & 3) << 1)));
}

constexpr float kBwdLog2e = 1.4426950408889634f;

// lse in log2 units; an empty row (lse -inf) or a row past the length gets +inf, so that
// exp2(x - l2) is 0 for every x including -inf, without a branch.
__device__ inline float bwd_l2(float lse) { return lse == -CUDART_INF_F ? CUDART_INF_F : lse * kBwdLog2e; }

// A dbias stored in the bias dtype comes uninitialised, and the dkv kernel writes only the tiles
// some query head of a plane keeps. The dq kernel's CTA of a plane's first head zeroes the others
// of one query tile (bounds and causality as the dkv kernel's find_next, the heads' activity bits
// ORed) after its own work: plain stores that drain while the SM's other CTA computes, instead
// of a fill of the whole buffer that runs alone before the backward (2 GiB, 0.65 ms at 32K
// per-row). The CTA zeroes the mirrored query tile, not its own: CTAs run heaviest (last under
// causal) tiles first and the first query tiles have the most unkept tiles, so the stores go to
// the long-running CTAs instead of the light tail. Measured at 32K per-row (benchmarks/NOTES.md,
// session 8): dq kernel 2.61 ms without zeroing (plus the 0.66 ms fill), 2.98 zeroing its own
// tile, 2.92 the mirrored one: the stores cost ~0.3 ms wherever they sit.
template <typename T>
__device__ inline void bwd_zero_skipped_dbias(const BwdParams& p, const BwdDbias& db, int64_t b, int64_t h,
                                              int64_t m_tile) {
  const Broadcast4d& DL = db.layout;
  const int nh = (int)DL.head_ratio;  // query heads of a dbias plane
  if ((int)h % nh != 0) return;
  const int64_t m0 = m_tile * kBlockM, nk = ceil_div(p.seqlen_k, kBlockN);
  const int vr = (int)imin(kBlockM, p.seqlen_q - m0);
  T* base = static_cast<T*>(db.ptr) + b * DL.batch_stride + (int)h / nh * DL.head_stride + m0 * DL.row_stride;
  const uint32_t* meta = p.mask.ptr ? static_cast<const uint32_t*>(p.tile_meta.ptr) + b * p.tile_meta.batch_stride +
                                          m_tile * p.tile_meta.row_stride
                                    : nullptr;
#pragma unroll 1
  for (int64_t t0 = 0; t0 < nk; t0 += 32) {
    uint32_t live = 0;
#pragma unroll 1
    for (int i = 0; i < 32 && t0 + i < nk; ++i) live |= uint32_t(TileBounds(p, m0, (t0 + i) * kBlockN).any()) << i;
    if (meta) {
      uint32_t kept = 0;
#pragma unroll 1
      for (int j = 0; j < nh; ++j)
        kept |= meta[(int)(h + j) / (int)p.tile_meta.head_ratio * p.tile_meta.head_stride + t0 / 32];
      live &= kept;
    }
    const uint32_t valid = nk - t0 >= 32 ? 0xffffffffu : (1u << (nk - t0)) - 1u;
    uint32_t dead = valid & ~live;
#pragma unroll 1
    while (dead) {
      const int i = __ffs(dead) - 1;
      dead &= dead - 1;
      const int64_t n0 = (t0 + i) * kBlockN;
      const int lc = (int)imin(kBlockN, p.seqlen_k - n0);
      T* tile = base + n0 * DL.col_stride;
      // Thread c: row c / 8, 8-key chunk c % 8 (a warp writes four 128-byte row segments).
#pragma unroll
      for (int u = 0; u < kBlockM * kBlockN / 8 / kThreads; ++u) {
        const int c = threadIdx.x + u * kThreads, r = c / (kBlockN / 8), col0 = (c % (kBlockN / 8)) * 8;
        if (r >= vr || col0 >= lc) continue;
        T* dst = tile + r * DL.row_stride + col0 * DL.col_stride;
        if (db.vec && col0 + 8 <= lc) {
          *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
        } else {
          for (int e = 0; e < 8 && col0 + e < lc; ++e) dst[e * DL.col_stride] = from_float<T>(0.f);
        }
      }
    }
  }
}

// Up to D = 128 two CTAs share an SM; wider heads (dq 148, dk/dv 174 KiB of smem at D = 256) run one.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, D <= 128 ? 2 : 1)
    bwd_dq_kernel(const BwdParams p, const BwdFlags f, const BwdDbias dbias) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  constexpr bool kWg = use_wgmma<D>();
  // wgmma's swizzled tiles need 1024-byte aligned blocks.
  unsigned char* smem = kWg ? smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024) : smem_raw;
  using L = BwdDqSmem<T, D>;
  T* sQ = reinterpret_cast<T*>(smem + L::kQ);
  T* sDO = reinterpret_cast<T*>(smem + L::kDO);
  T* sK = reinterpret_cast<T*>(smem + L::kK);
  T* sV = reinterpret_cast<T*>(smem + L::kV);
  T* sB = reinterpret_cast<T*>(smem + L::kBias);
  uint8_t* sKeep = smem + L::kKeep;

  // Heaviest (last, under causal) query tiles first, heads interleaved.
  const int nh = (int)p.num_heads;
  const int64_t h = (int)blockIdx.x % nh, b = blockIdx.y;
  const int64_t m_tile = (int)(gridDim.x / nh) - 1 - (int)blockIdx.x / nh;
  const int64_t kvh = (int)h / (int)(p.num_heads / p.num_heads_k);
  const int64_t m0 = m_tile * kBlockM;
  const int vr = (int)imin(kBlockM, p.seqlen_q - m0);
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, qc = lane % 4;

  issue_rows<T, D>(sQ, static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride + m0 * p.q_row_stride,
                       p.q_row_stride, vr, f.qkv_vec);
  issue_rows<T, D>(sDO, static_cast<const T*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride +
                                m0 * p.do_row_stride, p.do_row_stride, vr, f.qkv_vec);
  cp_async_commit();

  const T* kp = static_cast<const T*>(p.k) + b * p.k_batch_stride + kvh * p.k_head_stride;
  const T* vp = static_cast<const T*>(p.v) + b * p.v_batch_stride + kvh * p.v_head_stride;
  const bool has_bias = p.bias.ptr != nullptr, has_mask = p.mask.ptr != nullptr;
  const BwdPlane<T> bias(p.bias, b, h);
  const BwdPlane<uint8_t> mask(p.mask, b, h);
  const float scf = p.softcap > 0.f ? 1.f : 0.f;
  const float mulf = p.softcap > 0.f ? p.softcap * kBwdLog2e : p.softmax_scale * kBwdLog2e;
  const float soc = p.softcap > 0.f ? p.softmax_scale / p.softcap : 0.f;

  float l2[2], delta[2] = {0.f, 0.f};
  {
    const float* lse = static_cast<const float*>(p.lse) + (b * p.num_heads + h) * p.seqlen_q;
    const T* orow = static_cast<const T*>(p.out) + b * p.o_batch_stride + h * p.o_head_stride;
    const T* dorow = static_cast<const T*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = w * 16 + g + 8 * hh;
      l2[hh] = r < vr ? bwd_l2(lse[m0 + r]) : CUDART_INF_F;
      // rowsum(dout * out): the quad's four threads take a quarter of the row each.
      float acc = 0.f;
      if (r < vr) {
        const T* o = orow + (m0 + r) * p.o_row_stride;
        const T* d = dorow + (m0 + r) * p.do_row_stride;
#pragma unroll 8
        for (int c = qc; c < D; c += 4) acc = fmaf(to_float(o[c]), to_float(d[c]), acc);
      }
      acc += __shfl_xor_sync(0xffffffffu, acc, 1);
      acc += __shfl_xor_sync(0xffffffffu, acc, 2);
      delta[hh] = acc;
    }
  }
  int64_t kend = p.seqlen_k;
  if (p.is_causal) kend = imin(kend, m0 + kBlockM + p.seqlen_k - p.seqlen_q);
  const int64_t n_end = kend <= 0 ? 0 : ceil_div(kend, kBlockN);

  float dq[D / 8][4];
#pragma unroll
  for (int d = 0; d < D / 8; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[d][e] = 0.f;

  // First kept key tile >= t, its keep tile built into `slot` (only where a mask or a cut
  // tile needs one); n_end if none. Block-uniform.
  // Tiles whose activity bit is clear are passed over without reading their mask bytes; a set bit
  // on a tile with no bounds or causal cut means its raw mask bytes are its keep tile, copied
  // asynchronously (committed: the wait before the tile is used covers them).
  ActiveTiles active(has_mask ? BwdPlane<uint32_t>(p.tile_meta, b, h).at(m_tile, 0) : nullptr);
  auto find_next = [&](int64_t t, uint8_t* slot) -> int64_t {
#pragma unroll 1
    for (; t < n_end; ++t) {
      if (has_mask && (t = active.next(t, n_end)) >= n_end) break;
      const TileBounds tb(p, m0, t * kBlockN);
      if (has_mask) {
        if (tb.full && f.mask_vec) {
          issue_mask_raw(mask, slot, m0, t * kBlockN);
          return t;
        }
        if (bwd_build_keep(tb, mask, slot, f.mask_vec, m0, t * kBlockN)) return t;
      } else if (tb.any()) {
        if (!tb.full) bwd_build_keep(tb, mask, slot, f.mask_vec, m0, t * kBlockN);
        return t;
      }
    }
    return n_end;
  };

  {
    float dacc[2] = {0.f, 0.f};  // exact delta, for the dkv kernel
    // Tile tn's K and bias copies fly during tile t's work, V's once S / dP have read it (one
    // buffer: the smem of a second would cost the second CTA per SM). find_next's raw mask copy
    // is committed as the newest group, so the wait for tile t (wait<1>) leaves it in flight.
    T* sK2 = reinterpret_cast<T*>(smem + L::kK2);
    constexpr int kBiasElems = L::kBiasSlot / (int)sizeof(T);
    auto issue_kb = [&](int64_t tt, int buf) {
      bwd_issue_keys<T, D>(buf ? sK2 : sK, kp, p.k_row_stride, ContiguousKeys{}, tt * kBlockN, p.seqlen_k,
                           f.qkv_vec);
      if (has_bias)
        bwd_issue_bias<T>(TileBounds(p, m0, tt * kBlockN), bias, sB + buf * kBiasElems, f.bias_vec, m0, tt * kBlockN);
    };
    int slot = 0;
    int64_t t = find_next(0, sKeep);
    cp_async_commit();
    if (t < n_end) {
      issue_kb(t, 0);
      bwd_issue_keys<T, D>(sV, vp, p.v_row_stride, ContiguousKeys{}, t * kBlockN, p.seqlen_k, f.qkv_vec);
      cp_async_commit();
    }
#pragma unroll 1
    while (t < n_end) {
      const TileBounds tb(p, m0, t * kBlockN);
      const bool use_keep = has_mask || !tb.full;
      const uint8_t* keep = sKeep + slot * L::kKeepSlot;
      const T* sk = slot ? sK2 : sK;
      const T* sb = sB + slot * kBiasElems;
      const int64_t tn = find_next(t + 1, sKeep + (slot ^ 1) * L::kKeepSlot);
      cp_async_commit();
      cp_async_wait<1>();
      if constexpr (kWg) fence_proxy_async();
      __syncthreads();
      if (tn < n_end) {  // into the buffers tile t - 1 released at the barrier ending it
        issue_kb(tn, slot ^ 1);
        cp_async_commit();
      }
      float s[kBlockN / 8][4], dp[kBlockN / 8][4];
      bwd_gemm_nt2<T, D, D / 16>(s, sQ, sk, dp, sDO, sV, w * 16);
      __syncthreads();  // every warp's dP has read V
      if (tn < n_end) {
        bwd_issue_keys<T, D>(sV, vp, p.v_row_stride, ContiguousKeys{}, tn * kBlockN, p.seqlen_k, f.qkv_vec);
        cp_async_commit();
      }
      if (scf != 0.f) {
#pragma unroll
        for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[n][e] = tanhf(s[n][e] * soc);
      }
      // s holds raw q.k (or tanh of it under softcap); x = score in log2 units.
#pragma unroll
      for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = w * 16 + g + 8 * hh, col = n * 8 + 2 * qc;
          float2 bv = make_float2(0.f, 0.f);
          if (has_bias) bv = unpack2<T>(*reinterpret_cast<const uint32_t*>(sb + r * kBwdLdBias + col));
          uint32_t kv2 = 0x0101u;
          if (use_keep) kv2 = *reinterpret_cast<const uint16_t*>(keep + r * kLdKeep + col);
#pragma unroll
          for (int e1 = 0; e1 < 2; ++e1) {
            const int e = 2 * hh + e1;
            const float raw = s[n][e];
            float x = fmaf(e1 ? bv.y : bv.x, kBwdLog2e, raw * mulf);
            x = ((kv2 >> (8 * e1)) & 0xffu) ? x : -CUDART_INF_F;
            const float pr = exp2f(x - l2[hh]);
            dacc[hh] = fmaf(pr, dp[n][e], dacc[hh]);
            s[n][e] = pr * (dp[n][e] - delta[hh]) * fmaf(-scf * raw, raw, 1.f);
          }
        }
      bwd_gemm_pv<T, D>(dq, s, sk);
      __syncthreads();  // K / V / bias and this keep slot are free for the next tile
      t = tn;
      slot ^= 1;
    }
    cp_async_wait<0>();  // Q / dO copies of a CTA that kept no tile
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      dacc[hh] += __shfl_xor_sync(0xffffffffu, dacc[hh], 1);
      dacc[hh] += __shfl_xor_sync(0xffffffffu, dacc[hh], 2);
    }
    float* d = static_cast<float*>(p.softmax_d) + (b * p.num_heads + h) * p.seqlen_q + m0;
    if (qc == 0) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        if (w * 16 + g + 8 * hh < vr) d[w * 16 + g + 8 * hh] = dacc[hh];
    }
  }
  bwd_store_acc<T, D>(static_cast<T*>(p.dq) + b * p.dq_batch_stride + h * p.dq_head_stride + m0 * p.dq_row_stride,
                      p.dq_row_stride, dq, p.softmax_scale, w * 16, vr);
  if (dbias.in_dtype) bwd_zero_skipped_dbias<T>(p, dbias, b, h, (int)(gridDim.x / nh) - 1 - m_tile);
}

// kPart 0: dK, dV and dbias in one pass. Wider heads than 128 cannot hold both accumulators
// (D floats a thread next to S^T and dP^T) and run the kernel twice over the same work items:
// kPart 1 accumulates dV (no V, dP^T or dS), kPart 2 dK and dbias.
template <typename T, int D, int kPart>
__global__ void __launch_bounds__(kThreads, D <= 128 ? 2 : 1)
    bwd_dkv_kernel(const BwdParams p, const BwdDbias dbias, const BwdFlags f) {
  constexpr bool kDv = kPart != 2, kDk = kPart != 1;
  static_assert(kPart == 0 || D > 128, "narrow heads take both accumulators in one pass");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  constexpr bool kWg = use_wgmma<D>();
  unsigned char* smem = kWg ? smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024) : smem_raw;
  using L = BwdDkvSmem<T, D>;
  T* sK = reinterpret_cast<T*>(smem + L::kK);
  T* sV = reinterpret_cast<T*>(smem + L::kV);
  T* sQ = reinterpret_cast<T*>(smem + L::kQ);
  T* sDO = reinterpret_cast<T*>(smem + L::kDO);
  T* sB = reinterpret_cast<T*>(smem + L::kBias);
  uint8_t* sKeep = smem + L::kKeep;
  float* sL2 = reinterpret_cast<float*>(smem + L::kL2);
  float* sDelta = reinterpret_cast<float*>(smem + L::kDelta);
  float* sDS = reinterpret_cast<float*>(smem + L::kDS);
  float* sDB = reinterpret_cast<float*>(smem + L::kDB);

  const int64_t n_tile = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int64_t n0 = n_tile * kBlockN;
  const int64_t ratio = p.num_heads / p.num_heads_k;
  const int vc = (int)imin(kBlockN, p.seqlen_k - n0);
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, qc = lane % 4;

  T* dk_out = static_cast<T*>(p.dk) + b * p.dk_batch_stride + kvh * p.dk_head_stride + n0 * p.dk_row_stride;
  T* dv_out = static_cast<T*>(p.dv) + b * p.dv_batch_stride + kvh * p.dv_head_stride + n0 * p.dv_row_stride;
  bwd_issue_keys<T, D>(sK, static_cast<const T*>(p.k) + b * p.k_batch_stride + kvh * p.k_head_stride, p.k_row_stride,
                       ContiguousKeys{}, n0, p.seqlen_k, f.qkv_vec);
  if constexpr (kDk)
    bwd_issue_keys<T, D>(sV, static_cast<const T*>(p.v) + b * p.v_batch_stride + kvh * p.v_head_stride, p.v_row_stride,
                         ContiguousKeys{}, n0, p.seqlen_k, f.qkv_vec);
  cp_async_commit();

  const bool has_bias = p.bias.ptr != nullptr, has_mask = p.mask.ptr != nullptr, want_db = kDk && dbias.ptr != nullptr;
  const float scf = p.softcap > 0.f ? 1.f : 0.f;
  const float mulf = p.softcap > 0.f ? p.softcap * kBwdLog2e : p.softmax_scale * kBwdLog2e;
  const float soc = p.softcap > 0.f ? p.softmax_scale / p.softcap : 0.f;

  constexpr int kDkRows = kDk ? D / 8 : 1, kDvRows = kDv ? D / 8 : 1;  // a pass without one keeps a stub
  float dk[kDkRows][4], dv[kDvRows][4];
#pragma unroll
  for (int d = 0; d < D / 8; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (d < kDkRows) dk[d][e] = 0.f;
      if (d < kDvRows) dv[d][e] = 0.f;
    }

  // Causal: the first query row that sees key n0 is n0 - (K - Q).
  int64_t m_first = 0;
  if (p.is_causal) m_first = imax(0, n0 - (p.seqlen_k - p.seqlen_q));
  const int64_t m_tiles = ceil_div(p.seqlen_q, kBlockM);
  const Broadcast4d& DL = dbias.layout;
  const int64_t mt_begin = m_first / kBlockM;
  // Work items (query tile mt, query head gq) in a fixed order, heads inner: the heads sharing a
  // dbias plane follow each other, so their dS sums in smem. find_next advances to the first
  // kept one at or after (mt, gq), its keep tile built into `slot`; false when none is left.
  // Block-uniform.
  // Activity bits of this key tile's column for the work items in order, 4096 items at a time
  // in smem (thread t loads word t), so skipping an empty item costs a shared load instead of
  // a global round trip. Block-uniform.
  uint32_t* sMeta = reinterpret_cast<uint32_t*>(smem + L::kMeta);
  int meta_base = -1;
  auto item_active = [&](int64_t mt, int64_t gq) -> bool {
    // 32-bit item arithmetic: a 64-bit division compiles to a call, and this kernel is at its
    // register limit.
    const int item = (int)(mt - mt_begin) * (int)ratio + (int)gq, base = item & ~(L::kMetaItems - 1);
    if (base != meta_base) {
      __syncthreads();  // the previous chunk is no longer read
      meta_base = base;
      const uint32_t* col = static_cast<const uint32_t*>(p.tile_meta.ptr) + b * p.tile_meta.batch_stride + n_tile / 32;
      uint32_t bits = 0;
#pragma unroll 4
      for (int i = 0; i < 32; ++i) {
        const int it = base + (int)threadIdx.x * 32 + i, mt_i = (int)mt_begin + it / (int)ratio;
        const int h_i = (int)kvh * (int)ratio + it % (int)ratio;
        if (mt_i < m_tiles)
          bits |= ((col[(h_i / (int)p.tile_meta.head_ratio) * p.tile_meta.head_stride + mt_i * p.tile_meta.row_stride] >>
                    (n_tile % 32)) & 1u) << i;
      }
      sMeta[threadIdx.x] = bits;
      __syncthreads();
    }
    return (sMeta[(item - base) >> 5] >> ((item - base) & 31)) & 1u;
  };
  // Where all query heads of this kv head read one bias plane and one mask plane, an item of the
  // query tile gathered last takes that gather's sDS (bias and keep in log2 units; lse is applied
  // in the P^T loop) instead of copying and gathering its own. Not under softcap, whose
  // derivative overwrites sDS. find_next returns such an item without touching a keep slot: the
  // next item reuses iff it is in the same query tile. (Recomputed from the kernel parameters
  // where used: kept in a register it spilled.)
  auto group_shares = [&] {
    return p.softcap <= 0.f && (!p.bias.ptr || p.bias.head_stride == 0 || p.bias.head_ratio % ratio == 0) &&
           (!p.mask.ptr || p.mask.head_stride == 0 || p.mask.head_ratio % ratio == 0);
  };
  int reuse_mt = -1;  // the query tile whose gathered sDS is there to reuse (-1: none)
  auto find_next = [&](int64_t& mt, int64_t& gq, uint8_t* slot) -> bool {
#pragma unroll 1
    for (; mt < m_tiles; ++mt, gq = 0) {
      const TileBounds tb(p, mt * kBlockM, n0);
      if (!tb.any()) continue;
#pragma unroll 1
      for (; gq < ratio; ++gq) {
        if ((int)mt == reuse_mt && (!has_mask || item_active(mt, gq))) return true;
        if (has_mask) {
          if (!item_active(mt, gq)) continue;
          const BwdPlane<uint8_t> mask(p.mask, b, kvh * ratio + gq);
          if (tb.full && f.mask_vec) {  // as in the dq kernel: the bit says it keeps something
            issue_mask_raw(mask, slot, mt * kBlockM, n0);
            cp_async_commit();
            return true;
          }
          if (bwd_build_keep(tb, mask, slot, f.mask_vec, mt * kBlockM, n0)) return true;
        } else {
          if (!tb.full) bwd_build_keep(tb, BwdPlane<uint8_t>(p.mask, b, 0), slot, f.mask_vec, mt * kBlockM, n0);
          return true;
        }
      }
    }
    return false;
  };
  // dbias plane of query head gq (heads of one plane are consecutive in gq).
  auto db_plane = [&](int64_t gq_) -> int {
    return DL.head_stride == 0 ? 0 : (int)(kvh * ratio + gq_) / (int)DL.head_ratio;
  };
  int64_t gq = 0, mt = mt_begin;
  int slot = 0;
  bool first = true;  // first head of this (query tile, dbias plane): sDB starts from its dS
  bool have = find_next(mt, gq, sKeep);
  bool reuse = false;  // this item takes the previous item's sDS
#pragma unroll 1
  while (have) {
    {
      const int64_t h = kvh * ratio + gq;
      const BwdPlane<T> bias(p.bias, b, h);
      const T* qp = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
      const T* dop = static_cast<const T*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride;
      const float* lse = static_cast<const float*>(p.lse) + (b * p.num_heads + h) * p.seqlen_q;
      const float* dlt = static_cast<const float*>(p.softmax_d) + (b * p.num_heads + h) * p.seqlen_q;
      const int64_t m0 = mt * kBlockM;
      const TileBounds tb(p, m0, n0);
      const int vr = tb.lim_r;
      issue_rows<T, D>(sQ, qp + m0 * p.q_row_stride, p.q_row_stride, vr, f.qkv_vec);
      issue_rows<T, D>(sDO, dop + m0 * p.do_row_stride, p.do_row_stride, vr, f.qkv_vec);
      if (has_bias && !reuse) bwd_issue_bias<T>(tb, bias, sB, f.bias_vec, m0, n0);
      cp_async_commit();
      if (threadIdx.x < kBlockM) {
        const int r = threadIdx.x;
        sL2[r] = r < vr ? bwd_l2(lse[m0 + r]) : CUDART_INF_F;
        sDelta[r] = r < vr ? dlt[m0 + r] : 0.f;
      }
    }
    // The next kept item is found (its mask bytes read) while this item's copies fly.
    int64_t gq_n = gq + 1, mt_n = mt;
    reuse_mt = group_shares() ? (int)mt : -1;  // this item's sDS (gathered or reused) serves the next
    const bool have_n = find_next(mt_n, gq_n, sKeep + (slot ^ 1) * L::kKeepSlot);
    // Last head of this plane in this query tile: the summed tile goes out now.
    const bool flush = !have_n || mt_n != mt || db_plane(gq_n) != db_plane(gq);
    cp_async_wait<0>();
    if constexpr (kWg) fence_proxy_async();
    __syncthreads();
    {
      const int64_t h = kvh * ratio + gq;
      const int64_t m0 = mt * kBlockM;
      const TileBounds tb(p, m0, n0);
      const int vr = tb.lim_r;
      const bool use_keep = has_mask || !tb.full;
      const uint8_t* keep = sKeep + slot * L::kKeepSlot;

      // On wgmma, S^T = K Q^T runs while the block gathers the additive terms (it reads only the
      // K / Q tiles, the gather only bias, keep and lse). dP^T too would spill at D = 128.
      float s[kBlockN / 8][4];
      if constexpr (kWg) bwd_gemm_nt<T, D, false>(s, sK, sQ, w * 16);
      // Transposed scores: rows = this warp's 16 keys, columns = the tile's 64 queries. The
      // additive part of each score in log2 units (bias - lse, or -inf where dropped) is first
      // gathered from the [query][key] bias / keep tiles into sDS, so the element loop after the
      // GEMMs reads one float2 per pair instead of four scattered scalars (whose hoisted loads
      // cost the registers that dK / dV need). sB overlays sDS's upper half (keys 32..63): keys
      // 0..31 are written first, then keys 32..63 from values read before a barrier. Lane =
      // key, warp = 16 queries: the bias / keep reads are consecutive bytes of one row.
      if (!reuse) {
        const uint16_t* sBh = reinterpret_cast<const uint16_t*>(sB);
        const int key0 = lane, c0 = w * 16;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int key = key0 + 32 * half;
          uint32_t bv[8];
          if (has_bias) {
#pragma unroll
            for (int j = 0; j < 8; ++j)
              bv[j] = uint32_t(sBh[(c0 + 2 * j) * kBwdLdBias + key]) |
                      (uint32_t(sBh[(c0 + 2 * j + 1) * kBwdLdBias + key]) << 16);
            if (half == 1) __syncthreads();
          }
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            float a[4] = {0.f, 0.f, 0.f, 0.f};
            if (has_bias) {
              const float2 b0 = unpack2<T>(bv[2 * j]), b1 = unpack2<T>(bv[2 * j + 1]);
              a[0] = fmaf(b0.x, kBwdLog2e, a[0]);
              a[1] = fmaf(b0.y, kBwdLog2e, a[1]);
              a[2] = fmaf(b1.x, kBwdLog2e, a[2]);
              a[3] = fmaf(b1.y, kBwdLog2e, a[3]);
            }
            if (use_keep) {
#pragma unroll
              for (int e = 0; e < 4; ++e) a[e] = keep[(c0 + 4 * j + e) * kLdKeep + key] ? a[e] : -CUDART_INF_F;
            }
            *reinterpret_cast<float4*>(sDS + key * kBwdLdDS + c0 + 4 * j) = make_float4(a[0], a[1], a[2], a[3]);
          }
        }
        __syncthreads();
      }
      if constexpr (kWg) {
        wgmma_wait<0>();
        fence_regs(s);
      } else {
        bwd_gemm_nt<T, D>(s, sK, sQ, w * 16);
      }
      if (scf != 0.f) {
#pragma unroll
        for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[n][e] = tanhf(s[n][e] * soc);
      }
      // P^T; the softcap derivative 1 - t^2 is kept where the additive term was (read once).
#pragma unroll
      for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = w * 16 + g + 8 * hh, c = n * 8 + 2 * qc;
          float2* slot = reinterpret_cast<float2*>(sDS + r * kBwdLdDS + c);
          const float2 add = *slot;
          const float t0 = s[n][2 * hh], t1 = s[n][2 * hh + 1];
          const float2 l2c = *reinterpret_cast<const float2*>(sL2 + c);
          s[n][2 * hh] = exp2f(fmaf(t0, mulf, add.x) - l2c.x);
          s[n][2 * hh + 1] = exp2f(fmaf(t1, mulf, add.y) - l2c.y);
          if (scf != 0.f) *slot = make_float2(fmaf(-scf * t0, t0, 1.f), fmaf(-scf * t1, t1, 1.f));
        }
      if constexpr (kDv) bwd_gemm_pv<T, D>(dv, s, sDO);
      if constexpr (kDk) {
        float dp[kBlockN / 8][4];
        bwd_gemm_nt<T, D>(dp, sV, sDO, w * 16);
#pragma unroll
        for (int n = 0; n < kBlockN / 8; ++n) {
          const int c = n * 8 + 2 * qc;  // query
          const float2 dc = *reinterpret_cast<const float2*>(sDelta + c);
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int r = w * 16 + g + 8 * hh;  // key
            float2* slot = reinterpret_cast<float2*>(sDS + r * kBwdLdDS + c);
            const float2 der = scf != 0.f ? *slot : make_float2(1.f, 1.f);
            const float ds0 = s[n][2 * hh] * (dp[n][2 * hh] - dc.x);
            const float ds1 = s[n][2 * hh + 1] * (dp[n][2 * hh + 1] - dc.y);
            if (want_db) {  // this thread's own sDB slots in every head: no hazard
              float2* a = reinterpret_cast<float2*>(sDB + bwd_db_idx(r, c));
              if (first) {
                *a = make_float2(ds0, ds1);
              } else {
                const float2 o = *a;
                *a = make_float2(o.x + ds0, o.y + ds1);
              }
            }
            dp[n][2 * hh] = ds0 * der.x;
            dp[n][2 * hh + 1] = ds1 * der.y;
          }
        }
        bwd_gemm_pv<T, D>(dk, dp, sQ);

        if (want_db && flush) {
          __syncthreads();
          // Fixed order: the heads were summed in sDB in head order; broadcast rows / keys are
          // summed here in index order.
          const int lc = tb.lim_c;
          const int64_t db_off = n_tile * dbias.tile_stride + b * DL.batch_stride +
                                 (int)h / (int)DL.head_ratio * DL.head_stride;
          float* dbf = static_cast<float*>(dbias.ptr) + db_off;
          if (DL.row_stride != 0 && DL.col_stride != 0) {
            const bool vec_tile = dbias.vec && lc == kBlockN && vr == kBlockM;
            if (vec_tile) {
              // 16-byte stores of 8 keys: thread owns query row lane + 32 (w % 2) and key chunks
              // w / 2 + 2u. One load reads one key of 32 consecutive queries (conflict-free under
              // bwd_db_idx's swizzle); one store writes 16 bytes of 32 rows. The scalar path below
              // spent ~20 instructions an element (address, predicate, swizzle, convert).
              const int q = lane + 32 * (w & 1);
              T* dst = static_cast<T*>(dbias.ptr) + db_off + (m0 + q) * DL.row_stride + n0;
#pragma unroll
              for (int u = 0; u < kBlockN / 8 / 2; ++u) {
                const int c8 = (w >> 1) + 2 * u;
                uint32_t pk[4];
#pragma unroll
                for (int j = 0; j < 4; ++j)
                  pk[j] = pack2<T>(sDB[bwd_db_idx(8 * c8 + 2 * j, q)], sDB[bwd_db_idx(8 * c8 + 2 * j + 1, q)]);
                *reinterpret_cast<uint4*>(dst + 8 * c8) = make_uint4(pk[0], pk[1], pk[2], pk[3]);
              }
            }
            // One write per element: this CTA owns the tile (its plane's heads are all summed);
            // tiles no item writes are zero (the caller's float buffer; in the bias dtype, the
            // dq kernel's zeroing). Thread owns key column tid % 64 of rows tid / 64 + 2u.
            constexpr int kRowStep = kThreads / kBlockN, kPer = kBlockM / kRowStep;
            const int col = threadIdx.x % kBlockN, r0 = threadIdx.x / kBlockN;
            const int64_t off = (m0 + r0) * DL.row_stride + (n0 + col) * DL.col_stride;
            const int64_t step = kRowStep * DL.row_stride;
            if (!vec_tile && col < lc) {
              if (dbias.in_dtype) {
                T* dst = static_cast<T*>(dbias.ptr) + db_off + off;
#pragma unroll
                for (int u = 0; u < kPer; ++u)
                  if (r0 + kRowStep * u < vr) dst[u * step] = from_float<T>(sDB[bwd_db_idx(col, r0 + kRowStep * u)]);
              } else {
#pragma unroll
                for (int u = 0; u < kPer; ++u)
                  if (r0 + kRowStep * u < vr) dbf[off + u * step] = sDB[bwd_db_idx(col, r0 + kRowStep * u)];
              }
            }
          } else if (DL.col_stride != 0) {  // per-key bias: sum over the tile's rows
            if (vr == kBlockM) {
              // All four warps: thread sums 32 rows of key tid % 64 (four chains), the upper
              // half hands its sum over in sL2 (read by nobody until the next item's barrier).
              // Before, two warps walked all 64 rows in one dependent chain.
              const int col = threadIdx.x % kBlockN, half = threadIdx.x / kBlockN;
              float a[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
              for (int r = 0; r < kBlockM / 2; ++r) a[r % 4] += sDB[bwd_db_idx(col, half * (kBlockM / 2) + r)];
              const float acc = (a[0] + a[1]) + (a[2] + a[3]);
              if (half == 1) sL2[col] = acc;
              __syncthreads();
              if (half == 0 && col < lc) dbf[(n0 + col) * DL.col_stride] += acc + sL2[col];
            } else if (threadIdx.x < lc) {
              const int col = threadIdx.x;
              float acc = 0.f;
              for (int r = 0; r < vr; ++r) acc += sDB[bwd_db_idx(col, r)];
              dbf[(n0 + col) * DL.col_stride] += acc;
            }
          } else if (DL.row_stride != 0) {  // bias broadcast over keys: sum over the tile's keys
            if (threadIdx.x < vr) {
              const int r = threadIdx.x;
              float acc = 0.f;
              for (int col = 0; col < lc; ++col) acc += sDB[bwd_db_idx(col, r)];
              dbf[(m0 + r) * DL.row_stride] += acc;
            }
          } else if (threadIdx.x == 0) {
            float acc = 0.f;
            for (int r = 0; r < vr; ++r)
              for (int col = 0; col < lc; ++col) acc += sDB[bwd_db_idx(col, r)];
            dbf[0] += acc;
          }
        }
      }
    }
    __syncthreads();  // Q / dO / bias / sDS / sDB and this keep slot are free for the next item
    reuse = have_n && mt_n == mt && group_shares();
    first = flush;
    gq = gq_n;
    mt = mt_n;
    have = have_n;
    slot ^= 1;
  }
  cp_async_wait<0>();
  if constexpr (kDk) bwd_store_acc<T, D>(dk_out, p.dk_row_stride, dk, p.softmax_scale, w * 16, vc);
  if constexpr (kDv) bwd_store_acc<T, D>(dv_out, p.dv_row_stride, dv, 1.f, w * 16, vc);
}

// Sums the per-key-tile dbias slices into the accumulator in tile order.
__global__ void bwd_reduce_dbias_tiles(float* accum, const float* scratch, int64_t span, int64_t tiles) {
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < span; e += (int64_t)gridDim.x * blockDim.x) {
    float s = accum[e];
    for (int64_t t = 0; t < tiles; ++t) s += scratch[t * span + e];
    accum[e] = s;
  }
}

}  // namespace cuda
}  // namespace flexdma
