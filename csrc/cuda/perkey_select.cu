// The per-key selection on CUDA (flexdma::perkey_select): key_rank, row_thr and tile_keys of every
// plane (flexdma/perkey/contract.py states them) in one kernel launch after the zero fill of its
// counters: no sort by the host, no host synchronisation, so a CUDA graph holds it.
//
// One launch runs three kinds of work item, handed out in order by an atomic counter, so an item
// waits only for items that resident CTAs already hold (the waits cannot deadlock):
// 1. sort (plane, chunk of kChunk keys): the chunk's order values sorted in shared memory (a stable
//    block radix sort: equal values stay in key order).
// 2. rank (plane, 512 or 1024 keys of one sorted chunk; waits for the plane's sorts): a key's rank is
//    the sum over the plane's sorted chunks of its count there, by binary searches in shared
//    memory (each chunk staged once per item, the next one loaded during this one's searches).
//    Summed over the chunks of a prefix level [0, T) (levels are whole chunks), the same count is
//    the key's place in that level's rank order: the key is written there.
// 3. walk (plane, query tile; waits for the plane's ranks): the tile's candidates in rank order
//    from the smallest prefix level that holds its last row's keys, the rows' thresholds, the list
//    cut to the keys some row keeps. About 2 W level entries are read whatever the position.
//
// Everything an item reads that another item wrote is loaded from L2 (ld.global.cg): a line that
// an earlier CTA on the same SM cached in L1 before the writer finished would be stale.
#include <cub/block/block_radix_sort.cuh>
#include <cuda_runtime.h>

#include "constants.cuh"
#include "flash_dma_cuda.h"
#include "seq_info.cuh"

namespace flexdma {
namespace cuda {
namespace {

constexpr int kSelectThreads = 256;
constexpr int kChunk = 4096;                       // keys per sorted chunk (its order values fill 16 KiB)
constexpr int kSortPer = kChunk / kSelectThreads;  // keys a thread sorts
// Keys of one rank item: 1024, or 512 where a plane has at most kSmallRankChunks chunks. An item
// stages every chunk of its plane, so halving it doubles that traffic (long planes keep 1024),
// but twice the items fill both CTA slots of an SM where 1024 would leave one idle (128K keys).
constexpr int kRankKeys = 1024, kSmallRankKeys = 512;
constexpr int kSmallRankChunks = 32;
constexpr int kScanPer = 8;                       // level entries a thread reads per step of a walk
constexpr int kMaxTileRows = 128;                 // the window's visibility is 8 words a row
constexpr int kWinWords = 2 * kMaxTileRows / 32;  // words of a window bit mask
// A walk's list entries kept in shared memory by their index modulo kRing: the window (< 2 x 128
// entries ending at the list's last) is never overwritten there, since a step writes fewer than
// kRing consecutive indices and the window's entries are the last written.
constexpr int kRing = 4096;

// Six bits a pass: 16-bit scores sort in three passes instead of four (its counters, 33 KiB, about
// the size of the rank items' staged chunks).
using Sorter = cub::BlockRadixSort<uint32_t, kSelectThreads, kSortPer, int32_t, 6>;
// 16-bit scores: the order value and the key's place in its chunk as one 29-bit key (bits [12, 29)
// sorted), all distinct: no payload to move with each pass.
using KeySorter = cub::BlockRadixSort<uint32_t, kSelectThreads, kSortPer, cub::NullType, 6>;
static_assert(kChunk == 1 << 12, "a key's place in its chunk is the low 12 bits");

// A plane's prefix levels: [0, lvl0 << l) for l < n_levels, the last one all K; causal rows of a
// query tile see a prefix of the keys, and its walk reads the smallest level that holds it.
struct Levels {
  int64_t lvl0 = 1;  // the first level's size (a power of two, whole chunks)
  int n_levels = 1;
  int32_t window = 1;  // min(W, K): rows keep every key they see when W >= K
  // Entries of the plane's level orders, side by side (at most 3 K: the levels before the last
  // sum to less than 2 K).
  __host__ __device__ inline int64_t stride(int64_t K) const { return lvl0 * ((int64_t(1) << (n_levels - 1)) - 1) + K; }
};

__host__ __device__ inline Levels plane_levels(int64_t K, int64_t W, int64_t tile_rows, bool causal) {
  Levels l;
  l.window = static_cast<int32_t>(W < K ? W : (K > 0 ? K : 1));
  if (causal) {
    int64_t lvl0 = kChunk;
    while (lvl0 < 2 * l.window || lvl0 < 2 * tile_rows) lvl0 *= 2;
    l.lvl0 = lvl0;
    while ((lvl0 << (l.n_levels - 1)) < K) ++l.n_levels;
  } else {
    l.lvl0 = K > 0 ? K : 1;
  }
  return l;
}

// Sizes of one launch, computed once on the host (select_geometry). Packed sequences size the item
// space by the longest sequence (items past a shorter one's chunks or tiles only count), the
// scratch by the token count.
struct Geometry {
  int64_t batch = 1;         // P1
  int64_t n_chunks = 0;      // sort items a plane (each `subs` rank items too)
  int subs = 0;              // rank items a chunk (kChunk / their keys)
  int64_t plane_stride = 0;  // padded: entries of one plane's level orders
  int64_t n_tiles = 0;       // walk items a plane
  int64_t n_sort = 0, n_rank = 0, n_walk = 0;
  // Scratch: work counters ([0] the next item, [1, 1 + P) each plane's finished sorts, [1 + P,
  // 1 + 2 P) its finished ranks), sorted order values and key indices, the level orders.
  int64_t counters_bytes = 0, sorted_off = 0, keys_off = 0, orders_off = 0, bytes = 0;
};

constexpr int64_t align16(int64_t n) { return (n + 15) / 16 * 16; }

Geometry select_geometry(const SelectParams& p) {
  Geometry g;
  const bool packed = p.cu_seqlens_k != nullptr;
  g.batch = p.planes2 > 0 ? p.planes / p.planes2 : 0;
  g.n_chunks = ceil_div(p.seqlen_k, kChunk);
  g.plane_stride = plane_levels(p.seqlen_k, p.window, p.tile_rows, p.is_causal).stride(p.seqlen_k);
  g.n_tiles = ceil_div(p.seqlen_q, p.tile_rows);
  g.n_sort = p.planes * g.n_chunks;
  g.subs = kChunk / (g.n_chunks <= kSmallRankChunks ? kSmallRankKeys : kRankKeys);
  g.n_rank = g.n_sort * g.subs;
  g.n_walk = p.planes * g.n_tiles;
  // Packed: a sequence's chunks start at chunk k0 / kChunk + b of its head's (see PlaneInfo).
  const int64_t chunks = packed ? p.planes2 * (p.total_k / kChunk + g.batch) : g.n_sort;
  g.counters_bytes = align16(4 * (1 + 2 * p.planes));
  g.sorted_off = g.counters_bytes;
  g.keys_off = g.sorted_off + align16(4 * chunks * kChunk);
  g.orders_off = g.keys_off + align16(4 * chunks * kChunk);
  g.bytes = g.orders_off + align16(4 * (packed ? p.planes2 * 3 * p.total_k : p.planes * g.plane_stride));
  return g;
}

// One plane's sizes and where its data lies, padded or packed. A packed sequence's rows in a
// per-head array of rows / chunks / tiles start at offset / size + b: each earlier sequence took at
// most its own size's worth plus one, so two sequences never share one.
struct PlaneInfo {
  int64_t K, Q;
  int64_t score0;       // scores' element of its key 0
  int64_t chunk0;       // its first sorted chunk in the scratch
  int64_t order0;       // the first entry of its level orders
  int64_t rank0, thr0;  // key_rank's element of its key 0, row_thr's of its row 0
  int64_t list0;        // tile_keys' row of its query tile 0
  int64_t n_chunks, n_tiles;
  Levels lv;
};

// A packed call's offsets are read here first (check_packed_offsets, seq_info.cuh, states why).
__device__ inline PlaneInfo plane_info(const SelectParams& p, const Geometry& g, int64_t plane) {
  PlaneInfo s;
  const int64_t p1 = plane / p.planes2, p2 = plane % p.planes2;
  if (p.cu_seqlens_k) {
    const int64_t k0 = p.cu_seqlens_k[p1], q0 = p.cu_seqlens_q[p1];
    const int64_t k1 = p.cu_seqlens_k[p1 + 1], q1 = p.cu_seqlens_q[p1 + 1];
    check_packed_offsets(packed_offsets_ok(p1, g.batch, q0, q1, k0, k1, p.seqlen_q, p.seqlen_k, p.total_q, p.total_k));
    s.K = k1 - k0;
    s.Q = q1 - q0;
    s.score0 = p2 * p.stride2 + k0 * p.stride_k;
    s.chunk0 = p2 * (p.total_k / kChunk + g.batch) + k0 / kChunk + p1;
    s.order0 = p2 * 3 * p.total_k + 3 * k0;
    s.rank0 = p2 * p.total_k + k0;
    s.thr0 = p2 * p.total_q + q0;
    s.list0 = p2 * (p.total_q / p.tile_rows + g.batch) + q0 / p.tile_rows + p1;
  } else {
    s.K = p.seqlen_k;
    s.Q = p.seqlen_q;
    s.score0 = p1 * p.stride1 + p2 * p.stride2;
    s.chunk0 = plane * g.n_chunks;
    s.order0 = plane * g.plane_stride;
    s.rank0 = plane * s.K;
    s.thr0 = plane * s.Q;
    s.list0 = plane * g.n_tiles;
  }
  s.n_chunks = ceil_div(s.K, kChunk);
  s.n_tiles = ceil_div(s.Q, p.tile_rows);
  s.lv = plane_levels(s.K, p.window, p.tile_rows, p.is_causal);
  return s;
}

// ---- order values ----

// A score's place in the selection's order as an unsigned value that sorts ascending: score
// descending, every NaN first (above +inf), -0.0 equal to +0.0, -inf after every eligible score.
// From the bits alone (the build's fast math may fold float NaN tests). kHalf = 0x7fffffff for
// float32; 16-bit scores order by their own 16 bits (kHalf = 0x7fff), which float16 needs (its
// 10-bit mantissa does not fit a float32's top 16 bits).
template <uint32_t kHalf, uint32_t kInf>
__device__ inline uint32_t order_value(uint32_t bits) {
  const uint32_t mag = bits & kHalf;
  if (mag > kInf) return 0;
  if (mag == 0) return kHalf;
  return (bits & (kHalf + 1)) ? kHalf + 1 + mag : kHalf - mag;
}

// -inf's order value: keys at or above it are ineligible.
__device__ inline uint32_t ineligible_from(DType t) {
  return t == DType::kFloat32 ? 0x7fffffffu + 1 + 0x7f800000u
                              : (t == DType::kBFloat16 ? 0x7fffu + 1 + 0x7f80u : 0x7fffu + 1 + 0x7c00u);
}

__device__ inline uint32_t load_order(const SelectParams& p, const PlaneInfo& pi, int64_t j) {
  const int64_t at = pi.score0 + j * p.stride_k;
  if (p.dtype == DType::kFloat32)
    return order_value<0x7fffffffu, 0x7f800000u>(static_cast<const uint32_t*>(p.scores)[at]);
  const uint32_t bits = static_cast<const uint16_t*>(p.scores)[at];
  return p.dtype == DType::kBFloat16 ? order_value<0x7fffu, 0x7f80u>(bits) : order_value<0x7fffu, 0x7c00u>(bits);
}

// ---- item ordering ----

__device__ inline uint32_t ld_acquire(const uint32_t* ptr) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

// Until `target` items have counted at `counter`; their stores are visible to the whole CTA after.
__device__ inline void wait_for(const uint32_t* counter, uint32_t target) {
  if (threadIdx.x == 0)
    while (ld_acquire(counter) < target) __nanosleep(64);
  __syncthreads();
}

// Every thread's stores of this item, then one count.
__device__ inline void publish(uint32_t* counter) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
  }
}

struct Scratch {
  uint32_t* counters;
  uint32_t* sorted;  // each plane's sorted chunks (PlaneInfo::chunk0), kChunk order values each, ascending
  int32_t* keys;     // their key indices
  int32_t* orders;   // each plane's level orders (PlaneInfo::order0): keys (-1 ineligible) in rank order, side by side
};

union alignas(16) Smem {
  typename Sorter::TempStorage sort;
  typename KeySorter::TempStorage sort_keys;
  uint32_t chunk[2][kChunk];  // a rank item's staged chunks (double buffer)
  struct {
    int32_t new_at[kMaxTileRows];  // list index of each key the first row does not see (or NEVER)
    int32_t win_rank[2 * kMaxTileRows];
    unsigned win_base[kWinWords];                     // the window's base entries (seen by every row), a bit each
    unsigned warp_vis[kMaxTileRows / 32][kWinWords];  // new window entries the rows of a warp see
    int32_t warp_early[kMaxTileRows / 32];            // and the new keys they see listed before it
    int32_t warp_base[kSelectThreads / 32], warp_cand[kSelectThreads / 32];
    int32_t start, last_base, n_cut, top, cut;
    int32_t ring[kRing];  // the list's entries by index modulo kRing: the window is read back from here
  } walk;
};

// ---- 1. sort ----

__device__ void sort_chunk(const SelectParams& p, const Scratch& s, Smem& sm, const PlaneInfo& pi, int64_t c) {
  const int64_t K = pi.K;
  const int64_t base = (pi.chunk0 + c) * kChunk;
  if (p.dtype != DType::kFloat32) {
    // Past K: 0x10000, after every 16-bit value (stored as 0xffffffff, as the float32 path does).
    uint32_t x[kSortPer];
#pragma unroll
    for (int i = 0; i < kSortPer; ++i) {
      const int local = threadIdx.x * kSortPer + i;
      const int64_t key = c * kChunk + local;
      x[i] = (key < K ? load_order(p, pi, key) : 0x10000u) << 12 | static_cast<uint32_t>(local);
    }
    KeySorter(sm.sort_keys).SortBlockedToStriped(x, 12, 29);
#pragma unroll
    for (int i = 0; i < kSortPer; ++i) {
      const uint32_t u = x[i] >> 12;
      s.sorted[base + i * kSelectThreads + threadIdx.x] = u == 0x10000u ? 0xffffffffu : u;
      s.keys[base + i * kSelectThreads + threadIdx.x] = static_cast<int32_t>(c * kChunk + (x[i] & (kChunk - 1)));
    }
    return;
  }
  uint32_t u[kSortPer];
  int32_t j[kSortPer];
  // Blocked: thread t holds keys t * kSortPer + i, the order the sort keeps among equal values.
#pragma unroll
  for (int i = 0; i < kSortPer; ++i) {
    const int64_t key = c * kChunk + threadIdx.x * kSortPer + i;
    j[i] = static_cast<int32_t>(key);
    u[i] = key < K ? load_order(p, pi, key) : 0xffffffffu;  // past K: after every key
  }
  Sorter(sm.sort).SortBlockedToStriped(u, j);
#pragma unroll
  for (int i = 0; i < kSortPer; ++i) {
    s.sorted[base + i * kSelectThreads + threadIdx.x] = u[i];
    s.keys[base + i * kSelectThreads + threadIdx.x] = j[i];
  }
}

// ---- 2. rank ----

// Entries of a sorted chunk below x.
__device__ inline int32_t count_below(const uint32_t* chunk, uint32_t x) {
  int32_t pos = 0;
#pragma unroll
  for (int step = kChunk / 2; step >= 1; step /= 2) pos += chunk[pos + step - 1] < x ? step : 0;
  return pos + (chunk[pos] < x ? 1 : 0);
}

// kPer keys a thread ranks: item `sub` of chunk a holds its keys [sub, sub + 1) x kPer x 256.
template <int kPer>
__device__ void rank_keys(const SelectParams& p, const Scratch& s, Smem& sm, const PlaneInfo& pi, int64_t a, int sub) {
  const int64_t K = pi.K, NC = pi.n_chunks;
  const Levels& g = pi.lv;
  const uint32_t* sorted = s.sorted + pi.chunk0 * kChunk;
  const int32_t* keys = s.keys + pi.chunk0 * kChunk;
  int32_t* order = s.orders + pi.order0;
  constexpr int kKeys = kPer * kSelectThreads;
  uint32_t u[kPer];
  int32_t j[kPer], cnt[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = sub * kKeys + i * kSelectThreads + threadIdx.x;
    u[i] = __ldcg(sorted + a * kChunk + e);
    j[i] = __ldcg(keys + a * kChunk + e);
    cnt[i] = e;  // the keys before it in its own sorted chunk (ties there are in key order)
  }
  constexpr int kVec = kChunk / 4 / kSelectThreads;  // 16-byte loads a thread stages per chunk
  uint4 next[kVec];
  const auto fetch = [&](int64_t b) {
#pragma unroll
    for (int v = 0; v < kVec; ++v)
      next[v] = __ldcg(reinterpret_cast<const uint4*>(sorted + b * kChunk) + v * kSelectThreads + threadIdx.x);
  };
  const auto stage = [&](int buf) {
#pragma unroll
    for (int v = 0; v < kVec; ++v) reinterpret_cast<uint4*>(sm.chunk[buf])[v * kSelectThreads + threadIdx.x] = next[v];
  };
  const uint32_t ineligible = ineligible_from(p.dtype);
  fetch(0);
  stage(0);
  __syncthreads();
  int level = 0;
  for (int64_t b = 0; b < NC; ++b) {
    if (b + 1 < NC) fetch(b + 1);
    if (b != a) {
      // Equal values of an earlier chunk have lower key indices: they come first.
      const uint32_t tie = b < a ? 1u : 0u;
      // Independent searches: the item is bound by their latency, not by their loads.
#pragma unroll
      for (int i = 0; i < kPer; ++i) cnt[i] += count_below(sm.chunk[b & 1], u[i] + tie);
    }
    // A level [0, lvl0 << level) other than the last ends after this chunk: its members (keys of
    // chunks up to b) are placed in its order by their counts so far.
    if (level < g.n_levels - 1 && ((g.lvl0 << level) / kChunk) == b + 1) {
      if (a <= b) {  // (no slot past K: every level but the last ends before the last chunk)
        int32_t* lvl = order + g.lvl0 * ((int64_t(1) << level) - 1);
#pragma unroll
        for (int i = 0; i < kPer; ++i) lvl[cnt[i]] = u[i] < ineligible ? j[i] : -1;
      }
      ++level;
    }
    if (b + 1 < NC) stage((b + 1) & 1);
    __syncthreads();
  }
  // The last level is every key: its order is the rank order.
  int32_t* last = order + g.lvl0 * ((int64_t(1) << (g.n_levels - 1)) - 1);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    if (j[i] >= K) continue;  // a slot past K
    last[cnt[i]] = u[i] < ineligible ? j[i] : -1;
    p.key_rank[pi.rank0 + j[i]] = u[i] < ineligible ? cnt[i] : kNeverKept;
  }
}

// ---- 3. walk ----

__device__ inline unsigned lanes_below() { return (1u << (threadIdx.x % 32)) - 1; }

// Where the n-th (from 1) set bit of m is; m has at least n.
__device__ inline int nth_set_bit(unsigned m, int n) {
  int at = 0;
#pragma unroll
  for (int half = 16; half >= 1; half /= 2) {
    const int c = __popc(m & ((1u << half) - 1));
    if (n > c) n -= c, at += half, m >>= half;
  }
  return at;
}

__device__ void walk_tile(const SelectParams& p, const Scratch& s, Smem& sm, const PlaneInfo& pi, int64_t t) {
  auto& w = sm.walk;
  const Levels& g = pi.lv;
  const int64_t K = pi.K, Q = pi.Q, off = K - Q;
  const int TR = static_cast<int>(p.tile_rows);
  const int32_t W = g.window;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r0 = t * TR, r1 = (r0 + TR < Q ? r0 + TR : Q) - 1;
  const int64_t p_first = p.is_causal ? r0 + off : K - 1, p_last = p.is_causal ? r1 + off : K - 1;
  // The smallest prefix level that holds every key the tile's last row sees.
  int level = 0;
  int64_t size = g.lvl0;
  while (level < g.n_levels - 1 && size <= p_last) ++level, size *= 2;
  const int32_t* order = s.orders + pi.order0 + g.lvl0 * ((int64_t(1) << level) - 1);
  const int64_t n_level = size < K ? size : K;
  const int32_t* ranks = p.key_rank + pi.rank0;
  int32_t* head = p.tile_keys + (pi.list0 + t) * (1 + p.list_cap);
  int32_t* list = head + 1;
  for (int i = threadIdx.x; i < TR; i += kSelectThreads) w.new_at[i] = kNeverKept;
  if (threadIdx.x == 0) w.start = kNeverKept, w.last_base = 0, w.top = -1, w.cut = 0;

  // Candidates in rank order until the first row has seen W keys (every row's threshold is at most
  // that rank): the keys the last row sees. A key visible to the last row but not the first ("new",
  // at most TR - 1) leaves its list index in new_at. Base keys (seen by the first row) are seen by
  // every row, and a row sees at most TR - 1 keys more than the first, so every row's threshold
  // lies between the (W - TR + 1)-th base key and the W-th: a window of < 2 TR list entries from
  // `start`. Ineligible keys (-1 in the level order) follow the eligible ones: the first ends it.
  // A step reads kScanPer x 32 consecutive entries a warp, lane-strided (coalesced); the counts
  // before an entry are ballots within the warp plus the earlier warps' totals.
  const int64_t s_need = int64_t(W) - TR + 1;
  int32_t seen = 0, n = 0;
  bool more = p_last >= 0;
  constexpr int kStep = kSelectThreads * kScanPer, kWarps = kSelectThreads / 32;
  static_assert(kStep <= kRing && 2 * kMaxTileRows <= kRing, "a step or the window would wrap the ring");
  for (int64_t r = 0; more && r < n_level && seen < W; r += kStep) {
    int32_t pos[kScanPer];
    unsigned base_m[kScanPer], cand_m[kScanPer];
    bool all_valid = true;
#pragma unroll
    for (int i = 0; i < kScanPer; ++i) {
      const int64_t e = r + warp * 32 * kScanPer + i * 32 + lane;
      pos[i] = e < n_level ? __ldcg(order + e) : -1;
    }
    int32_t base_w = 0, cand_w = 0;
#pragma unroll
    for (int i = 0; i < kScanPer; ++i) {
      const bool valid = pos[i] >= 0;
      all_valid &= valid;
      base_m[i] = __ballot_sync(0xffffffffu, valid && pos[i] <= p_first);
      cand_m[i] = __ballot_sync(0xffffffffu, valid && pos[i] <= p_last);
      base_w += __popc(base_m[i]);
      cand_w += __popc(cand_m[i]);
    }
    if (lane == 0) w.warp_base[warp] = base_w, w.warp_cand[warp] = cand_w;
    more = __syncthreads_and(all_valid);
    int32_t before = seen, at = n, base_all = 0, cand_all = 0;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) {
      before += v < warp ? w.warp_base[v] : 0;
      at += v < warp ? w.warp_cand[v] : 0;
      base_all += w.warp_base[v];
      cand_all += w.warp_cand[v];
    }
    const unsigned below = lanes_below();
    int32_t last_base = 0;  // the list index of this lane's last listed base key
#pragma unroll
    for (int i = 0; i < kScanPer; ++i) {
      const bool base = base_m[i] >> lane & 1, cand = cand_m[i] >> lane & 1;
      const int32_t my_before = before + __popc(base_m[i] & below), my_at = at + __popc(cand_m[i] & below);
      if (cand && my_before < W) {
        list[my_at] = pos[i];
        w.ring[my_at % kRing] = pos[i];
        if (pos[i] > p_first) w.new_at[pos[i] - p_first - 1] = my_at;
        if (base) {
          if (my_before == s_need - 1) w.start = my_at;
          if (my_before == W - 1) w.n_cut = my_at + 1;
          last_base = my_at;
        }
      }
      before += __popc(base_m[i]);
      at += __popc(cand_m[i]);
    }
    // One shared-memory atomic a warp (a lane each would serialise on the one address).
    last_base = __reduce_max_sync(0xffffffffu, last_base);
    if (lane == 0 && last_base > 0) atomicMax(&w.last_base, last_base);
    // The W-th base key ends the list: the candidates after it in rank order are not listed.
    const bool cut = seen + base_all >= W;
    seen = min(seen + base_all, W);
    __syncthreads();  // new_at, start, n_cut, ring written; warp totals read before the next step's
    n = cut ? w.n_cut : n + cand_all;
  }
  __syncthreads();

  // W < TR: new keys alone can fill a row, the window starts at the list's start. Fewer base keys
  // than s_need: no row reaches W, each keeps up to its last visible key, and only new keys follow
  // the last base key (`seen` counts the listed base keys).
  const bool full = w.start != kNeverKept;
  const int32_t start = s_need <= 0 ? 0 : (full ? w.start : w.last_base);
  const int32_t base_before = s_need <= 0 ? 0 : (full ? static_cast<int32_t>(s_need - 1) : max(seen - 1, 0));
  const int32_t win = min(n - start, 2 * TR);
  // The window's entries (read back from the ring), their ranks, and a bit each for those every
  // row sees (base keys). A whole warp runs each turn: the bound is a multiple of 32.
  for (int e = threadIdx.x; e < 2 * kMaxTileRows; e += kSelectThreads) {
    int32_t rank = 0;
    bool base = false;
    if (e < win) {
      const int32_t pos = w.ring[(start + e) % kRing];
      base = pos <= p_first;
      rank = __ldcg(ranks + pos);
    }
    w.win_rank[e] = rank;
    const unsigned m = __ballot_sync(0xffffffffu, base);
    if (lane == 0) w.win_base[e / 32] = m;
  }

  // A thread a row. Row i sees the base entries and the new keys of rows 1..i (key p_first + d is
  // seen from row d on, at list index new_at[d - 1]): its window mask is an OR-scan over the rows
  // of one bit each, and its count of new keys listed before the window a sum-scan of one each.
  // Every row's mask at once: a warp a row would take a ballot per window word and row.
  const int rl = threadIdx.x;
  constexpr int kRowWarps = kMaxTileRows / 32;
  unsigned vis[kWinWords];
  int32_t early = 0;
  if (warp < kRowWarps) {
    const int32_t x = rl >= 1 && rl < TR ? w.new_at[rl - 1] : kNeverKept;
    const int32_t in_win = x != kNeverKept && x >= start && x - start < win ? x - start : -1;
    early = x != kNeverKept && x < start ? 1 : 0;
#pragma unroll
    for (int k = 0; k < kWinWords; ++k) vis[k] = in_win >= 0 && in_win / 32 == k ? 1u << (in_win % 32) : 0u;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
#pragma unroll
      for (int k = 0; k < kWinWords; ++k) {
        const unsigned v = __shfl_up_sync(0xffffffffu, vis[k], o);
        if (lane >= o) vis[k] |= v;
      }
      const int32_t v = __shfl_up_sync(0xffffffffu, early, o);
      if (lane >= o) early += v;
    }
    if (lane == 31) {
#pragma unroll
      for (int k = 0; k < kWinWords; ++k) w.warp_vis[warp][k] = vis[k];
      w.warp_early[warp] = early;
    }
  }
  __syncthreads();
  int32_t top = -1;  // the thread's row's threshold
  if (warp < kRowWarps) {
#pragma unroll
    for (int k = 0; k < kWinWords; ++k) vis[k] |= w.win_base[k];
    for (int v = 0; v < warp; ++v) {
#pragma unroll
      for (int k = 0; k < kWinWords; ++k) vis[k] |= w.warp_vis[v][k];
      early += w.warp_early[v];
    }
    // The row's threshold: the rank of the window entry where its count of visible keys reaches W
    // (or of its last visible one).
    const int64_t p_row = p.is_causal ? r0 + rl + off : K - 1;
    if (rl < TR && r0 + rl < Q) {
      int32_t thr = -1;
      if (p_row >= 0) {
        const int32_t need = W - base_before - (p.is_causal ? early : 0);  // >= 1
        // The word holding the need-th visible entry (and the count before it), else the last word
        // with a visible entry (selects, not an indexed array: vis stays in registers).
        int32_t acc = 0, word = -1, last_word = -1;
        unsigned m = 0, last_m = 0;
#pragma unroll
        for (int k = 0; k < kWinWords; ++k) {
          const int32_t c = __popc(vis[k]);
          if (word < 0 && acc + c >= need) word = k, m = vis[k];
          if (word < 0) acc += c;
          if (c) last_word = k, last_m = vis[k];
        }
        int32_t entry = -1;
        if (word >= 0)
          entry = word * 32 + nth_set_bit(m, need - acc);
        else if (last_word >= 0)
          entry = last_word * 32 + 31 - __clz(last_m);
        if (entry >= 0) thr = w.win_rank[entry];
      }
      p.row_thr[pi.thr0 + r0 + rl] = thr;
      top = thr;
    }
    top = __reduce_max_sync(0xffffffffu, top);
    if (lane == 0 && top >= 0) atomicMax(&w.top, top);
  }
  __syncthreads();
  // Keep the prefix of the list some row keeps: the list is in rank order and the largest
  // threshold is the rank of a window entry, so the prefix ends at that entry.
  top = w.top;
  int32_t cut = 0;
  for (int e = threadIdx.x; e < win; e += kSelectThreads)
    if (w.win_rank[e] <= top) cut = max(cut, start + e + 1);
  cut = __reduce_max_sync(0xffffffffu, cut);
  if (lane == 0 && cut > 0) atomicMax(&w.cut, cut);
  __syncthreads();
  if (threadIdx.x == 0) head[0] = w.cut;
}

__global__ void __launch_bounds__(kSelectThreads, 2) select_kernel(const SelectParams p, const Geometry g, Scratch s) {
  __shared__ Smem sm;
  __shared__ int64_t item_s;
  if (threadIdx.x == 0) item_s = atomicAdd(s.counters, 1u);
  __syncthreads();
  const int64_t item = item_s, P = p.planes;
  // Items past a packed sequence's own chunks or tiles do nothing, but count: the waits below are
  // for every item of the plane.
  if (item < g.n_sort) {
    const int64_t plane = item / g.n_chunks, c = item % g.n_chunks;
    const PlaneInfo pi = plane_info(p, g, plane);
    if (c < pi.n_chunks) sort_chunk(p, s, sm, pi, c);
    publish(s.counters + 1 + plane);
  } else if (item < g.n_sort + g.n_rank) {
    const int64_t i = item - g.n_sort, plane = i / (g.n_chunks * g.subs), c = i % (g.n_chunks * g.subs);
    const PlaneInfo pi = plane_info(p, g, plane);
    if (c / g.subs < pi.n_chunks) {
      wait_for(s.counters + 1 + plane, static_cast<uint32_t>(g.n_chunks));
      const int sub = static_cast<int>(c % g.subs);
      if (g.subs == kChunk / kSmallRankKeys)
        rank_keys<kSmallRankKeys / kSelectThreads>(p, s, sm, pi, c / g.subs, sub);
      else
        rank_keys<kRankKeys / kSelectThreads>(p, s, sm, pi, c / g.subs, sub);
    }
    publish(s.counters + 1 + P + plane);
  } else {
    const int64_t i = item - g.n_sort - g.n_rank, plane = i / g.n_tiles, t = i % g.n_tiles;
    const PlaneInfo pi = plane_info(p, g, plane);
    if (t >= pi.n_tiles) return;
    wait_for(s.counters + 1 + P + plane, static_cast<uint32_t>(g.n_chunks * g.subs));
    walk_tile(p, s, sm, pi, t);
  }
}

}  // namespace

int64_t select_workspace_bytes(const SelectParams& p) { return select_geometry(p).bytes; }

int64_t select_counter_bytes(const SelectParams& p) { return select_geometry(p).counters_bytes; }

const char* select_unsupported_reason(const SelectParams& p) {
  if (p.tile_rows > kMaxTileRows) return "tile_rows above 128";
  if (p.seqlen_k >= (int64_t(1) << 31) - kChunk) return "more keys than int32 ranks";
  const Geometry g = select_geometry(p);
  if (g.n_sort + g.n_rank + g.n_walk >= (int64_t(1) << 31)) return "more work items than one grid holds";
  return nullptr;
}

void run_select(const SelectParams& p, void* stream) {
  const Geometry g = select_geometry(p);
  const int64_t items = g.n_sort + g.n_rank + g.n_walk;
  if (items == 0) return;
  char* ws = static_cast<char*>(p.workspace);
  Scratch s{reinterpret_cast<uint32_t*>(ws), reinterpret_cast<uint32_t*>(ws + g.sorted_off),
            reinterpret_cast<int32_t*>(ws + g.keys_off), reinterpret_cast<int32_t*>(ws + g.orders_off)};
  select_kernel<<<static_cast<unsigned>(items), kSelectThreads, 0, static_cast<cudaStream_t>(stream)>>>(p, g, s);
}

}  // namespace cuda
}  // namespace flexdma
