// Per-key top-W selection in compact form (no Q x K tensor); see flexdma/perkey/contract.py for the
// contract.
#pragma once
#include <cstdint>

#include "../flash_dma_constants.h"

namespace flexdma {
namespace cpu {

// Rank of a key never kept (ineligible: masked out, or score -inf).
using flexdma::kNeverKept;

// One selection plane. scores[K]: per-key score, -inf = ineligible; NaN ranks above every number
// (as torch.sort does), so a NaN score is kept and reaches the output instead of vanishing.
// Writes key_rank[K], row_thr[Q], and per query tile of `tile_rows` rows the union of the rows'
// kept keys in rank order: tile_keys[t * (1 + list_cap)] = n, then n key indices.
void perkey_select_plane(const float* scores, int64_t K, int64_t Q, int64_t window, bool is_causal, int64_t tile_rows,
                         int64_t list_cap, int32_t* key_rank, int32_t* row_thr, int32_t* tile_keys);

}  // namespace cpu
}  // namespace flexdma
