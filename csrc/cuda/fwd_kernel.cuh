// Forward kernel: one CTA of 4 warps (one warpgroup) per (64-row query tile, head, batch); warp
// w owns query rows [16w, 16w + 16). Q lives in registers as A fragments (in smem above D = 128);
// S, the online softmax statistics, P and the O accumulator never leave registers (P's C fragments
// are repacked as the A operand of P.V). Both products are wgmma (sm_90a, head dims 64 / 128 /
// 192 / 256: B read from swizzled smem by the tensor cores) or mma.sync with ldmatrix (head dims
// 32 / 96, other targets). K, V, bias and mask tiles are double buffered with cp.async: tile
// t+1's copies are in flight while tile t is computed. Which key tiles keep
// anything comes from the mask's tile activity bits (FwdParams::tile_meta), so an all-false
// tile costs no byte at all and finding the next kept tile needs no load round trip.
#pragma once
#include "mma_sm80.cuh"
#include "mma_sm90.cuh"
#include "tile_io.cuh"

namespace flexdma {
namespace cuda {

constexpr int kLdBias = kBlockN + 8;   // 144-byte rows, same reason

__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }

// Heads wider than 128 keep Q in smem for the whole CTA and read it by wgmma (S with both operands
// in smem): as A fragments it would take D / 4 registers next to the D / 2 of the O accumulator.
template <int D>
constexpr bool fwd_q_in_smem() {
  return D > 128;
}

template <typename T, int D>
struct FwdSmem {
  static constexpr int kTileKV = tile_bytes<D>();
  static constexpr int kKeepSlot = kBlockM * kLdKeep;
  // Up to D = 128 the Q tiles are only staged here until they are in registers; the region then
  // holds the mask bytes of the two K / V buffers' tiles. Wider, Q (swizzled) stays, the keep slots
  // follow.
  static constexpr int kQ = 0;
  static constexpr int kKeep = fwd_q_in_smem<D>() ? tile_bytes<D>() : 0;
  static constexpr int kK = ((fwd_q_in_smem<D>() ? kKeep + 2 * kKeepSlot
                                                 : cmax(kBlockM * tile_ld(D) * 2, 2 * kKeepSlot)) +
                             1023) / 1024 * 1024;
  static constexpr int kV = kK + 2 * kTileKV;
  static constexpr int kBias = kV + 2 * kTileKV;
  static constexpr int kBytes = kBias + 2 * kBlockM * kLdBias * 2 + (use_wgmma<D>() ? 1024 : 0);  // + room to align the base to 1024
  static_assert(kBytes <= kMaxSmemPerBlock, "forward smem layout too large");
};

// Split over keys (flash-decoding): with fewer query tiles than SMs, blockIdx.z takes a slice of
// the key tiles and writes its normalised partial O and its LSE (float) to o_part / lse_part,
// laid out [split][batch][head][row](D); combine_splits merges them.
struct FwdSplit {
  int n = 1;
  float* o_part = nullptr;
  float* lse_part = nullptr;
};

// Launch-time facts about operand alignment (16-byte cp.async / vector loads allowed or not).
struct FwdFlags {
  bool qkv_vec, mask_vec, bias_vec, out_vec;
};

// Whether the mask tile at n0 is copied raw into a smem slot by cp.async with its K / V tile
// (aligned rows, tile inside both lengths) rather than built when the tile has landed.
// A mask broadcast over queries (row stride 0) reads the same row for every tile row, so a
// query tile cut by seqlen_q (decoding: one query) may copy all 64 rows too.
__device__ inline bool mask_async(const FwdParams& p, bool mask_vec, int64_t m0, int64_t n0) {
  return p.mask.ptr && mask_vec && (m0 + kBlockM <= p.seqlen_q || p.mask.row_stride == 0) &&
         n0 + kBlockN <= p.seqlen_k;
}

__device__ inline uint32_t byte_of(const uint4& v, int e) {
  const uint32_t w = e < 4 ? v.x : e < 8 ? v.y : e < 12 ? v.z : v.w;
  return (w >> (8 * (e % 4))) & 0xffu;
}

// Builds the exact keep tile (mask & causal & bounds) of key tile n0 in a slot straight from
// global memory and returns whether any element is kept; block-uniform (ends in a barrier that
// every thread of the block reaches).
__device__ inline bool build_keep(const FwdParams& p, const Plane<uint8_t>& m, uint8_t* slot, bool mask_vec,
                                  int64_t m0, int64_t n0) {
  const TileBounds tb(p, m0, n0);
  constexpr int kPer = kBlockM * kBlockN / 16 / kThreads;
  int any = 0;
  {
    uint4 v[kPer];
    bool direct[kPer];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int c = threadIdx.x + u * kThreads, r = c / (kBlockN / 16), col0 = (c % (kBlockN / 16)) * 16;
      const int64_t i = m0 + r, j0 = n0 + col0;
      direct[u] = m.base && mask_vec && i < p.seqlen_q && j0 + 16 <= p.seqlen_k;
      v[u] = direct[u] ? *reinterpret_cast<const uint4*>(m.at(i, j0)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int c = threadIdx.x + u * kThreads, r = c / (kBlockN / 16), col0 = (c % (kBlockN / 16)) * 16;
      uint32_t wds[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        bool kk = tb.ok(r, col0 + e);
        if (kk && m.base) kk = direct[u] ? byte_of(v[u], e) != 0 : *m.at(m0 + r, n0 + col0 + e) != 0;
        wds[e / 4] |= uint32_t(kk) << (8 * (e % 4));
        any |= kk;
      }
      *reinterpret_cast<uint4*>(slot + r * kLdKeep + col0) = make_uint4(wds[0], wds[1], wds[2], wds[3]);
    }
  }
  return __syncthreads_or(any) != 0;
}

// Requests the K and V rows of key tile n0 (zero rows past seqlen_k: P is 0 there, V must not
// hold garbage that 0 * NaN would spread). Every K / V byte of the forward comes through here;
// `keys` says which rows of K / V the tile's keys are (tile_io.cuh: contiguous, or gathered
// through an index list). k and v point at row 0.
template <typename T, int D, typename Keys = ContiguousKeys>
__device__ inline void issue_kv(const T* k, const T* v, int64_t k_rs, int64_t v_rs, int64_t seqlen_k, int64_t n0,
                                T* sk, T* sv, bool vec, const Keys& keys = Keys{}) {
  if constexpr (!Keys::kContiguous) {
    issue_key_rows<T, D>(sk, k, k_rs, keys, n0, seqlen_k, vec);
    issue_key_rows<T, D>(sv, v, v_rs, keys, n0, seqlen_k, vec);
    return;
  } else if constexpr (D > 128) {
    const int valid = (int)imin(kBlockN, seqlen_k - n0);
    issue_rows<T, D>(sk, k + n0 * k_rs, k_rs, valid, vec);
    issue_rows<T, D>(sv, v + n0 * v_rs, v_rs, valid, vec);
    return;
  } else {
    // Head dims up to 128: K and V copies interleaved.
    constexpr int kChunks = D / 8;
    constexpr int kRowsPerPass = kThreads / kChunks;
    if constexpr (kThreads % kChunks != 0) {
      // D = 96: 12 chunks a row do not split 128 threads into whole rows; walk the tile's chunks
      // linearly (64 * 12 = 6 per thread).
      static_assert(kBlockN * kChunks % kThreads == 0, "K/V tile must split evenly over the threads");
      if (vec) {
        const bool full = n0 + kBlockN <= seqlen_k;
#pragma unroll
        for (int u = 0; u < kBlockN * kChunks / kThreads; ++u) {
          const int c = threadIdx.x + u * kThreads, r = c / kChunks, col = (c % kChunks) * 8;
          const bool ok = full || n0 + r < seqlen_k;
          cp_async16(sk + r * tile_ld(D) + col, ok ? k + (n0 + r) * k_rs + col : k, ok ? 16 : 0);
          cp_async16(sv + r * tile_ld(D) + col, ok ? v + (n0 + r) * v_rs + col : v, ok ? 16 : 0);
        }
        return;
      }
    } else if (vec) {
      // Each thread copies one 16-byte column chunk of every kRowsPerPass-th row: per-thread
      // offsets are fixed, the tile start moves.
      // kRowsPerPass is a multiple of 8, so the swizzle of a thread's chunk is the same in every pass.
      const int r0 = threadIdx.x / kChunks, col = (threadIdx.x % kChunks) * 8;
      constexpr int kPass = kRowsPerPass * tile_row_pitch<D>();
      static_assert(!use_wgmma<D>() || kRowsPerPass % 8 == 0, "swizzle must repeat every pass");
      const T* kr = k + (n0 + r0) * k_rs + col;
      const T* vr = v + (n0 + r0) * v_rs + col;
      T* skr = sk + tile_index<D>(r0, col);
      T* svr = sv + tile_index<D>(r0, col);
      if (n0 + kBlockN <= seqlen_k) {
#pragma unroll
        for (int u = 0; u < kBlockN / kRowsPerPass; ++u) {
          cp_async16(skr + u * kPass, kr + u * kRowsPerPass * k_rs);
          cp_async16(svr + u * kPass, vr + u * kRowsPerPass * v_rs);
        }
      } else {
#pragma unroll
        for (int u = 0; u < kBlockN / kRowsPerPass; ++u) {
          const bool ok = n0 + r0 + u * kRowsPerPass < seqlen_k;
          cp_async16(skr + u * kPass, ok ? kr + u * kRowsPerPass * k_rs : k, ok ? 16 : 0);
          cp_async16(svr + u * kPass, ok ? vr + u * kRowsPerPass * v_rs : v, ok ? 16 : 0);
        }
      }
      return;
    }
    // Strided or unaligned K/V, any D: element by element.
    for (int c = threadIdx.x; c < kBlockN * D; c += kThreads) {
      const int r = c / D, col = c % D;
      const bool ok = n0 + r < seqlen_k;
      sk[tile_index<D>(r, col)] = ok ? k[(n0 + r) * k_rs + col] : from_float<T>(0.f);
      sv[tile_index<D>(r, col)] = ok ? v[(n0 + r) * v_rs + col] : from_float<T>(0.f);
    }
  }
}

// Requests the bias tile (m0, n0) into smem (row stride kLdBias); out-of-range entries are 0
// (they are never kept). The 16-byte path needs contiguous keys and aligned strides.
template <typename T>
__device__ inline void issue_bias(const FwdParams& p, const Plane<T>& bb, T* sb, bool vec, int64_t m0, int64_t n0) {
  if (vec && bb.rs == 0 && n0 + kBlockN <= p.seqlen_k) {
    // Broadcast over queries (per-key bias): one row serves the tile (readers use row 0). 64
    // copies of the same 128 bytes cost 64x the L2 requests, all CTAs hitting the same lines.
    if (threadIdx.x < kBlockN / 8) cp_async16(sb + threadIdx.x * 8, bb.base + n0 + threadIdx.x * 8);
  } else if (vec && m0 + kBlockM <= p.seqlen_q && n0 + kBlockN <= p.seqlen_k) {
    constexpr int kRowsPerPass = kThreads / (kBlockN / 8);
    const int r0 = threadIdx.x / (kBlockN / 8), col0 = (threadIdx.x % (kBlockN / 8)) * 8;
    const T* src = bb.base + (m0 + r0) * bb.rs + n0 + col0;
#pragma unroll
    for (int u = 0; u < kBlockM / kRowsPerPass; ++u)
      cp_async16(sb + (r0 + u * kRowsPerPass) * kLdBias + col0, src + u * kRowsPerPass * bb.rs);
  } else {
    // Tiles cut by a sequence end, and strided / unaligned biases: element by element; entries
    // outside the lengths are 0 (never kept).
    for (int c = threadIdx.x; c < kBlockM * kBlockN; c += kThreads) {
      const int r = c / kBlockN, col = c % kBlockN;
      const int64_t i = m0 + r, j = n0 + col;
      sb[r * kLdBias + col] = (i < p.seqlen_q && j < p.seqlen_k) ? *bb.at(i, j) : from_float<T>(0.f);
    }
  }
}

// Drops (-inf) the scores of a warp's C fragments whose keep byte is 0 (rows r0, r0 + 8);
// kBounds also applies the tile's bounds and causal limit.
template <bool kBounds>
__device__ inline void apply_keep(float (&s)[kBlockN / 8][4], const uint8_t* keep, int r0, int qc, const TileBounds& tb) {
#pragma unroll
  for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = r0 + 8 * hh, col = n * 8 + 2 * qc;
      const uint32_t kv2 = *reinterpret_cast<const uint16_t*>(keep + r * kLdKeep + col);
      bool k0 = (kv2 & 0xffu) != 0, k1 = (kv2 >> 8) != 0;
      if (kBounds) {
        k0 &= tb.ok(r, col);
        k1 &= tb.ok(r, col + 1);
      }
      s[n][2 * hh] = k0 ? s[n][2 * hh] : -CUDART_INF_F;
      s[n][2 * hh + 1] = k1 ? s[n][2 * hh + 1] : -CUDART_INF_F;
    }
}

// At D=64 three CTAs fit an SM (71 KiB smem each) once registers stay <= 168 (no spill): 12 warps
// per SM instead of 8 to hide latency. At D=128 smem (105 KiB) allows two. D=32 (53 KiB) takes
// D=64's bound, D=96 (85 KiB, 250 registers) D=128's; D=192 / 256 (149 / 190 KiB) run one.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, D <= 64 ? 3 : D <= 128 ? 2 : 1)
    fwd_kernel(const FwdParams p, const FwdFlags f, const FwdSplit sp) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  constexpr bool kWg = use_wgmma<D>();
  constexpr bool kQSmem = fwd_q_in_smem<D>();
  static_assert(!kQSmem || kWg, "head dims above 128 need the sm_90a (wgmma) build");
  // wgmma's swizzled K / V tiles need 1024-byte aligned blocks.
  unsigned char* smem = kWg ? smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024) : smem_raw;
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
  uint32_t qf[kQSmem ? 1 : D / 16][4];
  if constexpr (kQSmem) {
    // Requested here, landed by the first tile's wait.
    issue_rows<T, D>(sQ, q, p.q_row_stride, (int)imin(kBlockM, p.seqlen_q - m0), f.qkv_vec);
    cp_async_commit();
  } else {
    load_rows<T, kBlockM, D>(sQ, q, p.q_row_stride, (int)imin(kBlockM, p.seqlen_q - m0), f.qkv_vec, threadIdx.x);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      ldmatrix_x4(qf[kk], sQ + (w * 16 + (lane & 15)) * kLd + kk * 16 + (lane >> 4) * 8);
    __syncthreads();  // sQ's bytes now become keep / raw mask buffers
  }

  const T* kp = static_cast<const T*>(p.k) + b * p.k_batch_stride + kvh * p.k_head_stride;
  const T* vp = static_cast<const T*>(p.v) + b * p.v_batch_stride + kvh * p.v_head_stride;
  const bool has_bias = p.bias.ptr != nullptr;
  // This thread's bias rows in a smem bias tile; a bias broadcast over queries keeps only row 0.
  const int bias_row_step = p.bias.row_stride != 0 ? kLdBias : 0, bias_row0 = p.bias.row_stride != 0 ? w * 16 + g : 0;
  const Plane<T> bias(p.bias, b, h);
  const Plane<uint8_t> mask(p.mask, b, h);
  const int64_t n_all = key_tile_end(p, m0), per_split = ceil_div(n_all, sp.n);
  const int64_t t_begin = imin(n_all, (int64_t)blockIdx.z * per_split);
  const int64_t n_end = imin(n_all, t_begin + per_split);
  // This query tile's row of tile activity bits (bit kt: key tile kt keeps something).
  const uint32_t* meta_row = p.mask.ptr ? Plane<uint32_t>(p.tile_meta, b, h).at(m_tile, 0) : nullptr;

  const bool has_mask = p.mask.ptr != nullptr;
  const bool softcap_on = p.softcap > 0.f;
  const float scale_l2 = p.softmax_scale * kLog2e;
  const float cap_l2 = p.softcap * kLog2e, scale_over_cap = softcap_on ? p.softmax_scale / p.softcap : 0.f;
  auto issue_tile = [&](int64_t t, int buf) {
    issue_kv<T, D>(kp, vp, p.k_row_stride, p.v_row_stride, p.seqlen_k, t * kBlockN, sK + buf * L::kTileKV / 2,
                   sV + buf * L::kTileKV / 2, f.qkv_vec);
    if (has_bias) issue_bias<T>(p, bias, sB + buf * kBlockM * kLdBias, f.bias_vec, m0, t * kBlockN);
    if (has_mask && mask_async(p, f.mask_vec, m0, t * kBlockN))
      issue_mask_raw(mask, sKeep + buf * L::kKeepSlot, m0, t * kBlockN);
    cp_async_commit();
  };

  const uint32_t q_live = p.softcap < 0.f ? 1u : 0u;
  float o[D / 8][4];
#pragma unroll
  for (int d = 0; d < D / 8; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[d][e] = 0.f;
  float row_max[2] = {-CUDART_INF_F, -CUDART_INF_F}, row_sum[2] = {0.f, 0.f};  // rows g, g + 8; sum per thread

  // Tile t's K / V / bias copies (and the raw mask bytes of t + 1) have landed in every thread's
  // view, and in the async proxy's that wgmma reads through. Block-uniform.
  auto land = [&]() {
    cp_async_wait<0>();
    if constexpr (kWg) fence_proxy_async();
    __syncthreads();
  };
  // Tile t (landed in buffer buf) gets its keep bytes where they were not copied raw (tiles a
  // length cuts, unaligned masks). Block-uniform.
  auto keep_tile = [&](int64_t t, int buf) {
    if (has_mask && !mask_async(p, f.mask_vec, m0, t * kBlockN))
      build_keep(p, mask, sKeep + buf * L::kKeepSlot, f.mask_vec, m0, t * kBlockN);
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
        wgmma_ss64<T>(s, desc_k_major<kBlockM>(sQ, kk), desc_k_major<kBlockN>(sk, kk), kk > 0);
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
    land();
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

      // Scores in log2 units (scale * log2 e folded in once), so the softmax needs one exp2 per
      // element and no multiply. Each stage below is one unrolled loop behind a CTA-uniform branch:
      // a per-element branch (softcap or not, full tile or not) compiled to a jump per element.
      const TileBounds tb(p, m0, t * kBlockN);
      if (softcap_on) {
#pragma unroll
        for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[n][e] = cap_l2 * tanhf(s[n][e] * scale_over_cap);
      } else {
#pragma unroll
        for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[n][e] *= scale_l2;
      }
      if (has_bias) {
        const T* sb = sB + cur * kBlockM * kLdBias + bias_row0 * kLdBias;
#pragma unroll
        for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const float2 bv =
                unpack2<T>(*reinterpret_cast<const uint32_t*>(sb + 8 * hh * bias_row_step + n * 8 + 2 * qc));
            s[n][2 * hh] = fmaf(bv.x, kLog2e, s[n][2 * hh]);
            s[n][2 * hh + 1] = fmaf(bv.y, kLog2e, s[n][2 * hh + 1]);
          }
      }
      if (has_mask) {
        // Bounds and causality only matter on the few tiles a length or the diagonal cuts.
        const uint8_t* keep = sKeep + cur * L::kKeepSlot;
        if (tb.full)
          apply_keep<false>(s, keep, w * 16 + g, qc, tb);
        else
          apply_keep<true>(s, keep, w * 16 + g, qc, tb);
      } else if (!tb.full) {
#pragma unroll
        for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (!tb.ok(w * 16 + g + 8 * (e / 2), n * 8 + 2 * qc + (e % 2))) s[n][e] = -CUDART_INF_F;
      }
      float mx[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
      for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) mx[hh] = fmaxf(mx[hh], fmaxf(s[n][2 * hh], s[n][2 * hh + 1]));
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
        mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
        const float m_new = fmaxf(row_max[hh], mx[hh]);
        const float m_use = m_new == -CUDART_INF_F ? 0.f : m_new;  // all -inf so far: p = 0, alpha = 0
        const float alpha = exp2f(row_max[hh] - m_use);
        row_max[hh] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < kBlockN / 8; ++n) {
          s[n][2 * hh] = exp2f(s[n][2 * hh] - m_use);
          s[n][2 * hh + 1] = exp2f(s[n][2 * hh + 1] - m_use);
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
      if (tn >= n_end) break;

      land();  // tile tn landed; every warp is done with tile t's bias and keep bytes
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

  // Epilogue: O / rowsum into out, LSE = max + log(sum); empty rows give 0 and -inf. A split
  // writes the same, in float, to its slice of the partial buffers.
  T* out = static_cast<T*>(p.out) + b * p.o_batch_stride + h * p.o_head_stride;
  const int64_t row0 = ((blockIdx.z * p.batch + b) * p.num_heads + h) * p.seqlen_q;  // [split][b][h][row]
  float* lse = sp.n > 1 ? sp.lse_part + row0 : static_cast<float*>(p.lse) + (b * p.num_heads + h) * p.seqlen_q;
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
      if (sp.n > 1) {
        float* orow = sp.o_part + (row0 + i) * D;
#pragma unroll
        for (int d = 0; d < D / 8; ++d)
          *reinterpret_cast<float2*>(orow + d * 8 + 2 * qc) = make_float2(o[d][2 * hh] * inv, o[d][2 * hh + 1] * inv);
      } else {
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
      }
      // row_max is in log2 units: lse = ln 2 * (m + log2 l).
      if (qc == 0) lse[i] = empty ? -CUDART_INF_F : (m + __log2f(l)) * 0.6931471805599453f;
    }
  }
}

// Merges the key splits of every (batch, head, row), one warp per row, splits in a fixed order:
// out = sum_s w_s O_s / sum_s w_s with w_s = exp(lse_s - max lse), lse = max + log sum w.
// A row no split saw anything of stays 0 / -inf.
template <typename T, int D>
__global__ void combine_splits(const FwdParams p, const FwdSplit sp) {
  const int64_t rows = p.batch * p.num_heads * p.seqlen_q;
  const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  float m = -CUDART_INF_F;
  for (int s = lane; s < sp.n; s += 32) m = fmaxf(m, sp.lse_part[s * rows + row]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float acc[D / 32], wsum = 0.f;
#pragma unroll
  for (int e = 0; e < D / 32; ++e) acc[e] = 0.f;
  if (m != -CUDART_INF_F) {
    for (int s = 0; s < sp.n; ++s) {
      const float l = sp.lse_part[s * rows + row];
      if (l == -CUDART_INF_F) continue;
      const float wgt = __expf(l - m);
      wsum += wgt;
      const float* o = sp.o_part + (s * rows + row) * D;
#pragma unroll
      for (int e = 0; e < D / 32; ++e) acc[e] = fmaf(wgt, o[lane + 32 * e], acc[e]);
    }
  }
  const int64_t i = row % p.seqlen_q, bh = row / p.seqlen_q, h = bh % p.num_heads, b = bh / p.num_heads;
  T* orow = static_cast<T*>(p.out) + b * p.o_batch_stride + h * p.o_head_stride + i * p.o_row_stride;
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
#pragma unroll
  for (int e = 0; e < D / 32; ++e) orow[lane + 32 * e] = from_float<T>(acc[e] * inv);
  if (lane == 0) static_cast<float*>(p.lse)[row] = wsum > 0.f ? m + __logf(wsum) : -CUDART_INF_F;
}

}  // namespace cuda
}  // namespace flexdma
