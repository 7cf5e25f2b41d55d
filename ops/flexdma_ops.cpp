// The flexdma op family: schemas (one definition for every device) and the CPU kernels.
// Fake (meta) kernels and autograd are registered from Python (flexdma/_ops.py).
#include <ATen/Parallel.h>
#include <Python.h>
#include <torch/library.h>

#include "../csrc/cpu/flash_dma_cpu.h"
#include "op_impl.h"

extern "C" {
// A bare module so `import flexdma._C` loads this library and runs the registrations below.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

namespace flexdma {
namespace {

const cpu::ParallelFor kAtenParallelFor = [](int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) { fn(b, e); });
};

std::tuple<at::Tensor, at::Tensor> fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const c10::optional<at::Tensor>& mask,
                                           const c10::optional<at::Tensor>& bias, double softmax_scale,
                                           bool is_causal, double softcap, bool /*deterministic: read by the backward*/) {
  return fwd_impl(q, k, v, mask, bias, softmax_scale, is_causal, softcap,
                  [](const FwdParams& p) { cpu::run_fwd(p, kAtenParallelFor); });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& bias, const at::Tensor& out,
    const at::Tensor& lse, double softmax_scale, bool is_causal, double softcap, bool bias_requires_grad,
    bool deterministic) {
  return bwd_impl(dout, q, k, v, mask, bias, out, lse, softmax_scale, is_causal, softcap, bias_requires_grad,
                  deterministic, [](const BwdParams& p) { cpu::run_bwd(p, kAtenParallelFor); });
}

}  // namespace

TORCH_LIBRARY(flexdma, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? attn_bias, float softmax_scale, "
      "bool is_causal, float softcap, bool deterministic) -> (Tensor out, Tensor lse)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? attn_bias, Tensor out, "
      "Tensor lse, float softmax_scale, bool is_causal, float softcap, bool bias_requires_grad, "
      "bool deterministic) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias)",
      {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(flexdma, CPU, m) {
  m.impl("fwd", &fwd_cpu);
  m.impl("bwd", &bwd_cpu);
}

}  // namespace flexdma
