// The per-key decode step on CUDA (flexdma::decode_step / decode_append; DecodeParams states it).
//
// A step is a few query rows (a kv group's heads) against W slots: no tensor-core work, a few
// hundred kilobytes of K / V rows. So the kernel spreads a plane's slots over `splits` CTAs (a step
// with one plane still reads with many SMs), and each CTA takes the update decision itself from
// the plane's W scores (a few kilobytes: no CTA waits for another). A CTA attends its query rows
// over its slots of the UPDATED set (the replaced slot substituted by the new key) with an online
// softmax in float. With one split the CTA then writes the output and the plane's writes; with
// more, each CTA stores its partial rows and a second launch merges them and writes: kernel order
// on the stream puts every read of the kept set and the caches before the writes, with no
// counters to keep zeroed between steps.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "constants.cuh"
#include "flash_dma_cuda.h"
#include "launch.h"
#include "mma_sm80.cuh"

namespace flexdma {
namespace cuda {
namespace {

constexpr int kDecodeThreads = 256;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kSlots = 32;     // slots an attention step takes: one a lane in the rows' softmax update
constexpr int kMaxGroup = 32;  // query heads per kv head
constexpr int kMaxDim = 256;
constexpr int kAccPer = kMaxGroup * kMaxDim / kDecodeThreads;  // output elements a thread holds
constexpr int kMaxSplits = 128;

__device__ __forceinline__ float load_score(const void* base, DType t, int64_t at) {
  switch (t) {
    case DType::kBFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[at]);
    case DType::kFloat16:
      return __half2float(static_cast<const __half*>(base)[at]);
    default:
      return static_cast<const float*>(base)[at];
  }
}

// The score's element copied as it is stored (no rounding through float).
__device__ __forceinline__ void copy_score(void* dst, int64_t d, const void* src, int64_t s, DType t) {
  if (t == DType::kFloat32)
    static_cast<float*>(dst)[d] = static_cast<const float*>(src)[s];
  else
    static_cast<uint16_t*>(dst)[d] = static_cast<const uint16_t*>(src)[s];
}

// A score's order as an unsigned key (larger = kept first): -0.0 equal to +0.0, NaN above +inf
// (flexdma/perkey/kept.py's order_key, unsigned); kNegInf is -inf's (keys at or below it are not
// eligible; 0 pads past the last key). The decision orders float32 values by OrderKey<float>: 16-bit
// scores convert to float32 exactly, so their order is the same.
template <class B, B kInf>
struct OrderKeyOf {
  using Bits = B;
  static constexpr int kBits = 8 * sizeof(B);
  static constexpr uint32_t kSign = 1u << (kBits - 1), kAll = kSign | (kSign - 1);
  static constexpr uint32_t kNegInf = ~(kInf | kSign) & kAll;
  __device__ static uint32_t of(uint32_t b) {
    if ((b & (kSign - 1)) > kInf) return kAll;  // NaN
    if ((b & (kSign - 1)) == 0) return kSign;   // -0.0 is +0.0
    return (b & kSign) ? (~b & kAll) : (b | kSign);
  }
};
template <class S>
struct OrderKey;
template <>
struct OrderKey<__nv_bfloat16> : OrderKeyOf<uint16_t, 0x7F80> {};
template <>
struct OrderKey<__half> : OrderKeyOf<uint16_t, 0x7C00> {};
template <>
struct OrderKey<float> : OrderKeyOf<uint32_t, 0x7F800000u> {};
__device__ __forceinline__ uint32_t float_order(float s) { return OrderKey<float>::of(__float_as_uint(s)); }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// A plane's operands, located once a CTA: plane a of batch row b, its kv head g, its G query heads
// from a * G.
struct Plane {
  int64_t b, a, g, pos;
  int64_t* idx;
  uint8_t* valid;
  void* score;
  float sn;
  bool eligible;

  __device__ Plane(const DecodeParams& p, int64_t plane) {
    b = plane / p.planes_per_batch;
    a = plane % p.planes_per_batch;
    g = a * p.num_heads_k / p.planes_per_batch;
    pos = p.position_at ? *p.position_at : p.position;
    idx = p.kept_idx + b * p.idx_batch_stride + a * p.idx_head_stride;
    valid = p.kept_valid + b * p.valid_batch_stride + a * p.valid_head_stride;
    score = static_cast<char*>(p.kept_score) +
            (b * p.score_batch_stride + a * p.score_head_stride) * (p.score_dtype == DType::kFloat32 ? 4 : 2);
    // No new key (perkey_last_row): nothing enters, nothing is written.
    sn = p.s_new ? load_score(p.s_new, p.score_dtype, b * p.s_new_batch_stride + g * p.s_new_head_stride) : -INFINITY;
    eligible = p.eligible && p.eligible[b * p.eligible_batch_stride + g * p.eligible_head_stride] != 0;
  }
};

// decode.append's decision, the same in every CTA of the plane: the slot the new key takes, or -1.
// The slot is the first free one, else the worst kept key's: the smallest (order key, then the
// highest index) packed into one unsigned 64-bit word, its first slot.
__device__ __forceinline__ int32_t decide(const DecodeParams& p, const Plane& pl) {
  __shared__ unsigned long long best_s[kDecodeWarps];
  __shared__ int32_t slot_s[kDecodeWarps], free_s[kDecodeWarps];
  // No new key, or one that cannot enter (perkey_last_row; padding): nothing to decide. The same
  // in every thread of the CTA (one plane), so the barriers below are skipped by all or none.
  if (!pl.eligible || pl.sn == -INFINITY) return -1;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int32_t W = static_cast<int32_t>(p.window);
  unsigned long long best = ~0ull;
  int32_t best_slot = W, first_free = W;
  for (int32_t j = tid; j < W; j += kDecodeThreads) {
    // The three loads issued together (a slot's index and score do not wait for its flag).
    const bool valid = pl.valid[j * p.valid_slot_stride];
    const int64_t ix = pl.idx[j * p.idx_slot_stride];
    const float sc = load_score(pl.score, p.score_dtype, j * p.score_slot_stride);
    if (!valid) {
      first_free = min(first_free, j);
      continue;
    }
    const unsigned long long packed = static_cast<unsigned long long>(float_order(sc)) << 32 | (0x7FFFFFFFull - ix);
    if (packed < best) {  // strictly: a thread's slots rise, so its first slot of a value is kept
      best = packed;
      best_slot = j;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int32_t os = __shfl_xor_sync(0xffffffffu, best_slot, o);
    if (ob < best || (ob == best && os < best_slot)) {
      best = ob;
      best_slot = os;
    }
    first_free = min(first_free, __shfl_xor_sync(0xffffffffu, first_free, o));
  }
  if (lane == 0) {
    best_s[warp] = best;
    slot_s[warp] = best_slot;
    free_s[warp] = first_free;
  }
  __syncthreads();
  best = best_s[0];
  best_slot = slot_s[0];
  first_free = free_s[0];
  for (int w = 1; w < kDecodeWarps; ++w) {
    if (best_s[w] < best || (best_s[w] == best && slot_s[w] < best_slot)) {
      best = best_s[w];
      best_slot = slot_s[w];
    }
    first_free = min(first_free, free_s[w]);
  }
  const bool free = first_free < W;
  const bool enter =
      pl.eligible && pl.sn != -INFINITY && (free || float_order(pl.sn) > static_cast<uint32_t>(best >> 32));
  return enter ? (free ? first_free : best_slot) : -1;
}

// The plane's writes, after every read of its kept set and caches: the slot the new key took, and
// (decode_append) the new key's rows, score and eligibility into the caches.
template <class T>
__device__ __forceinline__ void commit(const DecodeParams& p, const Plane& pl, int32_t taken) {
  const int tid = threadIdx.x;
  const int64_t b = pl.b, g = pl.g, pos = pl.pos;
  const int64_t sn_at = b * p.s_new_batch_stride + g * p.s_new_head_stride;
  if (tid == 0 && taken >= 0) {
    pl.idx[taken * p.idx_slot_stride] = pos;
    pl.valid[taken * p.valid_slot_stride] = 1;
    copy_score(pl.score, taken * p.score_slot_stride, p.s_new, sn_at, p.score_dtype);
  }
  if (p.k_new == nullptr) return;
  const T* kn = static_cast<const T*>(p.k_new) + b * p.k_new_batch_stride + g * p.k_new_head_stride;
  const T* vn = static_cast<const T*>(p.v_new) + b * p.v_new_batch_stride + g * p.v_new_head_stride;
  T* kd = static_cast<T*>(p.k) + b * p.k_batch_stride + g * p.k_head_stride + pos * p.k_row_stride;
  T* vd = static_cast<T*>(p.v) + b * p.v_batch_stride + g * p.v_head_stride + pos * p.v_row_stride;
  for (int64_t d = tid; d < p.head_dim; d += kDecodeThreads) {
    kd[d] = kn[d];
    vd[d] = vn[d];
  }
  if (tid == 0) {
    copy_score(p.bias_cache, b * p.bias_batch_stride + g * p.bias_head_stride + pos * p.bias_row_stride, p.s_new, sn_at,
               p.score_dtype);
    if (g == 0) p.padding_cache[b * p.padding_batch_stride + pos * p.padding_row_stride] = pl.eligible ? 1 : 0;
  }
}

// A split's partial rows in the workspace: G maxima, G sums, G x D unnormalised outputs (float).
__device__ __forceinline__ float* partial(const DecodeParams& p, int64_t plane, int split, int splits) {
  const int64_t G = p.num_heads / p.planes_per_batch, unit = G * (p.head_dim + 2);
  return static_cast<float*>(p.workspace) + (plane * splits + split) * unit;
}
__device__ __forceinline__ int32_t* decisions(const DecodeParams& p, int splits) {
  const int64_t G = p.num_heads / p.planes_per_batch, planes = p.batch * p.planes_per_batch;
  return reinterpret_cast<int32_t*>(static_cast<float*>(p.workspace) + planes * splits * G * (p.head_dim + 2));
}

template <class T>
__global__ void __launch_bounds__(kDecodeThreads) decode_split_kernel(const DecodeParams p, int splits, int chunk) {
  __shared__ T q_s[kMaxGroup * kMaxDim];
  __shared__ T v_s[kSlots * kMaxDim];
  __shared__ float s_s[kMaxGroup * kSlots];
  __shared__ int64_t kix_s[kSlots];  // the slot's key row; -1: the new key
  __shared__ float bias_s[kSlots];
  __shared__ bool keep_s[kSlots];
  __shared__ float m_s[kMaxGroup], l_s[kMaxGroup], alpha_s[kMaxGroup];

  const int64_t plane = blockIdx.x;
  const int split = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int G = static_cast<int>(p.num_heads / p.planes_per_batch), D = static_cast<int>(p.head_dim);
  const Plane pl(p, plane);
  const int32_t taken = decide(p, pl);

  const T* qb = static_cast<const T*>(p.q) + pl.b * p.q_batch_stride + pl.a * G * p.q_head_stride;
  for (int e = tid; e < G * D; e += kDecodeThreads) q_s[e] = qb[(e / D) * p.q_head_stride + e % D];
  if (tid < G) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.f;
  }
  const T* kc = static_cast<const T*>(p.k) + pl.b * p.k_batch_stride + pl.g * p.k_head_stride;
  const T* vc = static_cast<const T*>(p.v) + pl.b * p.v_batch_stride + pl.g * p.v_head_stride;
  const T* k_new = p.k_new ? static_cast<const T*>(p.k_new) + pl.b * p.k_new_batch_stride + pl.g * p.k_new_head_stride
                           : kc + pl.pos * p.k_row_stride;
  const T* v_new = p.v_new ? static_cast<const T*>(p.v_new) + pl.b * p.v_new_batch_stride + pl.g * p.v_new_head_stride
                           : vc + pl.pos * p.v_row_stride;
  const float scale = static_cast<float>(p.softmax_scale), cap = static_cast<float>(p.softcap);

  float acc[kAccPer];
#pragma unroll
  for (int i = 0; i < kAccPer; ++i) acc[i] = 0.f;

  const int64_t lo = static_cast<int64_t>(split) * chunk, hi = min(lo + chunk, p.window);
  for (int64_t n0 = lo; n0 < hi; n0 += kSlots) {
    // 1. The chunk's slots as the updated set holds them.
    if (tid < kSlots) {
      const int64_t j = n0 + tid;
      bool keep = false;
      int64_t kix = 0;
      float bias = 0.f;
      if (j < hi) {
        if (j == taken) {
          keep = true;
          kix = -1;
          bias = pl.sn;
        } else if (pl.valid[j * p.valid_slot_stride]) {
          keep = true;
          kix = pl.idx[j * p.idx_slot_stride];
          bias = load_score(pl.score, p.score_dtype, j * p.score_slot_stride);
        }
      }
      keep_s[tid] = keep;
      kix_s[tid] = kix;
      bias_s[tid] = bias;
    }
    __syncthreads();
    // 2. A warp a slot: its K row against every query row (log2 units), its V row staged.
    for (int jj = warp; jj < kSlots; jj += kDecodeWarps) {
      if (!keep_s[jj]) {
        for (int r = lane; r < G; r += 32) s_s[r * kSlots + jj] = -INFINITY;
        for (int d = lane; d < D; d += 32) v_s[jj * D + d] = from_float<T>(0.f);
        continue;
      }
      const T* kr = kix_s[jj] < 0 ? k_new : kc + kix_s[jj] * p.k_row_stride;
      const T* vr = kix_s[jj] < 0 ? v_new : vc + kix_s[jj] * p.v_row_stride;
      float kv[kMaxDim / 32];
#pragma unroll
      for (int i = 0; i < kMaxDim / 32; ++i) {
        const int d = lane + 32 * i;
        kv[i] = d < D ? to_float(kr[d]) : 0.f;
        if (d < D) v_s[jj * D + d] = vr[d];
      }
      for (int r = 0; r < G; ++r) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < kMaxDim / 32; ++i) {
          const int d = lane + 32 * i;
          if (d < D) dot += to_float(q_s[r * D + d]) * kv[i];
        }
        dot = warp_sum(dot);
        if (lane == 0) {
          // The reference's order: scale, softcap, then the bias.
          float s = cap > 0.f ? cap * tanhf(scale * dot / cap) : scale * dot;
          s = (s + bias_s[jj]) * kLog2eF;
          // A NaN becomes +inf: the max and the sum turn NaN and the row comes out NaN (as in the
          // reference) instead of the max skipping it.
          s_s[r * kSlots + jj] = s != s ? INFINITY : s;
        }
      }
    }
    __syncthreads();
    // 3. The rows' online softmax over the chunk: a warp a row, a lane a slot.
    for (int r = warp; r < G; r += kDecodeWarps) {
      const float x = s_s[r * kSlots + lane];
      const float m_old = m_s[r], m_new = fmaxf(m_old, warp_max(x));
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2f(m_old - m_use), pr = exp2f(x - m_use);
      const float sum = warp_sum(pr);
      s_s[r * kSlots + lane] = pr;
      __syncwarp();
      if (lane == 0) {
        m_s[r] = m_new;
        l_s[r] = l_s[r] * alpha + sum;
        alpha_s[r] = alpha;
      }
    }
    __syncthreads();
    // 4. The output rows: P V over the chunk. (The next chunk's step 1 writes only what step 2
    // read, and its step 2 runs after a barrier: no barrier here.)
#pragma unroll
    for (int i = 0; i < kAccPer; ++i) {
      const int e = tid + i * kDecodeThreads;
      if (e < G * D) {
        const int r = e / D, d = e % D;
        float a = acc[i] * alpha_s[r];
#pragma unroll 8
        for (int jj = 0; jj < kSlots; ++jj) a += s_s[r * kSlots + jj] * to_float(v_s[jj * D + d]);
        acc[i] = a;
      }
    }
  }
  __syncthreads();  // every thread's reads of the kept set before its writes (one split) or the merge

  T* ob = static_cast<T*>(p.out) + pl.b * p.o_batch_stride + pl.a * G * p.o_head_stride;
  if (splits == 1) {
#pragma unroll
    for (int i = 0; i < kAccPer; ++i) {
      const int e = tid + i * kDecodeThreads;
      if (e < G * D) {
        const float l = l_s[e / D];
        ob[(e / D) * p.o_head_stride + e % D] = from_float<T>(l == 0.f ? 0.f : acc[i] / l);  // no key kept: 0
      }
    }
    commit<T>(p, pl, taken);
    return;
  }
  float* part = partial(p, plane, split, splits);
  if (tid < G) {
    part[tid] = m_s[tid];
    part[G + tid] = l_s[tid];
  }
#pragma unroll
  for (int i = 0; i < kAccPer; ++i) {
    const int e = tid + i * kDecodeThreads;
    if (e < G * D) part[2 * G + e] = acc[i];
  }
  if (split == 0 && tid == 0) decisions(p, splits)[plane] = taken;
}

// The splits' partial rows merged (log-sum-exp), the output written, then the plane's writes.
// A warp a query row, a lane a split: the splits' maxima and sums are read at once, and the output
// sums keep eight splits' reads in flight. Read one split after another, the merge is a chain of
// L2 round trips as long as the splits are many (32 for one plane on 132 SMs).
template <class T>
__global__ void __launch_bounds__(kDecodeThreads) decode_merge_kernel(const DecodeParams p, int splits) {
  __shared__ float w_s[kMaxSplits * kMaxGroup];
  __shared__ float l_s[kMaxGroup];
  const int64_t plane = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int G = static_cast<int>(p.num_heads / p.planes_per_batch), D = static_cast<int>(p.head_dim);
  const Plane pl(p, plane);
  for (int r = warp; r < G; r += kDecodeWarps) {
    float top = -INFINITY;
    for (int u = lane; u < splits; u += 32) top = fmaxf(top, partial(p, plane, u, splits)[r]);
    top = warp_max(top);
    const float use = top == -INFINITY ? 0.f : top;
    float l = 0.f;
    for (int u = lane; u < splits; u += 32) {
      const float* part = partial(p, plane, u, splits);
      const float w = exp2f(part[r] - use);
      w_s[u * G + r] = w;
      l += w * part[G + r];
    }
    l = warp_sum(l);
    if (lane == 0) l_s[r] = l;
  }
  __syncthreads();
  T* ob = static_cast<T*>(p.out) + pl.b * p.o_batch_stride + pl.a * G * p.o_head_stride;
  const int64_t unit = static_cast<int64_t>(G) * (D + 2);
  const float* base = partial(p, plane, 0, splits) + 2 * G;
  for (int e = tid; e < G * D; e += kDecodeThreads) {
    const int r = e / D;
    float a = 0.f;
#pragma unroll 8
    for (int u = 0; u < splits; ++u) a += w_s[u * G + r] * base[u * unit + e];
    const float l = l_s[r];
    ob[r * p.o_head_stride + e % D] = from_float<T>(l == 0.f ? 0.f : a / l);  // no key kept: 0
  }
  commit<T>(p, pl, decisions(p, splits)[plane]);
}

// ---- perkey_last_row's selection: a plane's top-W keys by (score desc, index asc), -inf never,
// NaN first (flexdma/perkey/contract.py), written in index order as the plane's kept set. A radix
// select over the scores' order keys, 8 bits a pass, each plane's keys split over `ctas` CTAs (one
// SM cannot stream 512K keys fast enough): a pass is a launch in which each CTA writes its chunk's
// histogram row (the keys matching the digits chosen so far), and every CTA of the next launch
// derives those digits from the rows (a few kilobytes), so no launch waits on another within
// itself. The last launch writes the kept keys in index order: a CTA's first slot and tie rank from
// the earlier chunks' rows of the last pass, its warps' from a count over its chunk. Two
// histogram launches for 16-bit scores, four for float32. ----

constexpr int kSelectThreads = 256;
constexpr int kSelectWarps = kSelectThreads / 32;
constexpr int kSelectUnroll = 4;     // 256-key steps a warp loads at once
constexpr int kSelectChunk = 8192;   // keys a CTA takes at least
constexpr int kRow = 257;            // a chunk's row: 256 bins, then the keys above the prefix
constexpr int kMaxSelectCtas = 256;  // CTAs a plane at most

// Keys i .. i + 7 of a plane (0 past K): 16 bytes at a time where the plane allows.
template <class S>
__device__ __forceinline__ void load8(const typename OrderKey<S>::Bits* base, int64_t i, int64_t K, bool vec,
                                      uint32_t (&u)[8]) {
  using K_ = OrderKey<S>;
  if (vec && i + 8 <= K) {
    if (K_::kBits == 16) {
      const uint4 x = *reinterpret_cast<const uint4*>(base + i);
      const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        u[2 * j] = K_::of(w[j] & 0xFFFF);
        u[2 * j + 1] = K_::of(w[j] >> 16);
      }
    } else {
      const uint4 x = *reinterpret_cast<const uint4*>(base + i);
      const uint4 y = *reinterpret_cast<const uint4*>(base + i + 4);
      const uint32_t w[8] = {x.x, x.y, x.z, x.w, y.x, y.y, y.z, y.w};
#pragma unroll
      for (int j = 0; j < 8; ++j) u[j] = K_::of(w[j]);
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) u[j] = i + j < K ? K_::of(base[i + j]) : 0u;
}

__device__ __forceinline__ uint32_t warp_exclusive(uint32_t x, int lane) {
  uint32_t incl = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  return incl - x;
}

// The digits chosen by passes 0 .. upto - 1 of a plane, from their rows (every thread returns
// them). A pass's digit is the bin where the count from the top reaches the keys still to take.
struct SelectState {
  uint32_t prefix = 0, mask = 0, remain = 0, digit = 0;
  bool all = false;  // fewer eligible keys than W: every one is kept (decided by pass 0)
};

template <int kBits>
__device__ SelectState derive_state(const uint32_t* rows, int64_t plane, int64_t planes, int ctas, int upto,
                                    uint32_t W) {
  constexpr int kPasses = kBits / 8;
  __shared__ uint32_t bins[kPasses][256];
  __shared__ SelectState st_s;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (upto == 0) {  // the first pass: no digit chosen yet (the same in every thread)
    SelectState st;
    st.remain = W;
    return st;
  }
  // Every pass's bins at once: a pass's rows were counted under the digits before it, which are
  // already fixed, so its sums need not wait for those choices (one chain of row loads, not one a
  // pass: the ordered write reads two passes' rows, four for float32 scores). The row pointer
  // moves by one add a row: the loop is latency-bound (one CTA an SM), so no index arithmetic.
  const int64_t pass_stride = planes * ctas * kRow;
  for (int b = tid; b < 256; b += kSelectThreads) {
    uint32_t c[kPasses] = {};
    const uint32_t* row = rows + plane * ctas * kRow + b;
#pragma unroll 4
    for (int x = 0; x < ctas; ++x, row += kRow) {
#pragma unroll
      for (int d = 0; d < kPasses; ++d)
        if (d < upto) c[d] += row[d * pass_stride];
    }
#pragma unroll
    for (int d = 0; d < kPasses; ++d) bins[d][b] = c[d];
  }
  __syncthreads();
  // The choices, in warp 0: a lane holds eight bins from the top, the lane where the count reaches
  // the keys still to take finds the digit, and a shuffle gives it to the others.
  if (warp == 0) {
    SelectState st;
    st.remain = W;
    for (int d = 0; d < upto; ++d) {
      const int shift = kBits - 8 * (d + 1);
      uint32_t h[8], sum = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        h[j] = bins[d][255 - 8 * lane - j];
        sum += h[j];
      }
      const uint32_t before = warp_exclusive(sum, lane);
      if (d == 0 && __shfl_sync(0xffffffffu, before + sum, 31) <= st.remain) {
        st.all = true;
        break;
      }
      uint32_t digit = 0, acc = before;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (acc + h[j] >= st.remain) {
          digit = 255 - 8 * lane - j;
          break;
        }
        acc += h[j];
      }
      const int src = __ffs(__ballot_sync(0xffffffffu, before < st.remain && before + sum >= st.remain)) - 1;
      st.digit = __shfl_sync(0xffffffffu, digit, src);
      st.prefix |= st.digit << shift;
      st.mask |= 255u << shift;
      st.remain -= __shfl_sync(0xffffffffu, acc, src);
    }
    if (lane == 0) st_s = st;
  }
  __syncthreads();
  return st_s;
}

// Pass `pass`: each CTA's histogram of the pass's digit over its chunk's keys that match the
// digits chosen so far, and the count of its keys above those digits' prefix (the last pass's:
// the keys above the W-th best that the digit does not separate).
template <class S>
__global__ void __launch_bounds__(kSelectThreads)
    select_hist_kernel(const DecodeParams p, uint32_t* rows, int ctas, int64_t chunk, int pass) {
  using K_ = OrderKey<S>;
  using Bits = typename K_::Bits;
  __shared__ uint32_t hist[kSelectWarps][256];
  __shared__ uint32_t above_s[kSelectWarps];
  const int64_t plane = blockIdx.x, planes = gridDim.x;
  const int c = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const Bits* base = static_cast<const Bits*>(p.scores) + (plane / p.score_planes2) * p.scores_batch_stride +
                     (plane % p.score_planes2) * p.scores_head_stride;
  const bool vec = (reinterpret_cast<uintptr_t>(base) & 15) == 0;
  const int64_t c_lo = c * chunk, c_hi = min(c_lo + chunk, p.seqlen_k);
  // A step: kSelectUnroll loads of 256 keys a warp. The first is issued before the digits are
  // derived (it does not depend on them): a chunk of 8192 keys is one step.
  uint32_t u[kSelectUnroll][8];
  const auto load_step = [&](int64_t i0) {
#pragma unroll
    for (int k = 0; k < kSelectUnroll; ++k) load8<S>(base, i0 + k * 256 * kSelectWarps + lane * 8, c_hi, vec, u[k]);
  };
  const int64_t first = c_lo + warp * 256;
  load_step(first);
  const SelectState st = derive_state<K_::kBits>(rows, plane, planes, ctas, pass, static_cast<uint32_t>(p.window));
  if (st.all) return;  // pass 0 kept every eligible key: nothing more to count
  const int shift = K_::kBits - 8 * (pass + 1);
  for (int j = lane; j < 256; j += 32) hist[warp][j] = 0;
  __syncwarp();
  const uint32_t hi_bits = shift + 8 < 32 ? ~((1u << (shift + 8)) - 1) : 0u;
  uint32_t above = 0;
  for (int64_t i0 = first; i0 < c_hi; i0 += 256 * kSelectWarps * kSelectUnroll) {
    if (i0 != first) load_step(i0);
#pragma unroll
    for (int k = 0; k < kSelectUnroll; ++k) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t x = u[k][j];
        const bool in = x > K_::kNegInf && (x & st.mask) == st.prefix;
        above += (x & hi_bits) > (st.prefix & hi_bits);
        // Lanes adding to one bin add once (trained scores' exponents fall in a few bins).
        const uint32_t bin = in ? (x >> shift) & 255 : 256u;
        const uint32_t same = __match_any_sync(0xffffffffu, bin);
        if (in && lane == __ffs(same) - 1) atomicAdd(&hist[warp][bin], __popc(same));
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) above += __shfl_xor_sync(0xffffffffu, above, o);
  if (lane == 0) above_s[warp] = above;
  __syncthreads();
  uint32_t* row = rows + ((static_cast<int64_t>(pass) * planes + plane) * ctas + c) * kRow;
  for (int b = tid; b < 256; b += kSelectThreads) {
    uint32_t n = 0;
#pragma unroll
    for (int w = 0; w < kSelectWarps; ++w) n += hist[w][b];
    row[b] = n;
  }
  if (tid == 0) {
    uint32_t n = 0;
    for (int w = 0; w < kSelectWarps; ++w) n += above_s[w];
    row[256] = n;
  }
}

template <class S>
__global__ void __launch_bounds__(kSelectThreads)
    select_write_kernel(const DecodeParams p, const uint32_t* rows, int ctas, int64_t chunk, int passes) {
  using K_ = OrderKey<S>;
  using Bits = typename K_::Bits;
  __shared__ uint32_t warp_above[kSelectWarps], warp_ties[kSelectWarps], base_s[3];
  __shared__ uint32_t chunk_above[kMaxSelectCtas], chunk_ties[kMaxSelectCtas];
  const int64_t plane = blockIdx.x, planes = gridDim.x, W = p.window;
  const int c = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const Bits* base = static_cast<const Bits*>(p.scores) + (plane / p.score_planes2) * p.scores_batch_stride +
                     (plane % p.score_planes2) * p.scores_head_stride;
  const bool vec = (reinterpret_cast<uintptr_t>(base) & 15) == 0;
  const int64_t c_lo = c * chunk, c_hi = min(c_lo + chunk, p.seqlen_k);
  // Warp w owns the chunk's keys [lo, hi): a contiguous segment, so that its kept keys follow the
  // earlier warps'.
  const int64_t seg = (chunk / 256 + kSelectWarps - 1) / kSelectWarps * 256;
  const int64_t lo = c_lo + warp * seg, hi = min(lo + seg, c_hi);
  // The warp's keys a block of kSelectUnroll 256-key steps at a time, in registers: a segment of
  // one block (chunks up to 8192 keys) is read once for the count and the write, and its loads
  // are issued before the digits are derived (they do not depend on them).
  constexpr int kBlock = kSelectUnroll * 256;
  uint32_t u[kSelectUnroll][8];
  const auto load_block = [&](int64_t b0) {
#pragma unroll
    for (int k = 0; k < kSelectUnroll; ++k) load8<S>(base, b0 + k * 256 + lane * 8, hi, vec, u[k]);
  };
  load_block(lo);
  const SelectState st = derive_state<K_::kBits>(rows, plane, planes, ctas, passes, static_cast<uint32_t>(W));
  const uint32_t T = st.all ? K_::kNegInf : st.prefix, r = st.all ? 0u : st.remain;
  const int last = st.all ? 0 : passes - 1;
  const uint32_t* last_rows = rows + (static_cast<int64_t>(last) * planes + plane) * ctas * kRow;
  // Chunks 0 .. c's keys above T and ties, from the last pass's rows (a warp a row): every eligible
  // key where all are kept (pass 0's rows). Then, in chunk order, the kept keys and ties before
  // this chunk (a chunk keeps its ties while the plane's earlier ties number fewer than r), and
  // the plane's total kept keys.
  // Two rows a warp in flight (a CTA late in the plane reads up to kMaxSelectCtas rows).
  for (int x0 = warp; x0 <= c; x0 += 2 * kSelectWarps) {
    const int x1 = x0 + kSelectWarps;
    const uint32_t* row0 = last_rows + x0 * kRow;
    const uint32_t* row1 = last_rows + min(x1, c) * kRow;
    uint32_t above0 = 0, above1 = 0;
#pragma unroll
    for (int b = lane; b < 256; b += 32) {
      const bool counted = st.all || b > static_cast<int>(st.digit);
      above0 += counted ? row0[b] : 0u;
      above1 += counted ? row1[b] : 0u;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      above0 += __shfl_xor_sync(0xffffffffu, above0, o);
      above1 += __shfl_xor_sync(0xffffffffu, above1, o);
    }
    if (lane == 0) {
      chunk_above[x0] = above0 + (st.all ? 0u : row0[256]);
      chunk_ties[x0] = st.all ? 0u : row0[st.digit];
      if (x1 <= c) {
        chunk_above[x1] = above1 + (st.all ? 0u : row1[256]);
        chunk_ties[x1] = st.all ? 0u : row1[st.digit];
      }
    }
  }
  __syncthreads();
  // In chunk order, by warp 0's scans 32 chunks at a time: chunk x keeps its keys above T and its
  // ties while the plane's earlier ties number fewer than r.
  if (warp == 0) {
    uint32_t kept_run = 0, ties_run = 0;
    for (int x0 = 0; x0 <= c; x0 += 32) {
      const int x = x0 + lane;
      const uint32_t ties = x <= c ? chunk_ties[x] : 0u;
      const uint32_t ties_before = ties_run + warp_exclusive(ties, lane);
      const uint32_t kept = x <= c ? chunk_above[x] + (ties_before >= r ? 0u : min(ties, r - ties_before)) : 0u;
      const uint32_t kept_before = kept_run + warp_exclusive(kept, lane);
      if (x == c) {
        base_s[0] = kept_before;
        base_s[1] = ties_before;
        base_s[2] = kept_before + kept;
      }
      kept_run = __shfl_sync(0xffffffffu, kept_before + kept, 31);
      ties_run = __shfl_sync(0xffffffffu, ties_before + ties, 31);
    }
  }
  // The warp's ties and keys above T. Its kept keys follow from the plane's ties before it: a warp
  // keeps its ties while the earlier ones number fewer than r, so no second counting pass.
  uint32_t ties_w = 0, above_w = 0;
  for (int64_t b0 = lo; b0 < hi; b0 += kBlock) {
    if (b0 != lo) load_block(b0);
#pragma unroll
    for (int k = 0; k < kSelectUnroll; ++k)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        ties_w += u[k][j] == T;
        above_w += u[k][j] > T;
      }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ties_w += __shfl_xor_sync(0xffffffffu, ties_w, o);
    above_w += __shfl_xor_sync(0xffffffffu, above_w, o);
  }
  if (lane == 0) warp_ties[warp] = ties_w, warp_above[warp] = above_w;
  __syncthreads();
  uint32_t tie_run = base_s[1], kept_run = base_s[0];
  for (int w = 0; w < warp; ++w) {
    kept_run += warp_above[w] + (tie_run >= r ? 0u : min(warp_ties[w], r - tie_run));
    tie_run += warp_ties[w];
  }
  // The write: a 256-key step's ties and kept keys ranked by two warp scans.
  const bool held = hi - lo <= kBlock;
  for (int64_t b0 = lo; b0 < hi; b0 += kBlock) {
    if (!held) load_block(b0);
#pragma unroll
    for (int k = 0; k < kSelectUnroll; ++k) {
      if (b0 + k * 256 >= hi) break;  // the same in every lane
      const int64_t i = b0 + k * 256 + lane * 8;
      uint32_t my_ties = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) my_ties += u[k][j] == T;
      const uint32_t tie_before = warp_exclusive(my_ties, lane);
      bool kept[8];
      uint32_t my_kept = 0, seen = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const bool tie = u[k][j] == T;
        kept[j] = u[k][j] > T || (tie && tie_run + tie_before + seen < r);
        seen += tie;
        my_kept += kept[j];
      }
      const uint32_t kept_before = warp_exclusive(my_kept, lane);
      uint32_t slot = kept_run + kept_before;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (kept[j]) {
          p.kept_idx[plane * W + slot] = i + j;
          p.kept_valid[plane * W + slot] = 1;
          static_cast<Bits*>(p.kept_score)[plane * W + slot] = base[i + j];
          ++slot;
        }
      }
      kept_run += __shfl_sync(0xffffffffu, kept_before + my_kept, 31);
      tie_run += __shfl_sync(0xffffffffu, tie_before + my_ties, 31);
    }
  }
  // The free slots past the plane's kept keys (the last CTA, which knows the total).
  if (c == ctas - 1) {
    for (int64_t j = base_s[2] + tid; j < W; j += kSelectThreads) {
      p.kept_idx[plane * W + j] = 0;
      p.kept_valid[plane * W + j] = 0;
      static_cast<Bits*>(p.kept_score)[plane * W + j] = 0;
    }
  }
}

// CTAs a plane: a power of two, so that planes x splits about fills the SMs, each with at least
// one step of kSlots slots.
int decode_splits(const DecodeParams& p) {
  const int64_t planes = p.batch * p.planes_per_batch;
  const int64_t steps = (p.window + kSlots - 1) / kSlots;
  int64_t n = sm_count() / (planes > 0 ? planes : 1);
  n = n < steps ? n : steps;
  n = n < kMaxSplits ? n : kMaxSplits;
  int splits = 1;
  while (splits * 2 <= n) splits *= 2;
  return splits;
}

}  // namespace

const char* decode_unsupported_reason(const DecodeParams& p) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return "dtype (it takes float16 and bfloat16)";
  if (p.score_dtype == DType::kFloat64) return "float64 scores (it ranks in float32)";
  if (p.head_dim < 1 || p.head_dim > kMaxDim) return "head_dim above 256";
  if (p.planes_per_batch < 1 || p.num_heads % p.planes_per_batch || p.num_heads / p.planes_per_batch > kMaxGroup)
    return "more than 32 query heads a kv head";
  if (p.window < 1 || p.capacity >= (int64_t{1} << 31)) return "a window below 1 or 2^31 cached keys or more";
  return nullptr;
}

int64_t decode_workspace_bytes(const DecodeParams& p) {
  const int splits = decode_splits(p);
  if (splits == 1) return 0;
  const int64_t planes = p.batch * p.planes_per_batch, G = p.num_heads / p.planes_per_batch;
  return (planes * splits * G * (p.head_dim + 2) + planes) * 4;
}

// CTAs a plane for the selection: chunks of at least kSelectChunk keys, about two CTAs an SM.
int select_ctas(const DecodeParams& p) {
  const int64_t planes = p.score_planes1 * p.score_planes2;
  int64_t n = (p.seqlen_k + kSelectChunk - 1) / kSelectChunk, most = 2 * sm_count() / (planes > 0 ? planes : 1);
  n = n < most ? n : most;
  n = n < kMaxSelectCtas ? n : kMaxSelectCtas;
  return static_cast<int>(n < 1 ? 1 : n);
}

int select_passes(const DecodeParams& p) { return p.score_dtype == DType::kFloat32 ? 4 : 2; }

template <class S>
void launch_select(const DecodeParams& p, uint32_t* rows, cudaStream_t st) {
  const int ctas = select_ctas(p), passes = select_passes(p);
  const int64_t chunk = (p.seqlen_k + ctas - 1) / ctas;
  const int64_t chunk256 = (chunk + 255) / 256 * 256;  // whole 256-key steps: aligned loads
  const dim3 grid(static_cast<unsigned>(p.score_planes1 * p.score_planes2), ctas);
  for (int pass = 0; pass < passes; ++pass)
    select_hist_kernel<S><<<grid, kSelectThreads, 0, st>>>(p, rows, ctas, chunk256, pass);
  select_write_kernel<S><<<grid, kSelectThreads, 0, st>>>(p, rows, ctas, chunk256, passes);
}

int64_t last_row_select_bytes(const DecodeParams& p) {
  return static_cast<int64_t>(select_passes(p)) * p.score_planes1 * p.score_planes2 * select_ctas(p) * kRow * 4;
}

void run_last_row(const DecodeParams& p, void* stream) {
  const int64_t planes = p.score_planes1 * p.score_planes2;
  if (planes > 0) {
    const cudaStream_t st = static_cast<cudaStream_t>(stream);
    uint32_t* rows = static_cast<uint32_t*>(p.select_workspace);
    if (p.score_dtype == DType::kBFloat16)
      launch_select<__nv_bfloat16>(p, rows, st);
    else if (p.score_dtype == DType::kFloat16)
      launch_select<__half>(p, rows, st);
    else
      launch_select<float>(p, rows, st);
  }
  run_decode(p, stream);
}

void run_decode(const DecodeParams& p, void* stream) {
  if (p.batch == 0) return;
  const int splits = decode_splits(p);
  const int chunk = static_cast<int>((p.window + splits * kSlots - 1) / (splits * kSlots) * kSlots);
  const dim3 grid(static_cast<unsigned>(p.batch * p.planes_per_batch), splits);
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (p.dtype == DType::kBFloat16) {
    decode_split_kernel<__nv_bfloat16><<<grid, kDecodeThreads, 0, st>>>(p, splits, chunk);
    if (splits > 1) decode_merge_kernel<__nv_bfloat16><<<grid.x, kDecodeThreads, 0, st>>>(p, splits);
  } else {
    decode_split_kernel<__half><<<grid, kDecodeThreads, 0, st>>>(p, splits, chunk);
    if (splits > 1) decode_merge_kernel<__half><<<grid.x, kDecodeThreads, 0, st>>>(p, splits);
  }
}

}  // namespace cuda
}  // namespace flexdma
