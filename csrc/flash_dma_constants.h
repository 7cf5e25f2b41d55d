// Constants shared by the kernels (csrc/cuda, csrc/cpu), the dispatcher binding (ops/) and Python
// (flexdma._C exports them: TILE_SIZE, TOPK_TILE_ROWS, TILES_PER_WORD, MAX_GRID_DIM, LN2). Torch-free.
#pragma once
#include <cstdint>

namespace flexdma {

// Query rows and keys of one tile of the CUDA kernels, and of one bit of tile_meta.
constexpr int kTileSize = 64;
// Query rows of a CTA of the CUDA per-key forward (two 64-row tiles that share its key tiles):
// the rows of the key lists it reads are a multiple of it.
constexpr int kTopkTileRows = 2 * kTileSize;
// Key tiles per 32-bit word of a tile_meta row (bit kt % 32 of word kt / 32).
constexpr int kTilesPerWord = 32;
// Largest grid y / z extent: batch and head counts a CUDA kernel takes (tile_meta launches mask
// planes in chunks of it).
constexpr int64_t kMaxGridDim = 65535;
// ln 2 and log2 e: the CUDA kernels keep scores in log2 units.
constexpr double kLn2 = 0.6931471805599453;
constexpr double kLog2e = 1.4426950408889634;

}  // namespace flexdma
