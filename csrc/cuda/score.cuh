// The score of one (query row, key) pair, shared by the forward and both backward kernels so
// that all three see bit-identical logits: s = softcap(scale * q.k) + bias, -inf where dropped.
#pragma once
#include "tile_io.cuh"

namespace flexdma {
namespace cuda {

struct ScoreMod {
  float scale, softcap;
  Broadcast4d bias;
  int64_t b, h;

  // Bias of the calling warp's 16 rows of the tile at (m0, n0), lane's keys lane and lane + 32;
  // read only where kept (a dropped entry costs no bias byte). All 32 loads of a lane are
  // issued before any is used, so their latencies overlap.
  template <typename T>
  __device__ inline void load_bias(const uint8_t* keep, int64_t m0, int64_t n0, float (&bv)[16][2]) const {
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    const T* bp = static_cast<const T*>(bias.ptr);
#pragma unroll
    for (int rr = 0; rr < 16; ++rr)
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int r = w * 16 + rr, c = lane + 32 * u;
        bv[rr][u] = (bp && keep[r * kBlockN + c]) ? to_float<T>(bp[bcast_offset(bias, b, h, m0 + r, n0 + c)]) : 0.f;
      }
  }

  // raw = q.k from the MMA; tanh_out receives tanh(scale * raw / softcap) (0 without softcap),
  // which the backward needs for the softcap's derivative.
  __device__ inline float operator()(float raw, bool keep, float bias_val, float* tanh_out) const {
    *tanh_out = 0.f;
    if (!keep) return -CUDART_INF_F;
    float x = raw * scale;
    if (softcap > 0.f) {
      const float t = tanhf(x / softcap);
      *tanh_out = t;
      x = softcap * t;
    }
    return x + bias_val;
  }
};

}  // namespace cuda
}  // namespace flexdma
