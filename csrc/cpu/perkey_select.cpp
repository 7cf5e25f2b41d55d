// CPU selection: a sort per plane, then one sweep over the rows with a bounded max-heap.
//
// Causal rows see a growing prefix of the keys, so the W best visible ranks change by at most one
// insertion and one eviction per newly visible key: row_thr costs O(K log W), not O(Q K).
#include "perkey_select.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <queue>
#include <vector>

namespace flexdma {
namespace cpu {

void perkey_select_plane(const float* scores, int64_t K, int64_t Q, int64_t window, bool is_causal, int64_t tile_rows,
                         int64_t list_cap, int32_t* key_rank, int32_t* row_thr, int32_t* tile_keys) {
  std::vector<int32_t> order;
  order.reserve(K);
  for (int64_t j = 0; j < K; ++j)
    if (!(scores[j] == -INFINITY)) order.push_back(static_cast<int32_t>(j));
  // (score desc, index asc); NaN first, like torch.sort(descending=True).
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    const float sa = scores[a], sb = scores[b];
    const bool na = std::isnan(sa), nb = std::isnan(sb);
    if (na || nb) return na && !nb;
    return sa > sb;
  });
  const int64_t n_eligible = static_cast<int64_t>(order.size());
  std::fill(key_rank, key_rank + K, kNeverKept);
  for (int64_t r = 0; r < n_eligible; ++r) key_rank[order[r]] = static_cast<int32_t>(r);

  const int64_t off = K - Q;  // causal: row i sees keys j <= i + off (bottom-right aligned)
  if (!is_causal) {
    const int32_t thr = n_eligible == 0 ? -1 : static_cast<int32_t>(std::min(window, n_eligible) - 1);
    std::fill(row_thr, row_thr + Q, thr);
  } else {
    // Max-heap of the (at most W) smallest visible ranks: its top is the row's threshold.
    std::priority_queue<int32_t> best;
    int64_t next = 0;  // first key not yet visible
    for (int64_t i = 0; i < Q; ++i) {
      const int64_t last = std::min(K - 1, i + off);
      for (; next <= last; ++next) {
        const int32_t r = key_rank[next];
        if (r == kNeverKept) continue;
        if (static_cast<int64_t>(best.size()) < window) {
          best.push(r);
        } else if (r < best.top()) {
          best.pop();
          best.push(r);
        }
      }
      row_thr[i] = best.empty() ? -1 : best.top();
    }
  }

  // A tile's list: keys some row of the tile keeps = visible to its last row with a rank at most
  // the largest threshold among its rows, taken in rank order. At most W + tile_rows - 1 keys.
  const int64_t n_tiles = (Q + tile_rows - 1) / tile_rows;
  for (int64_t t = 0; t < n_tiles; ++t) {
    const int64_t r0 = t * tile_rows, r1 = std::min(Q, r0 + tile_rows) - 1;
    const int32_t top = *std::max_element(row_thr + r0, row_thr + r1 + 1);
    const int64_t last_key = is_causal ? r1 + off : K - 1;
    int32_t* list = tile_keys + t * (1 + list_cap);
    int64_t n = 0;
    for (int64_t r = 0; r <= top && r < n_eligible; ++r)
      if (order[r] <= last_key && n < list_cap) list[1 + n++] = order[r];
    list[0] = static_cast<int32_t>(n);
  }
}

}  // namespace cpu
}  // namespace flexdma
