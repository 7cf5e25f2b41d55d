// Forward kernel of the head dims the warp-specialized one (fwd_ws_kernel.cuh) does not take
// (32 / 96 on mma.sync, 192 / 256 with Q in smem, any head dim on builds without sm_90a): one CTA
// of 4 warps (one warpgroup) per (64-row query tile, head, batch); warp
// w owns query rows [16w, 16w + 16). Q lives in registers as A fragments (in smem above D = 128);
// S, the online softmax statistics, P and the O accumulator never leave registers (P's C fragments
// are repacked as the A operand of P.V). Both products are wgmma (sm_90a, head dims 64 / 128 /
// 192 / 256: B read from swizzled smem by the tensor cores) or mma.sync with ldmatrix (head dims
// 32 / 96, other targets). K, V, bias and mask tiles are double buffered with cp.async: tile
// t+1's copies are in flight while tile t is computed. Which key tiles keep
// anything comes from the mask's tile activity bits (FwdParams::tile_meta), so an all-false
// tile costs no byte at all and finding the next kept tile needs no load round trip.
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
#include "seq_info.cuh"
#include "smem_layout.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"

namespace flexdma {
namespace cuda {

// O += P V of one key tile (V at sv): P's C fragments s repacked as A fragments pa, then the product
// (on wgmma issued and left in flight; on mma.sync computed). qf: Q's fragments (below D = 128).
template <typename T, int D, typename QFrags>
__device__ inline void fwd_pv_tile(float (&s)[kBlockN / 8][4], uint32_t (&pa)[kBlockN / 16][4], float (&o)[D / 8][4],
                                   QFrags& qf, uint32_t q_live, const T* sv, int lane) {
  constexpr bool kWg = use_wgmma<D>();
  constexpr bool kQSmem = fwd_q_in_smem<D>();
  constexpr int kLd = tile_ld(D);
  // O += P V, P's C fragments repacked as A fragments (16 keys per k step).
  c_to_a<T>(s, pa);
  if constexpr (kWg) {
    fence_regs(o);
    fence_regs(pa);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) wgmma_rs_mn<T, D, kBlockN>(o, pa[kk], sv, kk);
    wgmma_commit();
    // Q's fragments are read only by the S wgmma. ptxas (CUDA 13.0) took them for dead after
    // that read and gave their registers to P at D = 64 (wrong S from the second key tile on).
    // A real instruction that rewrites them here keeps them live across P.V; q_live is 0 at
    // run time (softcap >= 0 is checked before launch).
    if constexpr (!kQSmem) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) qf[kk][e] ^= q_live;
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, sv + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kLd + dp * 16 + (lane >> 4) * 8);
        mma_16816<T>(o[2 * dp], pa[kk], vb[0], vb[1]);
        mma_16816<T>(o[2 * dp + 1], pa[kk], vb[2], vb[3]);
      }
  }
}

// At D=64 three CTAs fit an SM (71 KiB smem each) once registers stay <= 168 (no spill): 12 warps
// per SM instead of 8 to hide latency. At D=128 smem (105 KiB) allows two. D=32 (53 KiB) takes
// D=64's bound, D=96 (85 KiB, 250 registers) D=128's; D=192 / 256 (149 / 190 KiB) run one.
// kPacked: packed sequences (FwdParams::cu_seqlens_q), a kernel of its own so that the padded one
// holds no sequence offsets in its registers.
template <typename T, int D, bool kPacked>
__global__ void __launch_bounds__(kThreads, D <= 64    ? 3
                                            : D <= 128 ? 2
                                                       : 1)
    fwd_kernel(const FwdParams p, const FwdFlags f, const FwdSplit sp) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  constexpr bool kWg = use_wgmma<D>();
  constexpr bool kQSmem = fwd_q_in_smem<D>();
  static_assert(!kQSmem || kWg, "head dims above 128 need the sm_90a (wgmma) build");
  // wgmma's swizzled K / V tiles need 1024-byte aligned blocks.
  unsigned char* smem = smem_raw + smem_align_pad<kWg>(smem_raw);
  using L = FwdSmem<T, D>;
  constexpr int kLd = tile_ld(D);
  T* sQ = reinterpret_cast<T*>(smem + L::kQ);
  uint8_t* sKeep = smem + L::kKeep;
  T* sK = reinterpret_cast<T*>(smem + L::kK);
  T* sV = reinterpret_cast<T*>(smem + L::kV);
  T* sB = reinterpret_cast<T*>(smem + L::kBias);

  // This CTA's query tile, head (the grid's units) and batch: heaviest first (tile_scheduler.cuh).
  const WorkTile work = SingleTileScheduler::get((int)p.num_heads);
  const int64_t h = work.unit, b = work.b;
  // Packed sequences (offsets checked ahead of this kernel: check_packed_offsets_kernel): the tiles
  // past a sequence's rows have nothing to do.
  const SeqInfo seq = SeqInfo::of<kPacked>(p, b);
  const int64_t m_tile = work.m_tile;
  const int64_t kvh = h / (p.num_heads / p.num_heads_k);
  const int64_t m0 = m_tile * kBlockM;
  if (kPacked && m0 >= seq.nq) return;
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, qc = lane % 4;

  const T* q = static_cast<const T*>(p.q) + seq.q_offset(p) + h * p.q_head_stride + m0 * p.q_row_stride;
  uint32_t qf[kQSmem ? 1 : D / 16][4];
  if constexpr (kQSmem) {
    // Requested here, landed by the first tile's wait.
    issue_rows<T, D>(sQ, q, p.q_row_stride, (int)imin(kBlockM, seq.nq - m0), f.qkv_vec);
    cp_async_commit();
  } else {
    load_rows<T, kBlockM, D>(sQ, q, p.q_row_stride, (int)imin(kBlockM, seq.nq - m0), f.qkv_vec, threadIdx.x);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      ldmatrix_x4(qf[kk], sQ + (w * 16 + (lane & 15)) * kLd + kk * 16 + (lane >> 4) * 8);
    __syncthreads();  // sQ's bytes now become keep / raw mask buffers
  }

  const T* kp = static_cast<const T*>(p.k) + seq.k_offset(p) + kvh * p.k_head_stride;
  const T* vp = static_cast<const T*>(p.v) + seq.v_offset(p) + kvh * p.v_head_stride;
  const bool has_bias = p.bias.ptr != nullptr;
  // This thread's bias rows in a smem bias tile; a bias broadcast over queries keeps only row 0.
  const int bias_row_step = p.bias.row_stride != 0 ? kLdBias : 0, bias_row0 = p.bias.row_stride != 0 ? w * 16 + g : 0;
  const Plane<T> bias = Plane<T>(p.bias, b, h).from(seq.q0, seq.k0);
  const Plane<uint8_t> mask = Plane<uint8_t>(p.mask, b, h).from(seq.q0, seq.k0);
  const bool bias_vec = seq.vec16<T>(p.bias, f.bias_vec);
  int64_t t_begin, n_end;
  SingleTileScheduler::key_range(key_tile_end(p, seq, m0), sp.n, work.split, t_begin, n_end);
  // This query tile's row of tile activity bits (bit kt: key tile kt keeps something).
  // Packed sequences take no mask (unsupported_reason): compiled out of their kernel.
  const bool has_mask = !kPacked && p.mask.ptr != nullptr;
  const uint32_t* meta_row = has_mask ? Plane<uint32_t>(p.tile_meta, b, h).at(m_tile, 0) : nullptr;

  const FwdScoreConsts sc(p);
  const int no_rank[2] = {0, 0};  // the rank rule's row terms, unused here
  const int64_t keys_full = full_keys(p, seq.nq, seq.nk, m0);
  auto issue_tile = [&](int64_t t, int buf) {
    issue_kv<T, D>(kp, vp, p.k_row_stride, p.v_row_stride, seq.nk, t * kBlockN, sK + buf * L::kTileKV / 2,
                   sV + buf * L::kTileKV / 2, f.qkv_vec);
    if (has_bias)
      issue_bias<true>(TileBounds(p, seq, m0, t * kBlockN), bias, sB + buf * kBlockM * kLdBias, bias_vec, m0,
                       t * kBlockN);
    if (has_mask && mask_async(p, seq, f.mask_vec, m0, t * kBlockN))
      issue_mask_raw(mask, sKeep + buf * L::kKeepSlot, m0, t * kBlockN);
    cp_async_commit();
  };

  const uint32_t q_live = p.softcap < 0.f ? 1u : 0u;
  float o[D / 8][4], row_max[2], row_sum[2];
  softmax_init<D>(o, row_max, row_sum);

  // Tile t's K / V / bias copies (and the raw mask bytes of t + 1) have landed in every thread's
  // view, and in the async proxy's that wgmma reads through. Block-uniform.
  auto land = [&](int buf) {
    cp_async_wait<0>();
    if constexpr (kWg) fence_proxy_async();
    __syncthreads();
  };
  // Tile t (landed in buffer buf) gets its keep bytes where they were not copied raw (tiles a
  // length cuts, unaligned masks). Block-uniform.
  auto keep_tile = [&](int64_t t, int buf) {
    if (has_mask && !mask_async(p, seq, f.mask_vec, m0, t * kBlockN))
      build_keep(TileBounds(p, seq, m0, t * kBlockN), mask, sKeep + buf * L::kKeepSlot, f.mask_vec, m0, t * kBlockN);
  };
  // First key tile >= t (and < n_end) that keeps something.
  ActiveTiles active(meta_row);
  auto next_active = [&](int64_t t) { return has_mask ? active.next(t, n_end) : t; };
  // S = Q K^T for this warp's 16 rows x 64 keys of the tile in buffer `buf`: issued and left
  // in flight (wgmma) or computed (mma.sync).
  float s[kBlockN / 8][4];
  auto gemm_s = [&](int buf) {
    const T* sk = sK + buf * L::kTileKV / 2;
#pragma unroll
    for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
    if constexpr (kQSmem) {
      fence_regs(s);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        wgmma_ss<T, 64>(s, desc_k_major<kBlockM>(sQ, kk), desc_k_major<kBlockN>(sk, kk), kk > 0);
      wgmma_commit();
    } else if constexpr (kWg) {
      fence_regs(s);
      fence_regs(qf);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) wgmma_rs<T, kBlockN, 0>(s, qf[kk], desc_k_major<kBlockN>(sk, kk), kk > 0);
      wgmma_commit();
    } else {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
        for (int np = 0; np < kBlockN / 16; ++np) {
          uint32_t kb[4];
          ldmatrix_x4(kb, sk + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * kLd + kk * 16 + ((lane >> 3) & 1) * 8);
          mma_16816<T>(s[2 * np], qf[kk], kb[0], kb[1]);
          mma_16816<T>(s[2 * np + 1], qf[kk], kb[2], kb[3]);
        }
    }
  };

  // The loop keeps the tensor cores busy while the block waits: on wgmma, P.V of tile t is in
  // flight while tile t's successor lands and its mask is checked, and S of that successor is in
  // flight while the tile after it is requested (into the buffers P.V of t has released).
  // On mma.sync both products are synchronous and the copies are requested before S.
  int64_t t = next_active(t_begin);
  int cur = 0;
  int64_t tn = n_end;
  uint32_t pa[kBlockN / 16][4];  // P of tile t as A fragments; read by the P.V wgmma until it is waited for
  if (t < n_end) {
    issue_tile(t, 0);
    land(0);
    keep_tile(t, 0);
    tn = next_active(t + 1);
    if (tn < n_end) issue_tile(tn, 1);
    gemm_s(0);
    // Left only through the break (a single exit with P.V in flight keeps ptxas from
    // serialising the wgmmas, C7515).
    for (;;) {
      if constexpr (kWg) {
        wgmma_wait<0>();  // S of tile t (and P.V of the tile before)
        fence_regs(s);
        fence_regs(o);
      }
      const T* sv = sV + cur * L::kTileKV / 2;

      const uint8_t* keep = has_mask ? sKeep + cur * L::kKeepSlot : nullptr;
      const T* sb = has_bias ? sB + cur * kBlockM * kLdBias + bias_row0 * kLdBias : nullptr;
      const float later = fwd_scores<false, T>(s, sc, p, seq, m0, t * kBlockN, t * kBlockN + kBlockN <= keys_full, sb,
                                               bias_row_step, keep, nullptr, no_rank, no_rank, 0, 0, w * 16 + g, qc);
      online_softmax<D>(s, row_max, row_sum, o, later);

      fwd_pv_tile<T, D>(s, pa, o, qf, q_live, sv, lane);
      if (tn >= n_end) break;

      land(cur ^ 1);  // tile tn landed; every warp is done with tile t's bias and keep bytes
      keep_tile(tn, cur ^ 1);
      const int64_t tnn = next_active(tn + 1);
      // P.V of tile t is done from here on: its K / V / bias / mask buffers take tile tnn. (Issuing S
      // while P.V is still in flight makes ptxas serialise every wgmma, C7514.)
      if constexpr (kWg) wgmma_wait<0>();
      if constexpr (!kWg) {
        if (tnn < n_end) issue_tile(tnn, cur);
      }
      gemm_s(cur ^ 1);
      if constexpr (kWg) {
        if (tnn < n_end) issue_tile(tnn, cur);
      }
      t = tn;
      tn = tnn;
      cur ^= 1;
    }
    if constexpr (kWg) {
      wgmma_wait<0>();
      fence_regs(o);
    }
  }
  if constexpr (kQSmem) cp_async_wait<0>();  // Q's copies, where no tile was kept

  fwd_epilogue<T, D>(p, f, sp, o, row_max, row_sum, seq, h, m0, threadIdx.x, nullptr, (int)work.split);
}

}  // namespace cuda
}  // namespace flexdma
