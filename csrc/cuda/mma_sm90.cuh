// Hopper (sm_90a) warpgroup MMA: wgmma.mma_async with the A operand in registers and B read by
// the tensor cores straight from shared memory through a matrix descriptor.
//
// Why: with mma.sync every warp of the CTA reads the whole K and V tile from shared memory by
// ldmatrix (4x the bytes of the tile per step for 4 warps, 0.5 LDSM per HMMA), which bounds the
// products by shared-memory bandwidth and instruction issue. A wgmma reads B once for the
// warpgroup and issues a 64 x N x 16 product as one instruction.
//
// Register layouts (warp w of the warpgroup owns rows 16w .. 16w + 15, g = lane / 4, c = lane % 4)
// are those of mma.sync m16n8k16 repeated over N / 8 column blocks, so the forward's softmax and
// its P repack (C fragments -> A fragment) carry over unchanged:
//   A 64x16 (registers): a0 (g, 2c..), a1 (g+8, 2c..), a2 (g, 2c+8..), a3 (g+8, 2c+8..)
//   D 64xN: d[j][0..1] (g, 8j + 2c ..), d[j][2..3] (g + 8, 8j + 2c ..)
//
// Shared-memory tiles of B use the 128-byte swizzle: a tile of R rows x C 16-bit columns
// (C a multiple of 64) is stored as C / 64 blocks of R rows x 128 bytes; inside a block the
// 16-byte chunk j of row r sits at chunk j ^ (r % 8). Blocks start on 1024-byte boundaries.
// The same layout serves K (B = K^T, "K-major": the reduction dim is contiguous) and V (B = V,
// "MN-major": the output dim is contiguous, imm-trans-b = 1).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>

#include "mma_sm80.cuh"

namespace flexdma {
namespace cuda {

// sw128_offset, use_wgmma and the tile layout helpers live in smem_layout.cuh.

// Shared-memory matrix descriptor: start address, leading / stride byte offsets (16-byte
// units), swizzle mode 1 = 128 B (bits 62-63). Base offset 0: blocks are 1024-byte aligned.
__device__ inline uint64_t sw128_desc(const void* smem, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  const uint64_t addr = smem_addr(smem);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t((lbo_bytes >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo_bytes >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// B = tile^T for k step kk (16 columns of the reduction dim) of a swizzled tile with `rows`
// rows: inside a 64-column block a k step moves 32 bytes (the hardware applies the XOR on the
// address bits); 8-row groups are 1024 bytes apart (SBO); LBO is unused for this mode.
template <int kRows>
__host__ __device__ constexpr uint32_t k_major_offset(int kk) {
  return (kk / 4) * kRows * 128 + (kk % 4) * 32;
}
template <int kRows>
__device__ inline uint64_t desc_k_major(const void* tile, int kk) {
  return sw128_desc(static_cast<const char*>(tile) + k_major_offset<kRows>(kk), 16, 1024);
}

// B = tile for k step kk (16 rows): 16 rows of 128 bytes = 2048 bytes per step; the 64-column
// blocks along N are kRows * 128 bytes apart (LBO), 8-row groups 1024 bytes (SBO).
constexpr uint32_t kMnMajorStep = 2048;
template <int kRows>
__device__ inline uint64_t desc_mn_major(const void* tile, int kk) {
  return sw128_desc(static_cast<const char*>(tile) + kk * kMnMajorStep, kRows * 128, 1024);
}

// The descriptor of the same tile form `bytes` further on: the start address sits in the low
// bits in 16-byte units, and shared-memory addresses (< 2^18) never carry out of its 14 bits. A
// loop that builds its descriptors once and moves them by constants spends one add per wgmma
// instead of the address masking and shifts of sw128_desc.
// The add is on the low word alone: a 64-bit add costs a carry (IADD3 + IMAD.X) per descriptor.
__device__ inline uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  return (desc & 0xffffffff00000000ull) | (uint32_t)((uint32_t)desc + (bytes >> 4));
}

// Orders the warpgroup's register accesses before / after the async MMAs (wgmma.fence), closes a
// group of them, and waits until at most N groups are pending.
__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ inline void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ inline void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes generic-proxy shared-memory writes (cp.async, st.shared) visible to the async proxy that
// wgmma reads B through; issued by the writers before the barrier that publishes the tile.
__device__ inline void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keeps the compiler from moving writes or reads of wgmma operand registers (accumulators, A
// fragments) across the fence / wait above: wgmma.fence only orders what comes before it.
template <int J>
__device__ inline void fence_regs(float (&d)[J][4]) {
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}
template <int J>
__device__ inline void fence_regs(uint32_t (&a)[J][4]) {
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[j][e])::"memory");
}

#define FLEXDMA_ACC4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define FLEXDMA_ACC_N64                                                                                 \
  FLEXDMA_ACC4(0), FLEXDMA_ACC4(1), FLEXDMA_ACC4(2), FLEXDMA_ACC4(3), FLEXDMA_ACC4(4), FLEXDMA_ACC4(5), \
      FLEXDMA_ACC4(6), FLEXDMA_ACC4(7)
#define FLEXDMA_ACC_N128                                                                                   \
  FLEXDMA_ACC_N64, FLEXDMA_ACC4(8), FLEXDMA_ACC4(9), FLEXDMA_ACC4(10), FLEXDMA_ACC4(11), FLEXDMA_ACC4(12), \
      FLEXDMA_ACC4(13), FLEXDMA_ACC4(14), FLEXDMA_ACC4(15)
#define FLEXDMA_REGS_N64                                                                                    \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27," \
  "%28,%29,%30,%31}"
#define FLEXDMA_REGS_N128                                                                                    \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,"  \
  "%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53," \
  "%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"

// The operands after D of a wgmma of width N: A's four registers, B's descriptor, the
// accumulate predicate (set from a register) and imm-trans-b (an immediate).
#define FLEXDMA_SETP_N64 "setp.ne.b32 p, %37, 0;\n"
#define FLEXDMA_OPS_N64 ", {%32,%33,%34,%35}, %36, p, 1, 1, %38;\n}\n"
#define FLEXDMA_SETP_N128 "setp.ne.b32 p, %69, 0;\n"
#define FLEXDMA_OPS_N128 ", {%64,%65,%66,%67}, %68, p, 1, 1, %70;\n}\n"
#define FLEXDMA_WGMMA_RS(N, TY)                                                                                   \
  asm volatile("{\n.reg .pred p;\n" FLEXDMA_SETP_N##N "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY \
                                                      " " FLEXDMA_REGS_N##N FLEXDMA_OPS_N##N                      \
               : FLEXDMA_ACC_N##N                                                                                 \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(kTransB))

// One wgmma: D (+)= A B with A from registers; `accumulate` = 0 ignores D's old value (scale-d
// false), kTransB = 1 reads B MN-major. N (the width of D) is 64 or 128.
template <typename T, int N, int kTransB>
__device__ inline void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc_b, int accumulate) {
  static_assert(N == 64 || N == 128, "wgmma_rs: N must be 64 or 128");
  constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  if constexpr (N == 64) {
    if constexpr (kBf16)
      FLEXDMA_WGMMA_RS(64, "bf16");
    else
      FLEXDMA_WGMMA_RS(64, "f16");
  } else {
    if constexpr (kBf16)
      FLEXDMA_WGMMA_RS(128, "bf16");
    else
      FLEXDMA_WGMMA_RS(128, "f16");
  }
}

// O[64 x D] += A B for k step kk, B an MN-major swizzled tile of kRows rows (V in P.V, dO / Q in
// the backward's dV / dK): one wgmma of width D up to 128; wider heads take one per 64-column
// block (each block is its own kRows x 128-byte region), which keeps the register lists of the
// asm above at two widths.
template <typename T, int D, int kRows>
__device__ inline void wgmma_rs_mn(float (&o)[D / 8][4], const uint32_t (&a)[4], const T* tile, int kk) {
  if constexpr (D <= 128) {
    wgmma_rs<T, D, 1>(o, a, desc_mn_major<kRows>(tile, kk), 1);
  } else {
    static_assert(D % 64 == 0, "wide heads come in 64-column blocks");
#pragma unroll
    for (int c = 0; c < D / 64; ++c) {
      float (&oc)[8][4] = *reinterpret_cast<float (*)[8][4]>(&o[8 * c][0]);
      wgmma_rs<T, 64, 1>(oc, a, desc_mn_major<kRows>(tile + c * kRows * 64, kk), 1);
    }
  }
}

// One wgmma with both operands in shared memory, read through the same descriptor form (A a
// 64-row tile): K-major by default (the backward's S^T = K Q^T and dP^T = V dO^T); kTrans = 1 reads
// both MN-major (its dQ = dS K, dS staged [key][query]; dV = P^T dO and dK = dS^T Q, at D = 128 one
// of width 128 a k step, which reads A once where two of width 64 read it twice). N is 64 or 128.
#define FLEXDMA_SETP_SS_N64 "setp.ne.b32 p, %34, 0;\n"
#define FLEXDMA_OPS_SS_N64 ", %32, %33, p, 1, 1, %35, %35;\n}\n"
#define FLEXDMA_SETP_SS_N128 "setp.ne.b32 p, %66, 0;\n"
#define FLEXDMA_OPS_SS_N128 ", %64, %65, p, 1, 1, %67, %67;\n}\n"
#define FLEXDMA_WGMMA_SS(N, TY)                                                                                      \
  asm volatile("{\n.reg .pred p;\n" FLEXDMA_SETP_SS_N##N "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY \
                                                         " " FLEXDMA_REGS_N##N FLEXDMA_OPS_SS_N##N                   \
               : FLEXDMA_ACC_N##N                                                                                    \
               : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTrans))
template <typename T, int N, int kTrans = 0>
__device__ inline void wgmma_ss(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  static_assert(N == 64 || N == 128, "wgmma_ss: N must be 64 or 128");
  constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  if constexpr (N == 64) {
    if constexpr (kBf16)
      FLEXDMA_WGMMA_SS(64, "bf16");
    else
      FLEXDMA_WGMMA_SS(64, "f16");
  } else {
    if constexpr (kBf16)
      FLEXDMA_WGMMA_SS(128, "bf16");
    else
      FLEXDMA_WGMMA_SS(128, "f16");
  }
}

// d = A B^T over a reduction of D columns, both operands K-major swizzled tiles in shared memory
// given by their first k step's descriptors (A kRowsA rows, B kRowsB rows): D / 16 wgmmas, the
// first overwriting d. What the warp-specialized kernels' S = Q K^T (and the backward's
// dP = dO V^T) issue.
template <typename T, int D, int kRowsA, int kRowsB>
__device__ inline void wgmma_ss64_k_major(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wgmma_ss<T, 64>(d, desc_advance(desc_a, k_major_offset<kRowsA>(kk)),
                    desc_advance(desc_b, k_major_offset<kRowsB>(kk)), kk > 0);
}
#undef FLEXDMA_WGMMA_RS
#undef FLEXDMA_WGMMA_SS
#undef FLEXDMA_SETP_SS_N64
#undef FLEXDMA_OPS_SS_N64
#undef FLEXDMA_SETP_SS_N128
#undef FLEXDMA_OPS_SS_N128
#undef FLEXDMA_SETP_N64
#undef FLEXDMA_OPS_N64
#undef FLEXDMA_SETP_N128
#undef FLEXDMA_OPS_N128
#undef FLEXDMA_ACC4
#undef FLEXDMA_ACC_N64
#undef FLEXDMA_ACC_N128
#undef FLEXDMA_REGS_N64
#undef FLEXDMA_REGS_N128

}  // namespace cuda
}  // namespace flexdma
