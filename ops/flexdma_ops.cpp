// The flexdma op family: schemas (one definition for every device) and the CPU kernels.
// Fake (meta) kernels and autograd are registered from Python (flexdma/_ops.py).
#include <ATen/Parallel.h>
#include <Python.h>
#include <torch/library.h>

#include "../csrc/cpu/flash_dma_cpu.h"
#include "op_impl.h"

extern "C" {
// A bare module so `import flexdma._C` loads this library and runs the registrations below; it
// carries the constants Python shares with the kernels (csrc/flash_dma_constants.h).
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  if (PyModule_AddIntConstant(m, "TILE_SIZE", flexdma::kTileSize) < 0 ||
      PyModule_AddIntConstant(m, "TILES_PER_WORD", flexdma::kTilesPerWord) < 0 ||
      PyModule_AddIntConstant(m, "MAX_GRID_DIM", static_cast<long>(flexdma::kMaxGridDim)) < 0 ||
      PyModule_AddObject(m, "LN2", PyFloat_FromDouble(flexdma::kLn2)) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
}

namespace flexdma {
namespace {

const cpu::ParallelFor kAtenParallelFor = [](int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) { fn(b, e); });
};

// The CPU kernel finds empty tiles itself (it reads each mask tile once per pass anyway), so it
// checks a given tile_meta but does not read it.
std::tuple<at::Tensor, at::Tensor> fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& bias,
                                           double softmax_scale, bool is_causal, double softcap,
                                           bool /*deterministic: read by the backward*/,
                                           const c10::optional<at::Tensor>& tile_meta) {
  return fwd_impl(q, k, v, mask, bias, softmax_scale, is_causal, softcap, tile_meta,
                  [](const FwdParams& p) { cpu::run_fwd(p, kAtenParallelFor); });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& bias, const at::Tensor& out,
    const at::Tensor& lse, double softmax_scale, bool is_causal, double softcap, bool bias_requires_grad,
    bool deterministic, const c10::optional<at::Tensor>& tile_meta) {
  return bwd_impl(dout, q, k, v, mask, bias, out, lse, softmax_scale, is_causal, softcap, bias_requires_grad,
                  deterministic, tile_meta, [](const BwdParams& p) { cpu::run_bwd(p, kAtenParallelFor); });
}

// Bit (kt % 32) of word kt / 32 of row (b, h, qt): the 64 x 64 tile keeps some (i, j) with
// mask[b, h, i, j] and, under causality, j <= i + K - Q.
at::Tensor tile_meta_cpu(const at::Tensor& mask, int64_t seqlen_q, int64_t seqlen_k, bool is_causal) {
  tile_meta_params(mask, seqlen_q, seqlen_k, is_causal);  // the checks
  at::Tensor meta = at::zeros(tile_meta_shape(mask.sizes(), seqlen_q, seqlen_k), mask.options().dtype(at::kInt));
  const auto m = mask.accessor<bool, 4>();
  auto out = meta.accessor<int32_t, 4>();
  const bool row_b = mask.size(2) == 1, col_b = mask.size(3) == 1;
  for (int64_t b = 0; b < mask.size(0); ++b)
    for (int64_t h = 0; h < mask.size(1); ++h)
      for (int64_t i = 0; i < seqlen_q; ++i)
        for (int64_t j = 0; j < seqlen_k; ++j) {
          if (is_causal && j > i + seqlen_k - seqlen_q) break;
          if (!m[b][h][row_b ? 0 : i][col_b ? 0 : j]) continue;
          const int64_t kt = j / kTileSize;
          out[b][h][i / kTileSize][kt / kTilesPerWord] |= static_cast<int32_t>(1u << (kt % kTilesPerWord));
        }
  return meta;
}

}  // namespace

TORCH_LIBRARY(flexdma, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? attn_bias, float softmax_scale, "
      "bool is_causal, float softcap, bool deterministic, Tensor? tile_meta=None) -> (Tensor out, Tensor lse)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? attn_bias, Tensor out, "
      "Tensor lse, float softmax_scale, bool is_causal, float softcap, bool bias_requires_grad, "
      "bool deterministic, Tensor? tile_meta=None) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias)",
      {at::Tag::pt2_compliant_tag});
  // Which 64 x 64 (query, key) tiles of attn_mask keep anything (bounds and causality applied):
  // computed once per mask and handed to fwd and bwd, whose CUDA kernels then skip empty tiles
  // without reading their bytes.
  m.def("tile_meta(Tensor attn_mask, SymInt seqlen_q, SymInt seqlen_k, bool is_causal) -> Tensor",
        {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(flexdma, CPU, m) {
  m.impl("fwd", &fwd_cpu);
  m.impl("bwd", &bwd_cpu);
  m.impl("tile_meta", &tile_meta_cpu);
}

}  // namespace flexdma
