// Grids and launches of the backward: delta and lse (one CTA per query tile, head, batch), the main pass (one CTA per
// key tile, kv head, batch; dK / dV / dbias written, dQ added into a float workspace), dq from that workspace. No two
// CTAs write the same dbias element. Instantiated per (head dim, dtype) in instantiations/bwd_hdim*_*.cu.
#pragma once
#include "bwd_dbias.cuh"
#include "bwd_kernel.cuh"
#include "bwd_prepost.cuh"
#include "perkey_bwd_kernel.cuh"
#include "launch.h"

namespace flexdma {
namespace cuda {

// The backward's one workspace: the per-row lse2 and delta (written by the pre kernel), the float dQ
// accumulator and (deterministic) the per-tile turns, these two zeroed by the launch; by query tile
// (DqAccum::tile).
template <int D>
struct BwdWorkspace {
  int64_t tiles_per_unit;  // DqAccum::m_tiles
  size_t row_bytes, acc_bytes, zero_bytes;
  explicit BwdWorkspace(const BwdParams& p) {
    tiles_per_unit = p.cu_seqlens_q ? p.total_q / kBlockM + p.batch : ceil_div(p.seqlen_q, kBlockM);
    const int64_t n_q_tiles = (p.cu_seqlens_q ? 1 : p.batch) * p.num_heads * tiles_per_unit;
    row_bytes = size_t(n_q_tiles) * kBlockM * sizeof(float);
    acc_bytes = size_t(n_q_tiles) * kBlockM * D * sizeof(float);
    zero_bytes = acc_bytes + (p.deterministic ? size_t(n_q_tiles) * sizeof(int) : 0);
  }
  size_t bytes() const { return 2 * row_bytes + zero_bytes; }
};

template <typename T, int D>
int64_t bwd_workspace_bytes(const BwdParams& p) {
  return p.tile_keys.ptr ? 0 : (int64_t)BwdWorkspace<D>(p).bytes();
}

// The per-key backward (tile_keys set; unsupported_reason admits it at the warp-specialized head
// dims only): one CTA per (128-row query tile, head, batch), heaviest tiles first. p.dk / p.dv
// point to zeroed float (B, K, KVH, D) accumulators and p.dbias_accum, where set, to a zeroed float
// one in the bias's layout; the caller casts them.
template <typename T, int D>
void launch_perkey_bwd(const BwdParams& p, cudaStream_t stream) {
  if constexpr (perkey_bwd_built<D>()) {
    using Scheduler = SingleTileScheduler;
    constexpr auto kernel = perkey_bwd_kernel<T, D, ListedKeys, Scheduler>;
    constexpr int kSmem = PerkeyBwdSmem<T, D>::kBytes;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    const dim3 grid = Scheduler::grid(ceil_div(p.seqlen_q, 2 * kBlockM), p.num_heads, p.batch, 1);
    // Packed calls: the offsets are checked ahead of the kernel (it runs wgmma: seq_info.cuh says why
    // not in it); the selection it reads was made by a launch of its own.
    if (p.cu_seqlens_q) check_packed_offsets_kernel<><<<(unsigned)ceil_div(p.batch, 128), 128, 0, stream>>>(p);
    kernel<<<grid, kPerkeyBwdThreads, kSmem, stream>>>(p);
  }
}

// The dense backward's launches (pre, main pass, post), padded or packed.
template <typename T, int D, bool kPacked>
void launch_dense_bwd(const BwdParams& p, cudaStream_t stream) {
  constexpr int kSmem = BwdSmem<T, D>::kBytes;
  // dK / dV in one pass up to D = 128, as a dV pass and a dK (+ dQ, dbias) pass above.
  constexpr bool kSplit = D > 128;
  using Keys = SequenceKeysOf<kPacked>;
  constexpr auto main_pass = bwd_kernel < T, D, kSplit ? 1 : 0, Keys, KeyTileScheduler > ;
  cudaFuncSetAttribute(main_pass, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if constexpr (kSplit)
    cudaFuncSetAttribute(bwd_kernel<T, D, 2, Keys, KeyTileScheduler>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         kSmem);
  BwdFlags f;
  f.qkv_vec = aligned16(p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride) &&
              aligned16(p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride) &&
              aligned16(p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride) &&
              aligned16(p.dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride);
  f.mask_vec = mask_rows_aligned(p);
  f.bias_vec = p.bias.ptr && p.bias.col_stride == 1 &&
               aligned16(p.bias.ptr, p.bias.batch_stride, p.bias.head_stride, p.bias.row_stride);
  PreFlags pf;
  pf.vec = aligned16(p.out, p.o_batch_stride, p.o_row_stride, p.o_head_stride) &&
           aligned16(p.dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride) &&
           reinterpret_cast<uintptr_t>(p.out_resid) % 16 == 0;
  const int64_t n_tiles = ceil_div(p.seqlen_k, kBlockN), m_tiles = ceil_div(p.seqlen_q, kBlockM);

  DqAccum dqa;
  const BwdWorkspace<D> w(p);
  dqa.m_tiles = (int)w.tiles_per_unit;
  dqa.num_heads = (int)p.num_heads;
  char* ws = static_cast<char*>(p.workspace);
  cudaMemsetAsync(ws + 2 * w.row_bytes, 0, w.zero_bytes, stream);
  dqa.lse2 = reinterpret_cast<float*>(ws);
  dqa.delta = reinterpret_cast<float*>(ws + w.row_bytes);
  dqa.ptr = reinterpret_cast<float*>(ws + 2 * w.row_bytes);
  if (p.deterministic) dqa.turn = reinterpret_cast<int*>(ws + 2 * w.row_bytes + w.acc_bytes);

  BwdDbias dbias;
  if (p.dbias_accum.ptr) {
    dbias.ptr = const_cast<void*>(p.dbias_accum.ptr);
    dbias.layout = p.dbias_accum;
    dbias.in_dtype = p.dbias_in_dtype;
    const Broadcast4d& a = p.dbias_accum;
    dbias.vec = p.dbias_in_dtype && a.col_stride == 1 && aligned16(a.ptr, a.batch_stride, a.row_stride, a.head_stride);
  }
  const dim3 grid_q = QueryTileScheduler::grid(m_tiles, p.num_heads, p.batch);
  bwd_pre_kernel<T, D, QueryTileScheduler><<<grid_q, kThreads, 0, stream>>>(p, dqa, pf);
  const dim3 grid_kv = KeyTileScheduler::grid(n_tiles, p.num_heads_k, p.batch);
  main_pass<<<grid_kv, kThreads, kSmem, stream>>>(p, dbias, f, dqa);
  if constexpr (kSplit)
    bwd_kernel<T, D, 2, Keys, KeyTileScheduler><<<grid_kv, kThreads, kSmem, stream>>>(p, dbias, f, dqa);
  bwd_post_kernel<T, D, QueryTileScheduler><<<grid_q, kThreads, 0, stream>>>(p, dqa);
}

// p.workspace holds bwd_workspace_bytes(p) bytes (the caller's allocation).
template <typename T, int D>
void launch_bwd(const BwdParams& p, cudaStream_t stream) {
  if (p.tile_keys.ptr) {
    launch_perkey_bwd<T, D>(p, stream);
    return;
  }
  if (p.cu_seqlens_q)
    launch_dense_bwd<T, D, true>(p, stream);
  else
    launch_dense_bwd<T, D, false>(p, stream);
}

}  // namespace cuda
}  // namespace flexdma
