// Grid and launch of the forward kernels: one CTA per (query tile, head, batch, key split), the
// grid and its order the tile scheduler's (tile_scheduler.cuh). Instantiated per (head dim, dtype) in
// instantiations/fwd_hdim*_*.cu.
#pragma once
#include "fwd_combine.cuh"
#include "fwd_kernel.cuh"
#include "fwd_ws_kernel.cuh"
#include "launch.h"
#include "tile_scheduler.cuh"

namespace flexdma {
namespace cuda {

// What a forward launch does for these params: the kernel and its CTA shape, the operand flags and
// the key splits. Planned once for fwd_workspace_bytes (the caller's allocation) and again for the
// launch, from the same params and device: the two agree.
template <typename T, int D>
struct FwdPlan {
  void (*kernel)(const FwdParams, const FwdFlags, const FwdSplit) = nullptr;
  int smem = 0, threads = kThreads, rows = kBlockM;
  int64_t units = 0;        // grid x per query tile: heads, or head pairs
  bool persistent = false;  // a CTA an SM over the work items (PersistentTileScheduler)
  int sms = 1;
  FwdFlags f;
  int splits = 1;

  // Float scratch of a split launch: every split's O rows, then its lse rows.
  int64_t workspace_bytes(const FwdParams& p) const {
    return splits > 1 ? int64_t(splits) * p.batch * p.num_heads * p.seqlen_q * (D + 1) * int64_t(sizeof(float)) : 0;
  }
};

// Head dims 64 / 128 on sm_90a run the warp-specialized kernel (one 128-row CTA per SM), the
// others the one-warpgroup kernel (64-row CTAs, two or three per SM).
template <typename T, int D>
FwdPlan<T, D> plan_fwd(const FwdParams& p) {
  constexpr bool kWs = fwd_warp_specialized<D>();
  FwdPlan<T, D> plan;
  int per_sm = 2;
  const int sms = sm_count();
  plan.sms = sms;
  FwdFlags& f = plan.f;
  // Two consecutive query heads share their operands when they share a kv head and every
  // broadcast operand (mask, bias, tile bits) maps both to one plane: head_ratio even. Paired
  // only where 128-row tiles of one head fill the GPU: with the keys split over CTAs (decoding)
  // the paired kernel is the slower one (benchmarks/perf-log.md, 'head pairs packed into the forward's M, ping-pong').
  const auto shared = [](const Broadcast4d& t) { return !t.ptr || t.head_ratio % 2 == 0; };
  f.pair = kWs && !p.tile_keys.ptr && (p.num_heads / p.num_heads_k) % 2 == 0 && shared(p.mask) && shared(p.bias) &&
           shared(p.tile_meta) && ceil_div(p.seqlen_q, kWsRows) * p.num_heads * p.batch >= sms;
  if constexpr (kWs) {
    // The per-key rule (tile_keys set; unsupported_reason admits it for perkey_head_dim only).
    using K = FwdWsKernels<T, D>;
    plan.persistent = p.tile_keys.ptr && K::Listed::kPersistent;
    plan.kernel = p.tile_keys.ptr  ? fwd_ws_kernel<typename K::Listed>
                  : p.cu_seqlens_q ? fwd_ws_kernel<typename K::PackedSequence>
                                   : fwd_ws_kernel<typename K::Sequence>;
    plan.smem = FwdWsSmem<T, D>::kBytes;
    plan.threads = kWsThreads;
    plan.rows = f.pair ? kBlockM : kWsRows;
    per_sm = 1;
  } else {
    plan.kernel = p.cu_seqlens_q ? fwd_kernel<T, D, true> : fwd_kernel<T, D, false>;
    plan.smem = FwdSmem<T, D>::kBytes;
  }
  f.qkv_vec = aligned16(p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride) &&
              aligned16(p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride) &&
              aligned16(p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  f.mask_vec = mask_rows_aligned(p);
  f.bias_vec = p.bias.ptr && p.bias.col_stride == 1 &&
               aligned16(p.bias.ptr, p.bias.batch_stride, p.bias.head_stride, p.bias.row_stride);
  f.out_vec = reinterpret_cast<uintptr_t>(p.out) % 4 == 0 && p.o_batch_stride % 2 == 0 && p.o_row_stride % 2 == 0 &&
              p.o_head_stride % 2 == 0;
  f.out_vec16 = aligned16(p.out, p.o_batch_stride, p.o_row_stride, p.o_head_stride) &&
                reinterpret_cast<uintptr_t>(p.out_resid) % 16 == 0;
  // The scheduler's units: heads, or head pairs when paired.
  plan.units = f.pair ? p.num_heads / 2 : p.num_heads;
  const int64_t ctas = ceil_div(p.seqlen_q, plan.rows) * plan.units * p.batch;
  // Packed sequences are never split (the partial rows and their combine are laid out padded).
  if (ctas < sms && !p.cu_seqlens_q) {
    // Too few query tiles to fill the GPU (decoding, short prompts): split the keys so that
    // every SM runs per_sm CTAs, each over at least 4 key tiles.
    // A per-key query tile walks its list (at most the list capacity), not the sequence.
    const int64_t keys = p.tile_keys.ptr ? imin(p.seqlen_k, p.tile_keys.row_stride - 1) : p.seqlen_k;
    plan.splits = (int)imax(1, imin(ceil_div(per_sm * sms, ctas), ceil_div(keys, 4 * kBlockN)));
  }
  return plan;
}

template <typename T, int D>
int64_t fwd_workspace_bytes(const FwdParams& p) {
  return plan_fwd<T, D>(p).workspace_bytes(p);
}

// p.workspace holds fwd_workspace_bytes(p) bytes (the caller's allocation).
template <typename T, int D>
void launch_fwd(const FwdParams& p, cudaStream_t stream) {
  const FwdPlan<T, D> plan = plan_fwd<T, D>(p);
  cudaFuncSetAttribute(plan.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, plan.smem);
  FwdSplit sp;
  sp.n = plan.splits;
  if (sp.n > 1) {
    const int64_t rows_all = p.batch * p.num_heads * p.seqlen_q;
    sp.o_part = static_cast<float*>(p.workspace);
    sp.lse_part = sp.o_part + sp.n * rows_all * D;
  }
  const int64_t m_tiles = ceil_div(p.seqlen_q, plan.rows);
  const dim3 grid = plan.persistent ? PersistentTileScheduler::grid(
                                          PersistentTileScheduler::items(m_tiles, plan.units, p.batch, sp.n), plan.sms)
                                    : SingleTileScheduler::grid(m_tiles, plan.units, p.batch, sp.n);
  // Packed calls: the offsets are checked before the kernel reads them (a per-key call's selection,
  // a launch of its own, may have had other offsets).
  if (p.cu_seqlens_q) check_packed_offsets_kernel<><<<(unsigned)ceil_div(p.batch, 128), 128, 0, stream>>>(p);
  plan.kernel<<<grid, plan.threads, plan.smem, stream>>>(p, plan.f, sp);
  if (sp.n > 1) {
    const int64_t rows_all = p.batch * p.num_heads * p.seqlen_q;
    combine_splits<T, D><<<(unsigned)ceil_div(rows_all, 4), 128, 0, stream>>>(p, sp);
  }
}

}  // namespace cuda
}  // namespace flexdma
