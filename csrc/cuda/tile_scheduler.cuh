// Which work a forward CTA takes: its (query tile, head or head pair, batch, key split) from the
// block index, and the grid the launcher starts for it. One type for both forwards and their
// launcher, so that the grid and the kernels agree on the order; a persistent scheduler (CTAs that
// fetch tile after tile) would take its place behind the same two calls.
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

}  // namespace cuda
}  // namespace flexdma
