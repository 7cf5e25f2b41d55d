// The forward's score stage on a warp's 16 x 64 S fragments, between S = Q K^T and the softmax:
// scale (or softcap), bias, and which scores are dropped (keep tile, bounds and causality, or the
// per-key rank rule). Shared by the forward kernels.
#pragma once
#include <math_constants.h>

#include "../flash_dma_params.h"
#include "constants.cuh"
#include "mask.cuh"
#include "mma_sm80.cuh"
#include "smem_layout.cuh"

namespace flexdma {
namespace cuda {

// Scores come out in log2 units (scale * log2 e folded in once), so the softmax needs one exp2
// per element and no multiply. The scale and the softcap factor stay two constants, not
// ScoreScale's selected `mul`: a select in front of every tile's multiply lengthens the
// forward's per-element chain.
struct FwdScoreConsts {
  bool softcap_on;
  float scale_l2, cap_l2, scale_over_cap;
  __device__ inline explicit FwdScoreConsts(const FwdParams& p)
      : softcap_on(p.softcap > 0.f),
        scale_l2(p.softmax_scale * kLog2eF),
        cap_l2(p.softcap * kLog2eF),
        scale_over_cap(p.softcap > 0.f ? p.softmax_scale / p.softcap : 0.f) {}
};

// The rows of a warp's fragments (r0 = its first row in the 64-row tile, qc = lane % 4) in the
// tile at (m0, n0); `full`: the tile needs no bounds or causal check (TileBounds::full, known to
// the caller without building the bounds; seq: the sequence whose lengths bound it). sb: the bias tile at row r0 (null:
// no bias), bias_row_step 0 where one row serves all queries; keep: the tile's keep bytes (null: no mask). kRankRule:
// the rank rule on the key slot instead of bias and keep (apply_rank_keep; lim_warp / thr_warp: the smallest causal
// limit / largest kept rank of the warp's rows). Each stage is one unrolled loop behind a CTA-uniform branch: a
// per-element branch (softcap or not, full tile or not) compiled to a jump per element. Returns the scale still to
// apply to s (softmax_step's): without softcap and bias the scores stay unscaled and the softmax folds the scale in.
template <bool kRankRule, typename T>
__device__ inline float fwd_scores(float (&s)[kBlockN / 8][4], const FwdScoreConsts& sc, const FwdParams& p,
                                   const SeqInfo& seq, int64_t m0, int64_t n0, bool full, const T* sb,
                                   int bias_row_step, const uint8_t* keep, const int32_t* key_slot, const int (&thr)[2],
                                   const int (&lim)[2], int lim_warp, int thr_warp, int r0, int qc) {
  float later = 1.f;
  if (sc.softcap_on) {
#pragma unroll
    for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = sc.cap_l2 * tanhf(s[n][e] * sc.scale_over_cap);
  }
  if constexpr (kRankRule) {
    // The scale folds into the rank rule's bias FFMA (softcap's scores are scaled already).
    apply_rank_keep(s, key_slot, thr, lim, lim_warp, thr_warp, sc.softcap_on ? 1.f : sc.scale_l2, qc);
    return later;
  }
  if (!sc.softcap_on) {
    if (sb || !(sc.scale_l2 > 0.f)) {
#pragma unroll
      for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] *= sc.scale_l2;
    } else {
      later = sc.scale_l2;
    }
  }
  if (sb) {
#pragma unroll
    for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float2 bv = unpack2<T>(*reinterpret_cast<const uint32_t*>(sb + 8 * hh * bias_row_step + n * 8 + 2 * qc));
        s[n][2 * hh] = fmaf(bv.x, kLog2eF, s[n][2 * hh]);
        s[n][2 * hh + 1] = fmaf(bv.y, kLog2eF, s[n][2 * hh + 1]);
      }
  }
  // Bounds and causality only matter on the few tiles a length or the diagonal cuts.
  if (full) {
    if (keep) apply_keep<false>(s, keep, r0, qc, TileBounds{});
  } else {
    const TileBounds tb(p, seq, m0, n0);
    if (keep) {
      apply_keep<true>(s, keep, r0, qc, tb);
    } else {
#pragma unroll
      for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (!tb.ok(r0 + 8 * (e / 2), n * 8 + 2 * qc + (e % 2))) s[n][e] = -CUDART_INF_F;
    }
  }
  return later;
}

// Key tiles at n0 with n0 + 64 <= full_keys(p, nq, nk, m0) need no bounds or causal check for the 64 rows
// at m0 (TileBounds::full): all rows inside seqlen_q, all keys inside seqlen_k and at or before
// the first row's causal limit.
// nq / nk: the sequence's query and key rows (SeqInfo).
__device__ inline int64_t full_keys(const FwdParams& p, int64_t nq, int64_t nk, int64_t m0) {
  if (m0 + kBlockM > nq) return 0;
  return p.is_causal ? imin(nk, m0 + nk - nq + 1) : nk;
}

}  // namespace cuda
}  // namespace flexdma
