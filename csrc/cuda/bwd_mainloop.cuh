// Pieces of the backward main pass's loop (bwd_kernel.cuh runs the walk over work items, the
// copies and the products): the walk's activity bits in smem, and P^T from S^T. Fragments are a warp's 16
// keys x 64 queries of the transposed scores (C-fragment layout: rows w * 16 + g (+ 8), columns
// n * 8 + 2 * qc (+ 1)). The gather of the additive terms into sDS and dS^T from dP^T stay in the
// kernel: as device functions (inlined or forced inline) ptxas orders their instructions
// differently.
#pragma once
#include "../flash_dma_params.h"
#include "constants.cuh"
#include "mma_sm80.cuh"
#include "smem_layout.cuh"
#include "softmax.cuh"

namespace flexdma {
namespace cuda {

// The walk's activity bits: bit i of word t of sMeta says whether work item base + 32 t + i (in
// walk order, item = (mt - mt_begin) * ratio + gq) keeps anything of key tile n_tile; one word a
// thread, so that skipping an empty item costs a shared load instead of a global round trip.
__device__ inline void bwd_meta_chunk(const BwdParams& p, uint32_t* sMeta, int b, int kvh, int ratio, int n_tile,
                                      int mt_begin, int m_tiles, int base) {
  const uint32_t* col =
      static_cast<const uint32_t*>(p.tile_meta.ptr) + b * p.tile_meta.batch_stride + n_tile / kTilesPerWord;
  uint32_t bits = 0;
#pragma unroll 4
  for (int i = 0; i < 32; ++i) {
    const int it = base + (int)threadIdx.x * 32 + i, mt_i = mt_begin + it / ratio;
    const int h_i = kvh * ratio + it % ratio;
    if (mt_i < m_tiles)
      bits |= ((col[(h_i / (int)p.tile_meta.head_ratio) * p.tile_meta.head_stride + mt_i * p.tile_meta.row_stride] >>
                (n_tile % kTilesPerWord)) &
               1u)
              << i;
  }
  sMeta[threadIdx.x] = bits;
}

// P^T = exp2(S^T * mul + additive term - lse2) in place of S^T (softcapped first where scf != 0);
// under softcap the derivative 1 - t^2 is kept where the additive term was (read once).
__device__ inline void bwd_probs(float (&s)[kBlockN / 8][4], float* sDS, const float* sL2, float mulf, float scf,
                                 float soc, int w, int g, int qc) {
  if (scf != 0.f) softcap_tanh(s, soc);
#pragma unroll
  for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = w * 16 + g + 8 * hh, c = n * 8 + 2 * qc;
      float2* slot = reinterpret_cast<float2*>(sDS + r * kLdDS + c);
      const float2 add = *slot;
      const float t0 = s[n][2 * hh], t1 = s[n][2 * hh + 1];
      const float2 l2c = *reinterpret_cast<const float2*>(sL2 + c);
      s[n][2 * hh] = exp2f(fmaf(t0, mulf, add.x) - l2c.x);
      s[n][2 * hh + 1] = exp2f(fmaf(t1, mulf, add.y) - l2c.y);
      if (scf != 0.f) *slot = make_float2(fmaf(-scf * t0, t0, 1.f), fmaf(-scf * t1, t1, 1.f));
    }
}

}  // namespace cuda
}  // namespace flexdma
