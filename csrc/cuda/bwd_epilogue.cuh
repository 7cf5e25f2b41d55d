// The backward main pass's epilogue: a CTA's dK (times the softmax scale) and dV rows out, once
// its walk over the work items is done.
#pragma once
#include "../flash_dma_params.h"
#include "gemm.cuh"
#include "seq_info.cuh"

namespace flexdma {
namespace cuda {

// Key rows [n0, n0 + valid) of kv head kvh: the warp's 16 rows from r0 of the dK / dV
// accumulators (a pass without one holds a stub: kDk / kDv say which are real). The output
// pointers are formed here, not at the start of the kernel: live across the walk they took
// registers.
template <typename T, int D, bool kDk, bool kDv, int kDkRows, int kDvRows>
__device__ inline void bwd_epilogue(const BwdParams& p, const SeqInfo& seq, int kvh, int n0,
                                    const float (&dk)[kDkRows][4], const float (&dv)[kDvRows][4], int r0, int valid) {
  T* dk_out = static_cast<T*>(p.dk) + seq.dk_offset(p) + kvh * p.dk_head_stride + n0 * p.dk_row_stride;
  T* dv_out = static_cast<T*>(p.dv) + seq.dv_offset(p) + kvh * p.dv_head_stride + n0 * p.dv_row_stride;
  if constexpr (kDk) store_acc<T, D>(dk_out, p.dk_row_stride, dk, p.softmax_scale, r0, valid);
  if constexpr (kDv) store_acc<T, D>(dv_out, p.dv_row_stride, dv, 1.f, r0, valid);
}

}  // namespace cuda
}  // namespace flexdma
