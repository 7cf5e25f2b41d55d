// The kernels around the backward's main pass (bwd_kernel.cuh), one CTA per (query tile, head,
// batch) each:
// - before: delta = rowsum(dout * out) per row, the row term of dS = P (dP - delta), and lse in
//   log2 units, both into the workspace (DqAccum), with out taken as out + out_resid (the
//   forward's float output, split in two of out's dtype) where the forward kept it: a bf16-rounded
//   out alone leaves an error per row that a dbias summed over rows or heads accumulates.
// - after: dq = softmax_scale * the float dQ accumulator (bwd_dq_accum.cuh's fragment order).
#pragma once
#include <cstdint>

#include "../flash_dma_params.h"
#include "bwd_dq_accum.cuh"
#include "constants.cuh"
#include "mma_sm80.cuh"
#include "seq_info.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"

namespace flexdma {
namespace cuda {

// Rows of out / out_resid / dout whose 8-element groups are 16-byte aligned.
struct PreFlags {
  bool vec;
};

// Scheduler: which (query tile, head, batch) a CTA takes (QueryTileScheduler).
template <typename T, int D, typename Scheduler>
__global__ void __launch_bounds__(kThreads) bwd_pre_kernel(const BwdParams p, const DqAccum ws, const PreFlags f) {
  const int nh = (int)p.num_heads;
  const int64_t h = Scheduler::head(nh), m_tile = Scheduler::m_tile(nh), b = Scheduler::batch();
  // Packed sequences: the offsets are read here first; the tiles past a sequence's rows have no
  // workspace slot.
  const SeqInfo seq = SeqInfo::of<true>(p, b);
  if (threadIdx.x == 0) seq.check(p);
  const int64_t m0 = m_tile * kBlockM;
  if (m0 >= seq.nq) return;
  // Two threads a row, D / 2 columns each.
  const int r = threadIdx.x / 2, half = threadIdx.x % 2;
  float acc = 0.f;
  if (m0 + r < seq.nq) {
    const int64_t o_off = seq.o_offset(p) + h * p.o_head_stride + (m0 + r) * p.o_row_stride + half * (D / 2);
    const T* o = static_cast<const T*>(p.out) + o_off;
    const T* res = p.out_resid ? static_cast<const T*>(p.out_resid) + o_off : nullptr;
    const T* d = static_cast<const T*>(p.dout) + seq.do_offset(p) + h * p.do_head_stride + (m0 + r) * p.do_row_stride +
                 half * (D / 2);
    if (f.vec && D % 16 == 0) {
#pragma unroll
      for (int c = 0; c < D / 2; c += 8) {
        const uint4 ov = *reinterpret_cast<const uint4*>(o + c), dv = *reinterpret_cast<const uint4*>(d + c);
        const uint4 rv = res ? *reinterpret_cast<const uint4*>(res + c) : make_uint4(0u, 0u, 0u, 0u);
        const uint32_t ow[4] = {ov.x, ov.y, ov.z, ov.w}, dw[4] = {dv.x, dv.y, dv.z, dv.w},
                       rw[4] = {rv.x, rv.y, rv.z, rv.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 o2 = unpack2<T>(ow[j]), d2 = unpack2<T>(dw[j]), r2 = unpack2<T>(rw[j]);
          acc = fmaf(d2.x, o2.x + r2.x, acc);
          acc = fmaf(d2.y, o2.y + r2.y, acc);
        }
      }
    } else {
#pragma unroll 8
      for (int c = 0; c < D / 2; ++c) acc = fmaf(to_float(d[c]), to_float(o[c]) + (res ? to_float(res[c]) : 0.f), acc);
    }
  }
  acc += __shfl_xor_sync(0xffffffffu, acc, 1);
  const int64_t row = ws.tile(seq, h, m_tile) * kBlockM + r;
  if (half == 0) {
    ws.delta[row] = acc;
    ws.lse2[row] =
        m0 + r < seq.nq ? lse_log2(static_cast<const float*>(p.lse)[seq.lse_offset(p, h) + m0 + r]) : CUDART_INF_F;
  }
}

template <typename T, int D, typename Scheduler>
__global__ void __launch_bounds__(kThreads) bwd_post_kernel(const BwdParams p, const DqAccum dqa) {
  const int nh = (int)p.num_heads;
  const int64_t h = Scheduler::head(nh), m_tile = Scheduler::m_tile(nh), b = Scheduler::batch();
  const SeqInfo seq = SeqInfo::of<true>(p, b);
  const int64_t m0 = m_tile * kBlockM;
  if (m0 >= seq.nq) return;
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, qc = lane % 4;
  const float* acc = dqa.ptr + dqa.tile(seq, h, m_tile) * (kBlockM * D);
  T* dq = static_cast<T*>(p.dq) + seq.dq_offset(p) + h * p.dq_head_stride + m0 * p.dq_row_stride;
  const int vr = (int)imin(kBlockM, seq.nq - m0);
  const float s = p.softmax_scale;
#pragma unroll 4
  for (int d8 = 0; d8 < D / 8; ++d8) {
    const float4 v = *reinterpret_cast<const float4*>(acc + ((w * (D / 8) + d8) * 32 + lane) * 4);
    const int r = w * 16 + g, c = d8 * 8 + 2 * qc;
    if (r < vr) *reinterpret_cast<uint32_t*>(dq + r * p.dq_row_stride + c) = pack2<T>(v.x * s, v.y * s);
    if (r + 8 < vr) *reinterpret_cast<uint32_t*>(dq + (r + 8) * p.dq_row_stride + c) = pack2<T>(v.z * s, v.w * s);
  }
}

}  // namespace cuda
}  // namespace flexdma
