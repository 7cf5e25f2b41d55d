// dQ of the backward. The main kernel (bwd_kernel.cuh) walks key tiles, so a query tile of a head
// receives one dQ contribution from every key tile that keeps part of it. The contributions are
// added into a float buffer (FlashAttention-3's dQ accumulator) and converted to the output dtype
// by bwd_post_kernel:
// - a contribution is a 64 x D product dS K, computed in column chunks from dS (staged in smem
//   as [key][query], read transposed by ldmatrix) and the CTA's K tile, and added straight from
//   the accumulator registers with 16-byte vector reductions (sm_90; scalar atomics before). A
//   smem staging tile for a bulk reduce-add would cost 16-32 KiB that the kernel does not have
//   at two CTAs per SM, and a wait for the bulk read before the next work item reuses it.
// - the buffer holds each (batch, head, query tile) as 64 x D floats in accumulator-fragment
//   order: float4 f of lane l of warp w for 8-column block d8 sits at ((w * D / 8 + d8) * 32 + l)
//   * 4, so a warp's reduction covers 512 contiguous bytes.
// - deterministic mode: one int per (batch, head, query tile) counts the key tiles whose
//   contribution is in. The CTA of key tile n adds when the count is n and then raises it to
//   n + 1, also for the query tiles it skips (nothing kept there), so the sum runs in key-tile
//   order whatever the timing. The key tiles that see a query tile are always a prefix 0..N (a
//   key tile's first query tile grows with its index), so every count reaches its end.
#pragma once
#include <cstdint>

#include "constants.cuh"
#include "gemm.cuh"
#include "mma_sm80.cuh"
#include "mma_sm90.cuh"
#include "seq_info.cuh"
#include "smem_layout.cuh"

namespace flexdma {
namespace cuda {

// The backward's workspace, indexed by (batch, head, query tile) (packed sequences: by (head,
// sequence tile), sequence b's query tile t at cu_seqlens_q[b] / 64 + b + t of its head's
// total_q / 64 + batch tiles, so O(total_q) rows): the dQ accumulator, the deterministic mode's
// turns, and the per-row terms bwd_pre_kernel computes for the main pass,
// 64 rows a tile (rows past seqlen_q padded: lse2 +inf, delta 0, so they contribute nothing), so
// the main pass copies a tile's 64 + 64 floats with 16-byte cp.async and no bounds checks or
// conversions on its critical path.
struct DqAccum {
  float* ptr = nullptr;    // (B, H, query tiles, 64 * D), fragment order
  int* turn = nullptr;     // (B, H, query tiles), deterministic mode only
  float* lse2 = nullptr;   // (B, H, query tiles, 64): lse in log2 units, +inf where -inf (lse_log2)
  float* delta = nullptr;  // (B, H, query tiles, 64): rowsum(dout * out)
  int m_tiles = 0;         // tiles a (batch, head), or a head when packed
  int num_heads = 0;
  __device__ int64_t tile(const SeqInfo& s, int64_t h, int64_t mt) const {
    return s.packed ? h * m_tiles + s.q0 / kBlockM + s.b + mt : (s.b * num_heads + h) * m_tiles + mt;
  }
};

// Column chunk of the dQ product: accumulator registers per thread = chunk / 2, next to dK / dV.
template <int D>
constexpr int dq_chunk() {
  return D % 64 == 0 ? 64 : 32;
}

// Adds four floats to 16-byte aligned global memory without reading them back.
__device__ inline void red_add4(float* p, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
  atomicAdd(p + 2, c);
  atomicAdd(p + 3, d);
#endif
}

// Deterministic mode, one thread: waits until `n` key tiles are in, and hands the tile on.
__device__ inline void dq_wait_turn(const int* turn, int n) {
  int v;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(turn) : "memory");
  } while (v != n);
}
__device__ inline void dq_pass_turn(int* turn, int next) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(turn), "r"(next) : "memory");
}

// Deterministic mode, thread 0: hands on the turn of every work item from position pos = (query
// tile, head in kv head kvh's group of `ratio` query heads) up to, not including, (mt_e, gq_e):
// those keep nothing of key tile n_tile. Moves pos there.
__device__ inline void dq_pass_until(const DqAccum& dqa, int* pos, int mt_e, int gq_e, const SeqInfo& seq, int kvh,
                                     int ratio, int n_tile) {
  if (threadIdx.x != 0) return;
  int pmt = pos[0], pgq = pos[1];
#pragma unroll 1
  while (pmt < mt_e || (pmt == mt_e && pgq < gq_e)) {
    int* turn = dqa.turn + dqa.tile(seq, kvh * ratio + pgq, pmt);
    dq_wait_turn(turn, n_tile);
    dq_pass_turn(turn, n_tile + 1);
    if (++pgq == ratio) pgq = 0, ++pmt;
  }
  pos[0] = pmt, pos[1] = pgq;
}

// Writes a warp's dS^T fragments (rows = its 16 keys, columns = the tile's 64 queries, the C
// layout of the dK product's A operand) into the [key][query] tile.
template <typename T, int D>
__device__ inline void stage_ds(T* sDst, const float (&ds)[kBlockM / 8][4], int key0) {
  // The lane's offsets are made opaque here: computed once per call they cost a few XORs, hoisted
  // out of the caller's loop they would hold 16 registers the whole kernel long.
  int lane = threadIdx.x % 32;
  asm volatile("" : "+r"(lane));
  const int g = lane / 4, qc = lane % 4;
#pragma unroll
  for (int n = 0; n < kBlockM / 8; ++n)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
      *reinterpret_cast<uint32_t*>(sDst + dst_index<D>(key0 + g + 8 * hh, n * 8 + 2 * qc)) =
          pack2<T>(ds[n][2 * hh], ds[n][2 * hh + 1]);
  if constexpr (use_wgmma<D>()) fence_proxy_async();  // read by wgmma after the caller's barrier
}

// dQ[64 x D] contribution = dS[64 queries x 64 keys] K[64 keys x D], added into `acc` (the
// tile's float slot), D in column chunks. Warp w computes queries 16w..; B = the K tile, MN-major
// for this product. On wgmma A is the staged tile itself; on mma.sync its fragments come by
// transposed ldmatrix.
template <typename T, int D>
__device__ inline void add_dq_tile(float* acc, const T* sDst, const T* sK) {
  constexpr int kChunk = dq_chunk<D>();
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint32_t a[use_wgmma<D>() ? 1 : kBlockN / 16][4];
  if constexpr (!use_wgmma<D>()) {
    const T* src = sDst + ((lane & 7) + ((lane >> 4) << 3)) * kLdDst + w * 16 + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) ldmatrix_x4_trans(a[kk], src + kk * 16 * kLdDst);
  }
  // Chunks one at a time (the accumulator of one chunk live next to dK / dV): unrolled, the
  // compiler would overlap the chunks' registers.
#pragma unroll 1
  for (int c = 0; c < D / kChunk; ++c) {
    float o[kChunk / 8][4];
#pragma unroll
    for (int j = 0; j < kChunk / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[j][e] = 0.f;
    if constexpr (use_wgmma<D>()) {
      static_assert(kChunk == 64, "wgmma_ss<T, 64> is 64 columns wide");
      fence_regs(o);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk)
        wgmma_ss<T, 64, 1>(o, desc_mn_major<kBlockN>(sDst, kk), desc_mn_major<kBlockN>(sK + c * kBlockN * 64, kk), 1);
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(o);
    } else {
      constexpr int kLd = tile_ld(D);
      const int boff = ((lane & 7) + ((lane >> 3) & 1) * 8) * kLd + (lane >> 4) * 8 + c * kChunk;
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk)
#pragma unroll
        for (int dp = 0; dp < kChunk / 16; ++dp) {
          uint32_t vb[4];
          ldmatrix_x4_trans(vb, sK + boff + kk * 16 * kLd + dp * 16);
          mma_16816<T>(o[2 * dp], a[kk], vb[0], vb[1]);
          mma_16816<T>(o[2 * dp + 1], a[kk], vb[2], vb[3]);
        }
    }
#pragma unroll
    for (int j = 0; j < kChunk / 8; ++j)
      red_add4(acc + ((w * (D / 8) + c * (kChunk / 8) + j) * 32 + lane) * 4, o[j][0], o[j][1], o[j][2], o[j][3]);
  }
}

}  // namespace cuda
}  // namespace flexdma
