// A work tile's sequences: where batch b's query and key rows start in each operand, and how many
// there are. Every batch has seqlen_q / seqlen_k rows, a batch stride apart; packed sequences
// (cu_seqlens) would give each batch its own row offsets and lengths here, and the kernels, which
// take a batch's base pointers and copy lengths from it, would follow.
#pragma once
#include <cstdint>

#include "../flash_dma_params.h"

namespace flexdma {
namespace cuda {

struct SeqInfo {
  int64_t b;
  __device__ inline explicit SeqInfo(int64_t batch) : b(batch) {}
  // Element offsets of batch b's row 0 in each operand.
  __device__ inline int64_t q_offset(const FwdParams& p) const { return b * p.q_batch_stride; }
  __device__ inline int64_t k_offset(const FwdParams& p) const { return b * p.k_batch_stride; }
  __device__ inline int64_t v_offset(const FwdParams& p) const { return b * p.v_batch_stride; }
  __device__ inline int64_t o_offset(const FwdParams& p) const { return b * p.o_batch_stride; }
  __device__ inline int64_t do_offset(const BwdParams& p) const { return b * p.do_batch_stride; }
  __device__ inline int64_t dq_offset(const BwdParams& p) const { return b * p.dq_batch_stride; }
  __device__ inline int64_t dk_offset(const BwdParams& p) const { return b * p.dk_batch_stride; }
  __device__ inline int64_t dv_offset(const BwdParams& p) const { return b * p.dv_batch_stride; }
  // Batch b's query and key rows.
  __device__ inline int64_t seqlen_q(const FwdParams& p) const { return p.seqlen_q; }
  __device__ inline int64_t seqlen_k(const FwdParams& p) const { return p.seqlen_k; }
};

}  // namespace cuda
}  // namespace flexdma
