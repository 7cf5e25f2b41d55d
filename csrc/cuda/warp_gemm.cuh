// Tensor-core GEMM of one warp's 16-row block on shared-memory operands (wmma m16n16k16,
// float accumulation). Warp w computes rows [16w, 16w + 16) of C for all N columns, so phases
// that work on rows of the same warp need no block barrier between them.
#pragma once
#include <mma.h>

#include "tile_io.cuh"

namespace flexdma {
namespace cuda {

// C[16w.., 0..N) (+)= A[16w.., 0..K) * B[0..K, 0..N)
// kACol: A(i, k) is stored at A[k * lda + i] (a transposed row-major tile), else A[i * lda + k].
// kBCol: B(k, n) is stored at B[n * ldb + k] (e.g. K^T from a row-major K tile), else B[k * ldb + n].
template <typename T, int N, int K, bool kACol, bool kBCol, bool kAccum>
__device__ inline void warp_gemm(float* C, int ldc, const T* A, int lda, const T* B, int ldb) {
  using namespace nvcuda;
  const int w = threadIdx.x / 32;
  using ALayout = typename std::conditional<kACol, wmma::col_major, wmma::row_major>::type;
  using BLayout = typename std::conditional<kBCol, wmma::col_major, wmma::row_major>::type;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, T, ALayout> a[K / 16];
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    const T* ap = kACol ? A + kk * 16 * lda + w * 16 : A + w * 16 * lda + kk * 16;
    wmma::load_matrix_sync(a[kk], ap, lda);
  }
#pragma unroll 2
  for (int n = 0; n < N / 16; ++n) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    float* cp = C + w * 16 * ldc + n * 16;
    if (kAccum) wmma::load_matrix_sync(acc, cp, ldc, wmma::mem_row_major);
    else wmma::fill_fragment(acc, 0.f);
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, BLayout> bf;
      const T* bp = kBCol ? B + n * 16 * ldb + kk * 16 : B + kk * 16 * ldb + n * 16;
      wmma::load_matrix_sync(bf, bp, ldb);
      wmma::mma_sync(acc, a[kk], bf, acc);
    }
    wmma::store_matrix_sync(cp, acc, ldc, wmma::mem_row_major);
  }
  __syncwarp();
}

}  // namespace cuda
}  // namespace flexdma
