// dbias of the backward: where a work item of the main pass adds dS, and the zeroing of the tiles
// no work item keeps.
#pragma once
#include <cstdint>

#include "../flash_dma_params.h"
#include "constants.cuh"
#include "mask.cuh"
#include "mma_sm80.cuh"
#include "seq_info.cuh"

namespace flexdma {
namespace cuda {

// Where a work item of the main pass adds dS: a bias that varies along the keys (the caller passes
// no accumulator for one constant along them, whose gradient is zero).
// in_dtype: ptr holds T and the full (per-row / per-element) tiles are stored as final values;
// the buffer comes unfilled, and the main pass zeroes the tiles no head of a plane keeps. vec (in_dtype only):
// contiguous keys and 16-byte aligned rows, so a full tile is stored (and an unkept one zeroed) 8 elements a store.
struct BwdDbias {
  void* ptr = nullptr;
  Broadcast4d layout;
  bool in_dtype = false;
  bool vec = false;
};

// Zeroes one (query tile, key tile) tile of a dbias stored in the bias dtype, `vr` rows and `lc`
// keys from `tile`. Block-uniform. The buffer comes unfilled and the main pass flushes only the
// tiles some query head of a plane keeps; its CTAs zero the rest of their own key column as they
// pass them (bwd_kernel.cuh): stores that drain while the SM's other CTA computes, where a fill of
// the whole buffer first would write every byte twice and run alone.
template <typename T>
__device__ inline void zero_dbias_tile(const BwdDbias& db, T* tile, int vr, int lc) {
  const Broadcast4d& DL = db.layout;
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

// Zeroes the dbias tiles of key tile n0's column (keys [n0, n0 + valid)) from position pos =
// (query tile, plane of kv head kvh's group of `ratio` query heads) up to, not including,
// (mt_e, pl_e), in walk order (planes inner).
template <typename T>
__device__ inline void zero_dbias_until(const BwdDbias& dbias, const int* pos, int mt_e, int pl_e, const SeqInfo& seq,
                                        int kvh, int ratio, int n0, int valid) {
  const Broadcast4d& DL = dbias.layout;
  int zmt = pos[0], zpl = pos[1];
#pragma unroll 1
  while (zmt < mt_e || (zmt == mt_e && zpl < pl_e)) {
    const int64_t m0z = (int64_t)zmt * kBlockM;
    const int plane = DL.head_stride == 0 ? 0 : kvh * ratio / (int)DL.head_ratio + zpl;
    zero_dbias_tile<T>(dbias,
                       static_cast<T*>(dbias.ptr) + seq.b * DL.batch_stride + plane * DL.head_stride +
                           seq.plane_offset(DL) + m0z * DL.row_stride + (int64_t)n0 * DL.col_stride,
                       (int)imin(kBlockM, seq.nq - m0z), valid);
    if (++zpl == (DL.head_stride == 0 ? 1 : (int)imax(1, ratio / (int)DL.head_ratio))) zpl = 0, ++zmt;
  }
}

// The main pass's dbias epilogue for one (query tile m0, key tile n0) of a dbias plane, once
// the heads of the plane are summed in sDB (float [key][query], db_idx): stored as final values
// (per-element dbias) or, for a bias broadcast over rows, summed over them in index order and
// added. Block-uniform; sL2 (64 floats) is free scratch here.
template <typename T>
__device__ inline void flush_dbias_tile(const BwdDbias& dbias, const float* sDB, float* sL2, const SeqInfo& seq,
                                        int64_t h, int64_t m0, int64_t n0, int vr, int lc) {
  const Broadcast4d& DL = dbias.layout;
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  // Fixed order: the heads were summed in sDB in head order; broadcast rows are summed here in
  // index order.
  const int64_t db_off = seq.b * DL.batch_stride + (int)h / (int)DL.head_ratio * DL.head_stride + seq.plane_offset(DL);
  float* dbf = static_cast<float*>(dbias.ptr) + db_off;
  if (DL.row_stride != 0 && DL.col_stride != 0) {
    const bool vec_tile = dbias.vec && lc == kBlockN && vr == kBlockM;
    if (vec_tile) {
      // 16-byte stores of 8 keys: thread owns query row lane + 32 (w % 2) and key chunks
      // w / 2 + 2u. One load reads one key of 32 consecutive queries (conflict-free under
      // db_idx's swizzle); one store writes 16 bytes of 32 rows. The scalar path below
      // spent ~20 instructions an element (address, predicate, swizzle, convert).
      const int q = lane + 32 * (w & 1);
      T* dst = static_cast<T*>(dbias.ptr) + db_off + (m0 + q) * DL.row_stride + n0;
#pragma unroll
      for (int u = 0; u < kBlockN / 8 / 2; ++u) {
        const int c8 = (w >> 1) + 2 * u;
        uint32_t pk[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
          pk[j] = pack2<T>(sDB[db_idx(8 * c8 + 2 * j, q)], sDB[db_idx(8 * c8 + 2 * j + 1, q)]);
        *reinterpret_cast<uint4*>(dst + 8 * c8) = make_uint4(pk[0], pk[1], pk[2], pk[3]);
      }
    }
    // One write per element: this CTA owns the tile (its plane's heads are all summed);
    // tiles no item writes are zero (the caller's float buffer; in the bias dtype, the
    // main pass's zeroing). Thread owns key column tid % 64 of rows tid / 64 + 2u.
    constexpr int kRowStep = kThreads / kBlockN, kPer = kBlockM / kRowStep;
    const int col = threadIdx.x % kBlockN, r0 = threadIdx.x / kBlockN;
    const int64_t off = (m0 + r0) * DL.row_stride + (n0 + col) * DL.col_stride;
    const int64_t step = kRowStep * DL.row_stride;
    if (!vec_tile && col < lc) {
      if (dbias.in_dtype) {
        T* dst = static_cast<T*>(dbias.ptr) + db_off + off;
#pragma unroll
        for (int u = 0; u < kPer; ++u)
          if (r0 + kRowStep * u < vr) dst[u * step] = from_float<T>(sDB[db_idx(col, r0 + kRowStep * u)]);
      } else {
#pragma unroll
        for (int u = 0; u < kPer; ++u)
          if (r0 + kRowStep * u < vr) dbf[off + u * step] = sDB[db_idx(col, r0 + kRowStep * u)];
      }
    }
  } else {  // per-key bias: sum over the tile's rows
    if (vr == kBlockM) {
      // All four warps: thread sums 32 rows of key tid % 64 (four chains, not one dependent
      // chain over 64 rows), the upper half hands its sum over in sL2 (read by nobody until the
      // next item's barrier).
      const int col = threadIdx.x % kBlockN, half = threadIdx.x / kBlockN;
      float a[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int r = 0; r < kBlockM / 2; ++r) a[r % 4] += sDB[db_idx(col, half * (kBlockM / 2) + r)];
      const float acc = (a[0] + a[1]) + (a[2] + a[3]);
      if (half == 1) sL2[col] = acc;
      __syncthreads();
      if (half == 0 && col < lc) dbf[(n0 + col) * DL.col_stride] += acc + sL2[col];
    } else if (threadIdx.x < lc) {
      const int col = threadIdx.x;
      float acc = 0.f;
      for (int r = 0; r < vr; ++r) acc += sDB[db_idx(col, r)];
      dbf[(n0 + col) * DL.col_stride] += acc;
    }
  }
}

}  // namespace cuda
}  // namespace flexdma
