// Backward kernels, both deterministic and free of atomics:
//  - dkv_kernel: one CTA per (key tile, kv head, batch). It loops over the query heads of its kv
//    head and over query tiles in a fixed order, accumulating dK, dV in shared memory and adding
//    dS into dbias_accum (summing over broadcast rows / heads inside the CTA).
//  - dq_kernel (launched first): one CTA per (query tile, head, batch); a first pass over the key
//    tiles recomputes delta = rowsum(P * dP) in float (into softmax_d), a second one P and dS
//    and accumulates dQ, the simplest deterministic dq.
// Both recompute S with the forward's ScoreMod and skip all-false keep tiles before loading.
#pragma once
#include "score.cuh"
#include "warp_gemm.cuh"

namespace flexdma {
namespace cuda {

template <typename T, int D>
struct BwdSmem {
  static constexpr int kTile = align128(64 * tile_ld(D) * 2);
  static constexpr int kK = 0, kV = kK + kTile, kQ = kV + kTile, kDO = kQ + kTile;
  static constexpr int kS = kDO + kTile;                        // float S, then float dS
  static constexpr int kDP = kS + align128(kBlockM * kBlockN * 4);  // float dP
  static constexpr int kP = kDP + align128(kBlockM * kBlockN * 4);  // T P
  static constexpr int kDS = kP + align128(kBlockM * kLdP * 2);  // T dS * scale * softcap'
  static constexpr int kAcc0 = kDS + align128(kBlockM * kLdP * 2);  // float dK (dkv) or dQ (dq)
  static constexpr int kAcc1 = kAcc0 + align128(64 * D * 4);            // float dV (dkv only)
  static constexpr int kKeep = kAcc1 + align128(64 * D * 4);
  static constexpr int kLse = kKeep + align128(kBlockM * kBlockN);
  static constexpr int kDelta = kLse + align128(kBlockM * 4);
  static constexpr int kBytes = kDelta + align128(kBlockM * 4);
};

// Where a work item adds dS. With the bias broadcast over keys and several key tiles, each
// key tile gets its own slice (tile_stride elements apart) that run_bwd sums in order.
struct DbiasTarget {
  float* ptr = nullptr;
  Broadcast4d layout;
  int64_t tile_stride = 0;
};

__device__ inline void load_row_stats(const BwdParams& p, float* lse, float* delta, int64_t b, int64_t h, int64_t m0) {
  const float* l = static_cast<const float*>(p.lse) + (b * p.num_heads + h) * p.seqlen_q;
  const float* d = static_cast<const float*>(p.softmax_d) + (b * p.num_heads + h) * p.seqlen_q;
  for (int r = threadIdx.x; r < kBlockM; r += kThreads) {
    const int64_t i = m0 + r;
    lse[r] = i < p.seqlen_q ? l[i] : -CUDART_INF_F;
    delta[r] = i < p.seqlen_q ? d[i] : 0.f;
  }
}

// Per warp-owned rows: from S (raw q.k) and dP, P = exp(s - lse) and dS = P * (dP - delta).
// Writes P (T) if sP, dS * scale * d softcap (T) into sDS, and the plain dS (float, the bias
// gradient) back into S.
template <typename T>
__device__ inline void grad_scores(const ScoreMod& mod, float* S, const float* dP, const uint8_t* keep,
                                   const float* lse, const float* delta, T* sP, T* sDS, int64_t m0, int64_t n0) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  float bv[16][2];
  mod.load_bias<T>(keep, m0, n0, bv);
#pragma unroll
  for (int rr = 0; rr < 16; ++rr) {
    const int r = w * 16 + rr;
    const float l = lse[r];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int c = lane + 32 * u, idx = r * kBlockN + c;
      float t;
      const float x = mod(S[idx], keep[idx], bv[rr][u], &t);
      const float pr = (l == -CUDART_INF_F || x == -CUDART_INF_F) ? 0.f : __expf(x - l);
      const float ds = pr * (dP[idx] - delta[r]);
      if (sP) sP[r * kLdP + c] = from_float<T>(pr);
      sDS[r * kLdP + c] = from_float<T>(ds * mod.scale * (mod.softcap > 0.f ? 1.f - t * t : 1.f));
      S[idx] = ds;
    }
  }
  __syncwarp();
}

// delta_r += sum_j P_rj * dP_rj over one key tile, for the warp-owned rows, in a fixed order.
// The backward's row term recomputed in float: rowsum(dout * out) with out rounded to bf16 is
// off by ~|dout||out| 2^-8, an error every dS of the row inherits and dbias sums up.
template <typename T>
__device__ inline void accumulate_delta(const ScoreMod& mod, const float* S, const float* dP, const uint8_t* keep,
                                        const float* lse, float* delta, int64_t m0, int64_t n0) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  float bv[16][2], acc[16];
  mod.load_bias<T>(keep, m0, n0, bv);
#pragma unroll
  for (int rr = 0; rr < 16; ++rr) {
    const int r = w * 16 + rr;
    const float l = lse[r];
    acc[rr] = 0.f;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int c = lane + 32 * u, idx = r * kBlockN + c;
      float t;
      const float x = mod(S[idx], keep[idx], bv[rr][u], &t);
      const float pr = (l == -CUDART_INF_F || x == -CUDART_INF_F) ? 0.f : __expf(x - l);
      acc[rr] += pr * dP[idx];
    }
  }
  // The 16 rows' reductions interleaved, so their shuffle latencies overlap.
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int rr = 0; rr < 16; ++rr) acc[rr] += __shfl_xor_sync(0xffffffffu, acc[rr], o);
  if (lane == 0) {
#pragma unroll
    for (int rr = 0; rr < 16; ++rr) delta[w * 16 + rr] += acc[rr];
  }
  __syncwarp();
}

// Adds the float dS tile (rows m0.., keys n0..) into dbias in a fixed order. Called by all
// threads after a barrier; rows / keys the target broadcasts over are summed here.
__device__ inline void accumulate_dbias(const DbiasTarget& tgt, const float* dS, int64_t b, int64_t h, int64_t m0,
                                        int64_t n0, int64_t n_tile, int64_t seqlen_q, int64_t seqlen_k) {
  const Broadcast4d& L = tgt.layout;
  float* base = tgt.ptr + n_tile * tgt.tile_stride + b * L.batch_stride + (h / L.head_ratio) * L.head_stride;
  const int vr = (int)imin(kBlockM, seqlen_q - m0), vc = (int)imin(kBlockN, seqlen_k - n0);
  if (L.row_stride != 0 && L.col_stride != 0) {
    // Every read of the tile issued before any add, so the read latencies overlap.
    constexpr int kPer = kBlockM * kBlockN / kThreads;
    float old[kPer];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int c = threadIdx.x + u * kThreads, r = c / kBlockN, col = c % kBlockN;
      old[u] = (r < vr && col < vc) ? base[(m0 + r) * L.row_stride + (n0 + col) * L.col_stride] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int c = threadIdx.x + u * kThreads, r = c / kBlockN, col = c % kBlockN;
      if (r < vr && col < vc) base[(m0 + r) * L.row_stride + (n0 + col) * L.col_stride] = old[u] + dS[c];
    }
  } else if (L.col_stride != 0) {  // per-key bias: sum over the tile's rows
    for (int col = threadIdx.x; col < vc; col += kThreads) {
      float s = 0.f;
      for (int r = 0; r < vr; ++r) s += dS[r * kBlockN + col];
      base[(n0 + col) * L.col_stride] += s;
    }
  } else if (L.row_stride != 0) {  // bias broadcast over keys: sum over the tile's keys
    for (int r = threadIdx.x; r < vr; r += kThreads) {
      float s = 0.f;
      for (int col = 0; col < vc; ++col) s += dS[r * kBlockN + col];
      base[(m0 + r) * L.row_stride] += s;
    }
  } else if (threadIdx.x == 0) {
    float s = 0.f;
    for (int r = 0; r < vr; ++r)
      for (int col = 0; col < vc; ++col) s += dS[r * kBlockN + col];
    base[0] += s;
  }
}

template <typename T, int D>
__device__ inline void store_rows(T* dst, int64_t row_stride, const float* src, int valid) {
  for (int c = threadIdx.x; c < valid * D; c += kThreads) {
    const int r = c / D, d = c % D;
    dst[r * row_stride + d] = from_float<T>(src[c]);
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) dkv_kernel(const BwdParams p, const DbiasTarget dbias, bool vec, bool mask_vec) {
  extern __shared__ __align__(128) unsigned char smem[];
  using L = BwdSmem<T, D>;
  T* sK = reinterpret_cast<T*>(smem + L::kK);
  T* sV = reinterpret_cast<T*>(smem + L::kV);
  T* sQ = reinterpret_cast<T*>(smem + L::kQ);
  T* sDO = reinterpret_cast<T*>(smem + L::kDO);
  float* sS = reinterpret_cast<float*>(smem + L::kS);
  float* sDP = reinterpret_cast<float*>(smem + L::kDP);
  T* sP = reinterpret_cast<T*>(smem + L::kP);
  T* sDS = reinterpret_cast<T*>(smem + L::kDS);
  float* sDK = reinterpret_cast<float*>(smem + L::kAcc0);
  float* sDV = reinterpret_cast<float*>(smem + L::kAcc1);
  uint8_t* keep = smem + L::kKeep;
  float* sLse = reinterpret_cast<float*>(smem + L::kLse);
  float* sDelta = reinterpret_cast<float*>(smem + L::kDelta);

  const int64_t n_tile = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int64_t n0 = n_tile * kBlockN;
  const int64_t ratio = p.num_heads / p.num_heads_k;
  KVTileLoader<T, D> load_kv{static_cast<const T*>(p.k) + b * p.k_batch_stride + kvh * p.k_head_stride,
                             static_cast<const T*>(p.v) + b * p.v_batch_stride + kvh * p.v_head_stride,
                             p.k_row_stride, p.v_row_stride, p.seqlen_k, vec};
  load_kv(n_tile, sK, sV);
  for (int c = threadIdx.x; c < kBlockN * D; c += kThreads) { sDK[c] = 0.f; sDV[c] = 0.f; }

  // Causal: the first query row that sees key n0 is n0 - (K - Q).
  int64_t m_first = 0;
  if (p.is_causal) m_first = imax(0, n0 - (p.seqlen_k - p.seqlen_q));
  const int64_t m_tiles = ceil_div(p.seqlen_q, kBlockM);
  for (int64_t g = 0; g < ratio; ++g) {
    const int64_t h = kvh * ratio + g;
    const ScoreMod mod{p.softmax_scale, p.softcap, p.bias, b, h};
    const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
    const T* dout = static_cast<const T*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride;
    for (int64_t mt = m_first / kBlockM; mt < m_tiles; ++mt) {
      const int64_t m0 = mt * kBlockM;
      __syncthreads();
      if (!load_keep_tile(keep, p.mask, mask_vec, b, h, m0, n0, p.seqlen_q, p.seqlen_k, p.is_causal)) continue;
      const int vr = (int)imin(kBlockM, p.seqlen_q - m0);
      load_rows<T, kBlockM, D>(sQ, q + m0 * p.q_row_stride, p.q_row_stride, vr, vec);
      load_rows<T, kBlockM, D>(sDO, dout + m0 * p.do_row_stride, p.do_row_stride, vr, vec);
      load_row_stats(p, sLse, sDelta, b, h, m0);
      __syncthreads();
      warp_gemm<T, kBlockN, D, false, true, false>(sS, kBlockN, sQ, tile_ld(D), sK, tile_ld(D));
      warp_gemm<T, kBlockN, D, false, true, false>(sDP, kBlockN, sDO, tile_ld(D), sV, tile_ld(D));
      grad_scores<T>(mod, sS, sDP, keep, sLse, sDelta, sP, sDS, m0, n0);
      __syncthreads();
      if (dbias.ptr) accumulate_dbias(dbias, sS, b, h, m0, n0, n_tile, p.seqlen_q, p.seqlen_k);
      // Rows of dK / dV are keys: A = P^T and dS^T, read transposed from the row-major tiles.
      warp_gemm<T, D, kBlockM, true, false, true>(sDV, D, sP, kLdP, sDO, tile_ld(D));
      warp_gemm<T, D, kBlockM, true, false, true>(sDK, D, sDS, kLdP, sQ, tile_ld(D));
    }
  }
  __syncthreads();
  const int vc = (int)imin(kBlockN, p.seqlen_k - n0);
  store_rows<T, D>(static_cast<T*>(p.dk) + b * p.dk_batch_stride + kvh * p.dk_head_stride + n0 * p.dk_row_stride,
                   p.dk_row_stride, sDK, vc);
  store_rows<T, D>(static_cast<T*>(p.dv) + b * p.dv_batch_stride + kvh * p.dv_head_stride + n0 * p.dv_row_stride,
                   p.dv_row_stride, sDV, vc);
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) dq_kernel(const BwdParams p, bool vec, bool mask_vec) {
  extern __shared__ __align__(128) unsigned char smem[];
  using L = BwdSmem<T, D>;
  T* sK = reinterpret_cast<T*>(smem + L::kK);
  T* sV = reinterpret_cast<T*>(smem + L::kV);
  T* sQ = reinterpret_cast<T*>(smem + L::kQ);
  T* sDO = reinterpret_cast<T*>(smem + L::kDO);
  float* sS = reinterpret_cast<float*>(smem + L::kS);
  float* sDP = reinterpret_cast<float*>(smem + L::kDP);
  T* sDS = reinterpret_cast<T*>(smem + L::kDS);
  float* sDQ = reinterpret_cast<float*>(smem + L::kAcc0);
  uint8_t* keep = smem + L::kKeep;
  float* sLse = reinterpret_cast<float*>(smem + L::kLse);
  float* sDelta = reinterpret_cast<float*>(smem + L::kDelta);

  const int64_t m_tile = gridDim.x - 1 - blockIdx.x;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int64_t kvh = h / (p.num_heads / p.num_heads_k);
  const int64_t m0 = m_tile * kBlockM;
  const int vr = (int)imin(kBlockM, p.seqlen_q - m0);
  load_rows<T, kBlockM, D>(sQ, static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride + m0 * p.q_row_stride,
                           p.q_row_stride, vr, vec);
  load_rows<T, kBlockM, D>(sDO, static_cast<const T*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride +
                                    m0 * p.do_row_stride, p.do_row_stride, vr, vec);
  load_row_stats(p, sLse, sDelta, b, h, m0);
  for (int c = threadIdx.x; c < kBlockM * D; c += kThreads) sDQ[c] = 0.f;

  KVTileLoader<T, D> load_kv{static_cast<const T*>(p.k) + b * p.k_batch_stride + kvh * p.k_head_stride,
                             static_cast<const T*>(p.v) + b * p.v_batch_stride + kvh * p.v_head_stride,
                             p.k_row_stride, p.v_row_stride, p.seqlen_k, vec};
  const ScoreMod mod{p.softmax_scale, p.softcap, p.bias, b, h};
  int64_t kend = p.seqlen_k;
  if (p.is_causal) kend = imin(kend, m0 + kBlockM + p.seqlen_k - p.seqlen_q);
  const int64_t n_end = kend <= 0 ? 0 : ceil_div(kend, kBlockN);
  // Pass 1: delta = rowsum(P * dP) in float over all visible key tiles; written to softmax_d
  // for dkv_kernel, which runs after this kernel.
  for (int r = threadIdx.x; r < kBlockM; r += kThreads) sDelta[r] = 0.f;
  for (int64_t t = 0; t < n_end; ++t) {
    __syncthreads();
    if (!load_keep_tile(keep, p.mask, mask_vec, b, h, m0, t * kBlockN, p.seqlen_q, p.seqlen_k, p.is_causal)) continue;
    load_kv(t, sK, sV);
    __syncthreads();
    warp_gemm<T, kBlockN, D, false, true, false>(sS, kBlockN, sQ, tile_ld(D), sK, tile_ld(D));
    warp_gemm<T, kBlockN, D, false, true, false>(sDP, kBlockN, sDO, tile_ld(D), sV, tile_ld(D));
    accumulate_delta<T>(mod, sS, sDP, keep, sLse, sDelta, m0, t * kBlockN);
  }
  __syncthreads();
  {
    float* d = static_cast<float*>(p.softmax_d) + (b * p.num_heads + h) * p.seqlen_q;
    for (int r = threadIdx.x; r < vr; r += kThreads) d[m0 + r] = sDelta[r];
  }
  // Pass 2: dQ.
  for (int64_t t = 0; t < n_end; ++t) {
    __syncthreads();
    if (!load_keep_tile(keep, p.mask, mask_vec, b, h, m0, t * kBlockN, p.seqlen_q, p.seqlen_k, p.is_causal)) continue;
    load_kv(t, sK, sV);
    __syncthreads();
    warp_gemm<T, kBlockN, D, false, true, false>(sS, kBlockN, sQ, tile_ld(D), sK, tile_ld(D));
    warp_gemm<T, kBlockN, D, false, true, false>(sDP, kBlockN, sDO, tile_ld(D), sV, tile_ld(D));
    grad_scores<T>(mod, sS, sDP, keep, sLse, sDelta, static_cast<T*>(nullptr), sDS, m0, t * kBlockN);
    warp_gemm<T, D, kBlockN, false, false, true>(sDQ, D, sDS, kLdP, sK, tile_ld(D));
  }
  __syncthreads();
  store_rows<T, D>(static_cast<T*>(p.dq) + b * p.dq_batch_stride + h * p.dq_head_stride + m0 * p.dq_row_stride,
                   p.dq_row_stride, sDQ, vr);
}

// Sums the per-key-tile dbias slices into the accumulator in tile order.
__global__ void reduce_dbias_tiles(float* accum, const float* scratch, int64_t span, int64_t tiles) {
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < span; e += (int64_t)gridDim.x * blockDim.x) {
    float s = accum[e];
    for (int64_t t = 0; t < tiles; ++t) s += scratch[t * span + e];
    accum[e] = s;
  }
}

}  // namespace cuda
}  // namespace flexdma
