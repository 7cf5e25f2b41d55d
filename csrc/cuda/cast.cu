// Float sums cast to bf16 / fp16 in one launch (CastParams): the per-key backward adds dK, dV and
// dbias into one float buffer, and three casts would be three launches (host time that the
// training call's short rows are bound by) for what is one pass over memory.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "constants.cuh"
#include "flash_dma_cuda.h"
#include "mma_sm80.cuh"  // pack2, from_float

namespace flexdma {
namespace cuda {
namespace {

constexpr int kCastThreads = 256;
constexpr int kVec = 8;  // elements a thread converts: two 16-byte loads, one 16-byte store

// Chunk c of kVec elements over the segments in order; a segment's last chunk may be partial.
template <typename T>
__global__ void __launch_bounds__(kCastThreads) cast_kernel(const CastParams p, int64_t c0, int64_t c1) {
  int64_t c = (int64_t)blockIdx.x * kCastThreads + threadIdx.x;
  int seg = 0;
  if (c >= c0) seg = c >= c0 + c1 ? 2 : 1;
  c -= seg == 0 ? 0 : (seg == 1 ? c0 : c0 + c1);
  // Selects, not an indexed parameter array (which would be copied to local memory).
  const int64_t i = c * kVec, n = seg == 0 ? p.n[0] : (seg == 1 ? p.n[1] : p.n[2]);
  if (i >= n) return;
  const float* src = (seg == 0 ? p.src[0] : (seg == 1 ? p.src[1] : p.src[2])) + i;
  T* dst = static_cast<T*>(seg == 0 ? p.dst[0] : (seg == 1 ? p.dst[1] : p.dst[2])) + i;
  // Whole chunks of 16-byte aligned segments take vector accesses (the buffers are allocations, and
  // segments start at multiples of kVec elements where that holds).
  const bool vec =
      i + kVec <= n && reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  if (vec) {
    const float4 a = *reinterpret_cast<const float4*>(src), b = *reinterpret_cast<const float4*>(src + 4);
    *reinterpret_cast<uint4*>(dst) =
        make_uint4(pack2<T>(a.x, a.y), pack2<T>(a.z, a.w), pack2<T>(b.x, b.y), pack2<T>(b.z, b.w));
  } else {
    for (int e = 0; e < kVec && i + e < n; ++e) dst[e] = from_float<T>(src[e]);
  }
}

}  // namespace

void run_cast(const CastParams& p, void* stream) {
  int64_t chunks[CastParams::kSegments];
  int64_t total = 0;
  for (int s = 0; s < CastParams::kSegments; ++s) total += chunks[s] = ceil_div(p.n[s], kVec);
  if (total == 0) return;
  const dim3 grid((unsigned)ceil_div(total, kCastThreads));
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (p.dtype == DType::kBFloat16)
    cast_kernel<__nv_bfloat16><<<grid, kCastThreads, 0, st>>>(p, chunks[0], chunks[1]);
  else
    cast_kernel<__half><<<grid, kCastThreads, 0, st>>>(p, chunks[0], chunks[1]);
}

}  // namespace cuda
}  // namespace flexdma
