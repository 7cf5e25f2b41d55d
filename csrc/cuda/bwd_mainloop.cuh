// Pieces of the backward main pass's loop (bwd_kernel.cuh runs the walk over work items, the
// copies and the products): the walk's activity bits in smem and its next kept item, and P^T from
// S^T. Fragments are a warp's 16 keys x 64 queries of the transposed scores (C-fragment layout:
// rows w * 16 + g (+ 8), columns n * 8 + 2 * qc (+ 1)). The steps of one work item are
// bwd_kernel.cuh's.
#pragma once
#include "../flash_dma_params.h"
#include "constants.cuh"
#include "copy.cuh"
#include "mask.cuh"
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

// The walk's next kept work item at or after (mt, gq) (query tiles below m_tiles, heads of kv head
// kvh's group of `ratio` in order), its keep tile requested or built into `slot` (a full tile's
// raw mask bytes by cp.async, committed; cut tiles built); false when none is left. The item of
// query tile reuse_mt takes the previous item's gathered terms and no keep tile. item_active(mt,
// gq): the item's activity bit. Block-uniform.
template <typename ItemActive>
__device__ inline bool bwd_find_next(const BwdParams& p, const BwdFlags& f, const SeqInfo& seq, int kvh, int ratio,
                                     int m_tiles, int n0, int reuse_mt, bool has_mask, ItemActive&& item_active,
                                     int& mt, int& gq, uint8_t* slot) {
  const int b = (int)seq.b;
#pragma unroll 1
  for (; mt < m_tiles; ++mt, gq = 0) {
    const TileBounds tb(p, seq, mt * kBlockM, n0);
    if (!tb.any()) continue;
#pragma unroll 1
    for (; gq < ratio; ++gq) {
      if (mt == reuse_mt && (!has_mask || item_active(mt, gq))) return true;
      if (has_mask) {
        if (!item_active(mt, gq)) continue;
        const Plane<uint8_t, int> mask(p.mask, b, kvh * ratio + gq);
        // A full tile whose activity bit is set keeps something: its raw mask bytes are its keep
        // tile, copied asynchronously (the wait before the item covers them).
        if (tb.full && f.mask_vec) {
          issue_mask_raw(mask, slot, mt * kBlockM, n0);
          cp_async_commit();
          return true;
        }
        if (build_keep(tb, mask, slot, f.mask_vec, mt * kBlockM, n0)) return true;
      } else {
        if (!tb.full) build_keep(tb, Plane<uint8_t, int>(p.mask, b, 0), slot, f.mask_vec, mt * kBlockM, n0);
        return true;
      }
    }
  }
  return false;
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
