// Where the warp-specialized forward's key tiles come from, as a policy type: which key tiles a CTA
// walks, how its loading warpgroup copies a tile's K / V rows and score operands into a stage, and
// the rule that drops scores. The mainloop (fwd_ws_mainloop.cuh) is written once over the policy;
// how it spends registers (FwdWsConfig) and which tiles a CTA takes (tile_scheduler.cuh) are
// policies of their own.
//   SequenceKeys: the sequence's key tiles, skipped by the mask's tile activity bits; contiguous
//     K / V rows, the mask's keep bytes (raw, or built where a length or misalignment rules that
//     out) and the bias tiles per 64-row half; scores dropped by keep tile, bounds and causality.
//     Padded batches (SequenceKeys), or packed sequences without a mask (PackedSequenceKeys: a
//     kernel of its own, so that the padded one holds no sequence offsets in its registers).
//   ListedKeys (the per-key top-W rule, flexdma::perkey_fwd): consecutive 64-entry pieces of the
//     query tile's key list (FwdParams::tile_keys, 128-row lists); K / V rows gathered through the
//     list (KeyList), each listed key's index, rank and bias in the stage's slot; scores dropped
//     by the rank rule (apply_rank_keep) with the bias of each listed key. No mask, no bias tiles,
//     no head pairs.
#pragma once
#include "../flash_dma_params.h"
#include "constants.cuh"
#include "copy.cuh"
#include "mask.cuh"
#include "pipeline.cuh"
#include "seq_info.cuh"
#include "smem_layout.cuh"

namespace flexdma {
namespace cuda {

template <bool kPackedSeqs>
struct SequenceKeysOf {
  static constexpr bool kRankRule = false;  // fwd_scores' drop rule: keep tile and bounds
  static constexpr bool kBiasTiles = true;  // the stages hold bias tiles
  static constexpr bool kTileBits = true;   // the walk skips tiles by the mask's activity bits
  static constexpr bool kPairs = true;      // a CTA may take a head pair (FwdFlags::pair)
  static constexpr bool kPacked = kPackedSeqs;
  // Packed sequences take no mask (unsupported_reason): compiled out, the loader and the computing
  // warps hold none of its operands (with them the packed kernel spilled).
  static constexpr bool kMask = !kPackedSeqs;

  // The number of key tiles the CTA's tile `c` walks (before key splits): those its last rows see;
  // none past a packed sequence's rows (CTAs of the longest sequence's tiles). No count is staged
  // for it (the last argument: ListedKeys').
  template <typename Tile>
  __device__ static inline int64_t tiles(const FwdParams& p, Tile& c, int64_t = -1) {
    return !kPacked || c.m0 < c.seq.nq ? key_tile_end(p, c.seq, c.rows(c.two ? 1 : 0)) : 0;
  }
  // The end of the tiles that rows [mc, mc + 64) see: tiles past their causal end drop every score.
  template <typename Tile>
  __device__ static inline int64_t own_end(const FwdParams& p, const Tile& c, int64_t mc) {
    return imin(c.n_end, key_tile_end(p, c.seq, mc));
  }
  // The drop rule's per-row terms (the rank rule's only).
  __device__ static inline void row_terms(const FwdParams&, const SeqInfo&, int64_t, int64_t, int, int, int (&)[2],
                                          int (&)[2]) {}

  // The loading warpgroup's copies of the tiles of `c`.
  template <typename T, int D, typename Tile>
  struct Loader {
    const FwdParams& p;
    const FwdFlags& f;
    const Tile& c;
    const SeqInfo seq;
    const T *kp, *vp;  // row 0 of this batch's and kv head's K / V
    const Plane<T> bias;
    const Plane<uint8_t> mask;
    const bool has_bias, has_mask;
    const bool bias_vec;  // 16-byte bias copies (SeqInfo::vec16: the sequence's offset is known here only)
    __device__ inline Loader(const FwdParams& p_, const FwdFlags& f_, const Tile& c_, const SeqInfo& seq_, int32_t*)
        : p(p_),
          f(f_),
          c(c_),
          seq(seq_),
          kp(static_cast<const T*>(p_.k) + seq_.k_offset(p_) + c_.kvh * p_.k_head_stride),
          vp(static_cast<const T*>(p_.v) + seq_.v_offset(p_) + c_.kvh * p_.v_head_stride),
          bias(Plane<T>(p_.bias, c_.b, c_.h).from(seq_.q0, seq_.k0)),
          mask(Plane<uint8_t>(p_.mask, c_.b, c_.h).from(seq_.q0, seq_.k0)),
          has_bias(p_.bias.ptr != nullptr),
          has_mask(kMask && p_.mask.ptr != nullptr),
          bias_vec(seq_.vec16<T>(p_.bias, f_.bias_vec)) {}
    // Before the first tile t is requested.
    __device__ inline void start(int64_t) {}
    // Key tile t's K rows, keep bytes (both halves) and bias tiles into K stage st (smem layout L:
    // the stage's slots are located here, where they are written, rather than by the caller;
    // passed in formed, ptxas schedules the loader and the computing warps differently).
    template <typename L>
    __device__ inline void load_k(int64_t t, int st, T* sK, uint8_t* sKeep, T* sB) {
      T* sk = sK + st * L::kTileKV / 2;
      const int64_t n0 = t * kBlockN;
      issue_rows<T, D>(sk, kp + n0 * p.k_row_stride, p.k_row_stride, (int)imin(kBlockN, seq.nk - n0), f.qkv_vec);
      for (int half = 0; half < c.halves(); ++half) {
        const int64_t mh = c.m0 + half * kBlockM;
        const TileBounds tb(p, seq, mh, n0);
        // A bias broadcast over queries is read from the first half's row 0 by both halves.
        if (has_bias && (half == 0 || bias.rs != 0))
          issue_bias<true>(tb, bias, sB + st * (L::kBiasSlot / 2) + half * kBlockM * kLdBias, bias_vec, mh, n0);
        uint8_t* keep = sKeep + st * L::kKeepSlot + half * kBlockM * kLdKeep;
        if (has_mask) {
          if (mask_async(p, seq, f.mask_vec, mh, n0))
            issue_mask_raw(mask, keep, mh, n0);
          else
            build_keep<false>(tb, mask, keep, f.mask_vec, mh, n0);
        }
      }
    }
    // Key tile t's V rows into V stage st.
    template <typename L>
    __device__ inline void load_v(int64_t t, int st, T* sV) {
      T* sv = sV + st * L::kTileKV / 2;
      const int64_t n0 = t * kBlockN;
      issue_rows<T, D>(sv, vp + n0 * p.v_row_stride, p.v_row_stride, (int)imin(kBlockN, seq.nk - n0), f.qkv_vec);
    }
  };
};

using SequenceKeys = SequenceKeysOf<false>;
using PackedSequenceKeys = SequenceKeysOf<true>;

struct ListedKeys {
  static constexpr bool kRankRule = true;
  static constexpr bool kBiasTiles = false;  // the listed keys' biases travel in the stage's slot
  static constexpr bool kTileBits = false;   // the list holds only keys some row keeps
  static constexpr bool kPairs = false;
  static constexpr bool kPacked = true;  // packed sequences (FwdParams::cu_seqlens_q) too
  static constexpr bool kMask = true;    // never given one (unsupported_reason); its branches stay as measured

  // The CTA's key list (count, then key indices) into c.list; its number of 64-entry tiles (or
  // `known`, the count the loader staged: FwdWsConfig::kStagedSetup). A packed sequence shorter
  // than the longest has CTAs past its rows: no list, nothing to walk.
  template <typename Tile>
  __device__ static inline int64_t tiles(const FwdParams& p, Tile& c, int64_t known = -1) {
    if (c.m0 >= c.seq.nq) {
      c.list = nullptr;
      return 0;
    }
    c.list = Plane<int32_t>(p.tile_keys, c.b, c.h).at(c.seq.tile0 + c.m0 / p.perkey_tile_rows, 0);
    return known >= 0 ? known : ceil_div(c.list[0], kBlockN);
  }
  // The key list is walked whole (the rank rule holds causality).
  template <typename Tile>
  __device__ static inline int64_t own_end(const FwdParams&, const Tile& c, int64_t) {
    return c.n_end;
  }
  // The same from the loader's copy of the tile's thresholds in smem (staged: 128 rows' row_thr
  // from the CTA's first row; persistent CTAs).
  __device__ static inline void row_terms_staged(const FwdParams& p, const SeqInfo& seq, const int32_t* staged,
                                                 int64_t m0, int64_t mc, int w, int g, int (&thr)[2], int (&lim)[2]) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int64_t r = mc + w * 16 + g + 8 * hh;
      if (r < seq.nq) thr[hh] = staged[r - m0];
      if (p.is_causal) lim[hh] = (int)(r + seq.nk - seq.nq);
    }
  }
  // The loader's half of it: rows [m0, m0 + 128) of head h's thresholds into `staged`, one
  // 4-byte cp.async a loading thread (covered by the Q buffer's copies arrival).
  __device__ static inline void stage_row_terms(const FwdParams& p, const SeqInfo& seq, int64_t h, int64_t m0,
                                                int32_t* staged) {
    const int64_t r = m0 + threadIdx.x;
    if (threadIdx.x < 2 * kBlockM && r < seq.nq)
      cp_async4(staged + threadIdx.x, Plane<int32_t>(p.row_thr, seq.b, h).from(seq.q0, 0).at(r, 0));
  }
  // The rank rule's per-row terms of this thread's rows g, g + 8 (of rows [mc, mc + 64) of head
  // `head`, warp w, of sequence seq): the largest kept rank (-1 past its rows: nothing kept) and the
  // causal limit.
  __device__ static inline void row_terms(const FwdParams& p, const SeqInfo& seq, int64_t head, int64_t mc, int w,
                                          int g, int (&thr)[2], int (&lim)[2]) {
    const Plane<int32_t> thr_plane = Plane<int32_t>(p.row_thr, seq.b, head).from(seq.q0, 0);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int64_t r = mc + w * 16 + g + 8 * hh;
      if (r < seq.nq) thr[hh] = *thr_plane.at(r, 0);
      if (p.is_causal) lim[hh] = (int)(r + seq.nk - seq.nq);
    }
  }

  // The loading warpgroup's copies (kTopKeys: with each slot's largest keys, for apply_rank_keep;
  // the backward's loader, at 72 registers, goes without them; kWhole: whole tiles gathered without
  // bounds by KeyList::issue_rows, where that measured faster: the forward's loader, not the
  // backward's): tile t's 64 key indices are held in an smem ring (idx(t); four tiles of 64 words)
  // a tile ahead, stored while K(t - 1) is requested, so that the gathers of tile t issue after a
  // shared-memory read; V(t) is requested after K(t + 1), so three of the four entries are live.
  template <typename T, int D, typename Tile, bool kTopKeys = true, bool kWhole = true>
  struct Loader {
    const FwdParams& p;
    const T *kp, *vp;
    const Plane<T> bias;
    const Plane<int32_t> ranks;
    int32_t* ring;
    const int32_t* list;
    KeyList<T, D> kl{};
    int32_t next_key = 0;  // this thread's key of the tile after the one requested next
    float key_bias = 0.f;  // and the bias of its key in the tile requested next
    __device__ inline Loader(const FwdParams& p_, const FwdFlags&, const Tile& c_, const SeqInfo& seq_, int32_t* ring_)
        : p(p_),
          kp(static_cast<const T*>(p_.k) + seq_.k_offset(p_) + c_.kvh * p_.k_head_stride),
          vp(static_cast<const T*>(p_.v) + seq_.v_offset(p_) + c_.kvh * p_.v_head_stride),
          bias(Plane<T>(p_.bias, c_.b, c_.h).from(0, seq_.k0)),
          ranks(Plane<int32_t>(p_.key_rank, c_.b, c_.h).from(0, seq_.k0)),
          ring(ring_),
          list(c_.list) {}
    __device__ inline int32_t* idx(int64_t t) const { return ring + (t & 3) * 64; }
    __device__ inline float bias_of(int32_t j, int64_t n0) const {
      return threadIdx.x < 64 && n0 + threadIdx.x < kl.n ? to_float(*bias.at(0, j)) : 0.f;
    }
    // Before the first tile t is requested: the list, tile t's indices into the ring, and this
    // thread's bias of tile t and key of tile t + 1.
    __device__ inline void start(int64_t t) {
      kl.keys = list + 1;
      kl.n = list[0];
      const int32_t first = kl.entry(t * kBlockN);
      if (threadIdx.x < 64) idx(t)[threadIdx.x] = first;
      key_bias = bias_of(first, t * kBlockN);
      next_key = kl.entry((t + 1) * kBlockN);
    }
    // Key tile t's gathered K rows and its slot (indices, ranks, biases) into K stage st; tile
    // t + 1's indices into the ring.
    template <typename L>
    __device__ inline void load_k(int64_t t, int st, T* sK, uint8_t* sKeep, T*) {
      T* sk = sK + st * L::kTileKV / 2;
      const int64_t n0 = t * kBlockN;
      named_barrier(NamedBarrier::kLoad, kThreads);  // tile t's indices, stored a tile ago, in every loader's view
      int32_t* slot = reinterpret_cast<int32_t*>(sKeep + st * L::kKeepSlot);
      kl.template issue_rows<kWhole>(idx(t), sk, kp, p.k_row_stride, n0);
      kl.template issue_slot<kTopKeys>(idx(t), slot, n0, ranks, key_bias);
      if (threadIdx.x < 64) idx(t + 1)[threadIdx.x] = next_key;
      key_bias = bias_of(next_key, n0 + kBlockN);
      next_key = kl.entry(n0 + 2 * kBlockN);
    }
    // Key tile t's gathered V rows into V stage st.
    template <typename L>
    __device__ inline void load_v(int64_t t, int st, T* sV) {
      T* sv = sV + st * L::kTileKV / 2;
      const int64_t n0 = t * kBlockN;
      kl.template issue_rows<kWhole>(idx(t), sv, vp, p.v_row_stride, n0);
    }
  };
};

}  // namespace cuda
}  // namespace flexdma
