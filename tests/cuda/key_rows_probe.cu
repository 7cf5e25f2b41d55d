// Checks the K / V tile loaders' key sources alone: issue_kv (forward) and issue_keys
// (backward) fill a smem tile from ContiguousKeys and from GatheredKeys (a shuffled index list,
// the tail tile cut by seqlen_k), 16-byte and element paths, head dims 64 / 96 / 128; the tile
// is read back through tile_index and compared with the rows on the host. Exit status 1 on any
// mismatch.
//   nvcc -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -DFLEXDMA_SM90A -I csrc tests/cuda/key_rows_probe.cu -o /tmp/kr && /tmp/kr
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/copy.cuh"

using namespace flexdma::cuda;
using T = __nv_bfloat16;

// Tile n0 of the key source into smem by the forward's (which = 0) or the backward's loader,
// then out[r][col] (64 x D, row-major) from the tile layout.
template <int D, typename Keys>
__global__ void load_tile(const T* k, const T* v, int64_t rs, Keys keys, int64_t n0, int64_t seqlen_k, bool vec, int which,
                          T* out_k, T* out_v) {
  __shared__ __align__(1024) T sk[tile_bytes<D>() / 2];
  __shared__ __align__(1024) T sv[tile_bytes<D>() / 2];
  if (which == 0) {
    issue_kv<T, D, Keys>(k, v, rs, rs, seqlen_k, n0, sk, sv, vec, keys);
  } else {
    issue_keys<T, D>(sk, k, rs, keys, n0, seqlen_k, vec);
    issue_keys<T, D>(sv, v, rs, keys, n0, seqlen_k, vec);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  for (int i = threadIdx.x; i < 64 * D; i += blockDim.x) {
    out_k[i] = sk[tile_index<D>(i / D, i % D)];
    out_v[i] = sv[tile_index<D>(i / D, i % D)];
  }
}

template <int D>
int run(bool gathered, bool vec, int which) {
  const int rows = 300, seqlen_k = 150, rs = D + 8;  // 150 keys: tiles 0, 64 full, 128 cut
  std::vector<T> k(rows * rs), v(rows * rs);
  for (int i = 0; i < rows * rs; ++i) {
    k[i] = __float2bfloat16(float(i % 251) - 125.f);
    v[i] = __float2bfloat16(float((i * 7) % 241) - 120.f);
  }
  std::vector<int32_t> idx(seqlen_k);
  for (int i = 0; i < seqlen_k; ++i) idx[i] = gathered ? (i * 97 + 13) % rows : i;
  T *dk, *dv, *ok, *ov;
  int32_t* didx;
  cudaMalloc(&dk, k.size() * 2);
  cudaMalloc(&dv, v.size() * 2);
  cudaMalloc(&ok, 64 * D * 2);
  cudaMalloc(&ov, 64 * D * 2);
  cudaMalloc(&didx, idx.size() * 4);
  cudaMemcpy(dk, k.data(), k.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dv, v.data(), v.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(didx, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice);
  int bad = 0;
  for (int n0 = 0; n0 < seqlen_k; n0 += 64) {
    if (gathered)
      load_tile<D><<<1, kThreads>>>(dk, dv, rs, GatheredKeys{didx}, n0, seqlen_k, vec, which, ok, ov);
    else
      load_tile<D><<<1, kThreads>>>(dk, dv, rs, ContiguousKeys{}, n0, seqlen_k, vec, which, ok, ov);
    const cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
      printf("D=%d: %s\n", D, cudaGetErrorString(err));
      return 1;
    }
    std::vector<T> hk(64 * D), hv(64 * D);
    cudaMemcpy(hk.data(), ok, hk.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(hv.data(), ov, hv.size() * 2, cudaMemcpyDeviceToHost);
    for (int r = 0; r < 64; ++r)
      for (int c = 0; c < D; ++c) {
        const bool in = n0 + r < seqlen_k;
        const float ek = in ? __bfloat162float(k[idx[n0 + r] * rs + c]) : 0.f;
        const float ev = in ? __bfloat162float(v[idx[n0 + r] * rs + c]) : 0.f;
        bad += __bfloat162float(hk[r * D + c]) != ek || __bfloat162float(hv[r * D + c]) != ev;
      }
  }
  printf("D=%3d %-10s %-7s %-8s: %s (%d wrong)\n", D, gathered ? "gathered" : "contiguous", vec ? "16-byte" : "element",
         which ? "backward" : "forward", bad ? "FAIL" : "ok", bad);
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(ok);
  cudaFree(ov);
  cudaFree(didx);
  return bad != 0;
}

int main() {
  int fails = 0;
  for (int which = 0; which < 2; ++which)
    for (int g = 0; g < 2; ++g)
      for (int vec = 0; vec < 2; ++vec) {
        fails += run<64>(g, vec, which);
        fails += run<96>(g, vec, which);
        fails += run<128>(g, vec, which);
      }
  printf("%s\n", fails ? "key_rows_probe: FAILED" : "key_rows_probe: all ok");
  return fails ? 1 : 0;
}
