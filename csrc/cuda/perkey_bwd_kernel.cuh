// Per-key backward, warp-specialized (sm_90a, the per-key forward's head dims: perkey_bwd_built):
// one CTA of three warpgroups per (128-row query tile, head, batch), from the tile scheduler,
// walking the query tile's key list (the key source Keys: ListedKeys, the forward's) in 64-entry
// pieces.
//   warpgroup 0 loads: Q and dO of the tile once, then each piece's gathered K and V rows with its
//     slot (key indices, ranks, biases) into a ring of stages, as the forward's loader does;
//   warpgroups 1 and 2 own rows [0, 64) and [64, 128): S = Q K^T and dP = dO V^T (both operands in
//     smem), P and dS in registers, dQ += dS K in registers for the whole walk (the CTA owns its
//     rows' dQ: no dQ reduction at all), and P / dS staged in smem. Then the piece's dV = P^T dO
//     (warpgroup 1) and dK = dS^T Q (warpgroup 2) over all 128 rows, each added to a float
//     accumulator per (batch, key, kv head) with 16-byte vector reductions.
// Why this ownership (query-major): the rows of a query tile share one list of at most W + 127
// keys, so its products are dense tiles; the key-major alternative covers 1.3-4x the listed pairs
// (benchmarks/perf-log.md, 'Measured on the CPU: how the backward should own dK / dV'). What
// query-major pays is the dK / dV reduction, one float row per list entry and 128 rows; it halves
// with every doubling of the rows that share a list.
// dbias (a per-key bias) is the column sum of dS, reduced over each warp's 16 rows by shuffles,
// over the eight warps in smem, and added once per key. The float accumulators are zeroed before
// and cast after the kernel (the op).
#pragma once
#include <math_constants.h>

#include "../flash_dma_params.h"
#include "bwd_dq_accum.cuh"  // red_add4
#include "constants.cuh"
#include "copy.cuh"
#include "fwd_key_source.cuh"
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

constexpr int kPerkeyBwdThreads = 3 * kThreads;
// Registers after the hand-over (setmaxnreg, within the launch's 384 x 168): the computing warps
// hold dQ (D / 2), S and dP (32 each) and then a piece's dK or dV (D / 2); the loader's gathers
// need few.
constexpr int kBwdLoadRegs = 72, kBwdComputeRegs = 216;
static_assert(kThreads * kBwdLoadRegs + 2 * kThreads * kBwdComputeRegs <=
                  kPerkeyBwdThreads * (65536 / kPerkeyBwdThreads / 8 * 8),
              "setmaxnreg cannot hand out more registers than the CTA was launched with");

template <typename T, int D>
struct PerkeyBwdSmem {
  static constexpr int kStages = 2;
  static constexpr int kTileKV = tile_bytes<D>();                  // 64 rows x D, swizzled
  static constexpr int kKeepSlot = KeyList<T, D>::kSlotWords * 4;  // a stage's slot (ListedKeys' name)
  static constexpr int kPTile = kBlockM * kBlockN * 2;             // 64 rows x 64 keys, swizzled
  static constexpr int kBars = 0;   // full / empty barriers of the K and the V stages, then Q / dO's
  static constexpr int kIdx = 256;  // the loader's index ring: 4 pieces of 64 words
  static constexpr int kSlot = kIdx + 4 * 256;
  static constexpr int kQ = (kSlot + kStages * kKeepSlot + 1023) / 1024 * 1024;  // two 64-row tiles
  static constexpr int kDO = kQ + 2 * kTileKV;                                   // two 64-row tiles
  static constexpr int kK = kDO + 2 * kTileKV;
  static constexpr int kV = kK + kStages * kTileKV;
  static constexpr int kP = kV + kStages * kTileKV;  // two buffers x two 64-row halves
  static constexpr int kDS = kP + 4 * kPTile;        // the same for dS
  // dbias: each warp's column sums of a piece, two buffers x 8 warps x 64 keys (float).
  static constexpr int kDB = kDS + 4 * kPTile;
  // The piece product's reduction staging: a warp's 16 accumulator rows x 32 floats (one 128-byte
  // line of each row), 16-byte units XOR-swizzled by the row, for each of the eight warps.
  static constexpr int kRedStage = kDB + 2 * 8 * kBlockN * 4;
  static constexpr int kRedWarpFloats = 16 * 32;
  static constexpr int kBytes = kRedStage + 8 * kRedWarpFloats * 4 + 1024;  // + room to align the base to 1024
  static_assert(kBytes <= kMaxSmemPerBlock, "per-key backward smem layout too large");
  static_assert((4 * kStages + 1) * 8 <= kIdx, "barriers must fit before the index ring");
};

// Byte offset in a 64-row P / dS half (128-byte swizzled, sw128_offset) of element (row 16 w + g,
// key 2 qc) of a computing warp's fragment. Its other elements are at (offset ^ (n << 4)) + 1024 hh
// (key 8 n + 2 qc, row + 8 hh): the swizzle XORs the row's low three bits (g) into the 16-byte
// unit, so one XOR a unit replaces each element's sw128_offset.
__host__ __device__ constexpr int p_offset0(int w, int g, int qc) { return 128 * (16 * w + g) + 16 * g + 4 * qc; }
constexpr bool p_offsets_match() {
  for (int w = 0; w < 4; ++w)
    for (int g = 0; g < 8; ++g)
      for (int qc = 0; qc < 4; ++qc)
        for (int n = 0; n < kBlockN / 8; ++n)
          for (int hh = 0; hh < 2; ++hh)
            if (((p_offset0(w, g, qc) ^ (n << 4)) + 1024 * hh) !=
                sw128_offset(kBlockM, 16 * w + g + 8 * hh, 8 * n + 2 * qc))
              return false;
  return true;
}
static_assert(p_offsets_match(), "p_offset0's XOR form must be sw128_offset");

// What the warpgroups of a CTA derive alike (the key source reads b, h, kvh, m0 and sets list).
struct PerkeyBwdTile {
  int64_t b, h, kvh, m0;
  SeqInfo seq;  // batch b's rows (padded, or a packed sequence's)
  const int32_t* list;
};

template <typename T, int D, typename Keys>
__device__ inline void perkey_bwd_load(const BwdParams& p, const PerkeyBwdTile& c, int64_t n_pieces,
                                       unsigned char* smem) {
  using L = PerkeyBwdSmem<T, D>;
  constexpr int S = L::kStages;
  uint64_t* full_k = reinterpret_cast<uint64_t*>(smem + L::kBars);
  uint64_t *empty_k = full_k + S, *full_v = full_k + 2 * S, *empty_v = full_k + 3 * S, *full_q = full_k + 4 * S;
  T* sK = reinterpret_cast<T*>(smem + L::kK);
  T* sV = reinterpret_cast<T*>(smem + L::kV);
  const SeqInfo& seq = c.seq;
  const FwdFlags none{};
  typename Keys::template Loader<T, D, PerkeyBwdTile, false, false> keys(p, none, c, seq,
                                                                         reinterpret_cast<int32_t*>(smem + L::kIdx));

  // Q and dO of both halves, once; rows past seqlen_q are zero (their P and dS come out 0).
  for (int half = 0; half < 2; ++half) {
    const int64_t mh = c.m0 + half * kBlockM;
    const int valid = (int)imax(0, imin(kBlockM, seq.nq - mh));
    const T* q = static_cast<const T*>(p.q) + seq.q_offset(p) + c.h * p.q_head_stride + mh * p.q_row_stride;
    const T* d = static_cast<const T*>(p.dout) + seq.do_offset(p) + c.h * p.do_head_stride + mh * p.do_row_stride;
    issue_rows<T, D>(reinterpret_cast<T*>(smem + L::kQ) + half * L::kTileKV / 2, q, p.q_row_stride, valid, true);
    issue_rows<T, D>(reinterpret_cast<T*>(smem + L::kDO) + half * L::kTileKV / 2, d, p.do_row_stride, valid, true);
  }
  mbar_arrive_copies(full_q);
  mbar_arrive(full_q);
  if (n_pieces == 0) {
    cp_async_wait<0>();  // no copy may land in the smem of a later CTA
    return;
  }
  keys.start(0);
  RingPos<S> pk, pv;
  for (int64_t t = 0; t < n_pieces; ++t) {
    // Both products of a piece need its K and its V: they are requested together.
    mbar_wait(&empty_k[pk.stage], pk.phase ^ 1u);
    keys.template load_k<L>(t, pk.stage, sK, smem + L::kSlot, nullptr);
    mbar_arrive_copies(&full_k[pk.stage]);
    mbar_arrive(&full_k[pk.stage]);
    pk.advance();
    mbar_wait(&empty_v[pv.stage], pv.phase ^ 1u);
    keys.template load_v<L>(t, pv.stage, sV);
    mbar_arrive_copies(&full_v[pv.stage]);
    pv.advance();
  }
  cp_async_wait<0>();
}

// lse (log2 units; +inf past seqlen_q or for an empty row, so that P is 0) and
// delta = rowsum(dO * (out + out_resid)) of this thread's rows g, g + 8 of rows [mc, mc + 64) of
// head h (warp w, lane quarter qc): the four lanes of a row each sum a quarter of it.
template <typename T, int D>
__device__ inline void perkey_bwd_row_terms(const BwdParams& p, const SeqInfo& seq, int64_t h, int64_t mc, int w, int g,
                                            int qc, float (&l2)[2], float (&delta)[2]) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int64_t r = mc + w * 16 + g + 8 * hh;
    l2[hh] = CUDART_INF_F;
    float acc = 0.f;
    if (r < seq.nq) {
      l2[hh] = lse_log2(static_cast<const float*>(p.lse)[seq.lse_offset(p, h) + r]);
      const int64_t ro = seq.o_offset(p) + h * p.o_head_stride + r * p.o_row_stride;
      const T* o = static_cast<const T*>(p.out) + ro;
      const T* res = p.out_resid ? static_cast<const T*>(p.out_resid) + ro : nullptr;
      const T* d = static_cast<const T*>(p.dout) + seq.do_offset(p) + h * p.do_head_stride + r * p.do_row_stride;
#pragma unroll
      for (int u = 0; u < D / 4; u += 2) {
        const int col = qc * (D / 4) + u;
        const float2 dv = unpack2<T>(*reinterpret_cast<const uint32_t*>(d + col));
        float2 ov = unpack2<T>(*reinterpret_cast<const uint32_t*>(o + col));
        if (res) {
          const float2 rv = unpack2<T>(*reinterpret_cast<const uint32_t*>(res + col));
          ov.x += rv.x;
          ov.y += rv.y;
        }
        acc = fmaf(dv.x, ov.x, fmaf(dv.y, ov.y, acc));
      }
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    delta[hh] = acc;
  }
}

// dbias of a piece, warp w of computing warpgroup wg's part: the column sums of dS over the warp's
// 16 rows (lanes of one qc hold one column pair), one reduction per listed key and warp, into
// piece buffer buf of the smem layout L's dbias sums.
template <typename L>
__device__ inline void perkey_bwd_colsums(float (&colsum)[kBlockN / 8][2], unsigned char* smem, int buf, int wg, int w,
                                          int g, int qc) {
#pragma unroll
  for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      float v = colsum[n][x];
      v += __shfl_xor_sync(0xffffffffu, v, 4);
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      colsum[n][x] = v;
    }
  // Lanes g = 0 of each warp hold its 64 column sums: into this piece's buffer, summed over the
  // eight warps after the barrier below (one reduction per key instead of eight).
  if (g == 0) {
    float* db = reinterpret_cast<float*>(smem + L::kDB) + (buf * 8 + wg * 4 + w) * kBlockN;
#pragma unroll
    for (int n = 0; n < kBlockN / 8; ++n)
      *reinterpret_cast<float2*>(db + n * 8 + 2 * qc) = make_float2(colsum[n][0], colsum[n][1]);
  }
}

// The product's rows go to the float accumulator a 128-byte line per row and instruction: in
// the fragment order an instruction covers 16 rows x 32 bytes, and the L2 adds such scattered
// sectors at 60% of the rate it adds whole lines (scripts/gpu/reduce_bench.cu). Each line of
// columns is turned through the warp's staging: the fragments' 8-byte pairs in, then 16 bytes
// of one row a lane out (lanes 8 i .. 8 i + 7 one row), unit u of row r at u ^ (r & 7) so that
// both sides take the fewest wavefronts.
// acc: computing warpgroup wg's piece product (the lane's rows are those of keys[i]), turned through
// warp w's slice of the staging of smem layout L.
template <typename T, int D, typename L>
__device__ inline void perkey_bwd_reduce(const float (&acc)[D / 8][4], unsigned char* smem, int wg, int w,
                                         const int32_t (&keys)[4], float* acc_base, int64_t acc_rs, int lane, int g,
                                         int qc) {
  float* stg = reinterpret_cast<float*>(smem + L::kRedStage) + (wg * 4 + w) * L::kRedWarpFloats;
  const int ru = lane % 8;
#pragma unroll
  for (int c = 0; c < D / 32; ++c) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int u = (2 * k + (qc >> 1)) ^ g, off = u * 4 + 2 * (qc & 1);
      *reinterpret_cast<float2*>(stg + g * 32 + off) = make_float2(acc[4 * c + k][0], acc[4 * c + k][1]);
      *reinterpret_cast<float2*>(stg + (g + 8) * 32 + off) = make_float2(acc[4 * c + k][2], acc[4 * c + k][3]);
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 4 * i + lane / 8;
      const float4 v = *reinterpret_cast<const float4*>(stg + r * 32 + (ru ^ (r & 7)) * 4);
      if (keys[i] != KeyList<T, D>::kNever)
        red_add4(acc_base + (int64_t)keys[i] * acc_rs + c * 32 + ru * 4, v.x, v.y, v.z, v.w);
    }
    __syncwarp();
  }
}

// dQ (already scaled) out: this thread's rows g, g + 8 of rows [mc, mc + 64) of head h, those inside
// seqlen_q.
template <typename T, int D>
__device__ inline void perkey_bwd_store_dq(const BwdParams& p, const SeqInfo& seq, int64_t h, int64_t mc,
                                           const float (&dq)[D / 8][4], int w, int g, int qc) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int64_t r = mc + w * 16 + g + 8 * hh;
    if (r >= seq.nq) continue;
    T* out = static_cast<T*>(p.dq) + seq.dq_offset(p) + h * p.dq_head_stride + r * p.dq_row_stride;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<uint32_t*>(out + n * 8 + 2 * qc) = pack2<T>(dq[n][2 * hh], dq[n][2 * hh + 1]);
  }
}

// Computing warpgroup wg: rows [64 wg, 64 wg + 64) of the tile over every piece of the list.
template <typename T, int D, typename Keys>
__device__ inline void perkey_bwd_compute(const BwdParams& p, const PerkeyBwdTile& c, int64_t n_pieces,
                                          unsigned char* smem, int wg) {
  using L = PerkeyBwdSmem<T, D>;
  constexpr int S = L::kStages;
  uint64_t* full_k = reinterpret_cast<uint64_t*>(smem + L::kBars);
  uint64_t *empty_k = full_k + S, *full_v = full_k + 2 * S, *empty_v = full_k + 3 * S, *full_q = full_k + 4 * S;
  const T* sK = reinterpret_cast<const T*>(smem + L::kK);
  const T* sV = reinterpret_cast<const T*>(smem + L::kV);
  const T* sQ = reinterpret_cast<const T*>(smem + L::kQ);
  const T* sDO = reinterpret_cast<const T*>(smem + L::kDO);
  T* sP = reinterpret_cast<T*>(smem + L::kP);
  T* sDS = reinterpret_cast<T*>(smem + L::kDS);
  const int tid = threadIdx.x - kThreads * (1 + wg);
  const int w = tid / 32, lane = tid % 32, g = lane / 4, qc = lane % 4;
  const int64_t mc = c.m0 + wg * kBlockM;
  const SeqInfo& seq = c.seq;

  int thr[2] = {-1, -1}, lim[2] = {0x7fffffff, 0x7fffffff};
  Keys::row_terms(p, seq, c.h, mc, w, g, thr, lim);
  float l2[2], delta[2];
  perkey_bwd_row_terms<T, D>(p, seq, c.h, mc, w, g, qc, l2, delta);
  const float scale_l2 = p.softmax_scale * kLog2eF, scale = p.softmax_scale;
  const bool want_db = p.dbias_accum.ptr != nullptr;
  // dbias's accumulator row (the bias's layout, float) of this batch and head; null without it.
  float* db_row = const_cast<float*>(Plane<float>(p.dbias_accum, c.b, c.h).from(0, seq.k0).base);
  // This warpgroup's piece product: dV (wg 0) from P and dO, dK (wg 1) from dS and Q.
  float* acc_base = static_cast<float*>(wg == 0 ? p.dv : p.dk) + (wg == 0 ? seq.dv_offset(p) : seq.dk_offset(p)) +
                    c.kvh * (wg == 0 ? p.dv_head_stride : p.dk_head_stride);
  const int64_t acc_rs = wg == 0 ? p.dv_row_stride : p.dk_row_stride;

  float dq[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[j][e] = 0.f;
  float s[kBlockN / 8][4], dp[kBlockN / 8][4];
  uint32_t dsa[kBlockN / 16][4];
  float acc[D / 8][4];

  const uint64_t dq0 = desc_k_major<kBlockM>(sQ + wg * L::kTileKV / 2, 0);
  const uint64_t ddo0 = desc_k_major<kBlockM>(sDO + wg * L::kTileKV / 2, 0);
  // The piece product's operands: A = P or dS staged [row][key] (MN-major: the keys are its M),
  // B = dO or Q [row][d] (MN-major), the reduction over the 128 rows in 16-row steps.
  const T* prod_a = wg == 0 ? sP : sDS;
  const T* prod_b = wg == 0 ? sDO : sQ;
  // The loop's other descriptors built once here and moved by constants there (desc_advance): an
  // add per wgmma where building each from its address (sw128_desc's masking and shifts) was ~8
  // uniform instructions, ~200 a piece.
  static_assert(D <= 128, "dQ += dS K is one wgmma of width D a k step");
  const uint64_t dk0 = desc_k_major<kBlockN>(sK, 0), dv0 = desc_k_major<kBlockN>(sV, 0);
  const uint64_t dk_mn0 = desc_mn_major<kBlockN>(sK, 0);
  const uint64_t da0 = desc_mn_major<kBlockM>(prod_a, 0), db0 = desc_mn_major<kBlockM>(prod_b, 0);

  // A piece's S = Q K^T is issued at the end of the previous piece, before that piece's
  // reductions, so that the tensor pipe computes it while the warps add dK / dV to the
  // accumulators; at D = 64 dP = dO V^T goes with it. At D = 128 dP waits for the piece itself:
  // dQ, the product's rows, S and dP live at once would not fit the computing warps' registers.
  constexpr bool kEarlyDp = D <= 64;
  // Issues a piece's S and / or dP on ring stage st as one commit group. K / V rows (and Q / dO)
  // were written by cp.async (generic proxy) and are read by wgmma (async proxy).
  auto issue = [&](int st, bool with_s, bool with_dp) {
    if (with_s) fence_proxy_async();
#pragma unroll
    for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (with_s) s[n][e] = 0.f;
        if (with_dp) dp[n][e] = 0.f;
      }
    if (with_s) fence_regs(s);
    if (with_dp) fence_regs(dp);
    wgmma_fence();
    if (with_s) wgmma_ss64_k_major<T, D, kBlockM, kBlockN>(s, dq0, desc_advance(dk0, st * L::kTileKV));
    if (with_dp) wgmma_ss64_k_major<T, D, kBlockM, kBlockN>(dp, ddo0, desc_advance(dv0, st * L::kTileKV));
    wgmma_commit();
  };
  RingPos<S> at;
  if (n_pieces > 0) {
    mbar_wait(full_q, 0);
    mbar_wait(&full_k[0], 0);
    mbar_wait(&full_v[0], 0);
    issue(0, true, kEarlyDp);
  }
  for (int64_t t = 0; t < n_pieces; ++t) {
    const int st = at.stage, buf = (int)(t & 1);
    if constexpr (!kEarlyDp) issue(st, false, true);
    wgmma_wait<0>();
    fence_regs(s);
    fence_regs(dp);

    // P = exp2(S scaled + bias - lse) under the rank rule; dS = P (dP - delta).
    const int32_t* slot = reinterpret_cast<const int32_t*>(smem + L::kSlot + st * L::kKeepSlot);
    // Every piece takes both compares: this loader has no registers for the largest keys the
    // causal skip needs, and the rank compare's skip alone is no faster here (benchmarks/perf-log.md,
    // 'Change: the forward's rank compare only on the pieces that hold a row's threshold').
    rank_keep_tile<true>(s, slot, thr, lim, scale_l2, qc);
    float colsum[kBlockN / 8][2];
#pragma unroll
    for (int n = 0; n < kBlockN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pe = exp2f(s[n][e] - l2[e / 2]);
        s[n][e] = pe;
        dp[n][e] = pe * (dp[n][e] - delta[e / 2]);
      }
      colsum[n][0] = dp[n][0] + dp[n][2];
      colsum[n][1] = dp[n][1] + dp[n][3];
    }
    if (want_db) perkey_bwd_colsums<L>(colsum, smem, buf, wg, w, g, qc);
    // P and dS (scaled: the products of dQ and dK take scale * dS) into this buffer's half, as the
    // fragments lie: element (row, key) of the 64-row half at sw128_offset(64, row, key).
    // The lane's offsets are recomputed a piece (opaque to the compiler): hoisted out of the loop
    // they are 16 registers, which do not fit beside S in flight at D = 128.
    unsigned char* sp = smem + L::kP + (2 * buf + wg) * L::kPTile;
    unsigned char* sds = smem + L::kDS + (2 * buf + wg) * L::kPTile;
    int ow = p_offset0(w, g, qc);
    asm volatile("" : "+r"(ow));
#pragma unroll
    for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int o = (ow ^ (n << 4)) + 1024 * hh;
        dp[n][2 * hh] *= scale;
        dp[n][2 * hh + 1] *= scale;
        *reinterpret_cast<uint32_t*>(sp + o) = pack2<T>(s[n][2 * hh], s[n][2 * hh + 1]);
        *reinterpret_cast<uint32_t*>(sds + o) = pack2<T>(dp[n][2 * hh], dp[n][2 * hh + 1]);
      }
    c_to_a<T>(dp, dsa);
    // dQ += dS K (K read MN-major: the keys are the reduction), left in flight.
    fence_regs(dq);
    fence_regs(dsa);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      wgmma_rs<T, D, 1>(dq, dsa[kk], desc_advance(dk_mn0, st * L::kTileKV + kk * kMnMajorStep), 1);
    wgmma_commit();
    // Both halves of P / dS written (and visible to the async proxy) before either piece product
    // reads them.
    fence_proxy_async();
    named_barrier(NamedBarrier::kBwdPiece, 2 * kThreads);
    if (want_db && wg == 0 && tid < kBlockN) {
      const float* db = reinterpret_cast<const float*>(smem + L::kDB) + buf * 8 * kBlockN + tid;
      float v = 0.f;
#pragma unroll
      for (int u = 0; u < 8; ++u) v += db[u * kBlockN];
      const int32_t j = slot[tid];
      if (j != KeyList<T, D>::kNever) atomicAdd(db_row + j * p.dbias_accum.col_stride, v);
    }
    fence_regs(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 2 * kBlockM / 16; ++kk) {
      const int half = kk / 4, k4 = kk % 4;
      const uint64_t da = desc_advance(da0, (2 * buf + half) * L::kPTile + k4 * kMnMajorStep);
      const uint64_t db = desc_advance(db0, half * L::kTileKV + k4 * kMnMajorStep);
      // B's two 64-column blocks at D = 128 are one operand of width 128 (desc_mn_major's LBO steps
      // between them).
      if constexpr (D == 128) {
        wgmma_ss<T, 128, 1>(acc, da, db, kk > 0);
      } else {
        wgmma_ss<T, 64, 1>(acc, da, db, kk > 0);
      }
    }
    wgmma_commit();
    // The keys of the rows this lane reduces (rows 4 i + lane / 8 of the warp's 16), read before the
    // stage is freed.
    int32_t keys[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) keys[i] = slot[w * 16 + 4 * i + lane / 8];
    wgmma_wait<0>();
    fence_regs(dq);
    fence_regs(acc);
    mbar_arrive(&empty_k[st]);
    mbar_arrive(&empty_v[st]);
    at.advance();
    if (t + 1 < n_pieces) {
      mbar_wait(&full_k[at.stage], at.phase);
      mbar_wait(&full_v[at.stage], at.phase);
      issue(at.stage, true, kEarlyDp);
    }
    perkey_bwd_reduce<T, D, L>(acc, smem, wg, w, keys, acc_base, acc_rs, lane, g, qc);
  }

  perkey_bwd_store_dq<T, D>(p, seq, c.h, mc, dq, w, g, qc);
}

// Keys: the key source (ListedKeys); Scheduler: which (query tile, head, batch) a CTA takes.
template <typename T, int D, typename Keys, typename Scheduler>
__global__ void __launch_bounds__(kPerkeyBwdThreads, 1) perkey_bwd_kernel(const BwdParams p) {
  static_assert(perkey_bwd_built<D>(), "the per-key backward is built for D = 64 / 128 on sm_90a");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + smem_align_pad<true>(smem_raw);
  using L = PerkeyBwdSmem<T, D>;

  if (threadIdx.x == 0) {
    // The K / V ring's barriers, then full_q (two arrivals of every loader).
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + L::kBars);
    mbar_init_kv_ring<L::kStages>(bars, kThreads, 2 * kThreads);
    mbar_init(&bars[4 * L::kStages], 2 * kThreads);
    mbar_init_fence();
  }
  __syncthreads();

  // Heaviest query tiles first (the last tiles' lists are the longest under causality).
  PerkeyBwdTile c;
  const WorkTile work = Scheduler::get((int)p.num_heads);
  c.h = work.unit;
  c.m0 = (int64_t)work.m_tile * (2 * kBlockM);
  c.b = work.b;
  c.seq = SeqInfo::of<true>(p, c.b);
  c.kvh = c.h / (p.num_heads / p.num_heads_k);
  const int64_t n_pieces = Keys::tiles(p, c);
  if (threadIdx.x < kThreads) {
    regs_release<kBwdLoadRegs>();
    perkey_bwd_load<T, D, Keys>(p, c, n_pieces, smem);
  } else {
    regs_claim<kBwdComputeRegs>();
    perkey_bwd_compute<T, D, Keys>(p, c, n_pieces, smem, warpgroup_uniform() - 1);
  }
}

}  // namespace cuda
}  // namespace flexdma
