// The warp-specialized forward's mainloop (fwd_ws_kernel.cuh composes it with the epilogue and a
// tile scheduler): its shared memory (FwdWsSmem), the loading warpgroup's copies
// (FwdWsMainloop::load) and the computing warpgroups' walk over the key tiles (fwd_ws_compute),
// written once over a key source (fwd_key_source.cuh) and a kernel configuration (FwdWsConfig).
#pragma once
#include <math_constants.h>

#include <type_traits>

#include "../flash_dma_params.h"
#include "constants.cuh"
#include "copy.cuh"
#include "fwd_key_source.cuh"
#include "fwd_scores.cuh"
#include "mask.cuh"
#include "mma_sm80.cuh"
#include "mma_sm90.cuh"
#include "pipeline.cuh"
#include "seq_info.cuh"
#include "smem_layout.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"

namespace flexdma {
namespace cuda {

constexpr int kWsThreads = 3 * kThreads;
constexpr int kWsRows = 2 * kBlockM;  // query rows of a CTA

// How the warp-specialized forward spends its registers and shared memory, apart from where its
// keys come from (the key source) and which tiles a CTA takes (the tile scheduler).
//   kQInRegisters: Q as S = Q K^T's A operand in registers (loaded once Q has landed): S then
//     reads only K from smem. A 64 x 64 product with both operands in smem reads as many smem
//     bytes as the tensor cores take cycles for it, next to P.V's V and the loader's gathers. Only
//     where the key source's operands leave room (the padded kernel with its mask at D = 128
//     spills with it); a persistent CTA needs it (its Q buffer stages O).
//   kWidePieces: the computing warpgroups take the listed keys 128 at a time (two ring stages, two
//     64-entry pieces of the list, a softmax step): a wgmma wait, a row-max shuffle and a rescale
//     check per 128 keys instead of per 64, and longer product batches between them. Where the
//     registers allow: at D = 64 S of 128 keys (64 registers), its P (32), O (32) and Q (16) fit
//     the computing warps' 200; at D = 128 (O and Q 96) ptxas spills ~190 bytes, and still does
//     with 216 (the loader at 72, which then spills as well). The rank rule's key lists only.
//   kStagedSetup: the loader stages a persistent tile's setup (its list's tile count, its rows'
//     thresholds) in smem with its Q, so that the computing warps start the tile without reading
//     global memory. Only at D = 64: at D = 128 the computing warps' wait for Q ahead of deriving
//     the tile costs more than the reads it saves, with a fourth K / V stage as with three
//     (measured; see the perf log).
// Registers per thread after the hand-over (setmaxnreg): it moves registers only within the CTA's
// launch allocation, 384 x 168 = 64512 (__launch_bounds__), so 128 x kLoadRegs + 256 x
// kComputeRegs must not exceed it (104 / 200 make it equal; asking more, the computing warps would
// wait for registers forever). The computing warps hold O (D / 2), S (32) and P (16) with S of the
// next tile and P.V of this one in flight; the loader's mask and bias copies (two 64-row halves,
// 64-bit addresses) need about 100.
template <bool kQRegs, bool kWide, bool kStaged>
struct FwdWsConfig {
  static constexpr bool kQInRegisters = kQRegs;
  static constexpr bool kWidePieces = kWide;
  static constexpr bool kStagedSetup = kStaged;
  static constexpr int kLoadRegs = 104, kComputeRegs = 200;
  static_assert(kThreads * kLoadRegs + 2 * kThreads * kComputeRegs <= kWsThreads * (65536 / kWsThreads / 8 * 8),
                "setmaxnreg cannot hand out more registers than the CTA was launched with");
  static_assert(!kWidePieces || kQInRegisters, "the wide walk reads Q from registers");
};

template <typename T, int D>
struct FwdWsSmem {
  // K and V stages (a K stage with the tile's mask / bias / rank operands): as many as smem holds.
  static constexpr int kStages = D <= 64 ? 4 : 3;
  static constexpr int kTileKV = tile_bytes<D>();
  // A stage's keep bytes for both 64-row halves, or (ListedKeys) the key list's slot.
  static constexpr int kKeepSlot = 2 * kBlockM * kLdKeep;
  static constexpr int kBiasSlot = kWsRows * kLdBias * 2;
  static constexpr int kBars = 0;  // full / empty barriers of the K and the V stages
  // Q's full barrier; persistent (PersistentTileScheduler): two, one a Q buffer, then each buffer's
  // "free" barrier (the computing warps' epilogue staged out of it).
  static constexpr int kQBar = 224;
  static constexpr int kIdx = 256;  // ListedKeys: key indices of 4 tiles (64 words each)
  static constexpr int kQ = 2048;   // two 64-row Q tiles, swizzled (read by wgmma)
  static constexpr int kK = kQ + 2 * kTileKV;
  static constexpr int kV = kK + kStages * kTileKV;
  static constexpr int kKeep = kV + kStages * kTileKV;
  static constexpr int kBias = kKeep + kStages * kKeepSlot;
  static constexpr int kBytes = kBias + kStages * kBiasSlot + 1024;  // + room to align the base to 1024
  // Persistent: the second Q buffer, in the bias stages a key source without bias tiles leaves free;
  // after it, where the loader stages a tile's setup (kStagedSetup), each buffer's rows' thresholds
  // (kWsRows int32), and at kSetup its list's tile count (int64).
  static constexpr int kQ2 = kBias;
  static constexpr int kThr = kQ2 + 2 * kTileKV;
  static constexpr int kSetup = kIdx + 4 * 256;
  static_assert(kBytes <= kMaxSmemPerBlock, "warp-specialized forward smem layout too large");
  static_assert(KeyList<T, D>::kSlotWords * 4 <= kKeepSlot, "KeyList's slot must fit a keep slot");
  static_assert(4 * kStages * 8 <= kQBar && kQBar + 4 * 8 <= kIdx, "barriers must fit before Q's, Q's before the ring");
  static_assert(kStages * kBiasSlot >= 2 * kTileKV + 2 * kWsRows * 4, "the bias stages must hold a second Q buffer");
  static_assert(kSetup + 2 * 8 <= kQ, "the tile setup must fit before Q");
  static_assert(kIdx + 4 * 256 <= kQ, "the index ring must fit before Q");
};

// Q buffer qb (its two 64-row tiles), its full barrier and (persistent) its free barrier.
template <typename T, int D>
__device__ inline T* q_buffer(unsigned char* smem, int qb) {
  return reinterpret_cast<T*>(smem + (qb ? FwdWsSmem<T, D>::kQ2 : FwdWsSmem<T, D>::kQ));
}
template <typename T, int D>
__device__ inline uint64_t* q_full(unsigned char* smem, int qb) {
  return reinterpret_cast<uint64_t*>(smem + FwdWsSmem<T, D>::kQBar) + qb;
}
template <typename T, int D>
__device__ inline uint64_t* q_free(unsigned char* smem, int qb) {
  return reinterpret_cast<uint64_t*>(smem + FwdWsSmem<T, D>::kQBar) + 2 + qb;
}
// kStagedSetup: Q buffer qb's tile setup (published with the buffer's full barrier).
template <typename T, int D>
__device__ inline int32_t* q_thr(unsigned char* smem, int qb) {
  return reinterpret_cast<int32_t*>(smem + FwdWsSmem<T, D>::kThr) + qb * kWsRows;
}
template <typename T, int D>
__device__ inline int64_t* q_setup(unsigned char* smem, int qb) {
  return reinterpret_cast<int64_t*>(smem + FwdWsSmem<T, D>::kSetup) + qb;
}

// What every warpgroup of a CTA derives alike: its tile, its key tiles [t_begin, n_end) (of the
// sequence, or of the key list), and the tile activity rows that say which of them to visit.
struct FwdWsTile {
  int64_t b, h, kvh, m0;
  SeqInfo seq;  // batch b's rows (padded, or a packed sequence's)
  bool two;     // the second warpgroup has rows
  bool pair;    // computing warpgroup wg takes rows [m0, m0 + 64) of head h + wg (else m0 + 64 wg of h)
  int split;    // its key split
  // Computing warpgroup wg's head and first row, and the 64-row mask / bias tiles a stage holds.
  __device__ inline int64_t head(int wg) const { return pair ? h + wg : h; }
  __device__ inline int64_t rows(int wg) const { return pair ? m0 : m0 + wg * kBlockM; }
  __device__ inline int halves() const { return two && !pair ? 2 : 1; }
  int64_t t_begin, n_end;
  int64_t n_all;          // key tiles before the split
  const uint32_t* meta0;  // tile activity row of rows [0, 64); null without a mask
  const uint32_t* meta1;  // and of rows [64, 128) where they exist
  const int32_t* list;    // ListedKeys: the query tile's list (count, then key indices)
  __device__ inline ActiveTiles active() const { return ActiveTiles(meta0, meta1); }
  // First key tile >= t (and < n_end) that keeps something.
  __device__ inline int64_t next(ActiveTiles& a, int64_t t) const { return meta0 ? a.next(t, n_end) : t; }
};

// The forward's mainloop over key source Keys and configuration Config: its smem layout, and the
// loading warpgroup's copies. The computing warpgroups' side is fwd_ws_compute.
template <typename T_, int D_, typename Keys_, typename Config_>
struct FwdWsMainloop {
  using T = T_;
  static constexpr int D = D_;
  using Keys = Keys_;
  using Config = Config_;
  using Smem = FwdWsSmem<T, D>;
  static constexpr int S = Smem::kStages;
  using Pos = RingPos<S>;
  static_assert(fwd_warp_specialized<D>(), "the warp-specialized forward is built for D = 64 / 128");
  static_assert(!Config::kWidePieces || (Keys::kRankRule && !Keys::kPairs && !Keys::kTileBits),
                "the wide walk takes every tile of a key list two at a time");

  // Warpgroup 0: requests key tile i's K (with its mask / bias / rank operands) into K stage
  // i % kStages and its V into V stage i % kStages, each once the computing warpgroups have
  // released that stage's previous use, in the order K(i + 1), V(i) (the products need K a tile
  // before V). A stage is published by arrivals that fire when the copies land
  // (cp.async.mbarrier.arrive), plus an ordinary arrival after the plain shared-memory stores of a
  // K stage: the loader never waits for its own copies, only for free stages.
  // kPersistent (a CTA over several tiles), the ring positions (pk, pv) run on from the CTA's
  // previous tile, Q goes to buffer qb, and the copies are waited for once, after the CTA's last
  // tile.
  template <bool kPersistent>
  __device__ static inline void load(const FwdParams& p, const FwdFlags& f, const FwdWsTile& c, unsigned char* smem,
                                     Pos& pk, Pos& pv, int qb = 0) {
    using L = Smem;
    uint64_t* full_k = reinterpret_cast<uint64_t*>(smem + L::kBars);
    uint64_t *empty_k = full_k + S, *full_v = full_k + 2 * S, *empty_v = full_k + 3 * S;
    T* sK = reinterpret_cast<T*>(smem + L::kK);
    T* sV = reinterpret_cast<T*>(smem + L::kV);
    uint8_t* sKeep = smem + L::kKeep;
    T* sB = reinterpret_cast<T*>(smem + L::kBias);
    const SeqInfo& seq = c.seq;
    typename Keys::template Loader<T, D, FwdWsTile> keys(p, f, c, seq, reinterpret_cast<int32_t*>(smem + L::kIdx));

    // Q of both warpgroups, once (rows past seqlen_q zero).
    for (int wg = 0; wg < (c.two ? 2 : 1); ++wg) {
      const int64_t mh = c.rows(wg);
      const T* q = static_cast<const T*>(p.q) + seq.q_offset(p) + c.head(wg) * p.q_head_stride;
      issue_rows<T, D>(q_buffer<T, D>(smem, qb) + wg * L::kTileKV / 2, q + mh * p.q_row_stride, p.q_row_stride,
                       (int)imin(kBlockM, seq.nq - mh), f.qkv_vec);
    }
    uint64_t* full_q = q_full<T, D>(smem, qb);
    if constexpr (Config::kStagedSetup) {
      static_assert(kPersistent, "a tile's setup is staged in the Q buffers of a persistent CTA");
      // The tile's setup for the computing warps, so that they read no global memory to start it:
      // the list's tile count (a plain store, published by this thread's arrival) and the rows'
      // thresholds (copies, published by the copies' arrival).
      if (threadIdx.x == 0) *q_setup<T, D>(smem, qb) = c.n_all;
      Keys::stage_row_terms(p, seq, c.h, c.m0, q_thr<T, D>(smem, qb));
    }
    mbar_arrive_copies(full_q);
    mbar_arrive(full_q);

    ActiveTiles active = c.active();
    int64_t t = c.next(active, c.t_begin);
    if (t >= c.n_end) {
      if constexpr (!kPersistent) cp_async_wait<0>();  // no copy may land in the smem of a later CTA
      return;
    }
    keys.start(t);

    // Positions in the K and V rings. Use i of a stage waits for release i - S, of the other parity;
    // in the first round that is the phase before the barrier's first, which counts as complete.
    // The next stage of a ring, once free.
    auto acquire = [&](uint64_t* empty, Pos& pos) {
      const int st = pos.stage;
      mbar_wait(&empty[st], pos.phase ^ 1u);
      pos.advance();
      return st;
    };
    auto load_k = [&](int64_t t) {
      const int st = acquire(empty_k, pk);
      keys.template load_k<L>(t, st, sK, sKeep, sB);
      mbar_arrive_copies(&full_k[st]);
      mbar_arrive(&full_k[st]);
    };
    auto load_v = [&](int64_t t) {
      const int st = acquire(empty_v, pv);
      keys.template load_v<L>(t, st, sV);
      mbar_arrive_copies(&full_v[st]);
    };

    load_k(t);
    for (;;) {
      const int64_t tn = c.next(active, t + 1);
      if (tn < c.n_end) load_k(tn);
      load_v(t);
      if (tn >= c.n_end) break;
      t = tn;
    }
    if constexpr (!kPersistent) cp_async_wait<0>();
  }
};

// The wide walk (FwdWsConfig::kWidePieces) of fwd_ws_compute: the list's tiles [t, own_end) two at a
// time (every tile of a list is visited; only its last step can be one tile), S of a step's two
// tiles issued with the previous step's P.V and its softmax run while that P.V does. Every wgmma a
// step issues is waited for in it, so the branches between steps see none in flight. On return t
// and at are past the walk. The stage waits and releases, Q's load, the products' issues and the
// score stage are fwd_ws_compute's; O, the softmax statistics and Q's fragments its registers.
template <typename T, int D, typename Pos, typename Wait, typename Release, typename LoadQ, typename IssueS,
          typename IssuePV, typename Scores, typename QFrags>
__device__ inline void fwd_ws_walk_wide(int64_t& t, Pos& at, int64_t own_end, int lane, uint64_t* full_k,
                                        uint64_t* empty_k, uint64_t* full_v, uint64_t* empty_v, Wait& wait,
                                        Release& release, LoadQ& load_q, IssueS& issue_s_rs, IssuePV& issue_pv,
                                        Scores& scores, QFrags& qa, float (&o)[D / 8][4], float (&row_max)[2],
                                        float (&row_sum)[2], float (&alpha)[2]) {
  float sw[2][kBlockN / 8][4];
  uint32_t pw[2][kBlockN / 16][4];
  // One step: S of the piece at tile tn (stages n0, n1; kTwo: both tiles) and, kPV, P.V of the
  // previous two-tile piece (stages v0, v1) under its softmax.
  auto step = [&](auto two, auto pv, int64_t tn, Pos n0, Pos n1, Pos v0, Pos v1) {
    constexpr bool kTwo = decltype(two)::value, kPV = decltype(pv)::value;
    wait(full_k, n0);
    if constexpr (kTwo) wait(full_k, n1);
    if constexpr (kPV) {
      wait(full_v, v0);
      wait(full_v, v1);
    }
    // K / V rows written by cp.async (generic proxy), read by wgmma (async proxy).
    fence_proxy_async();
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) sw[h][n][e] = 0.f;
    fence_regs(sw[0]);
    fence_regs(sw[1]);
    fence_regs(qa);
    wgmma_fence();
    issue_s_rs(sw[0], n0.stage);
    if constexpr (kTwo) issue_s_rs(sw[1], n1.stage);
    wgmma_commit();
    if constexpr (kPV) {
      fence_regs(o);
      fence_regs(pw[0]);
      fence_regs(pw[1]);
      wgmma_fence();
      issue_pv(pw[0], v0.stage);
      issue_pv(pw[1], v1.stage);
      wgmma_commit();
      wgmma_wait<1>();  // S; P.V still runs
    } else {
      wgmma_wait<0>();
    }
    fence_regs(sw[0]);
    fence_regs(sw[1]);
    scores(sw[0], tn, n0.stage);
    if constexpr (kTwo) {
      scores(sw[1], tn + 1, n1.stage);
    } else {
#pragma unroll
      for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) sw[1][n][e] = -CUDART_INF_F;
    }
    softmax_step(sw, row_max, row_sum, alpha);  // the rank rule's scores are scaled: fwd_scores' 1
    release(empty_k, n0);
    if constexpr (kTwo) release(empty_k, n1);
    if constexpr (kPV) {
      wgmma_wait<0>();
      fence_regs(o);
      release(empty_v, v0);
      release(empty_v, v1);
      rescale_o_if<D>(o, alpha);  // the first step's O is still 0: no rescale
    }
    c_to_a<T>(sw[0], pw[0]);
    if constexpr (kTwo) c_to_a<T>(sw[1], pw[1]);
  };
  // P.V of the walk's last piece (stages v0, v1; kTwo: both).
  auto last_pv = [&](auto two, Pos v0, Pos v1) {
    constexpr bool kTwo = decltype(two)::value;
    wait(full_v, v0);
    if constexpr (kTwo) wait(full_v, v1);
    fence_proxy_async();
    fence_regs(o);
    fence_regs(pw[0]);
    fence_regs(pw[1]);
    wgmma_fence();
    issue_pv(pw[0], v0.stage);
    if constexpr (kTwo) issue_pv(pw[1], v1.stage);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(o);
    release(empty_v, v0);
    if constexpr (kTwo) release(empty_v, v1);
  };
  constexpr std::true_type kBoth{};
  constexpr std::false_type kOne{}, kNoPV{};
  constexpr std::true_type kWithPV{};
  // The ldmatrix addresses derived here from an opaque copy of the lane, not hoisted out of the
  // tile loop and held (spilled) across every tile's walk.
  int lane_q = lane;
  asm volatile("" : "+r"(lane_q));
  load_q(lane_q);
  Pos a0 = at, a1 = at.next();
  bool two = t + 1 < own_end;
  if (two)
    step(kBoth, kNoPV, t, a0, a1, a0, a1);
  else
    step(kOne, kNoPV, t, a0, a1, a0, a1);
  while (two && t + 2 < own_end) {
    const int64_t tn = t + 2;
    const Pos n0 = a1.next(), n1 = n0.next();
    const bool two_n = tn + 1 < own_end;
    if (two_n)
      step(kBoth, kWithPV, tn, n0, n1, a0, a1);
    else
      step(kOne, kWithPV, tn, n0, n1, a0, a1);
    a0 = n0;
    a1 = n1;
    t = tn;
    two = two_n;
  }
  if (two)
    last_pv(kBoth, a0, a1);
  else
    last_pv(kOne, a0, a1);
  t += two ? 2 : 1;
  at = two ? a1.next() : a1;
}

// The walk a tile a step of fwd_ws_compute over the tiles [t, own_end) that its rows see (those of
// c's activity bits, `active`): S of a tile issued with P.V of the one before, its softmax under
// that P.V. On return t and at are past the walk. The stage waits and releases, Q's load, the
// turns, the products' issues and the softmax step are fwd_ws_compute's; S, P, O and the rescale
// factors its registers.
template <typename T, int D, typename Pos, typename Wait, typename Release, typename LoadQ, typename Turn,
          typename PassTurn, typename GemmS, typename GemmPV, typename SoftmaxTile>
__device__ inline void fwd_ws_walk(const FwdWsTile& c, ActiveTiles& active, int64_t& t, Pos& at, int64_t own_end,
                                   int lane, uint64_t* full_k, uint64_t* empty_k, uint64_t* full_v, uint64_t* empty_v,
                                   Wait& wait, Release& release, LoadQ& load_q, Turn& my_turn, PassTurn& pass_turn,
                                   GemmS& gemm_s, GemmPV& gemm_pv, SoftmaxTile& softmax_tile,
                                   float (&s)[kBlockN / 8][4], uint32_t (&pa)[kBlockN / 16][4], float (&o)[D / 8][4],
                                   float (&alpha)[2]) {
  load_q(lane);
  wait(full_k, at);
  // K / V rows (and Q) were written by cp.async (generic proxy) and are read by wgmma (async
  // proxy): the fence orders the two for this thread once the barriers say they have landed.
  fence_proxy_async();
  my_turn(true);
  gemm_s(at.stage);
  pass_turn(false);
  wgmma_wait<0>();
  fence_regs(s);
  softmax_tile(t, at.stage);  // O is still 0: no rescale
  release(empty_k, at);
  c_to_a<T>(s, pa);
  // Every wgmma issued in an iteration is waited for in it, and the loop exits before issuing;
  // the stage waits come before the first issue: ptxas serialises all wgmmas where one may still
  // be in flight across a branch (C7514 / C7515).
  for (;;) {
    const int64_t tn = c.next(active, t + 1);
    if (tn >= own_end) break;
    const Pos an = at.next();
    wait(full_k, an);
    wait(full_v, at);
    fence_proxy_async();
    my_turn(false);
    gemm_s(an.stage);
    gemm_pv(at.stage);
    pass_turn(false);
    wgmma_wait<1>();  // S of tile tn; P.V of tile t still runs
    fence_regs(s);
    softmax_tile(tn, an.stage);
    release(empty_k, an);
    wgmma_wait<0>();
    fence_regs(o);
    release(empty_v, at);
    rescale_o_if<D>(o, alpha);
    c_to_a<T>(s, pa);
    at = an;
    t = tn;
  }
  wait(full_v, at);
  fence_proxy_async();
  my_turn(false);
  gemm_pv(at.stage);
  pass_turn(true);
  wgmma_wait<0>();
  fence_regs(o);
  release(empty_v, at);
  at.advance();
  t = c.next(active, t + 1);
}

// Computing warpgroups 1 and 2 (wg 0 / 1): rows [64 wg, 64 wg + 64) of the CTA's tile over every
// stage in order, then (not idle) those rows out through Epilogue. A warpgroup whose rows see none
// of a tile (past its causal end, or past seqlen_q) only waits for the stage and releases it.
// kPersistent, the stage position `at_io` runs on from the CTA's previous tile, and Q is buffer qb
// in use qphase.
template <typename Mainloop, bool kPersistent, typename Epilogue>
__device__ inline void fwd_ws_compute(const FwdParams& p, const FwdFlags& f, const FwdSplit& sp, const FwdWsTile& c,
                                      unsigned char* smem, int wg, typename Mainloop::Pos& at_io, int qb = 0,
                                      uint32_t qphase = 0) {
  using T = typename Mainloop::T;
  constexpr int D = Mainloop::D;
  using Keys = typename Mainloop::Keys;
  using Config = typename Mainloop::Config;
  using L = typename Mainloop::Smem;
  constexpr int S = L::kStages;
  uint64_t* full_k = reinterpret_cast<uint64_t*>(smem + L::kBars);
  uint64_t *empty_k = full_k + S, *full_v = full_k + 2 * S, *empty_v = full_k + 3 * S;
  const T* sK = reinterpret_cast<const T*>(smem + L::kK);
  const T* sV = reinterpret_cast<const T*>(smem + L::kV);
  const uint8_t* sKeep = smem + L::kKeep;
  const T* sB = reinterpret_cast<const T*>(smem + L::kBias);
  const int tid = threadIdx.x - kThreads * (1 + wg);
  const int w = tid / 32, lane = tid % 32, g = lane / 4, qc = lane % 4;
  const int64_t mc = c.rows(wg), head = c.head(wg);
  const int half = c.pair ? 0 : wg;  // of the stages' mask / bias tiles
  const bool idle = mc >= c.seq.nq;

  const T* sQ = q_buffer<T, D>(smem, qb) + wg * L::kTileKV / 2;
  uint64_t* full_q = q_full<T, D>(smem, qb);
  // Persistent, every warpgroup waits for its Q, idle or not: a buffer is handed back only after
  // its copies have landed. With the staged setup the caller has waited for it (the setup lands
  // with Q).
  if constexpr (kPersistent && !Config::kStagedSetup) mbar_wait(full_q, qphase);

  // The rank rule's per-row terms of this thread's rows g, g + 8 (ListedKeys).
  int thr[2] = {-1, -1}, lim[2] = {0x7fffffff, 0x7fffffff};
  if constexpr (Config::kStagedSetup)
    Keys::row_terms_staged(p, c.seq, q_thr<T, D>(smem, qb), c.m0, mc, w, g, thr, lim);
  else
    Keys::row_terms(p, c.seq, head, mc, w, g, thr, lim);
  const int lim_warp = __shfl_sync(0xffffffffu, lim[0], 0);  // of the warp's first row (lane 0's g = 0)
  const int thr_warp = rank_thr_warp(thr);
  // The tiles this warpgroup's rows see (the others it only waits for and releases).
  const int64_t own_end = idle ? c.t_begin : Keys::own_end(p, c, mc);
  const bool has_bias = Keys::kBiasTiles && p.bias.ptr != nullptr, has_mask = Keys::kMask && p.mask.ptr != nullptr;
  const int bias_row_step = p.bias.row_stride != 0 ? kLdBias : 0;
  const int bias_row0 = p.bias.row_stride != 0 ? half * kBlockM + w * 16 + g : 0;
  const FwdScoreConsts sc(p);

  float o[D / 8][4], row_max[2], row_sum[2];
  softmax_init<D>(o, row_max, row_sum);
  float s[kBlockN / 8][4];
  uint32_t pa[kBlockN / 16][4];  // P as A fragments; read by the P.V wgmma until it is waited for
  float alpha[2];

  using Pos = RingPos<S>;
  auto wait = [&](uint64_t* full, Pos at) { mbar_wait(&full[at.stage], at.phase); };
  // Every thread arrives for its own reads of the stage (its release orders them before the
  // loader's next writes there), rather than one lane per warp after a __syncwarp: the loader
  // stores cut tiles' keep and bias bytes with plain stores, and compute-sanitizer's racecheck
  // counts a read of another lane as unordered with them.
  auto release = [&](uint64_t* empty, Pos at) { mbar_arrive(&empty[at.stage]); };
  // Descriptors built once and moved by constants (desc_advance): Q's, and stage 0's K and V.
  const uint64_t dq = desc_k_major<kBlockM>(sQ, 0);
  // Q as wgmma's A operand in registers (FwdWsConfig::kQInRegisters).
  constexpr bool kQRegs = Config::kQInRegisters;
  uint32_t qa[kQRegs ? D / 16 : 1][4];
  const uint64_t dk0 = desc_k_major<kBlockN>(sK, 0), dv0 = desc_mn_major<kBlockN>(sV, 0);
  // Before the walk's first product: Q has landed (one CTA a tile; persistent, waited for above),
  // and where the key source has room, into registers. ldmatrix x4's lanes 0-15 address rows 0-15
  // of the warp's 16 at columns kk * 16, lanes 16-31 the same rows 8 columns on: the A fragment's
  // four 8 x 8 blocks.
  // ln: this thread's lane.
  auto load_q = [&](int ln) {
    if constexpr (!kPersistent) mbar_wait(full_q, qphase);
    if constexpr (kQRegs) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const int r = w * 16 + (ln & 15), col = kk * 16 + (ln >> 4) * 8;
        ldmatrix_x4(qa[kk], sQ + sw128_offset(kBlockM, r, col) / 2);
      }
    }
  };
  // S = Q K^T into acc with Q from registers, and O += P V with P's A fragments a, of stage st:
  // the wgmmas alone (no fence, no commit), for the walks to group as they issue them.
  auto issue_s_rs = [&](float (&acc)[kBlockN / 8][4], int st) {
    const uint64_t dk = desc_advance(dk0, st * L::kTileKV);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_rs<T, kBlockN, 0>(acc, qa[kk], desc_advance(dk, k_major_offset<kBlockN>(kk)), kk > 0);
  };
  static_assert(D <= 128, "P.V is one wgmma of width D");
  auto issue_pv = [&](const uint32_t (&a)[kBlockN / 16][4], int st) {
    const uint64_t dv = desc_advance(dv0, st * L::kTileKV);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) wgmma_rs<T, D, 1>(o, a[kk], desc_advance(dv, kk * kMnMajorStep), 1);
  };
  // S = Q K^T of stage st (Q from registers or smem, K from smem), issued and left in flight.
  auto gemm_s = [&](int st) {
    const uint64_t dk = desc_advance(dk0, st * L::kTileKV);
#pragma unroll
    for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
    fence_regs(s);
    if constexpr (kQRegs) {
      fence_regs(qa);
      wgmma_fence();
      issue_s_rs(s, st);
    } else {
      // Opaque here, so that Q's eight descriptors are built in the loop (eight adds) rather than
      // hoisted out of it into sixteen registers the computing warps do not have.
      uint64_t dqh = dq;
      asm volatile("" : "+l"(dqh));
      wgmma_fence();
      wgmma_ss64_k_major<T, D, kBlockM, kBlockN>(s, dqh, dk);
    }
    wgmma_commit();
  };
  // O += P V of stage st, issued and left in flight (one wgmma of width D per 16 keys).
  auto gemm_pv = [&](int st) {
    fence_regs(o);
    fence_regs(pa);
    wgmma_fence();
    issue_pv(pa, st);
    wgmma_commit();
  };
  // Scale, bias and drop rule on the scores acc of key tile t in stage st; the scale still to apply
  // (fwd_scores').
  const int64_t keys_full = full_keys(p, c.seq.nq, c.seq.nk, mc);
  auto scores = [&](float (&acc)[kBlockN / 8][4], int64_t t, int st) {
    const uint8_t* keep = has_mask ? sKeep + st * L::kKeepSlot + half * kBlockM * kLdKeep : nullptr;
    const T* sb = has_bias ? sB + st * (L::kBiasSlot / 2) + bias_row0 * kLdBias : nullptr;
    const int32_t* slot = reinterpret_cast<const int32_t*>(sKeep + st * L::kKeepSlot);
    const int64_t n0 = t * kBlockN;
    return fwd_scores<Keys::kRankRule, T>(acc, sc, p, c.seq, mc, n0, n0 + kBlockN <= keys_full, sb, bias_row_step, keep,
                                          slot, thr, lim, lim_warp, thr_warp, w * 16 + g, qc);
  };
  // The same on S, then the softmax step.
  auto softmax_tile = [&](int64_t t, int st) { softmax_step(s, row_max, row_sum, alpha, scores(s, t, st)); };

  // The walk 128 keys a step (kWidePieces): fwd_ws_walk_wide.

  // Paired, the warpgroups take turns to issue (ping-pong), warpgroup 0 first. Both walk the same
  // tiles, so each issue's wait for this warpgroup's turn meets one hand-over from the other:
  // warpgroup 0 does not wait before its first issue, warpgroup 1 hands nothing on after its last.
  const bool turns = c.pair && !has_mask && !has_bias;
  auto my_turn = [&](bool first) { named_barrier_if(turns && !(first && wg == 0), turn_barrier(wg), 2 * kThreads); };
  auto pass_turn = [&](bool last) {
    named_barrier_arrive_if(turns && !(last && wg == 1), turn_barrier(1 - wg), 2 * kThreads);
  };

  ActiveTiles active = c.active();
  Pos at = at_io;  // the stages of tile t
  int64_t t = c.next(active, c.t_begin);
  if constexpr (Config::kWidePieces) {
    if (t < own_end)
      fwd_ws_walk_wide<T, D>(t, at, own_end, lane, full_k, empty_k, full_v, empty_v, wait, release, load_q, issue_s_rs,
                             issue_pv, scores, qa, o, row_max, row_sum, alpha);
  } else if (t < own_end) {
    fwd_ws_walk<T, D>(c, active, t, at, own_end, lane, full_k, empty_k, full_v, empty_v, wait, release, load_q, my_turn,
                      pass_turn, gemm_s, gemm_pv, softmax_tile, s, pa, o, alpha);
  }
  for (; t < c.n_end; t = c.next(active, t + 1), at.advance()) {
    wait(full_k, at);
    release(empty_k, at);
    wait(full_v, at);
    release(empty_v, at);
  }
  at_io = at;
  if (!idle) {
    // This warpgroup's Q tile stages its output rows: every product that read it has completed,
    // and Q has landed (one CTA a tile, a warpgroup with no tile to walk has not waited for it
    // yet; its copies must not land on the staged rows).
    if constexpr (!kPersistent) mbar_wait(full_q, qphase);
    T* stage = q_buffer<T, D>(smem, qb) + wg * L::kTileKV / 2;
    // The warp's ldmatrix reads of its Q rows (kQInRegisters) ordered before the epilogue's writes
    // over them by a warp barrier, the ordering compute-sanitizer's racecheck recognises (their
    // registers were consumed by the walk's wgmmas long before).
    if constexpr (kQRegs) __syncwarp();
    // Dense packed: the sequence's offsets are read again here rather than held in registers
    // across the walk (the per-key kernel has the registers).
    const SeqInfo seq = Keys::kRankRule ? c.seq : SeqInfo::of<Keys::kPacked>(p, c.b);
    Epilogue::template store<kPersistent>(p, f, sp, o, row_max, row_sum, seq, head, mc, tid, stage, c.split);
  }
}

}  // namespace cuda
}  // namespace flexdma
