// The per-key decode step on the CPU (flexdma::decode_step / decode_append; DecodeParams states it).
#pragma once
#include "flash_dma_cpu.h"

namespace flexdma {
namespace cpu {

// Planes (batch x kv head) in parallel on the binding's thread pool.
void run_decode(const DecodeParams& params, const ParallelFor& parallel_for);
// flexdma::perkey_last_row: the kept sets selected from params.scores, then the step.
void run_last_row(const DecodeParams& params, const ParallelFor& parallel_for);

}  // namespace cpu
}  // namespace flexdma
