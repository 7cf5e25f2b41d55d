// Grids and launches of the backward: dQ (one CTA per query tile and head, heavy tiles first;
// it also writes the float delta into softmax_d), then dK/dV/dbias (one CTA per key tile, kv
// head, batch); a bias broadcast over keys gets per-key-tile dbias slices summed in tile order
// afterwards, so no two CTAs ever write the same element.
#include "bwd_dbias.cuh"
#include "bwd_dkv_kernel.cuh"
#include "bwd_dq_kernel.cuh"
#include "head_dims.h"
#include "launch.h"

namespace flexdma {
namespace cuda {

template <typename T, int D>
void launch_bwd(const BwdParams& p, cudaStream_t stream) {
  constexpr int kSmemQ = BwdDqSmem<T, D>::kBytes, kSmemKV = BwdDkvSmem<T, D>::kBytes;
  // dK / dV in one pass up to D = 128, as a dV pass and a dK (+ dbias) pass above.
  constexpr bool kSplit = D > 128;
  cudaFuncSetAttribute(bwd_dq_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemQ);
  cudaFuncSetAttribute(bwd_dkv_kernel < T, D, kSplit ? 1 : 0 >, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemKV);
  if constexpr (kSplit)
    cudaFuncSetAttribute(bwd_dkv_kernel<T, D, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemKV);
  BwdFlags f;
  f.qkv_vec = aligned16(p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride) &&
              aligned16(p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride) &&
              aligned16(p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride) &&
              aligned16(p.dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride);
  f.mask_vec = mask_rows_aligned(p);
  f.bias_vec = p.bias.ptr && p.bias.col_stride == 1 &&
               aligned16(p.bias.ptr, p.bias.batch_stride, p.bias.head_stride, p.bias.row_stride);
  const int64_t n_tiles = ceil_div(p.seqlen_k, kBlockN);

  BwdDbias dbias;
  float* scratch = nullptr;
  int64_t span = 0;
  if (p.dbias_accum.ptr) {
    dbias.ptr = const_cast<void*>(p.dbias_accum.ptr);
    dbias.layout = p.dbias_accum;
    dbias.in_dtype = p.dbias_in_dtype;
    const Broadcast4d& a = p.dbias_accum;
    dbias.vec = p.dbias_in_dtype && a.col_stride == 1 && aligned16(a.ptr, a.batch_stride, a.row_stride, a.head_stride);
    if (!p.dbias_in_dtype && a.col_stride == 0 && n_tiles > 1) {
      const int64_t heads = a.head_stride ? p.num_heads / a.head_ratio : 1;
      span = (a.batch_stride ? (p.batch - 1) * a.batch_stride : 0) + (heads - 1) * a.head_stride +
             (a.row_stride ? (p.seqlen_q - 1) * a.row_stride : 0) + 1;
      cudaMallocAsync(reinterpret_cast<void**>(&scratch), n_tiles * span * sizeof(float), stream);
      cudaMemsetAsync(scratch, 0, n_tiles * span * sizeof(float), stream);
      dbias.ptr = scratch;
      dbias.tile_stride = span;
    }
  }
  // dq first: it writes softmax_d with the float delta that the dkv kernel reads.
  dim3 grid_q((unsigned)(ceil_div(p.seqlen_q, kBlockM) * p.num_heads), (unsigned)p.batch);
  bwd_dq_kernel<T, D><<<grid_q, kThreads, kSmemQ, stream>>>(p, f, dbias);
  dim3 grid_kv((unsigned)n_tiles, (unsigned)p.num_heads_k, (unsigned)p.batch);
  bwd_dkv_kernel<T, D, kSplit ? 1 : 0><<<grid_kv, kThreads, kSmemKV, stream>>>(p, dbias, f);
  if constexpr (kSplit) bwd_dkv_kernel<T, D, 2><<<grid_kv, kThreads, kSmemKV, stream>>>(p, dbias, f);
  if (scratch) {
    const int blocks = (int)imin(1024, ceil_div(span, 256));
    bwd_reduce_dbias_tiles<<<blocks, 256, 0, stream>>>(static_cast<float*>(const_cast<void*>(p.dbias_accum.ptr)),
                                                       scratch, span, n_tiles);
    cudaFreeAsync(scratch, stream);
  }
}

#define FLEXDMA_INSTANTIATE_BWD(D)                                     \
  template void launch_bwd<__half, D>(const BwdParams&, cudaStream_t); \
  template void launch_bwd<__nv_bfloat16, D>(const BwdParams&, cudaStream_t);
FLEXDMA_FOR_EACH_HEAD_DIM(FLEXDMA_INSTANTIATE_BWD)
#undef FLEXDMA_INSTANTIATE_BWD

}  // namespace cuda
}  // namespace flexdma
