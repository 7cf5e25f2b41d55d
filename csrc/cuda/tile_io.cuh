// Tile shapes, shared-memory tile copies and the mask/bias readers shared by every kernel.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <math_constants.h>

#include "../flash_dma_params.h"
#include "mma_sm80.cuh"

namespace flexdma {
namespace cuda {

constexpr int kBlockM = 64;   // query rows per tile
constexpr int kBlockN = 64;   // keys per tile
constexpr int kWarps = 4;     // warp w owns rows [16w, 16w + 16) of every 64-row tile
constexpr int kThreads = kWarps * 32;

__host__ __device__ inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
// Shared-memory carve-outs start on 128-byte boundaries (wmma wants 32-byte aligned pointers).
// Padded leading dims of the 16-bit smem tiles: rows of 2D + 16 bytes (and 144 bytes for P / dS)
// spread ldmatrix rows over banks instead of mapping them all to the same ones.
__host__ __device__ constexpr int tile_ld(int d) { return d + 8; }
constexpr int kLdP = kBlockN + 8;
__host__ __device__ constexpr int align128(int bytes) { return (bytes + 127) / 128 * 128; }
// Dynamic shared memory a block may opt into on sm_90 (227 KiB); every kernel's layout is checked
// against it at compile time, since an oversized launch only fails at run time.
constexpr int kMaxSmemPerBlock = 227 * 1024;
// Keep tiles (one byte per element of a 64 x 64 tile): 80-byte rows, so a warp's fragment reads
// hit distinct banks and 16-byte copies stay aligned.
constexpr int kLdKeep = kBlockN + 16;

// Byte offset of element (r, col) in a 128-byte-swizzled tile of `rows` rows.
__host__ __device__ constexpr int sw128_offset(int rows, int r, int col) {
  return (col / 64) * rows * 128 + r * 128 + ((((col % 64) / 8) ^ (r % 8)) * 16) + (col % 8) * 2;
}

// Whether head dim D runs its products on wgmma (sm_90a builds, head dims that fill whole
// 128-byte swizzle rows) instead of mma.sync with ldmatrix.
template <int D>
constexpr bool use_wgmma() {
#ifdef FLEXDMA_SM90A
  return D % 64 == 0;
#else
  return false;
#endif
}

// Element index of (row r, column col) in a 64-row Q / dO / K / V tile: 128-byte swizzled for
// wgmma, rows padded to tile_ld(D) for ldmatrix.
template <int D>
__device__ inline int tile_index(int r, int col) {
  if constexpr (use_wgmma<D>()) return sw128_offset(64, r, col) / 2;
  else return r * tile_ld(D) + col;
}
// Elements between consecutive rows of a column block, and the bytes of a 64-row tile.
template <int D>
constexpr int tile_row_pitch() { return use_wgmma<D>() ? 64 : tile_ld(D); }
template <int D>
constexpr int tile_bytes() { return 64 * tile_row_pitch<D>() * (use_wgmma<D>() ? D / 64 : 1) * 2; }


// Where the key rows of a tile come from: key i of the sequence a kernel walks (i < seqlen_k) is
// row at(i) of K / V. The op family instantiates ContiguousKeys (key i is row i); GatheredKeys
// maps through an index list, so a caller can feed key tiles from selected rows (the keys a
// per-key top-k keeps) without first copying them into a dense K / V. Only the K / V tile loads
// (issue_kv, bwd_issue_keys) take a key source; mask and bias columns stay indexed by i.
struct ContiguousKeys {
  static constexpr bool kContiguous = true;
  __device__ int64_t at(int64_t i) const { return i; }
};
struct GatheredKeys {
  static constexpr bool kContiguous = false;
  const int32_t* idx;  // seqlen_k row numbers of K / V
  __device__ int64_t at(int64_t i) const { return idx[i]; }
};

template <typename T> __device__ inline float to_float(T x);
template <> __device__ inline float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ inline float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ inline T from_float(float x);
template <> __device__ inline __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Requests the 64 key rows [n0, n0 + 64) of a non-contiguous key source into a smem tile
// (tile_index layout), one 16-byte chunk (or, without `vec`, one element) per step, every chunk
// addressed through keys.at; keys at or past seqlen_k give zero rows. `base` is row 0 of K or V.
template <typename T, int D, typename Keys>
__device__ inline void issue_key_rows(T* dst, const T* base, int64_t rs, const Keys& keys, int64_t n0, int64_t seqlen_k,
                                      bool vec) {
  constexpr int kChunks = D / 8;
  static_assert(64 * kChunks % kThreads == 0, "tile must split evenly over the threads");
#pragma unroll
  for (int u = 0; u < 64 * kChunks / kThreads; ++u) {
    const int c = threadIdx.x + u * kThreads, r = c / kChunks, col = (c % kChunks) * 8;
    const bool ok = n0 + r < seqlen_k;
    const T* src = base + (ok ? keys.at(n0 + r) : 0) * rs + col;
    if (vec) {
      cp_async16(dst + tile_index<D>(r, col), src, ok ? 16 : 0);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) dst[tile_index<D>(r, col + e)] = ok ? src[e] : from_float<T>(0.f);
    }
  }
}

// Requests 64 rows x D (row r at src + r * rs) into a smem tile (tile_index layout); rows at or
// past `valid` are zero (their P / dS are 0, and 0 * garbage could be NaN).
template <typename T, int D>
__device__ inline void issue_rows(T* dst, const T* src, int64_t rs, int valid, bool vec) {
  constexpr int kChunks = D / 8;
  constexpr int kRowsPerPass = kThreads / kChunks;
  if constexpr (kThreads % kChunks != 0) {
    // D = 96 / 192: 12 / 24 chunks a row do not split 128 threads into whole rows; walk the
    // tile's chunks linearly (6 / 12 per thread).
    static_assert(64 * kChunks % kThreads == 0, "tile must split evenly over the threads");
    if (vec) {
#pragma unroll
      for (int u = 0; u < 64 * kChunks / kThreads; ++u) {
        const int c = threadIdx.x + u * kThreads, r = c / kChunks, col = (c % kChunks) * 8;
        const bool ok = r < valid;
        cp_async16(dst + tile_index<D>(r, col), ok ? src + r * rs + col : src, ok ? 16 : 0);
      }
      return;
    }
  } else if (vec) {
    // Where kRowsPerPass is a multiple of 8 (or there is no swizzle) a thread's chunk keeps its
    // swizzle in every pass and the destination moves by a constant; at D = 256 (4 rows a pass)
    // it alternates, and each pass takes its own index.
    constexpr bool kFixed = !use_wgmma<D>() || kRowsPerPass % 8 == 0;
    constexpr int kPass = kRowsPerPass * tile_row_pitch<D>();
    const int r0 = threadIdx.x / kChunks, col = (threadIdx.x % kChunks) * 8;
    const T* s = src + r0 * rs + col;
    T* d = dst + tile_index<D>(r0, col);
    auto at = [&](int u) { return kFixed ? d + u * kPass : dst + tile_index<D>(r0 + u * kRowsPerPass, col); };
    if (valid >= 64) {
#pragma unroll
      for (int u = 0; u < 64 / kRowsPerPass; ++u) cp_async16(at(u), s + u * kRowsPerPass * rs);
    } else {
#pragma unroll
      for (int u = 0; u < 64 / kRowsPerPass; ++u) {
        const bool ok = r0 + u * kRowsPerPass < valid;
        cp_async16(at(u), ok ? s + u * kRowsPerPass * rs : src, ok ? 16 : 0);
      }
    }
    return;
  }
  // Strided or unaligned rows, any D: element by element.
  for (int c = threadIdx.x; c < 64 * D; c += kThreads) {
    const int r = c / D, col = c % D;
    dst[tile_index<D>(r, col)] = r < valid ? src[r * rs + col] : from_float<T>(0.f);
  }
}

// Requests the raw mask bytes of tile (m0, n0) into a keep slot (rows kLdKeep apart), 16 bytes a
// copy: for tiles that need no bounds or causal check, with 16-byte aligned mask rows. Bool bytes
// are 0 / 1, so the raw bytes are the keep tile.
template <typename MaskPlane>
__device__ inline void issue_mask_raw(const MaskPlane& m, uint8_t* slot, int64_t m0, int64_t n0) {
#pragma unroll
  for (int u = 0; u < kBlockM * kBlockN / 16 / kThreads; ++u) {
    const int c = threadIdx.x + u * kThreads, r = c / (kBlockN / 16), col0 = (c % (kBlockN / 16)) * 16;
    cp_async16(slot + r * kLdKeep + col0, m.base + (m0 + r) * m.rs + n0 + col0);
  }
}

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
  // Whether anything survives bounds and causality (row lim_r - 1 sees the most keys).
  __device__ inline bool any() const { return lim_r > 0 && lim_c > 0 && lim_r - 1 + diag >= 0; }
  // Non-short-circuit &: on a full tile every term is true, and the check compiles to compares
  // and a predicate op instead of a branch per element.
  __device__ inline bool ok(int r, int c) const { return (r < lim_r) & (c < lim_c) & (c <= r + diag); }
};

// A row of tile activity bits (FwdParams::tile_meta) walked forward: the current word stays in
// a register, so the scan reads memory once per 32 tiles, not once per tile (a dependent load
// in front of every tile's copies). The same in every thread.
struct ActiveTiles {
  const uint32_t* row;
  int64_t w_idx = -1;
  uint32_t word = 0;
  __device__ explicit ActiveTiles(const uint32_t* r) : row(r) {}
  // First tile in [t, end) whose bit is set; end if none.
  __device__ inline int64_t next(int64_t t, int64_t end) {
    while (t < end) {
      if ((t >> 5) != w_idx) {
        w_idx = t >> 5;
        word = row[w_idx];
      }
      const uint32_t wd = word >> (t & 31);
      if (wd) return imin(end, t + __ffs(wd) - 1);
      t = (t | 31) + 1;
    }
    return end;
  }
};
// Copies `rows` x D elements (row r at src + r * row_stride, head_dim contiguous) into a smem
// tile of kRows x D with leading dim tile_ld(D); rows past `valid` are zero so tails need no other predicate.
// `vec` says that src and row_stride allow 16-byte loads; tid is the thread's index among the
// kThreads that share the copy.
template <typename T, int kRows, int D>
__device__ inline void load_rows(T* smem, const T* src, int64_t row_stride, int valid, bool vec, unsigned tid) {
  if (vec) {
    // All loads of a thread are issued before any store, so they are in flight together.
    constexpr int kChunks = D / 8;  // 8 halves per 16 bytes
    constexpr int kPer = kRows * kChunks / kThreads;
    static_assert(kRows * kChunks % kThreads == 0, "tile must split evenly over the threads");
    uint4 val[kPer];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int c = tid + u * kThreads, r = c / kChunks, col = (c % kChunks) * 8;
      val[u] = r < valid ? *reinterpret_cast<const uint4*>(src + r * row_stride + col) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int c = tid + u * kThreads, r = c / kChunks, col = (c % kChunks) * 8;
      *reinterpret_cast<uint4*>(smem + r * tile_ld(D) + col) = val[u];
    }
  } else {
    for (int c = tid; c < kRows * D; c += kThreads) {
      const int r = c / D, col = c % D;
      smem[r * tile_ld(D) + col] = r < valid ? src[r * row_stride + col] : from_float<T>(0.f);
    }
  }
}

// A broadcast operand resolved to one (batch, query head) once per CTA: element (i, j) lives at
// base + i * rs + j * cs. Resolving it up front keeps the 64-bit head division (h / head_ratio)
// out of the tile loops, where it compiled to a call per load.
template <typename E>
struct Plane {
  const E* base;
  int64_t rs, cs;
  __device__ inline Plane(const Broadcast4d& t, int64_t b, int64_t h)
      : base(t.ptr ? static_cast<const E*>(t.ptr) + b * t.batch_stride + (h / t.head_ratio) * t.head_stride : nullptr),
        rs(t.row_stride), cs(t.col_stride) {}
  __device__ inline const E* at(int64_t i, int64_t j) const { return base + i * rs + j * cs; }
};

}  // namespace cuda
}  // namespace flexdma
