// Shared-memory layouts: tile element orders (padded rows for ldmatrix, 128-byte swizzle for
// wgmma), the leading dims of the keep / bias / dS tiles, and each kernel's carve-up of its
// dynamic shared memory (checked against kMaxSmemPerBlock at compile time).
#pragma once
#include <cstdint>

#include "constants.cuh"
#include "mma_sm80.cuh"

namespace flexdma {
namespace cuda {

// Padded leading dims of the 16-bit smem tiles: rows of 2D + 16 bytes spread ldmatrix rows over
// banks instead of mapping them all to the same ones.
__host__ __device__ constexpr int tile_ld(int d) { return d + 8; }
// Carve-outs start on 128-byte boundaries.
__host__ __device__ constexpr int align128(int bytes) { return (bytes + 127) / 128 * 128; }
// Keep tiles (one byte per element of a 64 x 64 tile): 80-byte rows, so a warp's fragment reads
// hit distinct banks and 16-byte copies stay aligned.
constexpr int kLdKeep = kBlockN + 16;
// Bias tiles (16-bit): 144-byte rows, for the same reason.
constexpr int kLdBias = kBlockN + 8;
// Float [key][query] tile of the backward: first the additive term of each score, then dS.
// 72-word rows: a warp's float2 fragment accesses (rows g, columns 2 * (lane % 4)) cover the banks once.
constexpr int kLdDS = kBlockN + 8;

// Byte offset of element (r, col) in a 128-byte-swizzled tile of `rows` rows.
__host__ __device__ constexpr int sw128_offset(int rows, int r, int col) {
  return (col / 64) * rows * 128 + r * 128 + ((((col % 64) / 8) ^ (r % 8)) * 16) + (col % 8) * 2;
}

// Whether head dim D runs its products on wgmma (sm_90a builds, head dims that fill whole
// 128-byte swizzle rows) instead of mma.sync with ldmatrix.
template <int D>
constexpr bool use_wgmma() {
#ifdef FLEXDMA_SM90A
  return D % 64 == 0;
#else
  return false;
#endif
}

// Element index of (row r, column col) in a 64-row Q / dO / K / V tile: 128-byte swizzled for
// wgmma, rows padded to tile_ld(D) for ldmatrix.
template <int D>
__device__ inline int tile_index(int r, int col) {
  if constexpr (use_wgmma<D>())
    return sw128_offset(64, r, col) / 2;
  else
    return r * tile_ld(D) + col;
}
// Elements between consecutive rows of a column block, and the bytes of a 64-row tile.
template <int D>
constexpr int tile_row_pitch() {
  return use_wgmma<D>() ? 64 : tile_ld(D);
}
template <int D>
constexpr int tile_bytes() {
  return 64 * tile_row_pitch<D>() * (use_wgmma<D>() ? D / 64 : 1) * 2;
}

// Bytes from the dynamic smem base to the first 1024-byte boundary where wgmma reads swizzled
// tiles from it (each layout below reserves the 1024 bytes this may skip), else 0. An offset, not
// a pointer: the kernel adds it to its __shared__ array, which keeps the pointer arithmetic in the
// shared window (a pointer returned from here compiled to 64-bit generic arithmetic).
template <bool kWgmma>
__device__ inline uint32_t smem_align_pad(const void* raw) {
  return kWgmma ? (1024 - smem_addr(raw) % 1024) % 1024 : 0;
}

// Heads wider than 128 keep Q in smem for the whole CTA and read it by wgmma (S with both operands
// in smem): as A fragments it would take D / 4 registers next to the D / 2 of the O accumulator.
template <int D>
constexpr bool fwd_q_in_smem() {
  return D > 128;
}

// Head dims whose forward is the warp-specialized kernel (fwd_ws_kernel.cuh): wgmma, with Q read
// from smem and P.V one instruction wide. Only that kernel runs the per-key rule.
template <int D>
constexpr bool fwd_warp_specialized() {
  return use_wgmma<D>() && !fwd_q_in_smem<D>();
}

// Head dims the per-key backward (perkey_bwd_kernel.cuh) is built for: those of the per-key
// forward (the warp-specialized one), whose loader and key lists it reuses.
template <int D>
constexpr bool perkey_bwd_built() {
  return fwd_warp_specialized<D>();
}

// [key][query] 16-bit dS tile. On wgmma it is a 64-row tile in the 128-byte swizzle, read as the
// MN-major A operand (no A registers next to dK / dV); on mma.sync 144-byte rows, so the
// transposed ldmatrix row reads and the fragment stores each cover the banks once. The fragment
// stores (rows g, 16-byte chunk n) are conflict-free in the swizzle too.
constexpr int kLdDst = kBlockM + 8;
template <int D>
constexpr int dst_bytes() {
  return use_wgmma<D>() ? kBlockN * kBlockM * 2 : kBlockN * kLdDst * 2;
}
template <int D>
__device__ inline int dst_index(int key, int q) {
  if constexpr (use_wgmma<D>())
    return sw128_offset(kBlockN, key, q) / 2;
  else
    return key * kLdDst + q;
}

template <typename T, int D>
struct FwdSmem {
  static constexpr int kTileKV = tile_bytes<D>();
  static constexpr int kKeepSlot = kBlockM * kLdKeep;
  // Up to D = 128 the Q tiles are only staged here until they are in registers; the region then
  // holds the mask bytes of the two K / V buffers' tiles. Wider, Q (swizzled) stays, the keep slots
  // follow.
  static constexpr int kQ = 0;
  static constexpr int kKeep = fwd_q_in_smem<D>() ? tile_bytes<D>() : 0;
  static constexpr int kK =
      ((fwd_q_in_smem<D>() ? kKeep + 2 * kKeepSlot : cmax(kBlockM * tile_ld(D) * 2, 2 * kKeepSlot)) + 1023) / 1024 *
      1024;
  static constexpr int kV = kK + 2 * kTileKV;
  static constexpr int kBias = kV + 2 * kTileKV;
  static constexpr int kBytes =
      kBias + 2 * kBlockM * kLdBias * 2 + (use_wgmma<D>() ? 1024 : 0);  // + room to align the base to 1024
  static_assert(kBytes <= kMaxSmemPerBlock, "forward smem layout too large");
};

// The backward kernel must stay <= ~113 KiB at D = 128 for 2 CTAs per SM, and the head-summed dbias
// tile (kDB) needs 16 KiB more: the bias tile, read only by the gather that fills sDS, lives in
// sDS's upper half (rows 32..63, exactly its size), and kDB is unpadded (swizzled, db_idx).
template <typename T, int D>
struct BwdSmem {
  static constexpr int kTile = align128(tile_bytes<D>());
  static constexpr int kK = 0, kV = kTile, kQ = 2 * kTile, kDO = 3 * kTile;
  static constexpr int kKeepSlot = align128(kBlockM * kLdKeep);
  // dO's slot also takes the dS tile of the dQ product once dP is computed (bwd_dq_accum.cuh).
  static constexpr int kDsTile = align128(cmax(kTile, dst_bytes<D>()));
  static constexpr int kKeep = kDO + kDsTile;  // two slots
  static constexpr int kL2 = kKeep + 2 * kKeepSlot;
  static constexpr int kDelta = kL2 + align128(kBlockM * 4);
  static constexpr int kDS = kDelta + align128(kBlockM * 4);
  static constexpr int kBias = kDS + kBlockN / 2 * kLdDS * 4;
  static constexpr int kDB = kDS + align128(kBlockN * kLdDS * 4);
  // Tile activity bits of the work items, one word per thread (2 x (115712 + 1024) bytes still
  // fit an SM at D = 128).
  static constexpr int kMetaItems = kThreads * 32;
  static constexpr int kMeta = kDB + kBlockN * kBlockM * 4;
  // Positions of the item walk (bwd_kernel.cuh): the deterministic mode's turns, the dbias
  // zeroing. In registers they would hold four of every thread's.
  static constexpr int kPass = kMeta + kThreads * 4;
  static constexpr int kBytes = kPass + 16 + (use_wgmma<D>() ? 1024 : 0);
  static_assert(kBytes <= kMaxSmemPerBlock, "backward smem layout too large");
  static_assert(kBlockM * kLdBias * 2 <= kBlockN / 2 * kLdDS * 4, "bias tile must fit in sDS's upper half");
};

// Element (key k, query q) of the unpadded float [key][query] dbias tile. The even XOR keeps
// float2 pairs adjacent; the 4 keys of a half-warp's fragment access land in 4 different 8-word
// groups (conflict-free), and a warp reading one query of 32 consecutive keys is 2-way.
__device__ inline int db_idx(int k, int q) { return k * kBlockM + (q ^ (((k & 3) << 3) | (((k >> 2) & 3) << 1))); }

}  // namespace cuda
}  // namespace flexdma
