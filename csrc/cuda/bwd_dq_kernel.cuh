// Backward, first kernel (FA2-style register design; deterministic, no atomics): one CTA of 4
// warps per (query tile, head, batch), warp w owns query rows [16w, 16w + 16). One pass over the
// kept key tiles accumulates dQ = P (dP - rowsum(dout * out)) K in registers (FlashAttention's
// delta, from the bf16 out) and, next to it, the exact delta = rowsum(P * dP) in float, which goes
// to softmax_d for the dk/dv kernel: the bf16-out delta is too coarse for a dbias summed over rows
// or heads (one systematic error per row adds up), and dQ is what FlashAttention computes. The
// next kept tile's K / bias copies fly during the current tile's products. A dbias stored in the
// bias dtype is zeroed here where the dk/dv kernel writes nothing (no fill pass before the kernels).
// S, dP, P and dS live in C fragments (wgmma's or mma.sync's, the same per-warp layout); P / dS
// are repacked as A fragments (no smem round trip). Q, dO, K, V tiles sit in smem, 128-byte
// swizzled and read by wgmma (sm_90a, head dims 64 / 128 / 192 / 256) or padded to D + 8 and read
// by ldmatrix (head dims 32 / 96). An all-false keep tile (mask & causal & bounds) is skipped before
// any of its operand bytes are requested (tile activity bits); the next kept tile is found, and
// its keep tile requested (raw mask bytes) or built (cut tiles) into a second keep slot, while the
// current tile's cp.async copies are in flight. Mask / bias are resolved to base pointers once
// (Plane, 32-bit head division). The per-element score math is branch-free: the CTA-uniform
// choices (softcap, bias, keep tile) become selects or loops behind uniform branches.
#pragma once
#include <math_constants.h>

#include "../flash_dma_params.h"
#include "bwd_dbias.cuh"
#include "constants.cuh"
#include "copy.cuh"
#include "gemm.cuh"
#include "mask.cuh"
#include "mma_sm80.cuh"
#include "mma_sm90.cuh"
#include "smem_layout.cuh"
#include "softmax.cuh"

namespace flexdma {
namespace cuda {

// Up to D = 128 two CTAs share an SM; wider heads (dq 148, dk/dv 174 KiB of smem at D = 256) run one.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, D <= 128 ? 2 : 1)
    bwd_dq_kernel(const BwdParams p, const BwdFlags f, const BwdDbias dbias) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  constexpr bool kWg = use_wgmma<D>();
  unsigned char* smem = smem_raw + smem_align_pad<kWg>(smem_raw);
  using L = BwdDqSmem<T, D>;
  T* sQ = reinterpret_cast<T*>(smem + L::kQ);
  T* sDO = reinterpret_cast<T*>(smem + L::kDO);
  T* sK = reinterpret_cast<T*>(smem + L::kK);
  T* sV = reinterpret_cast<T*>(smem + L::kV);
  T* sB = reinterpret_cast<T*>(smem + L::kBias);
  uint8_t* sKeep = smem + L::kKeep;

  // Heaviest (last, under causal) query tiles first, heads interleaved.
  const int nh = (int)p.num_heads;
  const int64_t h = (int)blockIdx.x % nh, b = blockIdx.y;
  const int64_t m_tile = (int)(gridDim.x / nh) - 1 - (int)blockIdx.x / nh;
  const int64_t kvh = (int)h / (int)(p.num_heads / p.num_heads_k);
  const int64_t m0 = m_tile * kBlockM;
  const int vr = (int)imin(kBlockM, p.seqlen_q - m0);
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, qc = lane % 4;

  issue_rows<T, D>(sQ, static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride + m0 * p.q_row_stride,
                   p.q_row_stride, vr, f.qkv_vec);
  issue_rows<T, D>(sDO,
                   static_cast<const T*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride + m0 * p.do_row_stride,
                   p.do_row_stride, vr, f.qkv_vec);
  cp_async_commit();

  const T* kp = static_cast<const T*>(p.k) + b * p.k_batch_stride + kvh * p.k_head_stride;
  const T* vp = static_cast<const T*>(p.v) + b * p.v_batch_stride + kvh * p.v_head_stride;
  const bool has_bias = p.bias.ptr != nullptr, has_mask = p.mask.ptr != nullptr;
  const Plane<T, int> bias(p.bias, b, h);
  const Plane<uint8_t, int> mask(p.mask, b, h);
  const ScoreScale sc(p);
  const float scf = sc.softcap_on, mulf = sc.mul, soc = sc.over_cap;

  float l2[2], delta[2] = {0.f, 0.f};
  {
    const float* lse = static_cast<const float*>(p.lse) + (b * p.num_heads + h) * p.seqlen_q;
    const T* orow = static_cast<const T*>(p.out) + b * p.o_batch_stride + h * p.o_head_stride;
    const T* dorow = static_cast<const T*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = w * 16 + g + 8 * hh;
      l2[hh] = r < vr ? lse_log2(lse[m0 + r]) : CUDART_INF_F;
      // rowsum(dout * out): the quad's four threads take a quarter of the row each.
      float acc = 0.f;
      if (r < vr) {
        const T* o = orow + (m0 + r) * p.o_row_stride;
        const T* d = dorow + (m0 + r) * p.do_row_stride;
#pragma unroll 8
        for (int c = qc; c < D; c += 4) acc = fmaf(to_float(o[c]), to_float(d[c]), acc);
      }
      acc += __shfl_xor_sync(0xffffffffu, acc, 1);
      acc += __shfl_xor_sync(0xffffffffu, acc, 2);
      delta[hh] = acc;
    }
  }
  const int64_t n_end = key_tile_end(p, m0);

  float dq[D / 8][4];
#pragma unroll
  for (int d = 0; d < D / 8; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[d][e] = 0.f;

  // First kept key tile >= t, its keep tile built into `slot` (only where a mask or a cut
  // tile needs one); n_end if none. Block-uniform.
  // Tiles whose activity bit is clear are passed over without reading their mask bytes; a set bit
  // on a tile with no bounds or causal cut means its raw mask bytes are its keep tile, copied
  // asynchronously (committed: the wait before the tile is used covers them).
  ActiveTiles active(has_mask ? Plane<uint32_t, int>(p.tile_meta, b, h).at(m_tile, 0) : nullptr);
  auto find_next = [&](int64_t t, uint8_t* slot) -> int64_t {
#pragma unroll 1
    for (; t < n_end; ++t) {
      if (has_mask && (t = active.next(t, n_end)) >= n_end) break;
      const TileBounds tb(p, m0, t * kBlockN);
      if (has_mask) {
        if (tb.full && f.mask_vec) {
          issue_mask_raw(mask, slot, m0, t * kBlockN);
          return t;
        }
        if (build_keep(tb, mask, slot, f.mask_vec, m0, t * kBlockN)) return t;
      } else if (tb.any()) {
        if (!tb.full) build_keep(tb, mask, slot, f.mask_vec, m0, t * kBlockN);
        return t;
      }
    }
    return n_end;
  };

  {
    float dacc[2] = {0.f, 0.f};  // exact delta, for the dkv kernel
    // Tile tn's K and bias copies fly during tile t's work, V's once S / dP have read it (one
    // buffer: the smem of a second would cost the second CTA per SM). find_next's raw mask copy
    // is committed as the newest group, so the wait for tile t (wait<1>) leaves it in flight.
    T* sK2 = reinterpret_cast<T*>(smem + L::kK2);
    constexpr int kBiasElems = L::kBiasSlot / (int)sizeof(T);
    auto issue_kb = [&](int64_t tt, int buf) {
      issue_keys<T, D>(buf ? sK2 : sK, kp, p.k_row_stride, ContiguousKeys{}, tt * kBlockN, p.seqlen_k, f.qkv_vec);
      if (has_bias)
        issue_bias<false>(TileBounds(p, m0, tt * kBlockN), bias, sB + buf * kBiasElems, f.bias_vec, m0, tt * kBlockN);
    };
    int slot = 0;
    int64_t t = find_next(0, sKeep);
    cp_async_commit();
    if (t < n_end) {
      issue_kb(t, 0);
      issue_keys<T, D>(sV, vp, p.v_row_stride, ContiguousKeys{}, t * kBlockN, p.seqlen_k, f.qkv_vec);
      cp_async_commit();
    }
#pragma unroll 1
    while (t < n_end) {
      const TileBounds tb(p, m0, t * kBlockN);
      const bool use_keep = has_mask || !tb.full;
      const uint8_t* keep = sKeep + slot * L::kKeepSlot;
      const T* sk = slot ? sK2 : sK;
      const T* sb = sB + slot * kBiasElems;
      const int64_t tn = find_next(t + 1, sKeep + (slot ^ 1) * L::kKeepSlot);
      cp_async_commit();
      cp_async_wait<1>();
      if constexpr (kWg) fence_proxy_async();
      __syncthreads();
      if (tn < n_end) {  // into the buffers tile t - 1 released at the barrier ending it
        issue_kb(tn, slot ^ 1);
        cp_async_commit();
      }
      float s[kBlockN / 8][4], dp[kBlockN / 8][4];
      gemm_nt2<T, D, D / 16>(s, sQ, sk, dp, sDO, sV, w * 16);
      __syncthreads();  // every warp's dP has read V
      if (tn < n_end) {
        issue_keys<T, D>(sV, vp, p.v_row_stride, ContiguousKeys{}, tn * kBlockN, p.seqlen_k, f.qkv_vec);
        cp_async_commit();
      }
      if (scf != 0.f) softcap_tanh(s, soc);
      // s holds raw q.k (or tanh of it under softcap); x = score in log2 units.
#pragma unroll
      for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = w * 16 + g + 8 * hh, col = n * 8 + 2 * qc;
          float2 bv = make_float2(0.f, 0.f);
          if (has_bias) bv = unpack2<T>(*reinterpret_cast<const uint32_t*>(sb + r * kLdBias + col));
          uint32_t kv2 = 0x0101u;
          if (use_keep) kv2 = *reinterpret_cast<const uint16_t*>(keep + r * kLdKeep + col);
#pragma unroll
          for (int e1 = 0; e1 < 2; ++e1) {
            const int e = 2 * hh + e1;
            const float raw = s[n][e];
            float x = fmaf(e1 ? bv.y : bv.x, kLog2eF, raw * mulf);
            x = ((kv2 >> (8 * e1)) & 0xffu) ? x : -CUDART_INF_F;
            const float pr = exp2f(x - l2[hh]);
            dacc[hh] = fmaf(pr, dp[n][e], dacc[hh]);
            s[n][e] = pr * (dp[n][e] - delta[hh]) * fmaf(-scf * raw, raw, 1.f);
          }
        }
      gemm_pv<T, D>(dq, s, sk);
      __syncthreads();  // K / V / bias and this keep slot are free for the next tile
      t = tn;
      slot ^= 1;
    }
    cp_async_wait<0>();  // Q / dO copies of a CTA that kept no tile
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      dacc[hh] += __shfl_xor_sync(0xffffffffu, dacc[hh], 1);
      dacc[hh] += __shfl_xor_sync(0xffffffffu, dacc[hh], 2);
    }
    float* d = static_cast<float*>(p.softmax_d) + (b * p.num_heads + h) * p.seqlen_q + m0;
    if (qc == 0) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        if (w * 16 + g + 8 * hh < vr) d[w * 16 + g + 8 * hh] = dacc[hh];
    }
  }
  store_acc<T, D>(static_cast<T*>(p.dq) + b * p.dq_batch_stride + h * p.dq_head_stride + m0 * p.dq_row_stride,
                  p.dq_row_stride, dq, p.softmax_scale, w * 16, vr);
  if (dbias.in_dtype) zero_skipped_dbias<T>(p, dbias, b, h, (int)(gridDim.x / nh) - 1 - m_tile);
}

}  // namespace cuda
}  // namespace flexdma
