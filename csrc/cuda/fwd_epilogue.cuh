// The forward's epilogue: O / rowsum into out, LSE = max + log(sum); empty rows give 0 and
// -inf; where FwdParams::out_resid is set, out's rounding error beside it. A split over keys writes the same, in float,
// to its slice of the partial buffers (combined by fwd_combine.cuh).
#pragma once
#include <math_constants.h>

#include "../flash_dma_params.h"
#include "constants.cuh"
#include "copy.cuh"
#include "mma_sm80.cuh"
#include "seq_info.cuh"
#include "smem_layout.cuh"

namespace flexdma {
namespace cuda {

// Split over keys (flash-decoding): with fewer query tiles than SMs, each split (blockIdx.z, or a
// persistent CTA's work item's) takes a slice of
// the key tiles and writes its normalised partial O and its LSE (float) to o_part / lse_part,
// laid out [split][batch][head][row](D); combine_splits merges them.
struct FwdSplit {
  int n = 1;
  float* o_part = nullptr;
  float* lse_part = nullptr;
};

// Rows [r0, r0 + 16) of a staged 64-row tile (tile_index's layout, 16-byte chunks swizzled by
// row: the fragments' 4-byte writes and the row reads are free of bank conflicts) to rows
// [0, valid) of dst (row stride rs), 16 bytes a lane: each store instruction writes whole rows
// (D = 128: two 256-byte rows), where the fragments' own stores write 4 bytes into each of 8 rows.
template <typename T, int D>
__device__ inline void store_staged_rows(const T* tile, int r0, T* dst, int64_t rs, int valid, int lane) {
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int u = 0; u < 16 * kChunks / 32; ++u) {
    const int i = u * 32 + lane, r = i / kChunks, c = i % kChunks;
    if (r < valid)
      *reinterpret_cast<uint4*>(dst + r * rs + c * 8) =
          *reinterpret_cast<const uint4*>(tile + tile_index<D>(r0 + r, c * 8));
  }
}

// A warp's rows of one 64-row query tile (m0) of head h, batch seq.b: the O accumulator (16 x D,
// rows g and g + 8 of the thread), the row max (log2 units) and the per-thread row sums; tid is
// the thread's index in the warpgroup that owns the tile. stage (or null): the warpgroup's 64-row
// tile of shared memory in tile_index's layout that it may overwrite (its Q tile, once its
// products are done); with it and 16-byte aligned rows, out and out_resid go through it
// (store_staged_rows). split: the key split of the tile (its work item's).
template <typename T, int D>
__device__ inline void fwd_epilogue(const FwdParams& p, const FwdFlags& f, const FwdSplit& sp,
                                    const float (&o)[D / 8][4], const float (&row_max)[2], const float (&row_sum)[2],
                                    const SeqInfo& seq, int64_t h, int64_t m0, int tid, T* stage, int split) {
  // Non-negative: tile_index's divisions and remainders by powers of two compile to shifts and masks.
  __builtin_assume(tid >= 0);
  const int w = tid / 32, lane = tid % 32, g = lane / 4, qc = lane % 4;
  const int64_t b = seq.b;
  T* out = static_cast<T*>(p.out) + seq.o_offset(p) + h * p.o_head_stride;
  // Key splits (never with packed sequences: the launcher does not split them) write partial rows
  // [split][b][h][row].
  const int64_t row0 = (((int64_t)split * p.batch + b) * p.num_heads + h) * p.seqlen_q;
  float* lse = sp.n > 1 ? sp.lse_part + row0 : static_cast<float*>(p.lse) + seq.lse_offset(p, h);
  const int64_t nq = seq.nq;
  // Rows g and g + 8: 1 / rowsum and the LSE.
  float inv[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float l = row_sum[hh];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float m = row_max[hh];
    // A finite max means some p = 1, so l >= 1: only a row that kept nothing is empty. A NaN row
    // (max and sum NaN) is not, and comes out NaN.
    const bool empty = m == -CUDART_INF_F;
    inv[hh] = empty ? 0.f : 1.f / l;
    // row_max is in log2 units: lse = ln 2 * (m + log2 l).
    const int64_t i = m0 + w * 16 + g + 8 * hh;
    if (qc == 0 && i < nq) lse[i] = empty ? -CUDART_INF_F : (m + __log2f(l)) * kLn2F;
  }
  if (stage && sp.n == 1 && f.out_vec16) {
    T* orows = out + (m0 + w * 16) * p.o_row_stride;
    const int valid = (int)imin(16, nq - (m0 + w * 16));
    // The rounded output, then (reusing the warp's rows of the tile) its rounding error.
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {
      if (pass == 1 && !p.out_resid) break;
#pragma unroll
      for (int d = 0; d < D / 8; ++d)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const float x0 = o[d][2 * hh] * inv[hh], x1 = o[d][2 * hh + 1] * inv[hh];
          uint32_t v = pack2<T>(x0, x1);
          if (pass == 1) {
            const float2 back = unpack2<T>(v);
            v = pack2<T>(x0 - back.x, x1 - back.y);
          }
          *reinterpret_cast<uint32_t*>(stage + tile_index<D>(w * 16 + g + 8 * hh, d * 8 + 2 * qc)) = v;
        }
      __syncwarp();
      T* dst = pass == 0 ? orows : static_cast<T*>(p.out_resid) + (orows - static_cast<T*>(p.out));
      store_staged_rows<T, D>(stage, w * 16, dst, p.o_row_stride, valid, lane);
      __syncwarp();  // the rows' reads before the next pass's writes
    }
    return;
  }
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int64_t i = m0 + w * 16 + g + 8 * hh;
    if (i >= nq) continue;
    if (sp.n > 1) {
      float* orow = sp.o_part + (row0 + i) * D;
#pragma unroll
      for (int d = 0; d < D / 8; ++d)
        *reinterpret_cast<float2*>(orow + d * 8 + 2 * qc) =
            make_float2(o[d][2 * hh] * inv[hh], o[d][2 * hh + 1] * inv[hh]);
    } else {
      T* orow = out + i * p.o_row_stride;
      T* rrow = p.out_resid ? static_cast<T*>(p.out_resid) + (orow - static_cast<T*>(p.out)) : nullptr;
#pragma unroll
      for (int d = 0; d < D / 8; ++d) {
        const int col = d * 8 + 2 * qc;
        const float x0 = o[d][2 * hh] * inv[hh], x1 = o[d][2 * hh + 1] * inv[hh];
        const uint32_t lo = pack2<T>(x0, x1);
        if (f.out_vec) {
          *reinterpret_cast<uint32_t*>(orow + col) = lo;
        } else {
          orow[col] = from_float<T>(x0);
          orow[col + 1] = from_float<T>(x1);
        }
        if (rrow) {
          const float2 back = unpack2<T>(lo);
          rrow[col] = from_float<T>(x0 - back.x);
          rrow[col + 1] = from_float<T>(x1 - back.y);
        }
      }
    }
  }
}

}  // namespace cuda
}  // namespace flexdma
