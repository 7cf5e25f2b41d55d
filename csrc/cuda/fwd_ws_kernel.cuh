// Forward kernel, warp-specialized (sm_90a, head dims 64 / 128): one CTA of three warpgroups per
// (128-row query tile, head, batch, key split), one CTA per SM.
//   warpgroup 0 loads: K / V tiles (contiguous, or gathered through the query tile's key list on
//     the per-key path), the bias tiles, the mask bytes (raw by cp.async, or built where a length
//     or misalignment rules that out) into a ring of kStages stages, handed over by mbarriers;
//   warpgroups 1 and 2 compute rows [0, 64) and [64, 128) of the tile from the same stages: Q in
//     registers, S = Q K^T and O += P V on wgmma, the online softmax in registers.
// Why: in the one-warpgroup kernel (fwd_kernel.cuh) the threads that run the products also issue
// every copy, compute its addresses and wait at a CTA barrier per tile, and each 64-row CTA reads
// its own K / V. Here the copies and their integer work are off the computing warps' issue path,
// a stage is released by the warps that used it instead of a CTA barrier, each K / V byte serves
// 128 rows, and inside a computing warpgroup S of the next tile is in flight while P V of this one
// runs (the softmax of tile t + 1 overlaps the tensor cores' P V of tile t).
// kTopk (the per-key top-W rule, flexdma::topk_fwd): the key tiles are consecutive 64-entry pieces
// of the query tile's key list (FwdParams::tile_keys, 128-row lists), and the mask is the rank rule
// (apply_rank_keep) with the bias of each listed key.
#pragma once
#include <math_constants.h>

#include "../flash_dma_params.h"
#include "constants.cuh"
#include "copy.cuh"
#include "fwd_epilogue.cuh"
#include "fwd_scores.cuh"
#include "mask.cuh"
#include "mma_sm80.cuh"
#include "mma_sm90.cuh"
#include "pipeline.cuh"
#include "smem_layout.cuh"
#include "softmax.cuh"

namespace flexdma {
namespace cuda {

constexpr int kWsThreads = 3 * kThreads;
constexpr int kWsRows = 2 * kBlockM;  // query rows of a CTA
// Registers per thread after the hand-over (setmaxnreg): 128 x 56 + 256 x 224 = 64512 of the
// SM's 65536. The computing warps hold O (D / 2), S (32), P (16) and Q (D / 4) at D = 128.
constexpr int kLoadRegs = 104, kComputeRegs = 200;
// Named barriers (0 is __syncthreads'): the loading warpgroup's, each computing warpgroup's.
constexpr int kBarLoad = 1, kBarCompute = 2;

template <typename T, int D>
struct FwdWsSmem {
  // A computing warpgroup holds stage i until it has S of tile i + 1 (issued before P V of tile
  // i), and the loader publishes stage i + 1 after it has requested stage i + 2: with two stages
  // each would wait for the other.
  static constexpr int kStages = D <= 64 ? 4 : 3;
  static_assert(kStages >= 3, "the forward's pipeline needs three stages");
  static constexpr int kTileKV = tile_bytes<D>();
  // A stage's keep bytes for both 64-row halves, or (kTopk) the key list's slot.
  static constexpr int kKeepSlot = 2 * kBlockM * kLdKeep;
  static constexpr int kBiasSlot = kWsRows * kLdBias * 2;
  static constexpr int kBars = 0;            // full[kStages], empty[kStages]
  static constexpr int kIdx = 256;           // kTopk: key indices of 4 tiles (64 words each)
  static constexpr int kQ = kIdx + 4 * 256;  // two 64-row Q tiles, padded rows (ldmatrix)
  static constexpr int kK = (kQ + 2 * kBlockM * tile_ld(D) * 2 + 1023) / 1024 * 1024;
  static constexpr int kV = kK + kStages * kTileKV;
  static constexpr int kKeep = kV + kStages * kTileKV;
  static constexpr int kBias = kKeep + kStages * kKeepSlot;
  static constexpr int kBytes = kBias + kStages * kBiasSlot + 1024;  // + room to align the base to 1024
  static_assert(kBytes <= kMaxSmemPerBlock, "warp-specialized forward smem layout too large");
  static_assert(KeyList<T, D>::kSlotWords * 4 <= kKeepSlot, "KeyList's slot must fit a keep slot");
  static_assert(2 * kStages * 8 <= kIdx, "barriers must fit before the index ring");
};

// What every warpgroup of a CTA derives alike: its tile, its key tiles [t_begin, n_end) (of the
// sequence, or of the key list), and the tile activity rows that say which of them to visit.
struct FwdWsTile {
  int64_t b, h, kvh, m0;
  bool two;  // rows [64, 128) exist
  int64_t t_begin, n_end;
  const uint32_t* meta0;  // tile activity row of rows [0, 64); null without a mask
  const uint32_t* meta1;  // and of rows [64, 128) where they exist
  const int32_t* list;    // kTopk: the query tile's list (count, then key indices)
  __device__ inline ActiveTiles active() const { return ActiveTiles(meta0, meta1); }
  // First key tile >= t (and < n_end) that keeps something.
  __device__ inline int64_t next(ActiveTiles& a, int64_t t) const { return meta0 ? a.next(t, n_end) : t; }
};

// Warpgroup 0: fills stage i % kStages with key tile i of the CTA's sequence once the computing
// warpgroups have released its previous use, and publishes it (full[stage]) when its copies have
// landed. Each thread publishes a stage after requesting the next one (cp.async groups complete
// in order), so two stages' copies are in flight per thread.
template <typename T, int D, bool kTopk>
__device__ inline void fwd_ws_load(const FwdParams& p, const FwdFlags& f, const FwdWsTile& c, unsigned char* smem) {
  using L = FwdWsSmem<T, D>;
  constexpr int S = L::kStages;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBars);
  uint64_t* empty = full + S;
  T* sK = reinterpret_cast<T*>(smem + L::kK);
  T* sV = reinterpret_cast<T*>(smem + L::kV);
  uint8_t* sKeep = smem + L::kKeep;
  T* sB = reinterpret_cast<T*>(smem + L::kBias);
  int32_t* ring = reinterpret_cast<int32_t*>(smem + L::kIdx);
  auto idx = [&](int64_t t) { return ring + (t & 3) * 64; };
  auto slot = [&](int st) { return reinterpret_cast<int32_t*>(sKeep + st * L::kKeepSlot); };

  const T* kp = static_cast<const T*>(p.k) + c.b * p.k_batch_stride + c.kvh * p.k_head_stride;
  const T* vp = static_cast<const T*>(p.v) + c.b * p.v_batch_stride + c.kvh * p.v_head_stride;
  const Plane<T> bias(p.bias, c.b, c.h);
  const Plane<uint8_t> mask(p.mask, c.b, c.h);
  const Plane<int32_t> ranks(p.key_rank, c.b, c.h);
  const bool has_bias = !kTopk && p.bias.ptr != nullptr, has_mask = p.mask.ptr != nullptr;
  KeyList<T, D> kl{};
  if constexpr (kTopk) {
    // Tile t's indices arrive two tiles ahead; the first two now.
    kl.keys = c.list + 1;
    kl.n = c.list[0];
    kl.request(idx(c.t_begin), c.t_begin * kBlockN);
    kl.request(idx(c.t_begin + 1), (c.t_begin + 1) * kBlockN);
    cp_async_commit();
    cp_async_wait<0>();
    named_barrier(kBarLoad, kThreads);
  }
  float prev_bias = 0.f;  // kTopk: KeyList's bias of the tile requested one iteration ago
  ActiveTiles active = c.active();
  int i = 0, prev = 0;
  for (int64_t t = c.next(active, c.t_begin); t < c.n_end; t = c.next(active, t + 1), ++i) {
    const int st = i % S;
    if (i >= S) mbar_wait(&empty[st], ((i / S) & 1) ^ 1);
    T* sk = sK + st * L::kTileKV / 2;
    T* sv = sV + st * L::kTileKV / 2;
    const int64_t n0 = t * kBlockN;
    float key_bias = 0.f;
    if constexpr (kTopk) {
      kl.issue(idx(t), slot(st), sk, sv, kp, vp, p.k_row_stride, p.v_row_stride, n0, ranks, bias, key_bias);
      kl.request(idx(t + 2), n0 + 2 * kBlockN);
    } else {
      issue_kv<T, D>(kp, vp, p.k_row_stride, p.v_row_stride, p.seqlen_k, n0, sk, sv, f.qkv_vec);
      for (int half = 0; half < (c.two ? 2 : 1); ++half) {
        const int64_t mh = c.m0 + half * kBlockM;
        const TileBounds tb(p, mh, n0);
        // A bias broadcast over queries is read from the first half's row 0 by both halves.
        if (has_bias && (half == 0 || bias.rs != 0))
          issue_bias<true>(tb, bias, sB + st * (L::kBiasSlot / 2) + half * kBlockM * kLdBias, f.bias_vec, mh, n0);
        uint8_t* keep = sKeep + st * L::kKeepSlot + half * kBlockM * kLdKeep;
        if (has_mask) {
          if (mask_async(p, f.mask_vec, mh, n0))
            issue_mask_raw(mask, keep, mh, n0);
          else
            build_keep<false>(tb, mask, keep, f.mask_vec, mh, n0);
        }
      }
    }
    cp_async_commit();
    if (i > 0) {
      cp_async_wait<1>();
      if constexpr (kTopk) kl.stage(slot(prev), prev_bias);
      fence_proxy_async();  // the copies are read by wgmma, through the async proxy
      mbar_arrive(&full[prev]);
    }
    // kTopk: the indices of tile t + 1 (requested with tile t - 1) are in every loader's view.
    if constexpr (kTopk) named_barrier(kBarLoad, kThreads);
    prev = st;
    prev_bias = key_bias;
  }
  if (i > 0) {
    cp_async_wait<0>();
    if constexpr (kTopk) kl.stage(slot(prev), prev_bias);
    fence_proxy_async();
    mbar_arrive(&full[prev]);
  }
  cp_async_wait<0>();  // the index requests past the list's end
}

// Warpgroups 1 and 2 (wg 0 / 1): rows [64 wg, 64 wg + 64) of the CTA's tile over every stage in
// order. A warpgroup whose rows see none of a tile (past its causal end, or past seqlen_q) only
// waits for the stage and releases it.
template <typename T, int D, bool kTopk>
__device__ inline void fwd_ws_compute(const FwdParams& p, const FwdFlags& f, const FwdSplit& sp, const FwdWsTile& c,
                                      unsigned char* smem, int wg) {
  using L = FwdWsSmem<T, D>;
  constexpr int S = L::kStages;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBars);
  uint64_t* empty = full + S;
  const T* sK = reinterpret_cast<const T*>(smem + L::kK);
  const T* sV = reinterpret_cast<const T*>(smem + L::kV);
  const uint8_t* sKeep = smem + L::kKeep;
  const T* sB = reinterpret_cast<const T*>(smem + L::kBias);
  const int tid = threadIdx.x - kThreads * (1 + wg);
  const int w = tid / 32, lane = tid % 32, g = lane / 4, qc = lane % 4;
  const int64_t mc = c.m0 + wg * kBlockM;
  const bool idle = mc >= p.seqlen_q;

  constexpr int kLd = tile_ld(D);
  uint32_t qf[D / 16][4];
  if (!idle) {
    T* sQ = reinterpret_cast<T*>(smem + L::kQ) + wg * kBlockM * kLd;
    const T* q = static_cast<const T*>(p.q) + c.b * p.q_batch_stride + c.h * p.q_head_stride + mc * p.q_row_stride;
    load_rows<T, kBlockM, D>(sQ, q, p.q_row_stride, (int)imin(kBlockM, p.seqlen_q - mc), f.qkv_vec, tid);
    named_barrier(kBarCompute + wg, kThreads);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      ldmatrix_x4(qf[kk], sQ + (w * 16 + (lane & 15)) * kLd + kk * 16 + (lane >> 4) * 8);
  }

  // The rank rule's per-row terms of this thread's rows g, g + 8: the largest kept rank (-1 past
  // seqlen_q: nothing kept) and the causal limit.
  int thr[2] = {-1, -1}, lim[2] = {0x7fffffff, 0x7fffffff};
  if constexpr (kTopk) {
    const Plane<int32_t> thr_plane(p.row_thr, c.b, c.h);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int64_t r = mc + w * 16 + g + 8 * hh;
      if (r < p.seqlen_q) thr[hh] = *thr_plane.at(r, 0);
      if (p.is_causal) lim[hh] = (int)(r + p.seqlen_k - p.seqlen_q);
    }
  }
  // Key tiles past this half's causal end drop every score of it. The key list is walked whole.
  const int64_t own_end = idle ? c.t_begin : kTopk ? c.n_end : imin(c.n_end, key_tile_end(p, mc));
  const bool has_bias = !kTopk && p.bias.ptr != nullptr, has_mask = p.mask.ptr != nullptr;
  const int bias_row_step = p.bias.row_stride != 0 ? kLdBias : 0;
  const int bias_row0 = p.bias.row_stride != 0 ? wg * kBlockM + w * 16 + g : 0;
  const FwdScoreConsts sc(p);
  const uint32_t q_live = p.softcap < 0.f ? 1u : 0u;

  float o[D / 8][4];
#pragma unroll
  for (int d = 0; d < D / 8; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[d][e] = 0.f;
  float row_max[2] = {-CUDART_INF_F, -CUDART_INF_F}, row_sum[2] = {0.f, 0.f};  // rows g, g + 8; sum per thread
  float s[kBlockN / 8][4];
  uint32_t pa[kBlockN / 16][4];  // P as A fragments; read by the P.V wgmma until it is waited for
  float alpha[2];

  auto wait_full = [&](int i) { mbar_wait(&full[i % S], (i / S) & 1); };
  auto release = [&](int i) {
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[i % S]);
  };
  // S = Q K^T of stage st, issued and left in flight.
  auto gemm_s = [&](int st) {
    const T* sk = sK + st * L::kTileKV / 2;
#pragma unroll
    for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
    fence_regs(s);
    fence_regs(qf);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) wgmma_rs<T, kBlockN, 0>(s, qf[kk], desc_k_major<kBlockN>(sk, kk), kk > 0);
    wgmma_commit();
  };
  // O += P V of stage st, issued and left in flight.
  auto gemm_pv = [&](int st) {
    const T* sv = sV + st * L::kTileKV / 2;
    fence_regs(o);
    fence_regs(pa);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) wgmma_rs_mn<T, D, kBlockN>(o, pa[kk], sv, kk);
    wgmma_commit();
  };
  // Q's fragments are read only by the S wgmma; ptxas (CUDA 13.0) took them for dead after that
  // read and gave their registers to P at D = 64. A real instruction that rewrites them keeps them
  // live; q_live is 0 at run time (softcap >= 0 is checked before launch). Only where no S wgmma
  // is in flight: a write to its input registers serialises every wgmma (C7513).
  auto keep_q = [&] {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) qf[kk][e] ^= q_live;
  };
  // Scale, bias and drop rule on S of key tile t in stage st, then the softmax step.
  auto softmax_tile = [&](int64_t t, int st) {
    const uint8_t* keep = has_mask ? sKeep + st * L::kKeepSlot + wg * kBlockM * kLdKeep : nullptr;
    const T* sb = has_bias ? sB + st * (L::kBiasSlot / 2) + bias_row0 * kLdBias : nullptr;
    const int32_t* slot = reinterpret_cast<const int32_t*>(sKeep + st * L::kKeepSlot);
    fwd_scores<kTopk, T>(s, sc, TileBounds(p, mc, t * kBlockN), sb, bias_row_step, keep, slot, thr, lim, w * 16 + g,
                         qc);
    softmax_step(s, row_max, row_sum, alpha);
  };

  ActiveTiles active = c.active();
  int i = 0;
  int64_t t = c.next(active, c.t_begin);
  if (t < own_end) {
    wait_full(i);
    gemm_s(i % S);
    wgmma_wait<0>();
    fence_regs(s);
    softmax_tile(t, i % S);  // O is still 0: no rescale
    c_to_a<T>(s, pa);
    // Every wgmma issued in an iteration is waited for in it, and the loop exits before issuing:
    // ptxas serialises all wgmmas where one may still be in flight across a branch (C7514 /
    // C7515).
    for (;;) {
      const int64_t tn = c.next(active, t + 1);
      if (tn >= own_end) break;
      wait_full(i + 1);
      gemm_s((i + 1) % S);
      gemm_pv(i % S);
      wgmma_wait<1>();  // S of tile tn; P.V of tile t still runs
      fence_regs(s);
      keep_q();
      softmax_tile(tn, (i + 1) % S);
      wgmma_wait<0>();
      fence_regs(o);
      release(i);
      rescale_o<D>(o, alpha);
      c_to_a<T>(s, pa);
      ++i;
      t = tn;
    }
    gemm_pv(i % S);
    wgmma_wait<0>();
    fence_regs(o);
    release(i);
    ++i;
    t = c.next(active, t + 1);
  }
  for (; t < c.n_end; t = c.next(active, t + 1), ++i) {
    wait_full(i);
    release(i);
  }
  if (!idle) fwd_epilogue<T, D>(p, f, sp, o, row_max, row_sum, c.b, c.h, mc, tid);
}

template <typename T, int D, bool kTopk>
__global__ void __launch_bounds__(kWsThreads, 1) fwd_ws_kernel(const FwdParams p, const FwdFlags f, const FwdSplit sp) {
  static_assert(use_wgmma<D>() && !fwd_q_in_smem<D>(), "the warp-specialized forward is built for D = 64 / 128");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + smem_align_pad<true>(smem_raw);
  using L = FwdWsSmem<T, D>;

  // Scheduling: the heaviest (last, under causal) query tiles of every head launch first, heads
  // interleaved, so the long tiles of the last head do not form the tail.
  FwdWsTile c;
  const int nh = (int)p.num_heads;
  c.h = (int)blockIdx.x % nh;
  c.b = blockIdx.y;
  const int64_t m_tile = (int)(gridDim.x / nh) - 1 - (int)blockIdx.x / nh;
  c.kvh = c.h / (p.num_heads / p.num_heads_k);
  c.m0 = m_tile * kWsRows;
  c.two = c.m0 + kBlockM < p.seqlen_q;
  int64_t n_all;
  c.list = nullptr;
  if constexpr (kTopk) {
    c.list = Plane<int32_t>(p.tile_keys, c.b, c.h).at(c.m0 / p.topk_tile_rows, 0);
    n_all = ceil_div(c.list[0], kBlockN);
  } else {
    n_all = key_tile_end(p, c.two ? c.m0 + kBlockM : c.m0);
  }
  const int64_t per_split = ceil_div(n_all, sp.n);
  c.t_begin = imin(n_all, (int64_t)blockIdx.z * per_split);
  c.n_end = imin(n_all, c.t_begin + per_split);
  c.meta0 = c.meta1 = nullptr;
  if (!kTopk && p.mask.ptr) {
    const Plane<uint32_t> meta(p.tile_meta, c.b, c.h);
    c.meta0 = meta.at(2 * m_tile, 0);
    if (c.two) c.meta1 = meta.at(2 * m_tile + 1, 0);
  }

  if (threadIdx.x == 0) {
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBars);
#pragma unroll
    for (int st = 0; st < L::kStages; ++st) {
      mbar_init(&full[st], kThreads);                 // every loading thread, once its copies landed
      mbar_init(&full[L::kStages + st], 2 * kWarps);  // (empty) one lane of each computing warp
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (threadIdx.x < kThreads) {
    regs_release<kLoadRegs>();
    fwd_ws_load<T, D, kTopk>(p, f, c, smem);
  } else {
    regs_claim<kComputeRegs>();
    fwd_ws_compute<T, D, kTopk>(p, f, sp, c, smem, threadIdx.x / kThreads - 1);
  }
}

}  // namespace cuda
}  // namespace flexdma
