// Forward kernel: one CTA per (query tile, head, batch). The mainloop walks the key tiles the
// tile can see (causal bound), skips tiles whose keep tile is all false before any K/V/bias
// byte is read, and keeps the running max / sum of the online softmax per row; the epilogue
// normalises O and writes O and LSE.
#pragma once
#include "score.cuh"
#include "warp_gemm.cuh"

namespace flexdma {
namespace cuda {

template <typename T, int D>
struct FwdSmem {
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + align128(kBlockM * tile_ld(D) * 2);
  static constexpr int kV = kK + align128(kBlockN * tile_ld(D) * 2);
  static constexpr int kS = kV + align128(kBlockN * tile_ld(D) * 2);
  static constexpr int kP = kS + align128(kBlockM * kBlockN * 4);
  static constexpr int kO = kP + align128(kBlockM * kLdP * 2);
  static constexpr int kKeep = kO + align128(kBlockM * D * 4);
  static constexpr int kBytes = kKeep + align128(kBlockM * kBlockN);
};

// Last key tile (exclusive) a query tile starting at m0 can see.
__device__ inline int64_t key_tile_end(const FwdParams& p, int64_t m0) {
  int64_t kend = p.seqlen_k;
  if (p.is_causal) kend = imin(kend, m0 + kBlockM + p.seqlen_k - p.seqlen_q);
  return kend <= 0 ? 0 : ceil_div(kend, kBlockN);
}

// Online softmax of one warp's 16 rows of S (raw q.k): writes P (in T) and rescales O rows.
// The row statistics live in registers (every lane holds all 16 rows' max and sum), and each
// step handles the 16 rows together so that their shuffles and exps overlap instead of
// forming one long dependency chain per row.
template <typename T, int D>
__device__ inline void softmax_rows(const ScoreMod& mod, const float* S, const uint8_t* keep, T* P, float* O,
                                    float (&row_max)[16], float (&row_sum)[16], int64_t m0, int64_t n0) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  float x[16][2];
  {
    float bv[16][2];
    mod.load_bias<T>(keep, m0, n0, bv);
    float dummy;
#pragma unroll
    for (int rr = 0; rr < 16; ++rr)
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int idx = (w * 16 + rr) * kBlockN + lane + 32 * u;
        x[rr][u] = mod(S[idx], keep[idx], bv[rr][u], &dummy);
      }
  }
  float mx[16];
#pragma unroll
  for (int rr = 0; rr < 16; ++rr) mx[rr] = fmaxf(x[rr][0], x[rr][1]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int rr = 0; rr < 16; ++rr) mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], o));
  float alpha[16], sum[16];
#pragma unroll
  for (int rr = 0; rr < 16; ++rr) {
    const float m_old = row_max[rr];
    const float m_new = fmaxf(m_old, mx[rr]);
    alpha[rr] = 1.f;
    float pr[2] = {0.f, 0.f};
    if (m_new != -CUDART_INF_F) {
      alpha[rr] = m_old == -CUDART_INF_F ? 0.f : __expf(m_old - m_new);
#pragma unroll
      for (int u = 0; u < 2; ++u) pr[u] = x[rr][u] == -CUDART_INF_F ? 0.f : __expf(x[rr][u] - m_new);
    }
    row_max[rr] = m_new;
    sum[rr] = pr[0] + pr[1];
#pragma unroll
    for (int u = 0; u < 2; ++u) P[(w * 16 + rr) * kLdP + lane + 32 * u] = from_float<T>(pr[u]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int rr = 0; rr < 16; ++rr) sum[rr] += __shfl_xor_sync(0xffffffffu, sum[rr], o);
#pragma unroll
  for (int rr = 0; rr < 16; ++rr) {
    row_sum[rr] = row_sum[rr] * alpha[rr] + sum[rr];
#pragma unroll
    for (int d = lane; d < D; d += 32) O[(w * 16 + rr) * D + d] *= alpha[rr];
  }
  __syncwarp();
}

// Epilogue: O / rowsum into out, LSE = max + log(sum); empty rows give 0 and -inf.
template <typename T, int D>
__device__ inline void write_out_lse(const FwdParams& p, const float* O, const float (&row_max)[16],
                                     const float (&row_sum)[16], int64_t b, int64_t h, int64_t m0) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  T* out = static_cast<T*>(p.out) + b * p.o_batch_stride + h * p.o_head_stride;
  float* lse = static_cast<float*>(p.lse) + (b * p.num_heads + h) * p.seqlen_q;
#pragma unroll
  for (int rr = 0; rr < 16; ++rr) {
    const int r = w * 16 + rr;
    const int64_t i = m0 + r;
    if (i < p.seqlen_q) {
      const float l = row_sum[rr], m = row_max[rr];
      const bool empty = !(l > 0.f) || m == -CUDART_INF_F;
      const float inv = empty ? 0.f : 1.f / l;
#pragma unroll
      for (int d = lane; d < D; d += 32) out[i * p.o_row_stride + d] = from_float<T>(O[r * D + d] * inv);
      if (lane == 0) lse[i] = empty ? -CUDART_INF_F : m + __logf(l);
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) fwd_kernel(const FwdParams p, bool vec, bool mask_vec) {
  extern __shared__ __align__(128) unsigned char smem[];
  using L = FwdSmem<T, D>;
  T* sQ = reinterpret_cast<T*>(smem + L::kQ);
  T* sK = reinterpret_cast<T*>(smem + L::kK);
  T* sV = reinterpret_cast<T*>(smem + L::kV);
  float* sS = reinterpret_cast<float*>(smem + L::kS);
  T* sP = reinterpret_cast<T*>(smem + L::kP);
  float* sO = reinterpret_cast<float*>(smem + L::kO);
  uint8_t* keep = smem + L::kKeep;

  // Scheduling: the heaviest (last, under causal) query tiles launch first.
  const int64_t m_tile = gridDim.x - 1 - blockIdx.x;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int64_t kvh = h / (p.num_heads / p.num_heads_k);
  const int64_t m0 = m_tile * kBlockM;

  const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride + m0 * p.q_row_stride;
  load_rows<T, kBlockM, D>(sQ, q, p.q_row_stride, (int)imin(kBlockM, p.seqlen_q - m0), vec);
  for (int c = threadIdx.x; c < kBlockM * D; c += kThreads) sO[c] = 0.f;
  float row_max[16], row_sum[16];  // of this warp's rows, replicated in every lane
#pragma unroll
  for (int rr = 0; rr < 16; ++rr) { row_max[rr] = -CUDART_INF_F; row_sum[rr] = 0.f; }

  KVTileLoader<T, D> load_kv{static_cast<const T*>(p.k) + b * p.k_batch_stride + kvh * p.k_head_stride,
                             static_cast<const T*>(p.v) + b * p.v_batch_stride + kvh * p.v_head_stride,
                             p.k_row_stride, p.v_row_stride, p.seqlen_k, vec};
  const ScoreMod mod{p.softmax_scale, p.softcap, p.bias, b, h};
  const int64_t n_end = key_tile_end(p, m0);
  for (int64_t t = 0; t < n_end; ++t) {
    __syncthreads();  // the previous tile's K/V/keep are no longer read
    if (!load_keep_tile(keep, p.mask, mask_vec, b, h, m0, t * kBlockN, p.seqlen_q, p.seqlen_k, p.is_causal)) continue;
    load_kv(t, sK, sV);
    __syncthreads();
    warp_gemm<T, kBlockN, D, false, true, false>(sS, kBlockN, sQ, tile_ld(D), sK, tile_ld(D));
    softmax_rows<T, D>(mod, sS, keep, sP, sO, row_max, row_sum, m0, t * kBlockN);
    warp_gemm<T, D, kBlockN, false, false, true>(sO, D, sP, kLdP, sV, tile_ld(D));
  }
  __syncthreads();
  write_out_lse<T, D>(p, sO, row_max, row_sum, b, h, m0);
}

}  // namespace cuda
}  // namespace flexdma
