// CUDA kernels of the flexdma op family (declarations only: no CUDA types leak to the binding).
#pragma once
#include "../flash_dma_params.h"

namespace flexdma {
namespace cuda {

// nullptr when the kernel handles these params, else a short reason ("head_dim 80 not built").
// The binding checks this before launching; Python asks the same through flexdma._C info.
const char* unsupported_reason(const FwdParams& params);

// stream is a cudaStream_t passed as void* so that this header needs no CUDA headers.
void run_fwd(const FwdParams& params, void* stream);
void run_bwd(const BwdParams& params, void* stream);

}  // namespace cuda
}  // namespace flexdma
