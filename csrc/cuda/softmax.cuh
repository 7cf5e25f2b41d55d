// The score transform and the softmax, in log2 units (exp2 instead of exp): the scale (and
// softcap) constants the backward kernels derive from the params, the forward's online softmax update,
// and the LSE read back by the backward.
#pragma once
#include <math_constants.h>

#include "../flash_dma_params.h"
#include "constants.cuh"

namespace flexdma {
namespace cuda {

// score = softcap > 0 ? softcap * tanh(scale * q.k / softcap) : scale * q.k, times log2 e:
// x = mul * (softcap > 0 ? tanh(q.k * over_cap) : q.k).
struct ScoreScale {
  float softcap_on;  // 1 with a softcap, else 0 (the backward's tanh derivative 1 - on * t^2)
  float mul;         // (softcap or softmax_scale) * log2 e
  float over_cap;    // softmax_scale / softcap, 0 without a softcap
  __device__ inline explicit ScoreScale(const FwdParams& p)
      : softcap_on(p.softcap > 0.f ? 1.f : 0.f),
        mul(p.softcap > 0.f ? p.softcap * kLog2eF : p.softmax_scale * kLog2eF),
        over_cap(p.softcap > 0.f ? p.softmax_scale / p.softcap : 0.f) {}
};

// lse in log2 units; an empty row (lse -inf) or a row past the length gets +inf, so that
// exp2(x - l2) is 0 for every x including -inf, without a branch.
__device__ inline float lse_log2(float lse) { return lse == -CUDART_INF_F ? CUDART_INF_F : lse * kLog2eF; }

// s = tanh(s * over_cap) over a warp's score fragments: the softcap before its scale (the
// backward keeps t = tanh(.) for the derivative 1 - t^2).
__device__ inline void softcap_tanh(float (&s)[kBlockN / 8][4], float over_cap) {
#pragma unroll
  for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[n][e] = tanhf(s[n][e] * over_cap);
}

// max that returns NaN when either input is NaN (fmaxf returns the other input). A kept score
// that is NaN (a NaN in q, k or bias) must turn its row NaN, as in the reference and in SDPA; a
// max that skipped it would leave the row looking finite. Dropped scores are -inf before the max,
// so a NaN at a masked key never gets here.
__device__ inline float fmax_nan(float a, float b) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a != a || b != b) ? a + b : fmaxf(a, b);
#endif
}

// How far (log2 units) a row's scores may rise above the max its P and O are scaled by before
// that max moves: 8 keeps P <= 256, exact in fp32 and within bf16 / fp16's range.
constexpr float kRescaleSlack = 8.f;

// The forward's accumulators before the first key tile: O = 0, and for rows g, g + 8 of the thread
// the running max (-inf: nothing seen) and the per-thread row sum.
template <int D>
__device__ inline void softmax_init(float (&o)[D / 8][4], float (&row_max)[2], float (&row_sum)[2]) {
#pragma unroll
  for (int d = 0; d < D / 8; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[d][e] = 0.f;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    row_max[hh] = -CUDART_INF_F;
    row_sum[hh] = 0.f;
  }
}

// One online-softmax step over a warp's 16 x (64 P) score fragments, P 64-key pieces side by side
// (rows g and g + 8 of the thread; s times `scale` (> 0) is in log2 units): the running row max (log2
// units) and per-thread row sum are updated, s becomes P, and alpha = exp2(old max - new max) is what
// the O accumulator must be scaled by (rescale_o). Apart so that a kernel can compute P while the
// previous tile's P.V still accumulates into O. The scale rides in the exponent's FFMA (exp2(s * scale
// - max)) where the scores need no other transform, instead of a multiply per score. A NaN score makes
// the max NaN, and with it P, the sum and O of the row (fmax_nan).
template <int P>
__device__ inline void softmax_step(float (&s)[P][kBlockN / 8][4], float (&row_max)[2], float (&row_sum)[2],
                                    float (&alpha)[2], float scale = 1.f) {
  float mx[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
  for (int j = 0; j < P; ++j)
#pragma unroll
    for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) mx[hh] = fmax_nan(mx[hh], fmax_nan(s[j][n][2 * hh], s[j][n][2 * hh + 1]));
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    mx[hh] = fmax_nan(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
    mx[hh] = fmax_nan(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
    const float m_new = fmax_nan(row_max[hh], mx[hh] * scale);
    // The max in use stays where the row's scores rise by at most kRescaleSlack over it: then
    // alpha is exactly 1 and a warp whose rows all keep theirs skips rescaling O (rescale_o_if).
    // P stays <= 2^kRescaleSlack, and the sum and O carry the same stale max, which the epilogue's
    // LSE (max + log2 sum) absorbs; the sum stays >= 1 (it holds the p = 1 of the score that set
    // the max). A NaN max fails the compare and is taken, as before.
    const bool stay = row_max[hh] != -CUDART_INF_F && m_new <= row_max[hh] + kRescaleSlack;
    const float m_cur = stay ? row_max[hh] : m_new;
    const float m_use = m_cur == -CUDART_INF_F ? 0.f : m_cur;  // all -inf so far: p = 0, alpha = 0
    alpha[hh] = stay ? 1.f : exp2f(row_max[hh] - m_use);
    row_max[hh] = m_cur;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < P; ++j)
#pragma unroll
      for (int n = 0; n < kBlockN / 8; ++n) {
        s[j][n][2 * hh] = exp2f(fmaf(s[j][n][2 * hh], scale, -m_use));
        s[j][n][2 * hh + 1] = exp2f(fmaf(s[j][n][2 * hh + 1], scale, -m_use));
        sum += s[j][n][2 * hh] + s[j][n][2 * hh + 1];
      }
    row_sum[hh] = row_sum[hh] * alpha[hh] + sum;
  }
}
// The same over one 64-key piece.
__device__ inline void softmax_step(float (&s)[kBlockN / 8][4], float (&row_max)[2], float (&row_sum)[2],
                                    float (&alpha)[2], float scale = 1.f) {
  softmax_step<1>(reinterpret_cast<float (&)[1][kBlockN / 8][4]>(s), row_max, row_sum, alpha, scale);
}

template <int D>
__device__ inline void rescale_o(float (&o)[D / 8][4], const float (&alpha)[2]) {
#pragma unroll
  for (int d = 0; d < D / 8; ++d)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      o[d][2 * hh] *= alpha[hh];
      o[d][2 * hh + 1] *= alpha[hh];
    }
}

// rescale_o where some row of the warp moved its max (warp-uniform: the rows' alphas are all 1
// once their maxima settle, which is most key tiles after the first few).
template <int D>
__device__ inline void rescale_o_if(float (&o)[D / 8][4], const float (&alpha)[2]) {
  if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) rescale_o<D>(o, alpha);
}

template <int D>
__device__ inline void online_softmax(float (&s)[kBlockN / 8][4], float (&row_max)[2], float (&row_sum)[2],
                                      float (&o)[D / 8][4], float scale = 1.f) {
  float alpha[2];
  softmax_step(s, row_max, row_sum, alpha, scale);
  rescale_o_if<D>(o, alpha);
}

}  // namespace cuda
}  // namespace flexdma
