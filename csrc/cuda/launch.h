// Launchers of the templated kernels, defined in fwd_launch.cuh / bwd_launch.cuh and instantiated
// one (direction, head dim, dtype) a file in instantiations/; flash_dma_cuda.cu picks one from the
// params.
#pragma once
#include <cuda_runtime.h>

#include "../flash_dma_params.h"
#include "head_dims.h"
#include "smem_layout.cuh"

namespace flexdma {
namespace cuda {

template <typename T, int D>
void launch_fwd(const FwdParams& p, cudaStream_t stream);
template <typename T, int D>
int64_t fwd_workspace_bytes(const FwdParams& p);

// Whether head dim d's forward (a runtime value: the params') is the warp-specialized kernel, the
// one that runs the per-key rule (fwd_warp_specialized).
constexpr bool perkey_head_dim(int64_t d) {
#define FLEXDMA_WS_DIM(D) (d == D && fwd_warp_specialized<D>()) ||
  return FLEXDMA_ALL_HEAD_DIMS(FLEXDMA_WS_DIM) false;
#undef FLEXDMA_WS_DIM
}
template <typename T, int D>
void launch_bwd(const BwdParams& p, cudaStream_t stream);
template <typename T, int D>
int64_t bwd_workspace_bytes(const BwdParams& p);

// 16-byte tile loads need 16-byte aligned bases and strides that are multiples of 8 elements.
inline bool aligned16(const void* ptr, int64_t s0, int64_t s1, int64_t s2) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && s0 % 8 == 0 && s1 % 8 == 0 && s2 % 8 == 0;
}

// A mask row read 16 bytes at a time: contiguous keys and 16-byte aligned row starts.
inline bool mask_rows_aligned(const FwdParams& p) {
  const Broadcast4d& m = p.mask;
  return m.ptr && m.col_stride == 1 && reinterpret_cast<uintptr_t>(m.ptr) % 16 == 0 && m.batch_stride % 16 == 0 &&
         m.head_stride % 16 == 0 && m.row_stride % 16 == 0;
}

}  // namespace cuda
}  // namespace flexdma
