// Grid and launch of the forward kernel: one CTA per (query tile, head, batch).
#include "fwd_kernel.cuh"
#include "launch.h"

namespace flexdma {
namespace cuda {

template <typename T, int D>
void launch_fwd(const FwdParams& p, cudaStream_t stream) {
  constexpr int kSmem = FwdSmem<T, D>::kBytes;
  cudaFuncSetAttribute(fwd_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  const bool vec = aligned16(p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride) &&
                   aligned16(p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride) &&
                   aligned16(p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  dim3 grid((unsigned)ceil_div(p.seqlen_q, kBlockM), (unsigned)p.num_heads, (unsigned)p.batch);
  fwd_kernel<T, D><<<grid, kThreads, kSmem, stream>>>(p, vec, mask_rows_aligned(p));
}

#define FLEXDMA_INSTANTIATE_FWD(D)                                            \
  template void launch_fwd<__half, D>(const FwdParams&, cudaStream_t);       \
  template void launch_fwd<__nv_bfloat16, D>(const FwdParams&, cudaStream_t);
#ifdef FLEXDMA_HEAD_DIM_64
FLEXDMA_INSTANTIATE_FWD(64)
#endif
#ifdef FLEXDMA_HEAD_DIM_128
FLEXDMA_INSTANTIATE_FWD(128)
#endif

}  // namespace cuda
}  // namespace flexdma
