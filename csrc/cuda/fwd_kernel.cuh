// Forward kernel (FlashAttention-2 style): one CTA of 4 warps per (64-row query tile, head,
// batch); warp w owns query rows [16w, 16w + 16). Q lives in registers as mma A fragments; S,
// the online softmax statistics, P and the O accumulator never leave registers (P's C fragments
// are repacked as the A operand of P.V). K, V and bias tiles are double buffered with cp.async:
// tile t+1's copies are in flight while tile t is computed. The keep tile (mask & causal &
// bounds) of the next tile is decided before any of its K/V/bias bytes are requested, so an
// all-false tile costs only its mask bytes; its raw mask bytes themselves travel with the
// previous tile's copies.
#pragma once
#include "mma_sm80.cuh"
#include "score.cuh"

namespace flexdma {
namespace cuda {

constexpr int kLdKeep = kBlockN + 16;  // 80-byte rows: a warp's fragment reads hit distinct banks
constexpr int kLdBias = kBlockN + 8;   // 144-byte rows, same reason

__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }

template <typename T, int D>
struct FwdSmem {
  static constexpr int kTileKV = kBlockN * tile_ld(D) * 2;
  static constexpr int kKeepSlot = kBlockM * kLdKeep;
  // The Q tile is only staged here until it is in registers; the region then holds three mask
  // slots (the tile being computed, the next one, the one after it in flight).
  static constexpr int kQ = 0;
  static constexpr int kKeep = 0;
  static constexpr int kK = align128(cmax(kBlockM * tile_ld(D) * 2, 3 * kKeepSlot));
  static constexpr int kV = kK + 2 * kTileKV;
  static constexpr int kBias = kV + 2 * kTileKV;
  static constexpr int kBytes = kBias + 2 * kBlockM * kLdBias * 2;
};

// Launch-time facts about operand alignment (16-byte cp.async / vector loads allowed or not).
struct FwdFlags {
  bool qkv_vec, mask_vec, bias_vec, out_vec;
};

// Last key tile (exclusive) a query tile starting at m0 can see.
__device__ inline int64_t key_tile_end(const FwdParams& p, int64_t m0) {
  int64_t kend = p.seqlen_k;
  if (p.is_causal) kend = imin(kend, m0 + kBlockM + p.seqlen_k - p.seqlen_q);
  return kend <= 0 ? 0 : ceil_div(kend, kBlockN);
}

// Bounds and causal limits of tile (m0, n0) in tile-local coordinates. Most tiles are `full`
// (inside both lengths and entirely below the diagonal) and need no per-element check.
struct TileBounds {
  bool full;
  int lim_r, lim_c, diag;  // kept iff r < lim_r && c < lim_c && c <= r + diag
  __device__ inline TileBounds(const FwdParams& p, int64_t m0, int64_t n0) {
    const int64_t shift = p.seqlen_k - p.seqlen_q;
    lim_r = (int)imin(kBlockM, p.seqlen_q - m0);
    lim_c = (int)imin(kBlockN, p.seqlen_k - n0);
    diag = p.is_causal ? (int)imax(-2 * kBlockN, imin(2 * kBlockN, m0 + shift - n0)) : 2 * kBlockN;
    full = lim_r == kBlockM && lim_c == kBlockN && kBlockN - 1 <= diag;
  }
  __device__ inline bool ok(int r, int c) const { return full || (r < lim_r && c < lim_c && c <= r + diag); }
};

// Whether the mask tile at n0 is copied raw into a smem slot by cp.async one tile ahead
// (aligned rows, tile inside both lengths) rather than read when the tile comes up.
__device__ inline bool mask_async(const FwdParams& p, bool mask_vec, int64_t m0, int64_t n0) {
  return p.mask.ptr && mask_vec && m0 + kBlockM <= p.seqlen_q && n0 + kBlockN <= p.seqlen_k;
}

__device__ inline void issue_mask_raw(const FwdParams& p, uint8_t* slot, int64_t b, int64_t h, int64_t m0, int64_t n0) {
  const uint8_t* mp = static_cast<const uint8_t*>(p.mask.ptr);
#pragma unroll
  for (int u = 0; u < kBlockM * kBlockN / 16 / kThreads; ++u) {
    const int c = threadIdx.x + u * kThreads, r = c / (kBlockN / 16), col0 = (c % (kBlockN / 16)) * 16;
    cp_async16(slot + r * kLdKeep + col0, mp + bcast_offset(p.mask, b, h, m0 + r, n0 + col0));
  }
}

__device__ inline uint32_t byte_of(const uint4& v, int e) {
  const uint32_t w = e < 4 ? v.x : e < 8 ? v.y : e < 12 ? v.z : v.w;
  return (w >> (8 * (e % 4))) & 0xffu;
}

// Whether a raw mask slot (landed) keeps anything once bounds and causality apply;
// block-uniform (ends in a barrier).
__device__ inline bool raw_any(const uint8_t* slot, const TileBounds& tb) {
  int any = 0;
#pragma unroll
  for (int u = 0; u < kBlockM * kBlockN / 16 / kThreads; ++u) {
    const int c = threadIdx.x + u * kThreads, r = c / (kBlockN / 16), col0 = (c % (kBlockN / 16)) * 16;
    const uint4 v = *reinterpret_cast<const uint4*>(slot + r * kLdKeep + col0);
    if (tb.full) {
      any |= (v.x | v.y | v.z | v.w) != 0;
    } else {
#pragma unroll
      for (int e = 0; e < 16; ++e) any |= byte_of(v, e) != 0 && tb.ok(r, col0 + e);
    }
  }
  return __syncthreads_or(any) != 0;
}

// Builds the exact keep tile (mask & causal & bounds) of key tile n0 in a slot straight from
// global memory and returns whether any element is kept; block-uniform (ends in a barrier).
__device__ inline bool build_keep(const FwdParams& p, uint8_t* slot, bool mask_vec, int64_t b, int64_t h, int64_t m0,
                                  int64_t n0) {
  const uint8_t* mp = static_cast<const uint8_t*>(p.mask.ptr);
  const TileBounds tb(p, m0, n0);
  constexpr int kPer = kBlockM * kBlockN / 16 / kThreads;
  uint4 v[kPer];
  bool direct[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int c = threadIdx.x + u * kThreads, r = c / (kBlockN / 16), col0 = (c % (kBlockN / 16)) * 16;
    const int64_t i = m0 + r, j0 = n0 + col0;
    direct[u] = mp && mask_vec && i < p.seqlen_q && j0 + 16 <= p.seqlen_k;
    v[u] = direct[u] ? *reinterpret_cast<const uint4*>(mp + bcast_offset(p.mask, b, h, i, j0)) : make_uint4(0, 0, 0, 0);
  }
  int any = 0;
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int c = threadIdx.x + u * kThreads, r = c / (kBlockN / 16), col0 = (c % (kBlockN / 16)) * 16;
    uint32_t wds[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      bool kk = tb.ok(r, col0 + e);
      if (kk && mp) kk = direct[u] ? byte_of(v[u], e) != 0 : mp[bcast_offset(p.mask, b, h, m0 + r, n0 + col0 + e)] != 0;
      wds[e / 4] |= uint32_t(kk) << (8 * (e % 4));
      any |= kk;
    }
    *reinterpret_cast<uint4*>(slot + r * kLdKeep + col0) = make_uint4(wds[0], wds[1], wds[2], wds[3]);
  }
  return __syncthreads_or(any) != 0;
}

// Requests the K and V rows of key tile n0 (zero rows past seqlen_k: P is 0 there, V must not
// hold garbage that 0 * NaN would spread).
template <typename T, int D>
__device__ inline void issue_kv(const T* k, const T* v, int64_t k_rs, int64_t v_rs, int64_t seqlen_k, int64_t n0,
                                T* sk, T* sv, bool vec) {
  constexpr int kChunks = D / 8;
  if (vec) {
#pragma unroll
    for (int u = 0; u < kBlockN * kChunks / kThreads; ++u) {
      const int c = threadIdx.x + u * kThreads, r = c / kChunks, col = (c % kChunks) * 8;
      const bool ok = n0 + r < seqlen_k;
      cp_async16(sk + r * tile_ld(D) + col, ok ? k + (n0 + r) * k_rs + col : k, ok ? 16 : 0);
      cp_async16(sv + r * tile_ld(D) + col, ok ? v + (n0 + r) * v_rs + col : v, ok ? 16 : 0);
    }
  } else {
    for (int c = threadIdx.x; c < kBlockN * D; c += kThreads) {
      const int r = c / D, col = c % D;
      const bool ok = n0 + r < seqlen_k;
      sk[r * tile_ld(D) + col] = ok ? k[(n0 + r) * k_rs + col] : from_float<T>(0.f);
      sv[r * tile_ld(D) + col] = ok ? v[(n0 + r) * v_rs + col] : from_float<T>(0.f);
    }
  }
}

// Requests the bias tile (m0, n0) into smem (row stride kLdBias); out-of-range entries are 0
// (they are never kept). The 16-byte path needs contiguous keys and aligned strides.
template <typename T>
__device__ inline void issue_bias(const FwdParams& p, T* sb, bool vec, int64_t b, int64_t h, int64_t m0, int64_t n0) {
  const T* bp = static_cast<const T*>(p.bias.ptr);
  if (vec) {
#pragma unroll
    for (int u = 0; u < kBlockM * kBlockN / 8 / kThreads; ++u) {
      const int c = threadIdx.x + u * kThreads, r = c / (kBlockN / 8), col0 = (c % (kBlockN / 8)) * 8;
      const int64_t i = m0 + r, j0 = n0 + col0;
      if (i < p.seqlen_q && j0 + 8 <= p.seqlen_k) {
        cp_async16(sb + r * kLdBias + col0, bp + bcast_offset(p.bias, b, h, i, j0));
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e)
          sb[r * kLdBias + col0 + e] = (i < p.seqlen_q && j0 + e < p.seqlen_k)
                                           ? bp[bcast_offset(p.bias, b, h, i, j0 + e)]
                                           : from_float<T>(0.f);
      }
    }
  } else {
    for (int c = threadIdx.x; c < kBlockM * kBlockN; c += kThreads) {
      const int r = c / kBlockN, col = c % kBlockN;
      const int64_t i = m0 + r, j = n0 + col;
      sb[r * kLdBias + col] =
          (i < p.seqlen_q && j < p.seqlen_k) ? bp[bcast_offset(p.bias, b, h, i, j)] : from_float<T>(0.f);
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) fwd_kernel(const FwdParams p, const FwdFlags f) {
  extern __shared__ __align__(128) unsigned char smem[];
  using L = FwdSmem<T, D>;
  constexpr int kLd = tile_ld(D);
  constexpr float kLog2e = 1.4426950408889634f;
  T* sQ = reinterpret_cast<T*>(smem + L::kQ);
  uint8_t* sKeep = smem + L::kKeep;
  T* sK = reinterpret_cast<T*>(smem + L::kK);
  T* sV = reinterpret_cast<T*>(smem + L::kV);
  T* sB = reinterpret_cast<T*>(smem + L::kBias);

  // Scheduling: the heaviest (last, under causal) query tiles of every head launch first, heads
  // interleaved, so the long tiles of the last head do not form the tail.
  const int nh = (int)p.num_heads;
  const int64_t h = (int)blockIdx.x % nh, b = blockIdx.y;
  const int64_t m_tile = (int)(gridDim.x / nh) - 1 - (int)blockIdx.x / nh;
  const int64_t kvh = h / (p.num_heads / p.num_heads_k);
  const int64_t m0 = m_tile * kBlockM;
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, qc = lane % 4;

  const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride + m0 * p.q_row_stride;
  load_rows<T, kBlockM, D>(sQ, q, p.q_row_stride, (int)imin(kBlockM, p.seqlen_q - m0), f.qkv_vec);
  __syncthreads();
  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(qf[kk], sQ + (w * 16 + (lane & 15)) * kLd + kk * 16 + (lane >> 4) * 8);
  __syncthreads();  // sQ's bytes now become keep / raw mask buffers

  const T* kp = static_cast<const T*>(p.k) + b * p.k_batch_stride + kvh * p.k_head_stride;
  const T* vp = static_cast<const T*>(p.v) + b * p.v_batch_stride + kvh * p.v_head_stride;
  const bool has_bias = p.bias.ptr != nullptr;
  const ScoreMod mod{p.softmax_scale, p.softcap, p.bias, b, h};
  const int64_t n_end = key_tile_end(p, m0);

  const bool has_mask = p.mask.ptr != nullptr;
  auto issue_tile = [&](int64_t t, int buf, int raw_slot) {
    issue_kv<T, D>(kp, vp, p.k_row_stride, p.v_row_stride, p.seqlen_k, t * kBlockN, sK + buf * kBlockN * kLd,
                   sV + buf * kBlockN * kLd, f.qkv_vec);
    if (has_bias) issue_bias<T>(p, sB + buf * kBlockM * kLdBias, f.bias_vec, b, h, m0, t * kBlockN);
    if (t + 1 < n_end && mask_async(p, f.mask_vec, m0, (t + 1) * kBlockN))
      issue_mask_raw(p, sKeep + raw_slot * L::kKeepSlot, b, h, m0, (t + 1) * kBlockN);
    cp_async_commit();
  };

  float o[D / 8][4];
#pragma unroll
  for (int d = 0; d < D / 8; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[d][e] = 0.f;
  float row_max[2] = {-CUDART_INF_F, -CUDART_INF_F}, row_sum[2] = {0.f, 0.f};  // rows g, g + 8; sum per thread

  // Mask slots: sa holds tile t's mask bytes, sb_ the next tile's, sc the one after (in flight).
  // Without a mask every tile below n_end keeps something and no slot is used.
  int sa = 0, sb_ = 1, sc = 2;
  int64_t t = 0;
  if (has_mask)
    while (t < n_end && !build_keep(p, sKeep, f.mask_vec, b, h, m0, t * kBlockN)) ++t;
  if (t < n_end) issue_tile(t, 0, sb_);
  int cur = 0;
  while (t < n_end) {
    cp_async_wait<0>();
    __syncthreads();  // tile t (and the raw mask of t + 1) landed; tile t - 1's buffers are free
    int64_t tn = t + 1;
    if (has_mask && tn < n_end) {
      uint8_t* slot = sKeep + sb_ * L::kKeepSlot;
      bool any = mask_async(p, f.mask_vec, m0, tn * kBlockN) ? raw_any(slot, TileBounds(p, m0, tn * kBlockN))
                                                               : build_keep(p, slot, f.mask_vec, b, h, m0, tn * kBlockN);
      while (!any && ++tn < n_end) any = build_keep(p, slot, f.mask_vec, b, h, m0, tn * kBlockN);
    }
    if (tn < n_end) issue_tile(tn, cur ^ 1, sc);

    // S = Q K^T for this warp's 16 rows x 64 keys.
    const T* sk = sK + cur * kBlockN * kLd;
    const T* sv = sV + cur * kBlockN * kLd;
    float s[kBlockN / 8][4];
#pragma unroll
    for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
      for (int np = 0; np < kBlockN / 16; ++np) {
        uint32_t kb[4];
        ldmatrix_x4(kb, sk + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * kLd + kk * 16 + ((lane >> 3) & 1) * 8);
        mma_16816<T>(s[2 * np], qf[kk], kb[0], kb[1]);
        mma_16816<T>(s[2 * np + 1], qf[kk], kb[2], kb[3]);
      }

    // Score modification (softcap, bias, keep) and online softmax, rows g and g + 8.
    const TileBounds tb(p, m0, t * kBlockN);
    const uint8_t* keep = sKeep + sa * L::kKeepSlot;
    const T* sb = sB + cur * kBlockM * kLdBias;
    float mx[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
    for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = w * 16 + g + 8 * hh, col = n * 8 + 2 * qc;
        const uint32_t kv2 = has_mask ? *reinterpret_cast<const uint16_t*>(keep + r * kLdKeep + col) : 0x0101u;
        const bool k0 = (kv2 & 0xffu) != 0 && tb.ok(r, col), k1 = (kv2 >> 8) != 0 && tb.ok(r, col + 1);
        float2 bv = make_float2(0.f, 0.f);
        if (has_bias) bv = unpack2<T>(*reinterpret_cast<const uint32_t*>(sb + r * kLdBias + col));
        float dummy;
        s[n][2 * hh] = mod(s[n][2 * hh], k0, bv.x, &dummy);
        s[n][2 * hh + 1] = mod(s[n][2 * hh + 1], k1, bv.y, &dummy);
        mx[hh] = fmaxf(mx[hh], fmaxf(s[n][2 * hh], s[n][2 * hh + 1]));
      }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
      mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
      const float m_new = fmaxf(row_max[hh], mx[hh]);
      const float m_use = m_new == -CUDART_INF_F ? 0.f : m_new;  // all -inf so far: p = 0, alpha = 0
      const float alpha = exp2f((row_max[hh] - m_use) * kLog2e);
      const float mb = -m_use * kLog2e;
      row_max[hh] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < kBlockN / 8; ++n) {
        s[n][2 * hh] = exp2f(fmaf(s[n][2 * hh], kLog2e, mb));
        s[n][2 * hh + 1] = exp2f(fmaf(s[n][2 * hh + 1], kLog2e, mb));
        sum += s[n][2 * hh] + s[n][2 * hh + 1];
      }
      row_sum[hh] = row_sum[hh] * alpha + sum;
#pragma unroll
      for (int d = 0; d < D / 8; ++d) {
        o[d][2 * hh] *= alpha;
        o[d][2 * hh + 1] *= alpha;
      }
    }

    // O += P V, P's C fragments repacked as A fragments (16 keys per k step).
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                       pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, sv + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kLd + dp * 16 + (lane >> 4) * 8);
        mma_16816<T>(o[2 * dp], a, vb[0], vb[1]);
        mma_16816<T>(o[2 * dp + 1], a, vb[2], vb[3]);
      }
    }
    t = tn;
    cur ^= 1;
    const int s_old = sa;
    sa = sb_;
    sb_ = sc;
    sc = s_old;
  }

  // Epilogue: O / rowsum into out, LSE = max + log(sum); empty rows give 0 and -inf.
  T* out = static_cast<T*>(p.out) + b * p.o_batch_stride + h * p.o_head_stride;
  float* lse = static_cast<float*>(p.lse) + (b * p.num_heads + h) * p.seqlen_q;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float l = row_sum[hh];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int64_t i = m0 + w * 16 + g + 8 * hh;
    if (i < p.seqlen_q) {
      const float m = row_max[hh];
      const bool empty = !(l > 0.f) || m == -CUDART_INF_F;
      const float inv = empty ? 0.f : 1.f / l;
      T* orow = out + i * p.o_row_stride;
#pragma unroll
      for (int d = 0; d < D / 8; ++d) {
        const int col = d * 8 + 2 * qc;
        if (f.out_vec) {
          *reinterpret_cast<uint32_t*>(orow + col) = pack2<T>(o[d][2 * hh] * inv, o[d][2 * hh + 1] * inv);
        } else {
          orow[col] = from_float<T>(o[d][2 * hh] * inv);
          orow[col + 1] = from_float<T>(o[d][2 * hh + 1] * inv);
        }
      }
      if (qc == 0) lse[i] = empty ? -CUDART_INF_F : m + __logf(l);
    }
  }
}

}  // namespace cuda
}  // namespace flexdma
