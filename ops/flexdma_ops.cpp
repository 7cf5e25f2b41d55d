// The flexdma op family: schemas (one definition for every device) and the CPU kernels.
// Fake (meta) kernels and autograd are registered from Python (flexdma/_ops.py).
#include <limits>
#include <ATen/Parallel.h>
#include <Python.h>
#include <torch/library.h>

#include "../csrc/cpu/flash_dma_cpu.h"
#include "../csrc/cpu/perkey_select.h"
#include "op_impl.h"

namespace {
// _C.perkey_list_cap(K, window, tile_rows): the list cap rule of csrc/flash_dma_constants.h.
PyObject* py_perkey_list_cap(PyObject*, PyObject* args) {
  long long K = 0, window = 0, tile_rows = 0;
  if (!PyArg_ParseTuple(args, "LLL", &K, &window, &tile_rows)) return nullptr;
  return PyLong_FromLongLong(flexdma::perkey_list_cap(K, window, tile_rows));
}
// _C.cuda_unsupported_reason(batch, num_heads, num_heads_k, head_dim, dtype, softcap): the CUDA
// kernels' own check (cuda::unsupported_reason) of a dense call of these sizes, for Python's backend
// choice; None when they take it. dtype is flexdma::DType's value (-1: a dtype it has no code for).
PyObject* py_cuda_unsupported_reason(PyObject*, PyObject* args) {
  long long batch = 0, heads = 0, heads_k = 0, head_dim = 0;
  int dtype = -1;
  double softcap = 0.0;
  if (!PyArg_ParseTuple(args, "LLLLid", &batch, &heads, &heads_k, &head_dim, &dtype, &softcap)) return nullptr;
  const flexdma::SupportCheck check = flexdma::cuda_support_check();
  if (check == nullptr) return PyUnicode_FromString("flexdma was built without CUDA kernels");
  if (dtype < 0) return PyUnicode_FromString("dtype must be bfloat16 or float16");
  flexdma::FwdParams p;
  p.batch = batch;
  p.num_heads = heads;
  p.num_heads_k = heads_k;
  p.head_dim = head_dim;
  p.dtype = static_cast<flexdma::DType>(dtype);
  p.softcap = static_cast<float>(softcap);
  const char* why = check(p);
  if (why == nullptr) Py_RETURN_NONE;
  return PyUnicode_FromString(why);
}

// _C.perkey_unsupported_reason(batch, num_heads, num_heads_k, head_dim, seqlen_q, seqlen_k, dtype,
// bias_dtype, softcap, rows_aligned, kv_row_stride, device_arch, backward, deterministic): the C++
// per-key kernels' own check (cuda::perkey_unsupported_reason, cuda::PerkeyCall's fields) for
// Python's per-key route; None when they take the call. dtypes as flexdma::DType's values (-1: none).
PyObject* py_perkey_unsupported_reason(PyObject*, PyObject* args) {
  flexdma::cuda::PerkeyCall c;
  int aligned = 1, backward = 0, deterministic = 0;
  double softcap = 0.0;
  long long sizes[6] = {0, 0, 0, 0, 0, 0}, kv_row_stride = 0;
  if (!PyArg_ParseTuple(args, "LLLLLLiidpLipp", &sizes[0], &sizes[1], &sizes[2], &sizes[3], &sizes[4], &sizes[5],
                        &c.dtype, &c.bias_dtype, &softcap, &aligned, &kv_row_stride, &c.device_arch, &backward,
                        &deterministic))
    return nullptr;
  const flexdma::PerkeySupportCheck check = flexdma::perkey_support_check();
  if (check == nullptr) return PyUnicode_FromString("flexdma was built without CUDA kernels");
  c.batch = sizes[0];
  c.num_heads = sizes[1];
  c.num_heads_k = sizes[2];
  c.head_dim = sizes[3];
  c.seqlen_q = sizes[4];
  c.seqlen_k = sizes[5];
  c.softcap = static_cast<float>(softcap);
  c.rows_aligned = aligned != 0;
  c.kv_row_stride = kv_row_stride;
  c.backward = backward != 0;
  c.deterministic = deterministic != 0;
  const char* why = check(c);
  if (why == nullptr) Py_RETURN_NONE;
  return PyUnicode_FromString(why);
}

PyMethodDef kMethods[] = {
    {"perkey_list_cap", py_perkey_list_cap, METH_VARARGS, "Entries of a per-key selection tile's key list."},
    {"cuda_unsupported_reason", py_cuda_unsupported_reason, METH_VARARGS,
     "The CUDA kernels' support check of a dense call: None, or why not."},
    {"perkey_unsupported_reason", py_perkey_unsupported_reason, METH_VARARGS,
     "The C++ per-key kernels' support check of a padded per-key call: None, or why not."},
    {nullptr, nullptr, 0, nullptr}};
}  // namespace

namespace flexdma {
SupportCheck& cuda_support_check() {
  static SupportCheck check = nullptr;
  return check;
}
PerkeySupportCheck& perkey_support_check() {
  static PerkeySupportCheck check = nullptr;
  return check;
}
}  // namespace flexdma

extern "C" {
// A bare module so `import flexdma._C` loads this library and runs the registrations below; it
// carries the constants Python shares with the kernels (csrc/flash_dma_constants.h).
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, kMethods};
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  if (PyModule_AddIntConstant(m, "TILE_SIZE", flexdma::kTileSize) < 0 ||
      PyModule_AddIntConstant(m, "PERKEY_TILE_ROWS", flexdma::kPerkeyTileRows) < 0 ||
      PyModule_AddIntConstant(m, "PERKEY_CPU_TILE_ROWS", flexdma::kPerkeyCpuTileRows) < 0 ||
      PyModule_AddIntConstant(m, "NEVER_KEPT", flexdma::kNeverKept) < 0 ||
      PyModule_AddIntConstant(m, "TILES_PER_WORD", flexdma::kTilesPerWord) < 0 ||
      PyModule_AddIntConstant(m, "MAX_GRID_DIM", static_cast<long>(flexdma::kMaxGridDim)) < 0 ||
      PyModule_AddObject(m, "LN2", PyFloat_FromDouble(flexdma::kLn2)) < 0 ||
      PyModule_AddObject(m, "LOG2E", PyFloat_FromDouble(flexdma::kLog2e)) < 0) {
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

// The CPU kernels as fwd_impl / bwd_impl call them, given the scale and softcap in double (the
// params hold them rounded to float; float64 inputs are computed with these).
std::function<void(const FwdParams&)> cpu_fwd(double softmax_scale, double softcap) {
  return [c = ScoreConsts{softmax_scale, softcap}](const FwdParams& p) { cpu::run_fwd(p, c, kAtenParallelFor); };
}
std::function<void(const BwdParams&)> cpu_bwd(double softmax_scale, double softcap) {
  return [c = ScoreConsts{softmax_scale, softcap}](const BwdParams& p) {
    cpu::run_bwd(p, c, kAtenParallelFor, at::get_num_threads());
  };
}

// The CPU kernel finds empty tiles itself (it reads each mask tile once per pass anyway), so it
// checks a given tile_meta but does not read it.
// Its out_resid is empty: the CPU backward computes its row sums from P and dP itself.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const c10::optional<at::Tensor>& mask,
                                                       const c10::optional<at::Tensor>& bias, double softmax_scale,
                                                       bool is_causal, double softcap,
                                                       bool /*deterministic: read by the backward*/,
                                                       const c10::optional<at::Tensor>& tile_meta,
                                                       bool /*keep_resid: never kept here*/) {
  auto [out, lse] =
      fwd_impl(q, k, v, mask, bias, softmax_scale, is_causal, softcap, tile_meta, cpu_fwd(softmax_scale, softcap));
  return {out, lse, at::empty({0}, q.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& bias, const at::Tensor& out,
    const at::Tensor& lse, double softmax_scale, bool is_causal, double softcap, bool bias_requires_grad,
    bool deterministic, const c10::optional<at::Tensor>& tile_meta, const c10::optional<at::Tensor>& /*out_resid*/) {
  return bwd_impl(dout, q, k, v, mask, bias, out, lse, softmax_scale, is_causal, softcap, bias_requires_grad,
                  deterministic, tile_meta, cpu_bwd(softmax_scale, softcap));
}

// tile_keys serves the CUDA kernels' tile skipping; the CPU kernel derives the same from the
// ranks and thresholds of each tile as it goes.
std::tuple<at::Tensor, at::Tensor, at::Tensor> perkey_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& v, const at::Tensor& bias,
                                                              const at::Tensor& key_rank, const at::Tensor& row_thr,
                                                              double softmax_scale, bool is_causal, double softcap,
                                                              bool /*deterministic*/,
                                                              const c10::optional<at::Tensor>& /*tile_keys*/) {
  auto [out, lse] = perkey_fwd_impl(q, k, v, bias, key_rank, row_thr, softmax_scale, is_causal, softcap,
                                    cpu_fwd(softmax_scale, softcap));
  return {out, lse, at::empty({0}, q.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> perkey_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
    const at::Tensor& key_rank, const at::Tensor& row_thr, const at::Tensor& out, const at::Tensor& lse,
    double softmax_scale, bool is_causal, double softcap, bool bias_requires_grad, bool deterministic,
    const c10::optional<at::Tensor>& /*tile_keys*/, const c10::optional<at::Tensor>& /*out_resid*/) {
  return perkey_bwd_impl(dout, q, k, v, bias, key_rank, row_thr, out, lse, softmax_scale, is_causal, softcap,
                         bias_requires_grad, deterministic, cpu_bwd(softmax_scale, softcap));
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

// The per-key top-W selection of every plane of `scores` (P1, P2, K), -inf = ineligible. Ranked in
// float32: the conversion from float16 / bfloat16 keeps every value and so the order.
std::tuple<at::Tensor, at::Tensor, at::Tensor> perkey_select_cpu(const at::Tensor& scores, int64_t window,
                                                                 int64_t seqlen_q, bool is_causal, int64_t tile_rows) {
  perkey_select_check(scores, window, seqlen_q, tile_rows);
  const int64_t K = scores.size(2), P = scores.size(0) * scores.size(1);
  const at::Tensor s = scores.to(at::kFloat).contiguous();
  const SelectOutputs o = alloc_select_outputs(scores, window, seqlen_q, tile_rows, /*zero_lists=*/true);
  const int64_t per_plane = o.tile_keys.size(2);
  at::parallel_for(0, P, 1, [&](int64_t b, int64_t e) {
    for (int64_t pl = b; pl < e; ++pl)
      cpu::perkey_select_plane(s.data_ptr<float>() + pl * K, K, seqlen_q, window, is_causal, tile_rows, o.list_cap,
                               o.key_rank.data_ptr<int32_t>() + pl * K, o.row_thr.data_ptr<int32_t>() + pl * seqlen_q,
                               o.tile_keys.data_ptr<int32_t>() + pl * per_plane);
  });
  return {o.key_rank, o.row_thr, o.tile_keys};
}

// Packed sequences (flexdma::varlen_fwd / varlen_bwd): q (Tq, H, D), k / v (Tk, KVH, D), int32
// offsets cu_q / cu_k (batch + 1); bias none or per-key (heads, Tk). Each sequence runs the dense
// (or, with window > 0, the per-key top-window) kernel on views of its rows, its selection made
// within itself; lse is (H, Tq).
void varlen_check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cu_q, const at::Tensor& cu_k,
                  const c10::optional<at::Tensor>& bias, int64_t window) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 3, "flexdma::varlen: q, k, v must be (tokens, heads, head_dim)");
  for (const at::Tensor* cu : {&cu_q, &cu_k})
    TORCH_CHECK_VALUE(cu->scalar_type() == at::kInt && cu->dim() == 1 && cu->numel() >= 1,
                      "flexdma::varlen: cu_seqlens must be 1-D int32 (batch + 1)");
  TORCH_CHECK_VALUE(cu_q.numel() == cu_k.numel(), "flexdma::varlen: cu_seqlens_q and _k differ in length");
  TORCH_CHECK_VALUE(!bias.has_value() || (bias->dim() == 2 && bias->size(1) == k.size(0)),
                    "flexdma::varlen: the bias must be per key, (heads, Tk)");
  TORCH_CHECK_VALUE(window == 0 || bias.has_value(), "flexdma::varlen: a window needs the per-key bias");
}

// One sequence's views: (1, n, heads, D) rows and the (1, heads, 1, nk) bias.
struct Seq {
  int64_t q0, nq, k0, nk;
  at::Tensor rows(const at::Tensor& t, bool keys) const {
    return t.narrow(0, keys ? k0 : q0, keys ? nk : nq).unsqueeze(0);
  }
  c10::optional<at::Tensor> bias(const c10::optional<at::Tensor>& b) const {
    if (!b.has_value()) return c10::nullopt;
    return b->narrow(1, k0, nk).unsqueeze(0).unsqueeze(2);
  }
};

std::vector<Seq> varlen_seqs(const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t tq, int64_t tk, int64_t max_q,
                             int64_t max_k) {
  const at::Tensor cq = cu_q.contiguous(), ck = cu_k.contiguous();
  const int32_t* a = cq.data_ptr<int32_t>();
  const int32_t* b = ck.data_ptr<int32_t>();
  const int64_t n = cq.numel() - 1;
  TORCH_CHECK_VALUE(a[0] == 0 && a[n] == tq && b[0] == 0 && b[n] == tk,
                    "flexdma::varlen: cu_seqlens must start at 0 and end at the token counts");
  std::vector<Seq> seqs;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(a[i + 1] >= a[i] && b[i + 1] >= b[i], "flexdma::varlen: cu_seqlens must not decrease");
    TORCH_CHECK_VALUE(a[i + 1] - a[i] <= max_q && b[i + 1] - b[i] <= max_k, "flexdma::varlen: sequence ", i,
                      " is longer than max_seqlen (", a[i + 1] - a[i], " / ", b[i + 1] - b[i], " tokens, max ", max_q,
                      " / ", max_k, ")");
    seqs.push_back({a[i], a[i + 1] - a[i], b[i], b[i + 1] - b[i]});
  }
  return seqs;
}

// float64 scores (P1, P2, K) as float32 keys in their order, every one distinct, -inf kept (not
// eligible): the selection ranks only by order, and rounding the scores to float32 would tie those
// apart by less than float32's resolution. The rule of flexdma/perkey/contract.py's float64_order,
// which the dense per-key path's selection ranks: key j's value falls with its rank by (score
// desc, index asc; NaN first), as float32 bit patterns from the smallest normal number up.
at::Tensor float64_order(const at::Tensor& scores) {
  constexpr int64_t kFltMinBits = 0x00800000, kMaxKeys = 0x7F800000 - kFltMinBits;  // below +inf's bits
  const int64_t K = scores.size(-1);
  TORCH_CHECK_VALUE(K <= kMaxKeys, "flexdma::varlen: a float64 bias takes at most ", kMaxKeys,
                    " keys a sequence to select from, got ", K);
  const at::Tensor by_rank = std::get<1>(scores.sort(/*stable=*/true, /*dim=*/-1, /*descending=*/true));
  const at::Tensor ranks = at::arange(K, by_rank.options()).expand_as(by_rank);
  const at::Tensor rank = at::empty_like(by_rank).scatter_(-1, by_rank, ranks);
  const double inf = std::numeric_limits<double>::infinity();
  return ((K - 1 + kFltMinBits) - rank).to(at::kInt).view(at::kFloat).masked_fill(scores == -inf, -inf);
}

// The selection of one sequence (window > 0): key_rank / row_thr of its per-key bias, float64
// scores by their float64 order, as flash_dma_attention's selection ranks them.
std::tuple<at::Tensor, at::Tensor> varlen_select(const at::Tensor& bias, const Seq& s, int64_t window, bool causal) {
  const at::Tensor scores = bias.scalar_type() == at::kDouble ? float64_order(bias.squeeze(2)) : bias.squeeze(2);
  auto [rank, thr, lists] = perkey_select_cpu(scores, window, s.nq, causal, kPerkeyCpuTileRows);
  return {rank, thr};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_fwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q, const at::Tensor& cu_k,
    int64_t max_q, int64_t max_k, const c10::optional<at::Tensor>& bias, double softmax_scale, bool is_causal,
    double softcap, int64_t window, bool /*deterministic: read by the backward*/,
    bool /*keep_resid: never kept here*/) {
  varlen_check(q, k, cu_q, cu_k, bias, window);
  // Rows of a sequence without keys are never visited: output 0, LSE -inf.
  at::Tensor out = at::zeros(q.sizes(), q.options());
  at::Tensor lse = at::full({q.size(1), q.size(0)}, -std::numeric_limits<double>::infinity(),
                            q.options().dtype(acc_type(q.scalar_type())));
  const auto run = cpu_fwd(softmax_scale, softcap);
  for (const Seq& s : varlen_seqs(cu_q, cu_k, q.size(0), k.size(0), max_q, max_k)) {
    if (s.nq == 0 || s.nk == 0) continue;
    const auto b = s.bias(bias);
    at::Tensor o, l;
    if (window > 0) {
      auto [rank, thr] = varlen_select(*b, s, window, is_causal);
      std::tie(o, l) = perkey_fwd_impl(s.rows(q, false), s.rows(k, true), s.rows(v, true), *b, rank, thr, softmax_scale,
                                       is_causal, softcap, run);
    } else {
      std::tie(o, l) = fwd_impl(s.rows(q, false), s.rows(k, true), s.rows(v, true), c10::nullopt, b, softmax_scale,
                                is_causal, softcap, c10::nullopt, run);
    }
    out.narrow(0, s.q0, s.nq).copy_(o[0]);
    lse.narrow(1, s.q0, s.nq).copy_(l[0]);
  }
  // The CPU kernels keep out in the inputs' dtype only: no rounding error to return.
  return {out, lse, at::empty({0}, q.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> varlen_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
    const at::Tensor& cu_k, int64_t max_q, int64_t max_k, const c10::optional<at::Tensor>& bias, const at::Tensor& out,
    const at::Tensor& lse, double softmax_scale, bool is_causal, double softcap, int64_t window,
    bool bias_requires_grad, bool deterministic, const c10::optional<at::Tensor>& /*out_resid*/) {
  varlen_check(q, k, cu_q, cu_k, bias, window);
  // Every element is written: rows of a sequence with no keys (and keys no row sees) get zeros.
  at::Tensor dq = at::zeros(q.sizes(), q.options()), dk = at::zeros(k.sizes(), k.options());
  at::Tensor dv = at::zeros(v.sizes(), v.options());
  const bool want_dbias = bias_requires_grad && bias.has_value();
  at::Tensor dbias = want_dbias ? at::zeros(bias->sizes(), bias->options()) : at::empty({0}, q.options());
  const auto run = cpu_bwd(softmax_scale, softcap);
  for (const Seq& s : varlen_seqs(cu_q, cu_k, q.size(0), k.size(0), max_q, max_k)) {
    if (s.nq == 0 || s.nk == 0) continue;
    const auto b = s.bias(bias);
    const at::Tensor o = s.rows(out, false), l = lse.narrow(1, s.q0, s.nq).unsqueeze(0);
    const at::Tensor d = s.rows(dout, false);
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> g;
    if (window > 0) {
      auto [rank, thr] = varlen_select(*b, s, window, is_causal);
      g = perkey_bwd_impl(d, s.rows(q, false), s.rows(k, true), s.rows(v, true), *b, rank, thr, o, l.contiguous(),
                          softmax_scale, is_causal, softcap, want_dbias, deterministic, run);
    } else {
      g = bwd_impl(d, s.rows(q, false), s.rows(k, true), s.rows(v, true), c10::nullopt, b, o, l.contiguous(),
                   softmax_scale, is_causal, softcap, want_dbias, deterministic, c10::nullopt, run);
    }
    dq.narrow(0, s.q0, s.nq).copy_(std::get<0>(g)[0]);
    dk.narrow(0, s.k0, s.nk).copy_(std::get<1>(g)[0]);
    dv.narrow(0, s.k0, s.nk).copy_(std::get<2>(g)[0]);
    if (want_dbias) dbias.narrow(1, s.k0, s.nk).copy_(std::get<3>(g).view({-1, s.nk}));
  }
  return {dq, dk, dv, dbias};
}

}  // namespace

TORCH_LIBRARY(flexdma, m) {
  // Dense attention under attn_mask / attn_bias. out_resid is out's rounding error (the float
  // result minus out, in out's dtype and layout) where a kernel keeps out in float but returns it
  // rounded (the CUDA one, which writes it): its backward computes delta = rowsum(dout * out) in a
  // pass before its main kernel, and a bf16-rounded out is too coarse for a dbias summed over rows
  // or keys. Empty on CPU, whose backward computes the row sums itself, and where keep_resid is
  // false (no backward will follow: the API passes whether one can). bwd given none (or an empty
  // one) uses out alone.
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? attn_bias, float softmax_scale, "
      "bool is_causal, float softcap, bool deterministic, Tensor? tile_meta=None, bool keep_resid=True) "
      "-> (Tensor out, Tensor lse, Tensor out_resid)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? attn_bias, Tensor out, "
      "Tensor lse, float softmax_scale, bool is_causal, float softcap, bool bias_requires_grad, "
      "bool deterministic, Tensor? tile_meta=None, Tensor? out_resid=None) "
      "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias)",
      {at::Tag::pt2_compliant_tag});
  // Which 64 x 64 (query, key) tiles of attn_mask keep anything (bounds and causality applied):
  // computed once per mask and handed to fwd and bwd, whose CUDA kernels then skip empty tiles
  // without reading their bytes.
  m.def("tile_meta(Tensor attn_mask, SymInt seqlen_q, SymInt seqlen_k, bool is_causal) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  // The per-key top-`window` selection in compact form (flexdma/perkey/contract.py states it):
  // key_rank (P1, P2, K), row_thr (P1, P2, Q) and, per query tile of `tile_rows` rows, the
  // length-prefixed list of the keys its rows keep, each 1 + cap entries, side by side:
  // (P1, P2, ceil(Q / tile_rows) * (1 + cap)) (one flat dim keeps the shape free of a guard on the
  // tile count under torch.export).
  m.def(
      "perkey_select(Tensor scores, int window, SymInt seqlen_q, bool is_causal, int tile_rows) -> "
      "(Tensor key_rank, Tensor row_thr, Tensor tile_keys)",
      {at::Tag::pt2_compliant_tag});
  // fwd / bwd with the per-key selection in place of attn_mask: row i keeps key j iff
  // key_rank[b, h, j] <= row_thr[b, h, i] (and causality). key_rank (1|B, 1|KVH|H, K) int32 ranks
  // the keys of a selection plane (INT32_MAX: never kept), row_thr (1|B, 1|KVH|H, Q) int32 (-1:
  // the row keeps nothing); attn_bias is per key, (1|B, 1|KVH|H, 1, K). out_resid is out's rounding
  // error (out - float(out) rounded to out's dtype) where a kernel keeps out in float but returns it
  // rounded (the CUDA one): the backward's rowsum(dout * out) needs out in float for a per-key
  // dbias summed over every row. Empty where the backward recomputes that sum itself (CPU).
  // On CUDA these are the C++ kernels (flexdma_cuda.cpp), which read tile_keys: perkey_select's
  // lists of 128-row query tiles (kPerkeyTileRows); they take the calls cuda::perkey_unsupported_reason
  // admits (flexdma._C.perkey_unsupported_reason) and refuse the others with its reason. The CPU
  // kernels ignore tile_keys. The per-key route (flexdma/perkey/route.py) sends the CUDA calls these
  // kernels do not take to the Triton kernels, registered as flexdma_triton::perkey_fwd / perkey_bwd
  // (flexdma/perkey/ops.py).
  m.def(
      "perkey_fwd(Tensor q, Tensor k, Tensor v, Tensor attn_bias, Tensor key_rank, Tensor row_thr, "
      "float softmax_scale, bool is_causal, float softcap, bool deterministic, Tensor? tile_keys=None) "
      "-> (Tensor out, Tensor lse, Tensor out_resid)",
      {at::Tag::pt2_compliant_tag});
  // The gradients of perkey_fwd: the lists of the forward's call, out_resid as it returned it
  // (empty: none). Returns (dq, dk, dv, dbias), dbias empty unless bias_requires_grad.
  m.def(
      "perkey_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor attn_bias, Tensor key_rank, "
      "Tensor row_thr, Tensor out, Tensor lse, float softmax_scale, bool is_causal, float softcap, "
      "bool bias_requires_grad, bool deterministic, Tensor? tile_keys=None, Tensor? out_resid=None) "
      "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias)",
      {at::Tag::pt2_compliant_tag});
  // Packed sequences, FlashAttention's varlen layout: q (Tq, H, D), k / v (Tk, KVH, D), int32
  // offsets (batch + 1), attn_bias none or per key (heads, Tk); window > 0: each row keeps its
  // sequence's top-window keys by the bias (the selection never crosses a boundary). lse (H, Tq).
  // out_resid as fwd's (empty on CPU, and where keep_resid is false).
  m.def(
      "varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
      "SymInt max_seqlen_k, Tensor? attn_bias, float softmax_scale, bool is_causal, float softcap, int window, "
      "bool deterministic=False, bool keep_resid=True) -> (Tensor out, Tensor lse, Tensor out_resid)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "varlen_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? attn_bias, Tensor out, Tensor lse, float softmax_scale, "
      "bool is_causal, float softcap, int window, bool bias_requires_grad, bool deterministic=False, "
      "Tensor? out_resid=None) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias)",
      {at::Tag::pt2_compliant_tag});
  // varlen_fwd / varlen_bwd on the CUDA kernels that read the offsets on the device, without host
  // synchronisation: with a window the C++ per-key kernels (those of perkey_fwd / perkey_bwd; the
  // backward without softcap, the selection made again), attn_bias (heads, Tk)
  // required; with window 0 the dense kernels (every built head dim; attn_bias (heads, Tk) or none).
  // attn_bias in q's dtype. No other device implements them.
  m.def(
      "varlen_fwd_cuda(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
      "SymInt max_seqlen_k, Tensor? attn_bias, float softmax_scale, bool is_causal, float softcap, int window) "
      "-> (Tensor out, Tensor lse, Tensor out_resid)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "varlen_bwd_cuda(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? attn_bias, Tensor out, Tensor lse, Tensor out_resid, "
      "float softmax_scale, bool is_causal, float softcap, int window, bool bias_requires_grad, "
      "bool deterministic) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias)",
      {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(flexdma, CPU, m) {
  m.impl("varlen_fwd", &varlen_fwd_cpu);
  m.impl("varlen_bwd", &varlen_bwd_cpu);
  m.impl("fwd", &fwd_cpu);
  m.impl("bwd", &bwd_cpu);
  m.impl("tile_meta", &tile_meta_cpu);
  m.impl("perkey_select", &perkey_select_cpu);
  m.impl("perkey_fwd", &perkey_fwd_cpu);
  m.impl("perkey_bwd", &perkey_bwd_cpu);
}

}  // namespace flexdma
