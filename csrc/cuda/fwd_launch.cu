// Grid and launch of the forward kernel: one CTA per (query tile, head, batch), (tile, head)
// flattened into x so that heads interleave.
#include "fwd_kernel.cuh"
#include "launch.h"

namespace flexdma {
namespace cuda {

template <typename T, int D>
void launch_fwd(const FwdParams& p, cudaStream_t stream) {
  constexpr int kSmem = FwdSmem<T, D>::kBytes;
  cudaFuncSetAttribute(fwd_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  FwdFlags f;
  f.qkv_vec = aligned16(p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride) &&
              aligned16(p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride) &&
              aligned16(p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  f.mask_vec = mask_rows_aligned(p);
  f.bias_vec = p.bias.ptr && p.bias.col_stride == 1 &&
               aligned16(p.bias.ptr, p.bias.batch_stride, p.bias.head_stride, p.bias.row_stride);
  f.out_vec = reinterpret_cast<uintptr_t>(p.out) % 4 == 0 && p.o_batch_stride % 2 == 0 &&
              p.o_row_stride % 2 == 0 && p.o_head_stride % 2 == 0;
  dim3 grid((unsigned)(ceil_div(p.seqlen_q, kBlockM) * p.num_heads), (unsigned)p.batch);
  fwd_kernel<T, D><<<grid, kThreads, kSmem, stream>>>(p, f);
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
