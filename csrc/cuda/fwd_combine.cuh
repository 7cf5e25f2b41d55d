// Split-key combine of the forward (flash-decoding): merges the normalised partial outputs and
// LSEs of the key splits into out and lse.
#pragma once
#include <math_constants.h>

#include "../flash_dma_params.h"
#include "constants.cuh"
#include "fwd_epilogue.cuh"
#include "mma_sm80.cuh"
#include "softmax.cuh"

namespace flexdma {
namespace cuda {

// Merges the key splits of every (batch, head, row), one warp per row, splits in a fixed order:
// out = sum_s w_s O_s / sum_s w_s with w_s = exp(lse_s - max lse), lse = max + log sum w.
// A row no split saw anything of stays 0 / -inf.
template <typename T, int D>
__global__ void combine_splits(const FwdParams p, const FwdSplit sp) {
  const int64_t rows = p.batch * p.num_heads * p.seqlen_q;
  const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  float m = -CUDART_INF_F;
  for (int s = lane; s < sp.n; s += 32) m = fmax_nan(m, sp.lse_part[s * rows + row]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmax_nan(m, __shfl_xor_sync(0xffffffffu, m, o));
  float acc[D / 32], wsum = 0.f;
#pragma unroll
  for (int e = 0; e < D / 32; ++e) acc[e] = 0.f;
  if (m != -CUDART_INF_F) {  // NaN enters: every weight is then NaN
    for (int s = 0; s < sp.n; ++s) {
      const float l = sp.lse_part[s * rows + row];
      if (l == -CUDART_INF_F) continue;
      const float wgt = __expf(l - m);
      wsum += wgt;
      const float* o = sp.o_part + (s * rows + row) * D;
#pragma unroll
      for (int e = 0; e < D / 32; ++e) acc[e] = fmaf(wgt, o[lane + 32 * e], acc[e]);
    }
  }
  const int64_t i = row % p.seqlen_q, bh = row / p.seqlen_q, h = bh % p.num_heads, b = bh / p.num_heads;
  T* orow = static_cast<T*>(p.out) + b * p.o_batch_stride + h * p.o_head_stride + i * p.o_row_stride;
  // wsum is 0 only when no split kept anything; a NaN split (its LSE NaN) makes m, wsum and the
  // row NaN.
  const bool empty = wsum == 0.f;
  const float inv = empty ? 0.f : 1.f / wsum;
  T* rrow = p.out_resid ? static_cast<T*>(p.out_resid) + (orow - static_cast<T*>(p.out)) : nullptr;
#pragma unroll
  for (int e = 0; e < D / 32; ++e) {
    const float x = acc[e] * inv;
    orow[lane + 32 * e] = from_float<T>(x);
    if (rrow) rrow[lane + 32 * e] = from_float<T>(x - to_float(from_float<T>(x)));
  }
  if (lane == 0) static_cast<float*>(p.lse)[row] = empty ? -CUDART_INF_F : m + __logf(wsum);
}

}  // namespace cuda
}  // namespace flexdma
