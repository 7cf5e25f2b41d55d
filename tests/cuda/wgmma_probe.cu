// Checks the forward's wgmma building blocks against a host product on random data, one
// warpgroup: S = Q K^T (A = Q from registers, K 128-byte-swizzled, K-major) and O = P V (A = P
// from registers, V swizzled, MN-major) for head dims 64 and 128. Prints the max error of each.
//   nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I csrc tests/cuda/wgmma_probe.cu -o /tmp/probe && /tmp/probe
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>

#include "cuda/mma_sm90.cuh"
#include "cuda/smem_layout.cuh"

using namespace flexdma::cuda;
using T = __nv_bfloat16;

// A operand (rows 64 x 16 cols at k step kk) of a row-major 64 x K matrix, in the m16n8k16 A layout.
__device__ void load_a(const T* m, int ld, int kk, uint32_t (&a)[4]) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  auto at = [&](int r, int col) {
    __nv_bfloat162 v;
    v.x = m[r * ld + col];
    v.y = m[r * ld + col + 1];
    return *reinterpret_cast<uint32_t*>(&v);
  };
  const int r = w * 16 + g, c0 = kk * 16 + 2 * c;
  a[0] = at(r, c0);
  a[1] = at(r + 8, c0);
  a[2] = at(r, c0 + 8);
  a[3] = at(r + 8, c0 + 8);
}

template <int N>
__device__ void store_d(float (&d)[N / 8][4], float* out) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  for (int j = 0; j < N / 8; ++j)
    for (int e = 0; e < 4; ++e) out[(w * 16 + g + 8 * (e / 2)) * N + 8 * j + 2 * c + (e % 2)] = d[j][e];
}

// S (64 x 64) = A (64 x D) B^T with B (64 x D) in smem; O (64 x D) = P (64 x 64) V (64 x D).
template <int D>
__global__ void probe(const T* a, const T* b, const T* p, float* s_out, float* o_out, int slot) {
  __shared__ __align__(1024) unsigned char tiles[3 * 64 * D * 2];
  unsigned char* tile = tiles + slot * 64 * D * 2;
  for (int i = threadIdx.x; i < 64 * D; i += blockDim.x) {
    const int r = i / D, col = i % D;
    *reinterpret_cast<T*>(tile + sw128_offset(64, r, col)) = b[i];
  }
  fence_proxy_async();
  __syncthreads();
  float s[8][4];
  for (int j = 0; j < 8; ++j)
    for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
  uint32_t qa[D / 16][4];
  for (int kk = 0; kk < D / 16; ++kk) load_a(a, D, kk, qa[kk]);
  wgmma_fence();
  for (int kk = 0; kk < D / 16; ++kk) wgmma_rs<T, 64, 0>(s, qa[kk], desc_k_major<64>(tile, kk), kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(s);
  store_d<64>(s, s_out);

  float o[D / 8][4];
  for (int j = 0; j < D / 8; ++j)
    for (int e = 0; e < 4; ++e) o[j][e] = 0.f;
  uint32_t pa[4][4];
  for (int kk = 0; kk < 4; ++kk) load_a(p, 64, kk, pa[kk]);
  fence_regs(o);
  wgmma_fence();
  for (int kk = 0; kk < 4; ++kk) wgmma_rs<T, D, 1>(o, pa[kk], desc_mn_major<64>(tile, kk), 1);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(o);
  store_d<D>(o, o_out);
}

template <int D>
void run(int slot) {
  std::vector<T> a(64 * D), b(64 * D), p(64 * 64);
  std::vector<float> af(64 * D), bf(64 * D), pf(64 * 64);
  auto fill = [](std::vector<T>& v, std::vector<float>& f) {
    for (size_t i = 0; i < v.size(); ++i) {
      v[i] = __float2bfloat16((rand() % 17 - 8) / 8.f);
      f[i] = __bfloat162float(v[i]);
    }
  };
  fill(a, af);
  fill(b, bf);
  fill(p, pf);
  T *da, *db, *dp;
  float *ds, *dout;
  cudaMalloc(&da, a.size() * 2);
  cudaMalloc(&db, b.size() * 2);
  cudaMalloc(&dp, p.size() * 2);
  cudaMalloc(&ds, 64 * 64 * 4);
  cudaMalloc(&dout, 64 * D * 4);
  cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dp, p.data(), p.size() * 2, cudaMemcpyHostToDevice);
  probe<D><<<1, 128>>>(da, db, dp, ds, dout, slot);
  const cudaError_t err = cudaDeviceSynchronize();
  std::vector<float> s(64 * 64), o(64 * D);
  cudaMemcpy(s.data(), ds, s.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(o.data(), dout, o.size() * 4, cudaMemcpyDeviceToHost);
  double es = 0, eo = 0;
  for (int i = 0; i < 64; ++i)
    for (int j = 0; j < 64; ++j) {
      double ref = 0;
      for (int k = 0; k < D; ++k) ref += af[i * D + k] * bf[j * D + k];
      es = fmax(es, fabs(ref - s[i * 64 + j]));
    }
  for (int i = 0; i < 64; ++i)
    for (int n = 0; n < D; ++n) {
      double ref = 0;
      for (int k = 0; k < 64; ++k) ref += pf[i * 64 + k] * bf[k * D + n];
      eo = fmax(eo, fabs(ref - o[i * D + n]));
    }
  printf("D=%d slot %d %s: max |S - ref| = %g, max |O - ref| = %g\n", D, slot, cudaGetErrorString(err), es, eo);
}

int main() {
  for (int slot = 0; slot < 3; ++slot) {
    run<64>(slot);
    run<128>(slot);
  }
  return 0;
}
