// Tile shape and numeric constants of the CUDA kernels, and the integer helpers every file uses.
// The tile size, the tile-activity word width, the grid limit and ln 2 come from
// csrc/flash_dma_constants.h, shared with the binding, the CPU side and Python (flexdma._C).
#pragma once
#include <cstdint>

#include "../flash_dma_constants.h"

namespace flexdma {
namespace cuda {

constexpr int kBlockM = kTileSize;  // query rows per tile
constexpr int kBlockN = kTileSize;  // keys per tile
constexpr int kWarps = 4;           // warp w owns rows [16w, 16w + 16) of every 64-row tile
constexpr int kThreads = kWarps * 32;
static_assert(kTilesPerWord == 32, "ActiveTiles walks tile activity words with 32-bit shifts");

// Scores are kept in log2 units (exp2 instead of exp): log2 e scales them in, ln 2 takes the LSE back.
constexpr float kLog2eF = static_cast<float>(kLog2e);
constexpr float kLn2F = static_cast<float>(kLn2);

// Dynamic shared memory a block may opt into on sm_90 (227 KiB); every kernel's layout is checked
// against it at compile time, since an oversized launch only fails at run time.
constexpr int kMaxSmemPerBlock = 227 * 1024;

__host__ __device__ inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }

}  // namespace cuda
}  // namespace flexdma
