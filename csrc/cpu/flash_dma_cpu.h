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

// consts: params.softmax_scale / softcap in double (ScoreConsts), which float64 inputs use.
void run_fwd(const FwdParams& params, const ScoreConsts& consts, const ParallelFor& parallel_for);
// num_threads: how many threads parallel_for runs on. It picks between two work schedules
// (see bwd_typed); both give the same bits, so results never depend on it.
void run_bwd(const BwdParams& params, const ScoreConsts& consts, const ParallelFor& parallel_for,
             int64_t num_threads = 1);

}  // namespace cpu
}  // namespace flexdma
