// Which work a CTA takes: its (query tile, head or head pair, batch, key split) from the block
// index, and the grid the launcher starts for it. The kernels take the scheduler as a type (the
// warp-specialized forward, FwdWsKernel, as a template parameter), and the launchers build their
// grids from the same type, so that the grid and the kernels agree on the order. Used by both
// forwards and the per-key backward; the dense backward's main pass takes key tiles
// (KeyTileScheduler), its pre / post kernels query tiles (QueryTileScheduler).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "constants.cuh"

namespace flexdma {
namespace cuda {

// A CTA's work: query tile m_tile (of the kernel's rows per tile), unit (a query head, or the
// first of a head pair, counted in units), batch b and key split.
struct WorkTile {
  int m_tile, unit;
  unsigned b, split;
};

// One work tile per CTA, heaviest first: grid x is (query tile, unit) with units fastest, the
// query tiles from the last to the first. The last tiles are the heaviest under causal (they see
// the most keys); launched first, with heads interleaved, the long tiles of the last head do not
// form the tail.
struct SingleTileScheduler {
  static constexpr bool kPersistent = false;
  static dim3 grid(int64_t m_tiles, int64_t units, int64_t batch, int splits) {
    return dim3((unsigned)(m_tiles * units), (unsigned)batch, (unsigned)splits);
  }
  // `units`: the grid's units per query tile (heads, or head pairs).
  __device__ static inline WorkTile get(int units) {
    WorkTile w;
    w.unit = (int)blockIdx.x % units;
    w.m_tile = (int)(gridDim.x / units) - 1 - (int)blockIdx.x / units;
    w.b = blockIdx.y;
    w.split = blockIdx.z;
    return w;
  }
  // Key split `split` of `splits` over n_all key tiles: tiles [begin, end), as even as can be
  // (the last splits may be short or empty).
  __device__ static inline void key_range(int64_t n_all, int splits, unsigned split, int64_t& begin, int64_t& end) {
    const int64_t per_split = ceil_div(n_all, splits);
    begin = imin(n_all, (int64_t)split * per_split);
    end = imin(n_all, begin + per_split);
  }
};

// Persistent CTAs (the per-key forward): a CTA an SM, each taking work items blockIdx.x,
// blockIdx.x + gridDim.x, ... of m_tiles x units x batch x splits, the query tiles from the last
// (heaviest under causal) to the first across every unit and batch, so that a CTA's next tile is
// about as long as the others' and the ring of stages runs on from one tile into the next.
struct PersistentTileScheduler {
  static constexpr bool kPersistent = true;
  __host__ __device__ static int64_t items(int64_t m_tiles, int64_t units, int64_t batch, int splits) {
    return m_tiles * units * batch * splits;
  }
  static dim3 grid(int64_t items, int sms) { return dim3((unsigned)imin(items, sms), 1, 1); }
  // 32-bit divisions (the launcher keeps the items below 2^31): 64-bit ones are long calls.
  __device__ static inline WorkTile get(unsigned w, unsigned units, unsigned m_tiles, unsigned batch) {
    WorkTile t;
    t.unit = (int)(w % units);
    w /= units;
    t.b = w % batch;
    w /= batch;
    t.m_tile = (int)(m_tiles - 1 - w % m_tiles);
    t.split = w / m_tiles;
    return t;
  }
};

// The dense backward's main pass (bwd_kernel.cuh): a CTA per (key tile, kv head, batch), in the
// grid's order (each CTA walks every query tile of its key tile: no order balances better).
struct KeyTileScheduler {
  struct Tile {
    int n_tile, kvh, b;
  };
  static dim3 grid(int64_t n_tiles, int64_t kv_heads, int64_t batch) {
    return dim3((unsigned)n_tiles, (unsigned)kv_heads, (unsigned)batch);
  }
  __device__ static inline Tile get() {
    Tile t;
    t.n_tile = blockIdx.x;
    t.kvh = blockIdx.y;
    t.b = blockIdx.z;
    return t;
  }
};

// The backward's pre / post kernels (bwd_prepost.cuh): a CTA per (query tile, head, batch), heads
// fastest, in the grid's order (every CTA does the same work).
struct QueryTileScheduler {
  static dim3 grid(int64_t m_tiles, int64_t heads, int64_t batch) {
    return dim3((unsigned)(m_tiles * heads), (unsigned)batch);
  }
  // The CTA's head, query tile and batch; `heads`: the grid's heads per query tile.
  __device__ static inline int head(int heads) { return (int)blockIdx.x % heads; }
  __device__ static inline int m_tile(int heads) { return (int)blockIdx.x / heads; }
  __device__ static inline unsigned batch() { return blockIdx.y; }
};

}  // namespace cuda
}  // namespace flexdma
