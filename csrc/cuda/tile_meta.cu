// Tile activity of a mask: one bit per (query tile, key tile) that keeps anything once mask,
// bounds and (bottom-right) causality apply; see FwdParams::tile_meta. One pass over the mask,
// so that the forward and both backward kernels skip empty tiles without reading their bytes.
#include <cuda_runtime.h>

#include "flash_dma_cuda.h"
#include "launch.h"
#include "constants.cuh"
#include "mask.cuh"

namespace flexdma {
namespace cuda {
namespace {

constexpr int kWarpsPerCta = 4;

// Whether the lane's 16-byte chunks kFrom .. kTo - 1 of the tile (m0, n0) keep anything: chunk
// u of lane l is row (l + 32 u) / 4, columns 16 ((l + 32 u) % 4) .. + 15. All loads are issued
// before any is tested.
template <int kFrom, int kTo>
__device__ inline int chunks_any(const Plane<uint8_t>& m, const TileBounds& tb, bool vec, int64_t m0, int64_t n0,
                                 int lane) {
  uint4 v[kTo - kFrom];
#pragma unroll
  for (int u = kFrom; u < kTo; ++u) {
    const int c = lane + 32 * u, r = c / (kBlockN / 16), col0 = (c % (kBlockN / 16)) * 16;
    v[u - kFrom] = vec && r < tb.lim_r && col0 + 16 <= tb.lim_c
                       ? *reinterpret_cast<const uint4*>(m.at(m0 + r, n0 + col0))
                       : make_uint4(0, 0, 0, 0);
  }
  int any = 0;
#pragma unroll
  for (int u = kFrom; u < kTo; ++u) {
    const int c = lane + 32 * u, r = c / (kBlockN / 16), col0 = (c % (kBlockN / 16)) * 16;
    const uint4& x = v[u - kFrom];
    if (r >= tb.lim_r) continue;
    if (vec && col0 + 16 <= tb.lim_c) {
      if (tb.full) {
        any |= (x.x | x.y | x.z | x.w) != 0;
      } else {
        const uint32_t w4[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int e = 0; e < 16; ++e) any |= ((w4[e / 4] >> (8 * (e % 4))) & 0xffu) != 0 && tb.ok(r, col0 + e);
      }
    } else {
      // Key tails and masks not readable 16 bytes at a time.
      for (int e = 0; e < 16; ++e) any |= tb.ok(r, col0 + e) && *m.at(m0 + r, n0 + col0 + e) != 0;
    }
  }
  return any;
}

// One warp per (query tile, key tile), so the grid covers every tile at once (a decode row of
// 8192 key tiles is as parallel as a square mask). Bits are ORed into a zero-filled buffer:
// the result does not depend on order.
__global__ void tile_meta_kernel(const FwdParams p, bool vec, uint32_t* meta, int64_t n_words, int64_t mask_heads,
                                 int64_t plane0) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t kt = (int64_t)blockIdx.x * kWarpsPerCta + warp, qt = blockIdx.y, plane = plane0 + blockIdx.z;
  const int64_t bm = plane / mask_heads, hm = plane % mask_heads;
  const int64_t m0 = qt * kBlockM, n0 = kt * kBlockN;
  const SeqInfo seq = SeqInfo::of<false>(p, bm);  // masks come padded only (unsupported_reason)
  if (kt >= key_tile_end(p, seq, m0)) return;
  // The mask's own (batch, head) plane: Plane takes a query head, h = hm * head_ratio.
  const Plane<uint8_t> m(p.mask, bm, hm * p.mask.head_ratio);
  const TileBounds tb(p, seq, m0, n0);
  // A top-k mask keeps something in almost every tile's first 8 rows: those are read first, and
  // the other 56 only when they are empty (for such masks the pass reads ~1/8 of the mask).
  constexpr int kPer = kBlockM * kBlockN / 16 / 32;
  bool hit = __any_sync(0xffffffffu, chunks_any<0, 1>(m, tb, vec, m0, n0, lane));
  if (!hit) hit = __any_sync(0xffffffffu, chunks_any<1, kPer>(m, tb, vec, m0, n0, lane));
  if (hit && lane == 0) {
    uint32_t* row = meta + (plane * gridDim.y + qt) * n_words;
    atomicOr(row + kt / kTilesPerWord, 1u << (kt % kTilesPerWord));
  }
}

}  // namespace

void run_tile_meta(const FwdParams& p, int64_t mask_batches, int64_t mask_heads, void* meta, int64_t n_words,
                   void* stream) {
  const int64_t n_qt = ceil_div(p.seqlen_q, kBlockM), n_kt = ceil_div(p.seqlen_k, kBlockN);
  const int64_t planes = mask_batches * mask_heads;
  for (int64_t plane0 = 0; plane0 < planes && n_qt > 0 && n_kt > 0; plane0 += kMaxGridDim) {
    dim3 grid((unsigned)ceil_div(n_kt, kWarpsPerCta), (unsigned)n_qt, (unsigned)imin(kMaxGridDim, planes - plane0));
    tile_meta_kernel<<<grid, 32 * kWarpsPerCta, 0, static_cast<cudaStream_t>(stream)>>>(
        p, mask_rows_aligned(p), static_cast<uint32_t*>(meta), n_words, mask_heads, plane0);
  }
}

}  // namespace cuda
}  // namespace flexdma
