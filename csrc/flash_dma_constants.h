// Constants shared by the kernels (csrc/cuda, csrc/cpu), the dispatcher binding (ops/) and Python
// (flexdma._C exports them: TILE_SIZE, PERKEY_TILE_ROWS, PERKEY_CPU_TILE_ROWS, NEVER_KEPT, TILES_PER_WORD,
// MAX_GRID_DIM, LN2, LOG2E, and perkey_list_cap). Torch-free.
#pragma once
#include <cstdint>

namespace flexdma {

// Query rows and keys of one tile of the CUDA kernels, and of one bit of tile_meta.
constexpr int kTileSize = 64;
// Query rows of a CTA of the CUDA per-key forward (two 64-row tiles that share its key tiles):
// the rows of the key lists it reads are a multiple of it.
constexpr int kPerkeyTileRows = 2 * kTileSize;
// Query rows per tile of the CPU selection's lists (the CPU kernels do not read the lists).
constexpr int kPerkeyCpuTileRows = 64;
// key_rank of a key no row of its plane keeps (masked out, or score -inf): int32 max.
constexpr int32_t kNeverKept = 2147483647;
// Entries of one query tile's key list of the per-key selection: at most W + tile_rows - 1 keys
// (and never more than K). Python's fake kernels mirror it for symbolic shapes (flexdma/perkey/
// contract.py; tests/test_perkey.py checks the two agree).
constexpr int64_t perkey_list_cap(int64_t K, int64_t window, int64_t tile_rows) {
  return K < window + tile_rows - 1 ? K : window + tile_rows - 1;
}
// Key tiles per 32-bit word of a tile_meta row (bit kt % 32 of word kt / 32).
constexpr int kTilesPerWord = 32;
// Largest grid y / z extent: batch and head counts a CUDA kernel takes (tile_meta launches mask
// planes in chunks of it).
constexpr int64_t kMaxGridDim = 65535;
// ln 2 and log2 e: the CUDA kernels keep scores in log2 units.
constexpr double kLn2 = 0.6931471805599453;
constexpr double kLog2e = 1.4426950408889634;

}  // namespace flexdma
