// CUDA implementation of the flexdma op family; built only when torch has CUDA and nvcc exists.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../csrc/cuda/flash_dma_cuda.h"
#include "op_impl.h"

namespace flexdma {
namespace {

void check_supported(const FwdParams& p) {
  const char* why = cuda::unsupported_reason(p);
  TORCH_CHECK(why == nullptr, "flexdma CUDA kernel does not support this call: ", why,
              " (use backend='auto' to fall back to FlexAttention)");
}

std::tuple<at::Tensor, at::Tensor> fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const c10::optional<at::Tensor>& mask,
                                            const c10::optional<at::Tensor>& bias, double softmax_scale,
                                            bool is_causal, double softcap, bool /*deterministic*/) {
  c10::cuda::CUDAGuard guard(q.device());
  return fwd_impl(q, k, v, mask, bias, softmax_scale, is_causal, softcap, [](const FwdParams& p) {
    check_supported(p);
    cuda::run_fwd(p, at::cuda::getCurrentCUDAStream().stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& bias, const at::Tensor& out,
    const at::Tensor& lse, double softmax_scale, bool is_causal, double softcap, bool bias_requires_grad,
    bool deterministic) {
  c10::cuda::CUDAGuard guard(q.device());
  return bwd_impl(dout, q, k, v, mask, bias, out, lse, softmax_scale, is_causal, softcap, bias_requires_grad,
                  deterministic, [](const BwdParams& p) {
                    check_supported(p);
                    cuda::run_bwd(p, at::cuda::getCurrentCUDAStream().stream());
                    C10_CUDA_KERNEL_LAUNCH_CHECK();
                  },
                  /*device_stores_dbias_dtype=*/true);
}

}  // namespace

TORCH_LIBRARY_IMPL(flexdma, CUDA, m) {
  m.impl("fwd", &fwd_cuda);
  m.impl("bwd", &bwd_cuda);
}

}  // namespace flexdma
