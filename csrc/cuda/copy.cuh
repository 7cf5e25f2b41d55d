// Global -> shared tile copies: cp.async wrappers, the K / V / Q / dO row copies (contiguous, or
// gathered through the per-key forward's key list), the bias tile and the raw mask bytes. Every operand byte a kernel
// reads comes through here.
#pragma once
#include <cstdint>

#include "../flash_dma_params.h"
#include "mask.cuh"
#include "mma_sm80.cuh"
#include "smem_layout.cuh"

namespace flexdma {
namespace cuda {

// 16-byte global -> shared copy; src_bytes = 0 zero-fills the destination without reading.
__device__ inline void cp_async16(void* dst, const void* src, int src_bytes = 16) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes)
               : "memory");
}
// The same without the zero fill's size operand (a copy known to be in bounds).
__device__ inline void cp_async16_all(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Launch-time facts about operand alignment (16-byte cp.async / vector loads allowed or not).
struct FwdFlags {
  bool qkv_vec, mask_vec, bias_vec, out_vec;
  // out (and out_resid, which has out's strides) in 16-byte row pieces: the warp-specialized
  // forward's epilogue stores its rows through shared memory (fwd_epilogue's `stage`).
  bool out_vec16 = false;
  // The warp-specialized forward's CTA takes 64 rows of two query heads that share every operand
  // (fwd_ws_tile); set by the launcher.
  bool pair = false;
};
struct BwdFlags {
  bool qkv_vec, mask_vec, bias_vec;
};

// 4-byte global -> shared copy (gathered int32 / float entries).
__device__ inline void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}

// The per-key forward's key tiles: list entries [n0, n0 + 64) of a query tile's key list
// (FwdParams::tile_keys) name the K / V rows of tile n0. Reading each index from global memory in
// front of its copy would put a dependent load in front of every tile; instead the loading
// warpgroup holds a tile's 64 indices in smem (idx) before it requests the tile, so its copies
// issue after a shared-memory read. A stage's slot holds (int32 words) the tile's key indices [0, 64) (the causal
// test), ranks [64, 128) and biases as float [128, 192). Threads 0..63 handle one key each: its index (entry), rank (by
// cp.async) and bias (16-bit, too narrow for cp.async: loaded a tile ahead into a register by the caller). 16-byte K /
// V copies only (the launcher refuses unaligned q / k / v). Run by the kThreads threads of the loading warpgroup.
template <typename T, int D>
struct KeyList {
  static constexpr int kChunks = D / 8;
  static constexpr int kSlotWords = KeySlot::kWords;
  // An entry past the list ranks as a key no row keeps (its index slot is never gathered).
  static constexpr int32_t kNever = kNeverKept;
  const int32_t* keys;  // the list's first key index
  int64_t n;            // its length

  // This thread's (threadIdx.x < 64) key index of the tile at list entry n0; 0 past the list.
  __device__ inline int32_t entry(int64_t n0) const {
    return threadIdx.x < 64 && n0 + threadIdx.x < n ? keys[n0 + threadIdx.x] : 0;
  }

  // Requests the K or V rows of tile n0 (indices in idx) into dst; zero rows past the list.
  // kWhole: whole tiles take the copies without bounds below.
  template <bool kWhole = true>
  __device__ inline void issue_rows(const int32_t* idx, T* dst, const T* base, int64_t rs, int64_t n0) const {
    static_assert(kThreads % kChunks == 0 && 64 * kChunks % kThreads == 0, "rows must split evenly over the threads");
    // Element offsets in 32 bits (seqlen_k x row stride < 2^31, checked at launch): a 64-bit
    // offset costs a sign extension and a three-instruction multiply per copy.
    const int32_t rs32 = (int32_t)rs;
    if (kWhole && n0 + 64 <= n) {
      // A whole tile (every tile of a list but its last): no bounds, and each thread keeps one
      // column, its rows kRowsPerPass apart, so its destinations lie a constant apart in the
      // swizzled tile (the swizzle repeats every 8 rows) and each source is one wide multiply-add of
      // the row's index: ~4 instructions a copy where the bounded form below takes ~20.
      constexpr int kRowsPerPass = kThreads / kChunks;
      static_assert(!use_wgmma<D>() || kRowsPerPass % 8 == 0, "a thread's rows must keep their swizzle");
      constexpr int kPass = kRowsPerPass * tile_row_pitch<D>();
      const int r0 = threadIdx.x / kChunks, col = (threadIdx.x % kChunks) * 8;
      const char* src = reinterpret_cast<const char*>(base + col);
      const int32_t rs_bytes = rs32 * (int32_t)sizeof(T);
      T* d = dst + tile_index<D>(r0, col);
      // Every index read before the first copy: the copies' asm orders memory, so a read between
      // two of them would wait for its own latency each time.
      int32_t j[64 / kRowsPerPass];
#pragma unroll
      for (int u = 0; u < 64 / kRowsPerPass; ++u) j[u] = idx[r0 + u * kRowsPerPass];
#pragma unroll
      for (int u = 0; u < 64 / kRowsPerPass; ++u) cp_async16_all(d + u * kPass, src + (int64_t)j[u] * rs_bytes);
      return;
    }
#pragma unroll
    for (int u = 0; u < 64 * kChunks / kThreads; ++u) {
      const int c = threadIdx.x + u * kThreads, r = c / kChunks, col = (c % kChunks) * 8;
      const bool ok = n0 + r < n;
      const int32_t j = ok ? idx[r] : 0;
      cp_async16(dst + tile_index<D>(r, col), base + (j * rs32 + col), ok ? 16 : 0);
    }
  }

  // The rank rule's operands of tile n0 into `slot`: indices, ranks, and this thread's key's
  // bias (loaded by the caller), in log2 units (apply_rank_keep adds it unscaled); and the largest
  // listed key of each 32-entry half where kTopKeys (the list is in rank order, not key order),
  // which tells apply_rank_keep whether the tile reaches any row's causal limit. Threads 0-63: two
  // whole warps.
  template <bool kTopKeys, typename RankPlane>
  __device__ inline void issue_slot(const int32_t* idx, int32_t* slot, int64_t n0, const RankPlane& ranks,
                                    float bias) const {
    if (threadIdx.x < 64) {
      const bool ok = n0 + threadIdx.x < n;
      const int32_t j = idx[threadIdx.x];
      if constexpr (kTopKeys) {
        // Entries past the list are never kept: they need no causal compare.
        const int32_t top = __reduce_max_sync(0xffffffffu, ok ? j : 0);
        if (threadIdx.x % 32 == 0) slot[KeySlot::kTop + threadIdx.x / 32] = top;
      }
      slot[threadIdx.x] = ok ? j : kNever;
      if (ok)
        cp_async4(slot + KeySlot::kRank + threadIdx.x, ranks.at(0, j));
      else
        slot[KeySlot::kRank + threadIdx.x] = kNever;
      reinterpret_cast<float*>(slot)[KeySlot::kBias + threadIdx.x] = bias * kLog2eF;
    }
  }
};

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
  // Strided or unaligned rows, any D: element by element (a cold path; not unrolled, so its
  // addresses are not hoisted into registers the callers' loops need).
#pragma unroll 1
  for (int c = threadIdx.x; c < 64 * D; c += kThreads) {
    const int r = c / D, col = c % D;
    dst[tile_index<D>(r, col)] = r < valid ? src[r * rs + col] : from_float<T>(0.f);
  }
}

// The K / V tile of keys [n0, n0 + 64) (zero rows past seqlen_k); base is row 0 of K or V.
template <typename T, int D>
__device__ inline void issue_keys(T* dst, const T* base, int64_t rs, int64_t n0, int64_t seqlen_k, bool vec) {
  issue_rows<T, D>(dst, base + n0 * rs, rs, (int)imin(64, seqlen_k - n0), vec);
}

// Requests the K and V rows of key tile n0 (zero rows past seqlen_k: P is 0 there, V must not
// hold garbage that 0 * NaN would spread): the one-warpgroup forward's K / V bytes. k and v point
// at row 0.
template <typename T, int D>
__device__ inline void issue_kv(const T* k, const T* v, int64_t k_rs, int64_t v_rs, int64_t seqlen_k, int64_t n0, T* sk,
                                T* sv, bool vec) {
  if constexpr (D > 128) {
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

// Requests the bias tile (m0, n0) into smem (row stride kLdBias); entries outside the lengths
// are 0 (never kept). The 16-byte path needs contiguous keys and aligned strides (vec). A bias
// broadcast over queries (per-key) is copied as one row where the readers take row 0 for every
// query (kOneRowIfBroadcast: the forward): 64 copies of the same 128 bytes would cost 64x the L2
// requests, every CTA hitting the same lines.
template <bool kOneRowIfBroadcast, typename T, typename Idx>
__device__ inline void issue_bias(const TileBounds& tb, const Plane<T, Idx>& bb, T* sb, bool vec, int64_t m0,
                                  int64_t n0) {
  if constexpr (kOneRowIfBroadcast) {
    if (bb.rs == 0) {
      if (vec && tb.lim_c == kBlockN) {
        if (threadIdx.x < kBlockN / 8) cp_async16(sb + threadIdx.x * 8, bb.base + n0 + threadIdx.x * 8);
      } else if (threadIdx.x < kBlockN) {
        // A tile a sequence end cuts, or a row not on a 16-byte boundary (a packed sequence's keys
        // start anywhere): the one row, an element a thread.
        sb[threadIdx.x] = threadIdx.x < tb.lim_c ? *bb.at(0, n0 + threadIdx.x) : from_float<T>(0.f);
      }
      return;
    }
  }
  if (vec && (tb.lim_r == kBlockM || bb.rs == 0) && tb.lim_c == kBlockN) {
    constexpr int kRowsPerPass = kThreads / (kBlockN / 8);
    const int r0 = threadIdx.x / (kBlockN / 8), col0 = (threadIdx.x % (kBlockN / 8)) * 8;
    const T* src = bb.base + (m0 + r0) * bb.rs + n0 + col0;
#pragma unroll
    for (int u = 0; u < kBlockM / kRowsPerPass; ++u)
      cp_async16(sb + (r0 + u * kRowsPerPass) * kLdBias + col0, src + u * kRowsPerPass * bb.rs);
  } else {
    // Tiles cut by a sequence end, and strided / unaligned biases: element by element.
    for (int c = threadIdx.x; c < kBlockM * kBlockN; c += kThreads) {
      const int r = c / kBlockN, col = c % kBlockN;
      sb[r * kLdBias + col] = (r < tb.lim_r && col < tb.lim_c) ? *bb.at(m0 + r, n0 + col) : from_float<T>(0.f);
    }
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

}  // namespace cuda
}  // namespace flexdma
