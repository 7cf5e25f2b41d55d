// A work tile's sequence: where batch b's query and key rows start in each operand, and how many
// there are. Padded batches (FwdParams::cu_seqlens_q null) have seqlen_q / seqlen_k rows each, a
// batch stride apart. Packed sequences (cu_seqlens) have their own lengths and start at row
// cu_seqlens[b] of operands whose batch strides are 0; the per-key operands (bias, key_rank,
// row_thr, tile_keys, dbias) are packed along their key / row dim the same way. The kernels take
// every base pointer and length from here, so one kernel serves both layouts.
#pragma once
#include <cstdint>

#include "../flash_dma_params.h"

namespace flexdma {
namespace cuda {

struct SeqInfo {
  int64_t b;
  int64_t q0, k0;  // the sequence's first query / key row (0 in a padded batch)
  int64_t nq, nk;  // its query / key rows
  int64_t tile0;   // packed: the tile_keys row of its first query tile (FwdParams::cu_seqlens_q)
  bool packed;     // a constant where the kernel takes no packed sequences (of<false>)
  // kPacked false: a kernel that never gets packed sequences (unsupported_reason refuses them), whose
  // offsets then fold to the batch strides at no cost.
  template <bool kPacked>
  __device__ static inline SeqInfo of(const FwdParams& p, int64_t batch) {
    SeqInfo s;
    s.b = batch;
    s.packed = kPacked && p.cu_seqlens_q;
    if (s.packed) {
      s.q0 = p.cu_seqlens_q[batch];
      s.k0 = p.cu_seqlens_k[batch];
      s.nq = p.cu_seqlens_q[batch + 1] - s.q0;
      s.nk = p.cu_seqlens_k[batch + 1] - s.k0;
      s.tile0 = s.q0 / p.topk_tile_rows + batch;
    } else {
      s.q0 = s.k0 = s.tile0 = 0;
      s.nq = p.seqlen_q;
      s.nk = p.seqlen_k;
    }
    return s;
  }
  // Element offsets of the sequence's row 0 in each operand.
  __device__ inline int64_t q_offset(const FwdParams& p) const { return b * p.q_batch_stride + q0 * p.q_row_stride; }
  __device__ inline int64_t k_offset(const FwdParams& p) const { return b * p.k_batch_stride + k0 * p.k_row_stride; }
  __device__ inline int64_t v_offset(const FwdParams& p) const { return b * p.v_batch_stride + k0 * p.v_row_stride; }
  __device__ inline int64_t o_offset(const FwdParams& p) const { return b * p.o_batch_stride + q0 * p.o_row_stride; }
  __device__ inline int64_t do_offset(const BwdParams& p) const { return b * p.do_batch_stride + q0 * p.do_row_stride; }
  __device__ inline int64_t dq_offset(const BwdParams& p) const { return b * p.dq_batch_stride + q0 * p.dq_row_stride; }
  __device__ inline int64_t dk_offset(const BwdParams& p) const { return b * p.dk_batch_stride + k0 * p.dk_row_stride; }
  __device__ inline int64_t dv_offset(const BwdParams& p) const { return b * p.dv_batch_stride + k0 * p.dv_row_stride; }
  // lse's element of the sequence's row 0 of head h: (B, H, Q), or (H, total_q) when packed.
  __device__ inline int64_t lse_offset(const FwdParams& p, int64_t h) const {
    return packed ? h * p.total_q + q0 : (b * p.num_heads + h) * p.seqlen_q;
  }
};

}  // namespace cuda
}  // namespace flexdma
