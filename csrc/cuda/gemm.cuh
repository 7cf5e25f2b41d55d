// Tile products of the backward on either MMA path, in the per-warp C / A register layout that
// mma.sync m16n8k16 and wgmma share (mma_sm80.cuh, mma_sm90.cuh): S / dP = A B^T (gemm_nt),
// O += P B (gemm_pv), and the store of a float accumulator.
#pragma once
#include "constants.cuh"
#include "mma_sm80.cuh"
#include "mma_sm90.cuh"
#include "smem_layout.cuh"

namespace flexdma {
namespace cuda {

// On wgmma (use_wgmma<D>) every product below is one warpgroup MMA per 16-wide k step, issued,
// committed and waited for in place: the tiles are read by the tensor cores from smem (A too,
// for the products of two smem tiles), which is what the mma.sync versions spent their
// ldmatrix traffic and most of their instructions on. The C / A register layouts are the same.

// C[16 x 64] = A[16 rows of sA] * B[64 rows of sB]^T over D (the "QK^T" pattern): A fragments
// by ldmatrix from rows a_row0.., B by non-transposed ldmatrix; on wgmma the whole 64-row tiles
// in one group (a_row0 unused). The backward computes S^T and dP^T one after the other (dV's
// GEMM in between), so that they are never both live next to dK and dV.
// kWait = false (wgmma) leaves the product in flight; the caller waits (wgmma_wait<0>, then
// fence_regs(c0)) before reading c0.
template <typename T, int D, bool kWait = true>
__device__ inline void gemm_nt(float (&c0)[kBlockN / 8][4], const T* a0, const T* b0, int a_row0) {
  constexpr int kLd = tile_ld(D);
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) c0[n][e] = 0.f;
  if constexpr (use_wgmma<D>()) {
    fence_regs(c0);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_ss<T, 64>(c0, desc_k_major<64>(a0, kk), desc_k_major<kBlockN>(b0, kk), kk > 0);
    wgmma_commit();
    if constexpr (kWait) {
      wgmma_wait<0>();
      fence_regs(c0);
    }
    return;
  }
  const int aoff = (a_row0 + (lane & 15)) * kLd + (lane >> 4) * 8;
  const int boff = ((lane & 7) + ((lane >> 4) << 3)) * kLd + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t fa0[4];
    ldmatrix_x4(fa0, a0 + aoff + kk * 16);
#pragma unroll
    for (int np = 0; np < kBlockN / 16; ++np) {
      uint32_t kb[4];
      ldmatrix_x4(kb, b0 + boff + np * 16 * kLd + kk * 16);
      mma_16816<T>(c0[2 * np], fa0, kb[0], kb[1]);
      mma_16816<T>(c0[2 * np + 1], fa0, kb[2], kb[3]);
    }
  }
}

// O[16 x D] += A * B with A the 16 x 64 C fragments `x` repacked to T and B a [64 x D] smem
// tile read transposed (the "PV" pattern).
template <typename T, int D>
__device__ inline void gemm_pv(float (&o)[D / 8][4], const float (&x)[kBlockN / 8][4], const T* sb) {
  constexpr int kLd = tile_ld(D);
  const int lane = threadIdx.x % 32;
  if constexpr (use_wgmma<D>()) {
    uint32_t a[kBlockN / 16][4];
    c_to_a<T>(x, a);
    fence_regs(o);
    fence_regs(a);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) wgmma_rs_mn<T, D, 64>(o, a[kk], sb, kk);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(o);
    return;
  }
  const int boff = ((lane & 7) + ((lane >> 3) & 1) * 8) * kLd + (lane >> 4) * 8;
#pragma unroll
  for (int kk = 0; kk < kBlockN / 16; ++kk) {
    const uint32_t a[4] = {pack2<T>(x[2 * kk][0], x[2 * kk][1]), pack2<T>(x[2 * kk][2], x[2 * kk][3]),
                           pack2<T>(x[2 * kk + 1][0], x[2 * kk + 1][1]), pack2<T>(x[2 * kk + 1][2], x[2 * kk + 1][3])};
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t vb[4];
      ldmatrix_x4_trans(vb, sb + boff + kk * 16 * kLd + dp * 16);
      mma_16816<T>(o[2 * dp], a, vb[0], vb[1]);
      mma_16816<T>(o[2 * dp + 1], a, vb[2], vb[3]);
    }
  }
}

// Stores a warp's 16 x D float accumulator (rows r0 + g, r0 + g + 8 of dst) times `mul`.
template <typename T, int D>
__device__ inline void store_acc(T* dst, int64_t rs, const float (&acc)[D / 8][4], float mul, int r0, int valid) {
  const int lane = threadIdx.x % 32, g = lane / 4, qc = lane % 4;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = r0 + g + 8 * hh;
    if (r < valid) {
      T* row = dst + r * rs;
#pragma unroll
      for (int d = 0; d < D / 8; ++d) {
        row[d * 8 + 2 * qc] = from_float<T>(acc[d][2 * hh] * mul);
        row[d * 8 + 2 * qc + 1] = from_float<T>(acc[d][2 * hh + 1] * mul);
      }
    }
  }
}

}  // namespace cuda
}  // namespace flexdma
