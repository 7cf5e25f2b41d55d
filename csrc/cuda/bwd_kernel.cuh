// Backward, one pass (FlashAttention-3's structure on FlashAttention-2's register tiles): one CTA
// per (key tile, kv head, batch), warp w owns keys [16w, 16w + 16); it walks the query tiles and,
// inside each, the query heads of its kv head in a fixed order, with S^T = K Q^T and dP^T = V dO^T,
// dV += P^T dO, dK += dS^T Q in registers, and dQ += dS K added into a float buffer per query tile
// (bwd_dq_accum.cuh; bwd_post_kernel converts it); each row's delta and lse come from bwd_pre_kernel.
// dS of the heads that share a dbias plane is summed in a float smem tile and written once per
// query tile (fixed order, so bitwise reproducible; bwd_dbias.cuh): a float read-modify-write per
// head would dominate the dbias traffic, and a tile written once can go straight to the bias dtype
// (16-byte stores). Heads that read one bias / mask plane share one copy and gather of it per
// query tile. Q, dO, K, V tiles sit in smem, 128-byte swizzled and read by wgmma (sm_90a, head
// dims 64 / 128 / 192 / 256) or padded to D + 8 and read by ldmatrix (head dims 32 / 96); S, dP
// and dS live in C fragments (wgmma's or mma.sync's, the same per-warp layout). An all-false keep
// tile (mask & causal & bounds) is skipped by the tile activity bits before any of its operand
// bytes are requested; the next kept item is found (its keep tile requested or built) while the
// current item's copies fly. Mask / bias are resolved once per work item (Plane, 32-bit head
// division). The kernel body is the walk over the work items, each item a sequence of the named
// steps below (its copies, S^T and P^T with the gather of the additive terms, dV, dS^T, dK and
// dQ, the deterministic turn); the pieces by role are bwd_mainloop.cuh (the walk's activity bits
// and next item, P^T), bwd_dq_accum.cuh (dQ, the deterministic turns), bwd_dbias.cuh (dbias flush
// and zeroing) and bwd_epilogue.cuh (dK / dV out).
#pragma once
#include <math_constants.h>

#include "../flash_dma_params.h"
#include "bwd_dbias.cuh"
#include "bwd_dq_accum.cuh"
#include "bwd_epilogue.cuh"
#include "bwd_mainloop.cuh"
#include "fwd_key_source.cuh"
#include "constants.cuh"
#include "copy.cuh"
#include "gemm.cuh"
#include "mask.cuh"
#include "mma_sm80.cuh"
#include "mma_sm90.cuh"
#include "seq_info.cuh"
#include "smem_layout.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"

namespace flexdma {
namespace cuda {

// The CTA's first copies, one commit group: its key tile's K rows and (a pass that computes dK)
// its V rows.
template <typename T, int D, bool kDk>
__device__ __forceinline__ void bwd_issue_kv(const BwdParams& p, const BwdFlags& f, const SeqInfo& seq, T* sK, T* sV,
                                             int kvh, int n0) {
  issue_keys<T, D>(sK, static_cast<const T*>(p.k) + seq.k_offset(p) + kvh * p.k_head_stride, p.k_row_stride, n0, seq.nk,
                   f.qkv_vec);
  if constexpr (kDk)
    issue_keys<T, D>(sV, static_cast<const T*>(p.v) + seq.v_offset(p) + kvh * p.v_head_stride, p.v_row_stride, n0,
                     seq.nk, f.qkv_vec);
  cp_async_commit();
}

// The dK / dV accumulators cleared (a pass without one holds a one-row stub).
template <int kDkRows, int kDvRows>
__device__ __forceinline__ void bwd_zero_acc(float (&dk)[kDkRows][4], float (&dv)[kDvRows][4]) {
  constexpr int kRows = kDkRows > kDvRows ? kDkRows : kDvRows;
#pragma unroll
  for (int d = 0; d < kRows; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (d < kDkRows) dk[d][e] = 0.f;
      if (d < kDvRows) dv[d][e] = 0.f;
    }
}

// The activity bit of work item (mt, gq) in the walk's order: kMetaItems items' bits at a time in
// smem (sMeta, bwd_meta_chunk; meta_base the chunk's first item, -1 before the first), so that
// skipping an empty item costs a shared load instead of a global round trip. 32-bit item
// arithmetic: a 64-bit division compiles to a call, and the kernel is at its register limit.
// Block-uniform (the chunk's load is between barriers).
template <int kMetaItems>
__device__ __forceinline__ bool bwd_item_active(const BwdParams& p, uint32_t* sMeta, int& meta_base, int b, int kvh,
                                                int ratio, int n_tile, int mt_begin, int m_tiles, int mt, int gq) {
  const int item = (mt - mt_begin) * ratio + gq, base = item & ~(kMetaItems - 1);
  if (base != meta_base) {
    __syncthreads();  // the previous chunk is no longer read
    meta_base = base;
    bwd_meta_chunk(p, sMeta, b, kvh, ratio, n_tile, mt_begin, m_tiles, base);
    __syncthreads();
  }
  return (sMeta[(item - base) >> 5] >> ((item - base) & 31)) & 1u;
}

// The steps of one work item (query tile mt, query head h) of bwd_kernel's walk, in their order:
// bwd_issue_item, bwd_scores (with bwd_gather_terms), dV and dS^T (in the kernel), bwd_dk_dq,
// bwd_turn_done. Forced inline: they work on the kernel's register arrays (S^T, dP^T, dK, dV),
// which a call would move to local memory.

// The item's copies, one commit group: its Q tile (unless the previous item requested it early,
// load_q false), dO, its bias tile (unless it reuses the previous item's gathered terms) and its
// rows' lse2 and delta (16 bytes a thread).
template <typename T, int D, typename IssueQ>
__device__ __forceinline__ void bwd_issue_item(const BwdParams& p, const BwdFlags& f, const DqAccum& dqa,
                                               const SeqInfo& seq, T* sDO, T* sB, float* sL2, float* sDelta, int b,
                                               int h, int mt, int gq, int n0, bool load_q, bool load_bias,
                                               IssueQ&& issue_q) {
  const Plane<T, int> bias = Plane<T, int>(p.bias, b, h).from(seq.q0, seq.k0);
  const T* dop = static_cast<const T*>(p.dout) + seq.do_offset(p) + h * p.do_head_stride;
  const int64_t m0 = mt * kBlockM;
  const TileBounds tb(p, seq, m0, n0);
  if (load_q) issue_q(mt, gq);
  issue_rows<T, D>(sDO, dop + m0 * p.do_row_stride, p.do_row_stride, tb.lim_r, f.qkv_vec);
  if (load_bias) issue_bias<false>(tb, bias, sB, seq.vec16<T>(p.bias, f.bias_vec), m0, n0);
  if (threadIdx.x < 2 * kBlockM / 4) {
    const int half = threadIdx.x / (kBlockM / 4), c = threadIdx.x % (kBlockM / 4);
    cp_async16((half ? sDelta : sL2) + 4 * c, (half ? dqa.delta : dqa.lse2) + dqa.tile(seq, h, mt) * kBlockM + 4 * c);
  }
  cp_async_commit();
}

// The additive part of each transposed score in log2 units (bias - lse, or -inf where dropped),
// gathered from the [query][key] bias / keep tiles into sDS, so that the element loop after the
// GEMMs reads one float2 per pair instead of four scattered scalars (whose hoisted loads cost the
// registers that dK / dV need). sB overlays sDS's upper half (keys 32..63): keys 0..31 are written
// first, then keys 32..63 from values read before a barrier. Lane = key, warp w = 16 queries: the
// bias / keep reads are consecutive bytes of one row. Ends at a barrier (sDS is read across warps).
template <typename T>
__device__ __forceinline__ void bwd_gather_terms(float* sDS, const T* sB, const uint8_t* keep, bool has_bias,
                                                 bool use_keep, int w, int lane) {
  const uint16_t* sBh = reinterpret_cast<const uint16_t*>(sB);
  const int key0 = lane, c0 = w * 16;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = key0 + 32 * half;
    uint32_t bv[8];
    if (has_bias) {
#pragma unroll
      for (int j = 0; j < 8; ++j)
        bv[j] = uint32_t(sBh[(c0 + 2 * j) * kLdBias + key]) | (uint32_t(sBh[(c0 + 2 * j + 1) * kLdBias + key]) << 16);
      if (half == 1) __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float a[4] = {0.f, 0.f, 0.f, 0.f};
      if (has_bias) {
        const float2 b0 = unpack2<T>(bv[2 * j]), b1 = unpack2<T>(bv[2 * j + 1]);
        a[0] = fmaf(b0.x, kLog2eF, a[0]);
        a[1] = fmaf(b0.y, kLog2eF, a[1]);
        a[2] = fmaf(b1.x, kLog2eF, a[2]);
        a[3] = fmaf(b1.y, kLog2eF, a[3]);
      }
      if (use_keep) {
#pragma unroll
        for (int e = 0; e < 4; ++e) a[e] = keep[(c0 + 4 * j + e) * kLdKeep + key] ? a[e] : -CUDART_INF_F;
      }
      *reinterpret_cast<float4*>(sDS + key * kLdDS + c0 + 4 * j) = make_float4(a[0], a[1], a[2], a[3]);
    }
  }
  __syncthreads();
}

// S^T = K Q^T, then P^T in its place (bwd_probs). On wgmma the product runs while the block
// gathers the additive terms (gather; the product reads only the K / Q tiles, the gather only
// bias, keep and lse); dP^T too would spill at D = 128.
template <typename T, int D, typename Gather>
__device__ __forceinline__ void bwd_scores(float (&s)[kBlockN / 8][4], const T* sK, const T* sQ, float* sDS,
                                           const float* sL2, float mulf, float scf, float soc, int w, int g, int qc,
                                           Gather&& gather) {
  constexpr bool kWg = use_wgmma<D>();
  if constexpr (kWg) gemm_nt<T, D, false>(s, sK, sQ, w * 16);
  gather();
  if constexpr (kWg) {
    wgmma_wait<0>();
    fence_regs(s);
  } else {
    gemm_nt<T, D>(s, sK, sQ, w * 16);
  }
  bwd_probs(s, sDS, sL2, mulf, scf, soc, w, g, qc);
}

// dK += dS^T Q and dQ += dS K for item (mt, query head h) into dQ's float buffer (dqa). dS
// goes to smem over the dO tile, which dP^T read last (every warp's reads end at the first
// barrier); after it, thread 0 moves the dbias zeroing's position (dbias_passed). In the
// deterministic mode thread 0 waits for this key tile's turn at the dQ tile before the
// additions. Once every warp's dK product has read Q (the second barrier) the next item's Q tile
// (next: there is one, (mt_n, gq_n)) is requested, its copy flying during dQ and the dbias flush
// instead of on the next item's critical path.
template <typename T, int D, int kDkRows, typename DbiasPassed, typename IssueQ>
__device__ __forceinline__ void bwd_dk_dq(float (&dk)[kDkRows][4], float (&dp)[kBlockN / 8][4], T* sDO, const T* sQ,
                                          const T* sK, const DqAccum& dqa, const SeqInfo& seq, int h, int mt,
                                          int n_tile, bool det, int w, DbiasPassed&& dbias_passed, bool next, int mt_n,
                                          int gq_n, IssueQ&& issue_q) {
  T* sDst = sDO;
  __syncthreads();
  dbias_passed();
  stage_ds<T, D>(sDst, dp, w * 16);
  gemm_pv<T, D>(dk, dp, sQ);
  if (det && threadIdx.x == 0) dq_wait_turn(dqa.turn + dqa.tile(seq, h, mt), n_tile);
  __syncthreads();
  if (next) {
    issue_q(mt_n, gq_n);
    cp_async_commit();
  }
  add_dq_tile<T, D>(dqa.ptr + dqa.tile(seq, h, mt) * (kBlockM * D), sDst, sK);
}

// Deterministic dQ, after the item's last barrier: thread 0 hands the item's dQ tile (turn) on to
// the next key tile, the CTA's additions ordered before by the barrier and published first, and
// moves the position (pass[0..1]) past the item (mt, gq).
__device__ __forceinline__ void bwd_turn_done(int* turn, int* pass, int mt, int gq, int ratio, int n_tile) {
  if (threadIdx.x == 0) {
    __threadfence();
    dq_pass_turn(turn, n_tile + 1);
    pass[0] = gq + 1 == ratio ? mt + 1 : mt;
    pass[1] = gq + 1 == ratio ? 0 : gq + 1;
  }
}

// kPart 0: dK, dV, dQ and dbias in one pass. Wider heads than 128 cannot hold both accumulators
// (D floats a thread next to S^T and dP^T) and run the kernel twice over the same work items:
// kPart 1 accumulates dV (no V, dP^T or dS), kPart 2 dK, dQ and dbias. Keys: the key source,
// SequenceKeys or PackedSequenceKeys (packed sequences, BwdParams::cu_seqlens_q: a kernel of its
// own so that the padded one holds no sequence offsets in its registers). Scheduler: which (key
// tile, kv head, batch) a CTA takes (KeyTileScheduler).
template <typename T, int D, int kPart, typename Keys, typename Scheduler>
__global__ void __launch_bounds__(kThreads, D <= 128 ? 2 : 1)
    bwd_kernel(const BwdParams p, const BwdDbias dbias, const BwdFlags f, const DqAccum dqa) {
  constexpr bool kPacked = Keys::kPacked;
  constexpr bool kDv = kPart != 2, kDk = kPart != 1;
  static_assert(kPart == 0 || D > 128, "narrow heads take both accumulators in one pass");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  constexpr bool kWg = use_wgmma<D>();
  unsigned char* smem = smem_raw + smem_align_pad<kWg>(smem_raw);
  using L = BwdSmem<T, D>;
  T* sK = reinterpret_cast<T*>(smem + L::kK);
  T* sV = reinterpret_cast<T*>(smem + L::kV);
  T* sQ = reinterpret_cast<T*>(smem + L::kQ);
  T* sDO = reinterpret_cast<T*>(smem + L::kDO);
  T* sB = reinterpret_cast<T*>(smem + L::kBias);
  uint8_t* sKeep = smem + L::kKeep;
  float* sL2 = reinterpret_cast<float*>(smem + L::kL2);
  float* sDelta = reinterpret_cast<float*>(smem + L::kDelta);
  float* sDS = reinterpret_cast<float*>(smem + L::kDS);
  float* sDB = reinterpret_cast<float*>(smem + L::kDB);

  const typename Scheduler::Tile tile = Scheduler::get();
  const int n_tile = tile.n_tile, kvh = tile.kvh, b = tile.b;
  const int n0 = n_tile * kBlockN;
  // Packed sequences: the key tiles past a sequence's keys have nothing to do.
  const SeqInfo seq = SeqInfo::of<kPacked>(p, b);
  if (kPacked && n0 >= seq.nk) return;
  const int ratio = (int)(p.num_heads / p.num_heads_k);
  const int vc = (int)imin(kBlockN, seq.len_k(p) - n0);
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, qc = lane % 4;

  bwd_issue_kv<T, D, kDk>(p, f, seq, sK, sV, kvh, n0);

  // Packed sequences take no mask (unsupported_reason): compiled out of their kernel.
  const bool has_bias = p.bias.ptr != nullptr, has_mask = !kPacked && p.mask.ptr != nullptr;
  const bool want_db = kDk && dbias.ptr != nullptr;
  const ScoreScale sc(p);
  const float scf = sc.softcap_on, mulf = sc.mul, soc = sc.over_cap;

  constexpr int kDkRows = kDk ? D / 8 : 1, kDvRows = kDv ? D / 8 : 1;  // a pass without one keeps a stub
  float dk[kDkRows][4], dv[kDvRows][4];
  bwd_zero_acc(dk, dv);

  // Causal: the first query row that sees key n0 is n0 - (K - Q).
  int64_t m_first = 0;
  if (p.is_causal) m_first = imax(0, n0 - (seq.len_k(p) - seq.len_q(p)));
  const int m_tiles = (int)ceil_div(seq.len_q(p), kBlockM);
  const Broadcast4d& DL = dbias.layout;
  const int mt_begin = (int)(m_first / kBlockM);
  // Work items (query tile mt, query head gq) in a fixed order, heads inner: the heads sharing a
  // dbias plane follow each other, so their dS sums in smem. find_next advances to the first
  // kept one at or after (mt, gq), its keep tile built into `slot`; false when none is left.
  // Activity bits of this key tile's column for the work items in order (bwd_item_active).
  uint32_t* sMeta = reinterpret_cast<uint32_t*>(smem + L::kMeta);
  int meta_base = -1;
  auto item_active = [&](int mt, int gq) -> bool {
    return bwd_item_active<L::kMetaItems>(p, sMeta, meta_base, b, kvh, ratio, n_tile, mt_begin, m_tiles, mt, gq);
  };
  // Where all query heads of this kv head read one bias plane and one mask plane, an item of the
  // query tile gathered last takes that gather's sDS (bias and keep in log2 units; lse is applied
  // in the P^T loop) instead of copying and gathering its own. Not under softcap, whose
  // derivative overwrites sDS. find_next returns such an item without touching a keep slot: the
  // next item reuses iff it is in the same query tile. (Recomputed from the kernel parameters
  // where used: kept in a register it spilled.)
  auto group_shares = [&] {
    return p.softcap <= 0.f && (!p.bias.ptr || p.bias.head_stride == 0 || p.bias.head_ratio % ratio == 0) &&
           (!p.mask.ptr || p.mask.head_stride == 0 || p.mask.head_ratio % ratio == 0);
  };
  int reuse_mt = -1;  // the query tile whose gathered sDS is there to reuse (-1: none)
  auto find_next = [&](int& mt, int& gq, uint8_t* slot) -> bool {
    return bwd_find_next(p, f, seq, kvh, ratio, m_tiles, n0, reuse_mt, has_mask, item_active, mt, gq, slot);
  };
  // dbias plane of query head gq (heads of one plane are consecutive in gq).
  auto db_plane = [&](int gq_) -> int {
    return DL.head_stride == 0 ? 0 : (int)(kvh * ratio + gq_) / (int)DL.head_ratio;
  };
  int gq = 0, mt = mt_begin;
  int slot = 0;
  bool first = true;  // first head of this (query tile, dbias plane): sDB starts from its dS
  bool have = find_next(mt, gq, sKeep);
  // Positions of the walk kept in smem by thread 0: pass[0..1] the deterministic mode's
  // (query tile, head in group), pass[2..3] the dbias zeroing's (query tile, plane in group).
  const bool det = kDk && p.deterministic;
  int* pass = reinterpret_cast<int*>(smem + L::kPass);
  if (det && threadIdx.x == 0) pass[0] = mt_begin, pass[1] = 0;
  // A dbias in the bias dtype comes unfilled: the tiles of this key column that no processed item
  // flushes are zeroed as the walk passes them, (query tile, dbias plane of the group) in order
  // from (0, 0) (the causally unseen query tiles first); the position is in pass[2..3], moved
  // by thread 0 (after a barrier that ends every thread's read of it).
  if (kDk && dbias.in_dtype && threadIdx.x == 0) pass[2] = 0, pass[3] = 0;
  auto group_plane = [&](int gq_) { return DL.head_stride == 0 ? 0 : gq_ / (int)DL.head_ratio; };
  auto group_planes = [&] { return DL.head_stride == 0 ? 1 : (int)imax(1, ratio / (int)DL.head_ratio); };
  auto zero_until = [&](int mt_e, int pl_e) {
    zero_dbias_until<T>(dbias, pass + 2, mt_e, pl_e, seq, kvh, ratio, n0, vc);
  };
  // Thread 0 moves the zeroing's position past the plane tile of item (mt_, gq_), which it flushes.
  auto zero_passed = [&](int mt_, int gq_) {
    if (dbias.in_dtype && threadIdx.x == 0) {
      const int pl = group_plane(gq_);
      pass[2] = pl + 1 == group_planes() ? mt_ + 1 : mt_;
      pass[3] = pl + 1 == group_planes() ? 0 : pl + 1;
    }
  };
  // Deterministic dQ (bwd_dq_accum.cuh): thread 0 hands on the turn of every item from its
  // position up to, not including, (mt_e, gq_e): those keep nothing of this key tile.
  auto pass_until = [&](int mt_e, int gq_e) { dq_pass_until(dqa, pass, mt_e, gq_e, seq, kvh, ratio, n_tile); };
  if (det) pass_until(have ? mt : m_tiles, have ? gq : 0);
  bool reuse = false;    // this item takes the previous item's sDS
  bool q_ready = false;  // this item's Q tile was requested during the previous item
  // The Q tile of item (mt_, gq_).
  auto issue_q = [&](int mt_, int gq_) {
    const int64_t m0 = mt_ * kBlockM;
    const T* qp = static_cast<const T*>(p.q) + seq.q_offset(p) + (kvh * ratio + gq_) * p.q_head_stride;
    issue_rows<T, D>(sQ, qp + m0 * p.q_row_stride, p.q_row_stride, (int)imin(kBlockM, seq.nq - m0), f.qkv_vec);
  };
#pragma unroll 1
  while (have) {
    bwd_issue_item<T, D>(p, f, dqa, seq, sDO, sB, sL2, sDelta, b, kvh * ratio + gq, mt, gq, n0, !q_ready,
                         has_bias && !reuse, issue_q);
    // The next kept item is found (its mask bytes read) while this item's copies fly.
    int gq_n = gq + 1, mt_n = mt;
    reuse_mt = group_shares() ? mt : -1;  // this item's sDS (gathered or reused) serves the next
    const bool have_n = find_next(mt_n, gq_n, sKeep + (slot ^ 1) * L::kKeepSlot);
    // Last head of this plane in this query tile: the summed tile goes out now.
    const bool flush = !have_n || mt_n != mt || db_plane(gq_n) != db_plane(gq);
    cp_async_wait<0>();
    if constexpr (kWg) fence_proxy_async();
    __syncthreads();
    if (kDk && dbias.in_dtype) zero_until(mt, group_plane(gq));
    const int h = kvh * ratio + gq;
    const int64_t m0 = mt * kBlockM;
    const TileBounds tb(p, seq, m0, n0);
    const bool use_keep = has_mask || !tb.full;
    const uint8_t* keep = sKeep + slot * L::kKeepSlot;
    float s[kBlockN / 8][4];  // S^T, then P^T: rows = this warp's 16 keys, columns = the tile's 64 queries
    bwd_scores<T, D>(s, sK, sQ, sDS, sL2, mulf, scf, soc, w, g, qc, [&] {
      if (!reuse) bwd_gather_terms<T>(sDS, sB, keep, has_bias, use_keep, w, lane);
    });
    if constexpr (kDv) gemm_pv<T, D>(dv, s, sDO);
    if constexpr (kDk) {
      float dp[kBlockN / 8][4];
      gemm_nt<T, D>(dp, sV, sDO, w * 16);
      // dS^T = P^T (dP^T - delta) in place of dP^T, times the softcap derivative that bwd_probs left
      // in sDS; the undifferentiated dS^T summed into sDB for dbias. Written here, not as a step
      // function: as one, ptxas takes a register more for the packed kernel at D = 64.
#pragma unroll
      for (int n = 0; n < kBlockN / 8; ++n) {
        const int c = n * 8 + 2 * qc;  // query
        const float2 dc = *reinterpret_cast<const float2*>(sDelta + c);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = w * 16 + g + 8 * hh;  // key
          float2* slot = reinterpret_cast<float2*>(sDS + r * kLdDS + c);
          const float2 der = scf != 0.f ? *slot : make_float2(1.f, 1.f);
          const float ds0 = s[n][2 * hh] * (dp[n][2 * hh] - dc.x);
          const float ds1 = s[n][2 * hh + 1] * (dp[n][2 * hh + 1] - dc.y);
          if (want_db) {  // this thread's own sDB slots in every head: no hazard
            float2* a = reinterpret_cast<float2*>(sDB + db_idx(r, c));
            if (first) {
              *a = make_float2(ds0, ds1);
            } else {
              const float2 o = *a;
              *a = make_float2(o.x + ds0, o.y + ds1);
            }
          }
          dp[n][2 * hh] = ds0 * der.x;
          dp[n][2 * hh + 1] = ds1 * der.y;
        }
      }
      bwd_dk_dq<T, D>(
          dk, dp, sDO, sQ, sK, dqa, seq, h, mt, n_tile, det, w, [&] { zero_passed(mt, gq); }, have_n, mt_n, gq_n,
          issue_q);
      if (want_db && flush) flush_dbias_tile<T>(dbias, sDB, sL2, seq, h, m0, n0, tb.lim_r, tb.lim_c);
    }
    __syncthreads();  // Q / dO / bias / sDS / sDB and this keep slot are free for the next item
    if (det) {
      bwd_turn_done(dqa.turn + dqa.tile(seq, h, mt), pass, mt, gq, ratio, n_tile);
      pass_until(have_n ? mt_n : m_tiles, have_n ? gq_n : 0);
    }
    reuse = have_n && mt_n == mt && group_shares();
    q_ready = kDk && have_n;
    first = flush;
    gq = gq_n;
    mt = mt_n;
    have = have_n;
    slot ^= 1;
  }
  if (kDk && dbias.in_dtype) {
    __syncthreads();  // the last item's move of the position (or its start) is seen
    zero_until(m_tiles, 0);
  }
  cp_async_wait<0>();
  bwd_epilogue<T, D, kDk, kDv>(p, seq, kvh, n0, dk, dv, w * 16, vc);
}

}  // namespace cuda
}  // namespace flexdma
