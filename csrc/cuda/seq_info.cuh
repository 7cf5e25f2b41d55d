// A work tile's sequence: where batch b's query and key rows start in each operand, and how many
// there are. Padded batches (FwdParams::cu_seqlens_q null) have seqlen_q / seqlen_k rows each, a
// batch stride apart. Packed sequences (cu_seqlens) have their own lengths and start at row
// cu_seqlens[b] of operands whose batch strides are 0; the per-key operands (bias, key_rank,
// row_thr, tile_keys, dbias) are packed along their key / row dim the same way. The kernels take
// every base pointer and length from here, so one kernel serves both layouts.
#pragma once
#include <cassert>  // __assert_fail
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
  // kPacked false: a padded kernel (packed calls run the packed instantiation, or none where
  // unsupported_reason refuses them), whose offsets then fold to the batch strides at no cost.
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
      s.tile0 = s.q0 / p.perkey_tile_rows + batch;
    } else {
      s.q0 = s.k0 = s.tile0 = 0;
      s.nq = p.seqlen_q;
      s.nk = p.seqlen_k;
    }
    return s;
  }
  // Stops the device where a packed sequence's offsets break check_packed_offsets' rules: called by
  // the kernel of a call that reads them first (never one that runs wgmma: the forward's are
  // checked by check_packed_offsets_kernel ahead of it).
  __device__ inline void check(const FwdParams& p) const;
  // nq / nk, read from the params where the batch is padded: a kernel parameter is an operand of the
  // instruction that uses it, where a copy made at the start is a register held all kernel long
  // (the dense backward, at its register limit, spilled).
  __device__ inline int64_t len_q(const FwdParams& p) const { return packed ? nq : p.seqlen_q; }
  __device__ inline int64_t len_k(const FwdParams& p) const { return packed ? nk : p.seqlen_k; }
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
  // A per-sequence operand plane (bias, mask, dbias) from the sequence's row 0 and key 0: packed
  // operands hold every sequence's rows / keys along their own row / key dims.
  __device__ inline int64_t plane_offset(const Broadcast4d& t) const { return q0 * t.row_stride + k0 * t.col_stride; }
  // Whether 16-byte copies of a plane of T elements stay aligned at the sequence's row 0 / key 0
  // (a packed sequence starts anywhere; `aligned`: the plane's own alignment, FwdFlags::bias_vec).
  template <typename T>
  __device__ inline bool vec16(const Broadcast4d& t, bool aligned) const {
    return aligned && plane_offset(t) % (16 / sizeof(T)) == 0;
  }
};

// Packed offsets are never read on the host (no synchronisation): the kernel that reads them first
// in a call checks them and stops the device at an assert naming the rule, as torch's own index
// checks on CUDA do (the next synchronising call raises "device-side assert triggered"), before any
// kernel reads or writes past a tensor. The CPU op checks the same rules and raises a ValueError.
__device__ inline void check_packed_offsets(bool ok) {
  if (!ok)
    __assert_fail(
        "flexdma: cu_seqlens_q / cu_seqlens_k must start at 0, not decrease and end at the token counts, and no "
        "sequence may be longer than max_seqlen_q / max_seqlen_k",
        __FILE__, __LINE__, __func__);
}

// The rules of sequence b of `batch` (rows [q0, q1) and keys [k0, k1)): the offsets start at 0, do
// not decrease, end at the token counts, and no sequence is longer than max_seqlen.
__device__ inline bool packed_offsets_ok(int64_t b, int64_t batch, int64_t q0, int64_t q1, int64_t k0, int64_t k1,
                                         int64_t max_q, int64_t max_k, int64_t total_q, int64_t total_k) {
  const bool first = b == 0, last = b + 1 == batch;
  return q0 >= 0 && k0 >= 0 && q0 <= q1 && k0 <= k1 && q1 - q0 <= max_q && k1 - k0 <= max_k && q1 <= total_q &&
         k1 <= total_k && (!first || (q0 == 0 && k0 == 0)) && (!last || (q1 == total_q && k1 == total_k));
}

__device__ inline void SeqInfo::check(const FwdParams& p) const {
  if (!packed) return;
  check_packed_offsets(
      packed_offsets_ok(b, p.batch, q0, q0 + nq, k0, k0 + nk, p.seqlen_q, p.seqlen_k, p.total_q, p.total_k));
}

// The forward's packed offsets, checked ahead of its kernel in a launch of their own (a thread a
// sequence): a call to assert anywhere in a kernel that runs wgmma makes ptxas serialise all of
// its wgmmas (C7510), which takes the forward's S / P.V overlap away. A template so that every
// instantiation file that includes this header may define it.
template <int kUnused = 0>
__global__ void check_packed_offsets_kernel(const FwdParams p) {
  const int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (b < p.batch) SeqInfo::of<true>(p, b).check(p);
}

}  // namespace cuda
}  // namespace flexdma
