// The per-key decode step on the CPU (flexdma::decode_step / decode_append; DecodeParams states it).
#pragma once
#include <cstdint>
#include <functional>

#include "../flash_dma_params.h"

namespace flexdma {
namespace cpu {

// Planes (batch x kv head) in parallel: parallel_for(n, fn) calls fn(begin, end) on disjoint
// ranges covering [0, n) (the binding's thread pool).
void run_decode(const DecodeParams& params,
                const std::function<void(int64_t, const std::function<void(int64_t, int64_t)>&)>& parallel_for);
// flexdma::perkey_last_row: the kept sets selected from params.scores, then the step.
void run_last_row(const DecodeParams& params,
                  const std::function<void(int64_t, const std::function<void(int64_t, int64_t)>&)>& parallel_for);

}  // namespace cpu
}  // namespace flexdma
