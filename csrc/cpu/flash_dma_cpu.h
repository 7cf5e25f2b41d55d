// CPU kernel of the flexdma op family: the FlashAttention algorithm in plain C++.
#pragma once
#include <cstdint>
#include <functional>

#include "../flash_dma_params.h"

namespace flexdma {
namespace cpu {

// The binding supplies the thread pool (at::parallel_for), so this code stays torch-free.
// fn(begin, end) is called on disjoint ranges covering [0, n).
using ParallelFor = std::function<void(int64_t n, const std::function<void(int64_t, int64_t)>& fn)>;

void run_fwd(const FwdParams& params, const ParallelFor& parallel_for);
void run_bwd(const BwdParams& params, const ParallelFor& parallel_for);

}  // namespace cpu
}  // namespace flexdma
