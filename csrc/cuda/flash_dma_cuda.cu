// Entry points of the CUDA kernels: what is supported, and dispatch on (dtype, head dim).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "flash_dma_cuda.h"
#include "launch.h"

namespace flexdma {
namespace cuda {

namespace {
bool head_dim_built(int64_t d) {
#ifdef FLEXDMA_HEAD_DIM_32
  if (d == 32) return true;
#endif
#ifdef FLEXDMA_HEAD_DIM_64
  if (d == 64) return true;
#endif
#ifdef FLEXDMA_HEAD_DIM_96
  if (d == 96) return true;
#endif
#ifdef FLEXDMA_HEAD_DIM_128
  if (d == 128) return true;
#endif
#if defined(FLEXDMA_HEAD_DIM_192) && defined(FLEXDMA_SM90A)
  if (d == 192) return true;
#endif
#if defined(FLEXDMA_HEAD_DIM_256) && defined(FLEXDMA_SM90A)
  if (d == 256) return true;
#endif
  return false;
}

template <typename Fn>
void dispatch(const FwdParams& p, Fn&& fn) {
  const bool bf16 = p.dtype == DType::kBFloat16;
#ifdef FLEXDMA_HEAD_DIM_32
  if (p.head_dim == 32) { bf16 ? fn(__nv_bfloat16{}, std::integral_constant<int, 32>{}) : fn(__half{}, std::integral_constant<int, 32>{}); return; }
#endif
#ifdef FLEXDMA_HEAD_DIM_64
  if (p.head_dim == 64) { bf16 ? fn(__nv_bfloat16{}, std::integral_constant<int, 64>{}) : fn(__half{}, std::integral_constant<int, 64>{}); return; }
#endif
#ifdef FLEXDMA_HEAD_DIM_96
  if (p.head_dim == 96) { bf16 ? fn(__nv_bfloat16{}, std::integral_constant<int, 96>{}) : fn(__half{}, std::integral_constant<int, 96>{}); return; }
#endif
#ifdef FLEXDMA_HEAD_DIM_128
  if (p.head_dim == 128) { bf16 ? fn(__nv_bfloat16{}, std::integral_constant<int, 128>{}) : fn(__half{}, std::integral_constant<int, 128>{}); return; }
#endif
#if defined(FLEXDMA_HEAD_DIM_192) && defined(FLEXDMA_SM90A)
  if (p.head_dim == 192) { bf16 ? fn(__nv_bfloat16{}, std::integral_constant<int, 192>{}) : fn(__half{}, std::integral_constant<int, 192>{}); return; }
#endif
#if defined(FLEXDMA_HEAD_DIM_256) && defined(FLEXDMA_SM90A)
  if (p.head_dim == 256) { bf16 ? fn(__nv_bfloat16{}, std::integral_constant<int, 256>{}) : fn(__half{}, std::integral_constant<int, 256>{}); return; }
#endif
}
}  // namespace

const char* unsupported_reason(const FwdParams& p) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return "dtype must be bfloat16 or float16";
  if (p.head_dim != 32 && p.head_dim != 64 && p.head_dim != 96 && p.head_dim != 128 && p.head_dim != 192 &&
      p.head_dim != 256)
    return "head_dim must be 32, 64, 96, 128, 192 or 256";
  if (!head_dim_built(p.head_dim)) return "head_dim not built (FLEXDMA_HEAD_DIMS)";
  if (p.num_heads_k <= 0 || p.num_heads % p.num_heads_k != 0) return "num_heads must be a multiple of num_heads_k";
  if (p.num_heads > 65535 || p.batch > 65535) return "batch and num_heads must be <= 65535";
  if (p.softcap < 0.f) return "softcap must be >= 0";
  if (p.key_rank.ptr || p.row_thr.ptr) return "the top-k rank keep rule (key_rank / row_thr) is not implemented";
  return nullptr;
}

void run_fwd(const FwdParams& p, void* stream) {
  dispatch(p, [&](auto t, auto d) { launch_fwd<decltype(t), decltype(d)::value>(p, static_cast<cudaStream_t>(stream)); });
}

void run_bwd(const BwdParams& p, void* stream) {
  dispatch(p, [&](auto t, auto d) { launch_bwd<decltype(t), decltype(d)::value>(p, static_cast<cudaStream_t>(stream)); });
}

}  // namespace cuda
}  // namespace flexdma
