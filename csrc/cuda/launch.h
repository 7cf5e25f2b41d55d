// Launchers of the templated kernels, defined in fwd_launch.cuh / bwd_launch.cuh and instantiated
// one (direction, head dim, dtype) a file in instantiations/; flash_dma_cuda.cu picks one from the
// params.
#pragma once
#include <cuda_runtime.h>

#include <atomic>

#include "../flash_dma_params.h"
#include "head_dims.h"
#include "smem_layout.cuh"

namespace flexdma {
namespace cuda {

// The current device's SM count, asked of the runtime once a device: every launch plan reads it
// (a decode step's plan three times a call).
inline int sm_count() {
  constexpr int kDevices = 64;
  static std::atomic<int> known[kDevices] = {};
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  if (dev >= 0 && dev < kDevices) sms = known[dev].load(std::memory_order_relaxed);
  if (sms > 0) return sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  sms = sms > 0 ? sms : 1;
  if (dev >= 0 && dev < kDevices) known[dev].store(sms, std::memory_order_relaxed);
  return sms;
}

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
