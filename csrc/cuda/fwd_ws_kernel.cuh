// Forward kernel, warp-specialized (sm_90a, head dims 64 / 128): one CTA of three warpgroups per
// (128-row query tile, head, batch, key split), or per (64-row query tile, head pair, batch, key
// split) where two query heads share every operand (FwdFlags::pair), one CTA per SM; or
// (PersistentTileScheduler, the per-key lists) one CTA per SM over work item after work item, the
// next tile's Q and first gathers requested while this one's last pieces and epilogue run.
//   warpgroup 0 loads: K / V tiles (contiguous, or gathered through the query tile's key list on
//     the per-key path), the bias tiles, the mask bytes (raw by cp.async, or built where a length
//     or misalignment rules that out) into rings of K stages (with the mask / bias / rank
//     operands) and V stages, handed over by mbarriers;
//   warpgroups 1 and 2 compute rows [0, 64) and [64, 128) of the tile (paired: the same 64 rows of
//     head h and h + 1) from the same stages: S = Q K^T (Q loaded once into smem by warpgroup 0,
//     and from there into registers where the configuration has room: FwdWsConfig::kQInRegisters) and
//     O += P V on wgmma, the online softmax in registers (O rescaled only when a row's max moves:
//     softmax_step).
// Why: in the one-warpgroup kernel (fwd_kernel.cuh) the threads that run the products also issue
// every copy, compute its addresses and wait at a CTA barrier per tile, and each 64-row CTA reads
// its own K / V. Here the copies and their integer work are off the computing warps' issue path,
// a stage is released by the warps that used it instead of a CTA barrier (K as soon as S and the
// softmax have read it, V after P V), each K / V byte serves 128 rows, and inside a computing
// warpgroup S of the next tile is in flight while P V of this one runs (the softmax of tile t + 1
// overlaps the tensor cores' P V of tile t). On the per-key lists at D = 64 a step takes two tiles
// (FwdWsConfig::kWidePieces): 128 keys a softmax step, where the registers allow it.
// Paired (GQA: consecutive query heads over one kv head, with mask, bias and tile bits broadcast
// over both): the loader copies one 64-row mask / bias tile for both warpgroups, half the bytes and
// copy work of two query tiles of one head, and the warpgroups walk the same key tiles. That lets
// their products alternate (FA3's ping-pong: a warpgroup issues its S / P.V once the other has
// issued its own, so one's softmax runs under the other's products instead of both contending for
// the tensor cores and then both computing exponentials). It does so without mask and bias only:
// with them the per-element work makes the warpgroups' softmax phases long and uneven, and a fixed
// alternation makes the quicker one wait instead of overlapping anything (slower, in the perf log).
// Composed as FlashAttention-3's kernels are: FwdWsKernel<Mainloop, Epilogue, Scheduler>.
//   Mainloop (fwd_ws_mainloop.cuh): FwdWsMainloop<T, D, Keys, Config>, the loader's copies and the
//     computing warpgroups' walk over a key source Keys (fwd_key_source.cuh: where the key tiles
//     come from, how they are copied and what drops a score: SequenceKeys, the sequence's key
//     tiles, mask and bias tiles, or ListedKeys, the per-key top-W rule's query-tile key list and
//     rank rule) in a configuration Config (FwdWsConfig: Q in registers, the wide walk, the staged
//     setup, the register split);
//   Epilogue: FwdWsEpilogue, O and LSE out (fwd_epilogue.cuh);
//   Scheduler (tile_scheduler.cuh): SingleTileScheduler (a CTA a tile) or PersistentTileScheduler.
// FwdWsKernels names the kernels the launcher starts.
#pragma once
#include "../flash_dma_params.h"
#include "fwd_epilogue.cuh"
#include "fwd_key_source.cuh"
#include "fwd_ws_mainloop.cuh"
#include "pipeline.cuh"
#include "seq_info.cuh"
#include "smem_layout.cuh"
#include "tile_scheduler.cuh"

namespace flexdma {
namespace cuda {

// The forward's epilogue: a computing warpgroup's O and LSE rows out, staged through its Q tile.
template <typename T, int D>
struct FwdWsEpilogue {
  // kPersistent: the fragment addresses are derived here from an opaque copy of tid, not hoisted
  // out of the tile loop and held (spilled) across every tile's walk.
  template <bool kPersistent>
  __device__ static inline void store(const FwdParams& p, const FwdFlags& f, const FwdSplit& sp,
                                      const float (&o)[D / 8][4], const float (&row_max)[2], const float (&row_sum)[2],
                                      const SeqInfo& seq, int64_t head, int64_t m0, int tid, T* stage, int split) {
    int tid_e = tid;
    if constexpr (kPersistent) asm volatile("" : "+r"(tid_e));
    fwd_epilogue<T, D>(p, f, sp, o, row_max, row_sum, seq, head, m0, tid_e, stage, split);
  }
};

// The tile of work item `work` (tile_scheduler.cuh's order, heaviest first).
template <typename Keys>
__device__ inline FwdWsTile fwd_ws_tile(const FwdParams& p, const FwdFlags& f, const FwdSplit& sp, WorkTile work,
                                        int64_t n_known = -1) {
  FwdWsTile c;
  c.pair = Keys::kPairs && f.pair;
  c.h = work.unit << (c.pair ? 1 : 0);
  c.b = work.b;
  c.seq = SeqInfo::of<Keys::kPacked>(p, c.b);
  const int64_t m_tile = work.m_tile;
  c.kvh = c.h / (p.num_heads / p.num_heads_k);
  c.m0 = m_tile * (c.pair ? kBlockM : kWsRows);
  c.two = c.pair || c.m0 + kBlockM < c.seq.nq;
  c.list = nullptr;
  // n_known: the loader's count (a persistent CTA's computing warps, kStagedSetup), or -1.
  const int64_t n_all = Keys::tiles(p, c, n_known);
  c.n_all = n_all;
  c.split = (int)work.split;
  SingleTileScheduler::key_range(n_all, sp.n, work.split, c.t_begin, c.n_end);
  c.meta0 = c.meta1 = nullptr;
  if (Keys::kTileBits && Keys::kMask && p.mask.ptr) {
    const Plane<uint32_t> meta(p.tile_meta, c.b, c.h);
    c.meta0 = meta.at(c.m0 / kBlockM, 0);
    if (c.halves() == 2) c.meta1 = meta.at(c.m0 / kBlockM + 1, 0);
  }
  return c;
}
// The tile of this CTA (one a tile). Units of the grid's x: head pairs when paired (then 64-row
// query tiles), else heads.
template <typename Keys>
__device__ inline FwdWsTile fwd_ws_tile(const FwdParams& p, const FwdFlags& f, const FwdSplit& sp) {
  return fwd_ws_tile<Keys>(p, f, sp, SingleTileScheduler::get((int)p.num_heads >> (Keys::kPairs && f.pair ? 1 : 0)));
}

// The tile of persistent work item w (PersistentTileScheduler's order).
template <typename Keys>
__device__ inline FwdWsTile fwd_ws_tile_at(const FwdParams& p, const FwdFlags& f, const FwdSplit& sp, unsigned w,
                                           int64_t n_known = -1) {
  const unsigned m_tiles = (unsigned)ceil_div(p.seqlen_q, kWsRows);
  return fwd_ws_tile<Keys>(p, f, sp, PersistentTileScheduler::get(w, (unsigned)p.num_heads, m_tiles, (unsigned)p.batch),
                           n_known);
}

// A warp-specialized forward kernel: its mainloop, epilogue and tile scheduler (which work items a
// CTA takes: one, or one after another).
template <typename Mainloop_, typename Epilogue_, typename Scheduler_>
struct FwdWsKernel {
  using Mainloop = Mainloop_;
  using Epilogue = Epilogue_;
  using Scheduler = Scheduler_;
  using T = typename Mainloop::T;
  static constexpr int D = Mainloop::D;
  using Keys = typename Mainloop::Keys;
  using Config = typename Mainloop::Config;
  using L = typename Mainloop::Smem;
  using Pos = typename Mainloop::Pos;
  static constexpr bool kPersistent = Scheduler::kPersistent;
  static_assert(!kPersistent || (Config::kQInRegisters && !Keys::kBiasTiles && !Keys::kPairs),
                "a persistent CTA stages O in its Q buffer and keeps the second in the bias stages");

  // A computing warpgroup's part of tile c: the walk, then its rows out.
  __device__ static inline void compute(const FwdParams& p, const FwdFlags& f, const FwdSplit& sp, const FwdWsTile& c,
                                        unsigned char* smem, int wg, Pos& at, int qb = 0, uint32_t qphase = 0) {
    fwd_ws_compute<Mainloop, kPersistent, Epilogue>(p, f, sp, c, smem, wg, at, qb, qphase);
  }

  // Persistent: tile i of this CTA takes Q buffer i % 2 (use i / 2); the loader refills a buffer
  // once both computing warpgroups have staged their output out of it (its free barrier, use
  // i / 2 - 1).
  __device__ static inline void run_persistent(const FwdParams& p, const FwdFlags& f, const FwdSplit& sp,
                                               unsigned char* smem, Pos& pk, Pos& pv) {
    const unsigned items = (unsigned)Scheduler::items(ceil_div(p.seqlen_q, kWsRows), p.num_heads, p.batch, sp.n);
    if (threadIdx.x < kThreads) {
      regs_release<Config::kLoadRegs>();
      int i = 0;
      for (unsigned w = blockIdx.x; w < items; w += gridDim.x, ++i) {
        const int qb = i & 1;
        if (i >= 2) mbar_wait(q_free<T, D>(smem, qb), ((i >> 1) - 1) & 1);
        // The previous tile's reads of the index ring done before this tile's first writes there.
        named_barrier(NamedBarrier::kLoad, kThreads);
        Mainloop::template load<true>(p, f, fwd_ws_tile_at<Keys>(p, f, sp, w), smem, pk, pv, qb);
      }
      cp_async_wait<0>();  // no copy may land in the smem of a later CTA
    } else {
      regs_claim<Config::kComputeRegs>();
      const int wg = warpgroup_uniform() - 1;
      int i = 0;
      for (unsigned w = blockIdx.x; w < items; w += gridDim.x, ++i) {
        const int qb = i & 1;
        const uint32_t qphase = (i >> 1) & 1;
        if constexpr (Config::kStagedSetup) {
          // The loader's setup of the tile (its list's tile count, its rows' thresholds) lands with Q.
          mbar_wait(q_full<T, D>(smem, qb), qphase);
          const FwdWsTile c = fwd_ws_tile_at<Keys>(p, f, sp, w, *q_setup<T, D>(smem, qb));
          compute(p, f, sp, c, smem, wg, pk, qb, qphase);
        } else {
          compute(p, f, sp, fwd_ws_tile_at<Keys>(p, f, sp, w), smem, wg, pk, qb, qphase);
        }
        mbar_arrive(q_free<T, D>(smem, qb));
      }
    }
  }

  __device__ static inline void run(const FwdParams& p, const FwdFlags& f, const FwdSplit& sp, unsigned char* smem) {
    Pos pk, pv;
    if (threadIdx.x == 0) {
      mbar_init_kv_ring<L::kStages>(reinterpret_cast<uint64_t*>(smem + L::kBars), kThreads, 2 * kThreads);
      mbar_init(q_full<T, D>(smem, 0), 2 * kThreads);
      if constexpr (kPersistent) {
        mbar_init(q_full<T, D>(smem, 1), 2 * kThreads);
        mbar_init(q_free<T, D>(smem, 0), 2 * kThreads);
        mbar_init(q_free<T, D>(smem, 1), 2 * kThreads);
      }
      mbar_init_fence();
    }
    __syncthreads();

    if constexpr (kPersistent) {
      run_persistent(p, f, sp, smem, pk, pv);
    } else if (threadIdx.x < kThreads) {
      // The tile is derived after the register hand-over: values live across it travel through
      // local memory.
      regs_release<Config::kLoadRegs>();
      Mainloop::template load<false>(p, f, fwd_ws_tile<Keys>(p, f, sp), smem, pk, pv);
    } else {
      regs_claim<Config::kComputeRegs>();
      compute(p, f, sp, fwd_ws_tile<Keys>(p, f, sp), smem, warpgroup_uniform() - 1, pk);
    }
  }
};

template <typename Kernel>
__global__ void __launch_bounds__(kWsThreads, 1) fwd_ws_kernel(const FwdParams p, const FwdFlags f, const FwdSplit sp) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Kernel::run(p, f, sp, smem_raw + smem_align_pad<true>(smem_raw));
}

// The warp-specialized forward's kernels of (T, D), the launcher's choice among them by the params.
template <typename T, int D>
struct FwdWsKernels {
  // Padded batches: Q read from smem (with the mask's operands, Q in registers spills at D = 128).
  using Sequence = FwdWsKernel<FwdWsMainloop<T, D, SequenceKeys, FwdWsConfig<false, false, false>>, FwdWsEpilogue<T, D>,
                               SingleTileScheduler>;
  // Packed sequences (no mask): Q in registers.
  using PackedSequence = FwdWsKernel<FwdWsMainloop<T, D, PackedSequenceKeys, FwdWsConfig<true, false, false>>,
                                     FwdWsEpilogue<T, D>, SingleTileScheduler>;
  // The per-key lists: a CTA an SM over tile after tile (the next tile's Q and first gathers land
  // during this one's last pieces and epilogue), Q in registers, at D = 64 the wide walk and the
  // staged setup (FwdWsConfig says why not at D = 128).
  using Listed = FwdWsKernel<FwdWsMainloop<T, D, ListedKeys, FwdWsConfig<true, D <= 64, D <= 64>>, FwdWsEpilogue<T, D>,
                             PersistentTileScheduler>;
};

}  // namespace cuda
}  // namespace flexdma
