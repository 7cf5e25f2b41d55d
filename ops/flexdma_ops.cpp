// The flexdma op family: schemas (one definition for every device) and the CPU kernels.
// Fake (meta) kernels and autograd are registered from Python (flexdma/_ops.py).
#include <limits>
#include <ATen/Parallel.h>
#include <Python.h>
#include <torch/library.h>

#include "../csrc/cpu/flash_dma_cpu.h"
#include "../csrc/cpu/decode_step.h"
#include "../csrc/cpu/perkey_select.h"
#include "decode_impl.h"
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

// _C.decode_unsupported_reason(batch, num_heads, planes, head_dim, window, capacity, dtype,
// score_dtype): the CUDA decode kernels' own check (planes: the attention planes a batch row, the kv
// heads or, with a kept set a query head, the heads) (cuda::decode_unsupported_reason) for Python's
// route of a cached step; None when they take it. dtypes as flexdma::DType's values (-1: none).
PyObject* py_decode_unsupported_reason(PyObject*, PyObject* args) {
  flexdma::DecodeParams p;
  int dtype = -1, score_dtype = -1;
  if (!PyArg_ParseTuple(args, "LLLLLLii", &p.batch, &p.num_heads, &p.num_heads_k, &p.head_dim, &p.window, &p.capacity,
                        &dtype, &score_dtype))
    return nullptr;
  const flexdma::DecodeSupportCheck check = flexdma::decode_support_check();
  if (check == nullptr) return PyUnicode_FromString("flexdma was built without CUDA kernels");
  if (dtype < 0 || score_dtype < 0) return PyUnicode_FromString("a dtype the kernels have no code for");
  p.dtype = static_cast<flexdma::DType>(dtype);
  p.score_dtype = static_cast<flexdma::DType>(score_dtype);
  p.planes_per_batch = p.num_heads_k;  // the caller passes the attention planes a batch row there
  const char* why = check(p);
  if (why == nullptr) Py_RETURN_NONE;
  return PyUnicode_FromString(why);
}

PyMethodDef kMethods[] = {
    {"perkey_list_cap", py_perkey_list_cap, METH_VARARGS, "Entries of a per-key selection tile's key list."},
    {"cuda_unsupported_reason", py_cuda_unsupported_reason, METH_VARARGS,
     "The CUDA kernels' support check of a dense call: None, or why not."},
    {"perkey_unsupported_reason", py_perkey_unsupported_reason, METH_VARARGS,
     "The C++ per-key kernels' support check of a padded per-key call: None, or why not."},
    {"decode_unsupported_reason", py_decode_unsupported_reason, METH_VARARGS,
     "The CUDA decode kernels' support check of a cached step: None, or why not."},
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
DecodeSupportCheck& decode_support_check() {
  static DecodeSupportCheck check = nullptr;
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

// ---- The packed form on the CPU: each sequence runs the padded implementation on views of its
// rows (the offsets read on the host), its outputs copied into the packed ones. ----

// One sequence's views: rows (1, n, heads, D), the per-key bias (1, heads, 1, nk), and the per-key
// selection's planes key_rank (1, heads, nk) and row_thr (1, heads, nq).
struct Seq {
  int64_t q0, nq, k0, nk;
  at::Tensor rows(const at::Tensor& t, bool keys) const {
    return t.narrow(0, keys ? k0 : q0, keys ? nk : nq).unsqueeze(0);
  }
  c10::optional<at::Tensor> bias(const c10::optional<at::Tensor>& b) const {
    if (!b.has_value() || !b->defined()) return c10::nullopt;
    return b->narrow(1, k0, nk).unsqueeze(0).unsqueeze(2);
  }
  at::Tensor plane(const at::Tensor& t, bool keys) const {
    return t.narrow(1, keys ? k0 : q0, keys ? nk : nq).unsqueeze(0);
  }
};

// The sequences of s, its offsets read here and checked as the CUDA kernels check them on the device.
std::vector<Seq> packed_seqs(const Packed& s, const char* op) {
  const int32_t* a = s.cu_q.data_ptr<int32_t>();
  const int32_t* b = s.cu_k.data_ptr<int32_t>();
  const int64_t n = s.batch;
  TORCH_CHECK_VALUE(a[0] == 0 && a[n] == s.total_q && b[0] == 0 && b[n] == s.total_k, op,
                    ": cu_seqlens must start at 0 and end at the token counts (", s.total_q, " / ", s.total_k,
                    "), got ", a[0], "..", a[n], " / ", b[0], "..", b[n]);
  std::vector<Seq> seqs;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(a[i + 1] >= a[i] && b[i + 1] >= b[i], op, ": cu_seqlens must not decrease");
    TORCH_CHECK_VALUE(a[i + 1] - a[i] <= s.max_q && b[i + 1] - b[i] <= s.max_k, op, ": sequence ", i,
                      " is longer than max_seqlen (", a[i + 1] - a[i], " / ", b[i + 1] - b[i], " tokens, max ", s.max_q,
                      " / ", s.max_k, ")");
    seqs.push_back({a[i], a[i + 1] - a[i], b[i], b[i + 1] - b[i]});
  }
  return seqs;
}

// fwd / perkey_fwd packed: `one` is the padded forward of a sequence's views. Rows of a sequence
// without keys are never visited: output 0, LSE -inf. The CPU kernels keep out in the inputs' dtype
// only: no rounding error to return (out_resid empty).
std::tuple<at::Tensor, at::Tensor, at::Tensor> packed_fwd_cpu(const at::Tensor& q, const Packed& s, const char* op,
                                                              const std::function<FwdOutputs(const Seq&)>& one) {
  at::Tensor out = at::zeros(q.sizes(), q.options());
  at::Tensor lse = at::full({q.size(1), q.size(0)}, -std::numeric_limits<double>::infinity(),
                            q.options().dtype(acc_type(q.scalar_type())));
  for (const Seq& x : packed_seqs(s, op)) {
    if (x.nq == 0 || x.nk == 0) continue;
    auto [o, l] = one(x);
    out.narrow(0, x.q0, x.nq).copy_(o[0]);
    lse.narrow(1, x.q0, x.nq).copy_(l[0]);
  }
  return {out, lse, at::empty({0}, q.options())};
}

// bwd / perkey_bwd packed: `one` is the padded backward of a sequence's views, given its rows of
// grad_out and out and its (1, H, nq) lse. Every element is written: rows of a sequence with no keys
// (and keys no row sees) get zeros; dbias is the bias's (heads, Tk).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> packed_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const c10::optional<at::Tensor>& bias, bool want_dbias, const Packed& s, const char* op,
    const std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
        const Seq&, const at::Tensor& dout, const at::Tensor& out, const at::Tensor& lse)>& one) {
  packed_bwd_check(dout, q, out, lse, op);
  at::Tensor dq = at::zeros(q.sizes(), q.options()), dk = at::zeros(k.sizes(), k.options());
  at::Tensor dv = at::zeros(v.sizes(), v.options());
  at::Tensor dbias = want_dbias ? at::zeros(bias->sizes(), bias->options()) : at::empty({0}, q.options());
  for (const Seq& x : packed_seqs(s, op)) {
    if (x.nq == 0 || x.nk == 0) continue;
    const auto g = one(x, x.rows(dout, false), x.rows(out, false), lse.narrow(1, x.q0, x.nq).unsqueeze(0).contiguous());
    dq.narrow(0, x.q0, x.nq).copy_(std::get<0>(g)[0]);
    dk.narrow(0, x.k0, x.nk).copy_(std::get<1>(g)[0]);
    dv.narrow(0, x.k0, x.nk).copy_(std::get<2>(g)[0]);
    if (want_dbias) dbias.narrow(1, x.k0, x.nk).copy_(std::get<3>(g).view({-1, x.nk}));
  }
  return {dq, dk, dv, dbias};
}

// The CPU kernel finds empty tiles itself (it reads each mask tile once per pass anyway), so it
// checks a given tile_meta but does not read it.
// Its out_resid is empty: the CPU backward computes its row sums from P and dP itself.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
    const c10::optional<at::Tensor>& bias, double softmax_scale, bool is_causal, double softcap,
    bool /*deterministic: read by the backward*/, const c10::optional<at::Tensor>& tile_meta,
    bool /*keep_resid: never kept here*/, const c10::optional<at::Tensor>& cu_q, const c10::optional<at::Tensor>& cu_k,
    int64_t max_q, int64_t max_k) {
  const auto run = cpu_fwd(softmax_scale, softcap);
  if (packed_form(cu_q, cu_k, max_q, max_k, "flexdma::fwd")) {
    packed_dense_check(mask, tile_meta, "flexdma::fwd");
    const Packed s = packed_check(q, k, v, cu_q, cu_k, max_q, max_k, bias, "flexdma::fwd");
    return packed_fwd_cpu(q, s, "flexdma::fwd", [&](const Seq& x) {
      return fwd_impl(x.rows(q, false), x.rows(k, true), x.rows(v, true), c10::nullopt, x.bias(bias), softmax_scale,
                      is_causal, softcap, c10::nullopt, run);
    });
  }
  auto [out, lse] = fwd_impl(q, k, v, mask, bias, softmax_scale, is_causal, softcap, tile_meta, run);
  return {out, lse, at::empty({0}, q.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& bias, const at::Tensor& out,
    const at::Tensor& lse, double softmax_scale, bool is_causal, double softcap, bool bias_requires_grad,
    bool deterministic, const c10::optional<at::Tensor>& tile_meta, const c10::optional<at::Tensor>& /*out_resid*/,
    const c10::optional<at::Tensor>& cu_q, const c10::optional<at::Tensor>& cu_k, int64_t max_q, int64_t max_k) {
  const auto run = cpu_bwd(softmax_scale, softcap);
  if (packed_form(cu_q, cu_k, max_q, max_k, "flexdma::bwd")) {
    packed_dense_check(mask, tile_meta, "flexdma::bwd");
    const Packed s = packed_check(q, k, v, cu_q, cu_k, max_q, max_k, bias, "flexdma::bwd");
    const bool want_dbias = bias_requires_grad && bias.has_value() && bias->defined();
    return packed_bwd_cpu(dout, q, k, v, out, lse, bias, want_dbias, s, "flexdma::bwd",
                          [&](const Seq& x, const at::Tensor& d, const at::Tensor& o, const at::Tensor& l) {
                            return bwd_impl(d, x.rows(q, false), x.rows(k, true), x.rows(v, true), c10::nullopt,
                                            x.bias(bias), o, l, softmax_scale, is_causal, softcap, want_dbias,
                                            deterministic, c10::nullopt, run);
                          });
  }
  return bwd_impl(dout, q, k, v, mask, bias, out, lse, softmax_scale, is_causal, softcap, bias_requires_grad,
                  deterministic, tile_meta, run);
}

// tile_keys serves the CUDA kernels' tile skipping; the CPU kernel derives the same from the
// ranks and thresholds of each tile as it goes. Packed: each sequence's slices of key_rank / row_thr
// hold its own selection (perkey_select's packed form makes them so).
std::tuple<at::Tensor, at::Tensor, at::Tensor> perkey_fwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias, const at::Tensor& key_rank,
    const at::Tensor& row_thr, double softmax_scale, bool is_causal, double softcap, bool /*deterministic*/,
    const c10::optional<at::Tensor>& /*tile_keys*/, const c10::optional<at::Tensor>& cu_q,
    const c10::optional<at::Tensor>& cu_k, int64_t max_q, int64_t max_k) {
  const auto run = cpu_fwd(softmax_scale, softcap);
  if (packed_form(cu_q, cu_k, max_q, max_k, "flexdma::perkey_fwd")) {
    packed_perkey_check(q, k, bias, key_rank, row_thr, "flexdma::perkey_fwd");
    const Packed s = packed_check(q, k, v, cu_q, cu_k, max_q, max_k, bias, "flexdma::perkey_fwd");
    return packed_fwd_cpu(q, s, "flexdma::perkey_fwd", [&](const Seq& x) {
      return perkey_fwd_impl(x.rows(q, false), x.rows(k, true), x.rows(v, true), *x.bias(bias), x.plane(key_rank, true),
                             x.plane(row_thr, false), softmax_scale, is_causal, softcap, run);
    });
  }
  auto [out, lse] = perkey_fwd_impl(q, k, v, bias, key_rank, row_thr, softmax_scale, is_causal, softcap, run);
  return {out, lse, at::empty({0}, q.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> perkey_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
    const at::Tensor& key_rank, const at::Tensor& row_thr, const at::Tensor& out, const at::Tensor& lse,
    double softmax_scale, bool is_causal, double softcap, bool bias_requires_grad, bool deterministic,
    const c10::optional<at::Tensor>& /*tile_keys*/, const c10::optional<at::Tensor>& /*out_resid*/,
    const c10::optional<at::Tensor>& cu_q, const c10::optional<at::Tensor>& cu_k, int64_t max_q, int64_t max_k) {
  const auto run = cpu_bwd(softmax_scale, softcap);
  if (packed_form(cu_q, cu_k, max_q, max_k, "flexdma::perkey_bwd")) {
    packed_perkey_check(q, k, bias, key_rank, row_thr, "flexdma::perkey_bwd");
    const Packed s = packed_check(q, k, v, cu_q, cu_k, max_q, max_k, bias, "flexdma::perkey_bwd");
    return packed_bwd_cpu(dout, q, k, v, out, lse, bias, bias_requires_grad, s, "flexdma::perkey_bwd",
                          [&](const Seq& x, const at::Tensor& d, const at::Tensor& o, const at::Tensor& l) {
                            return perkey_bwd_impl(d, x.rows(q, false), x.rows(k, true), x.rows(v, true), *x.bias(bias),
                                                   x.plane(key_rank, true), x.plane(row_thr, false), o, l,
                                                   softmax_scale, is_causal, softcap, bias_requires_grad, deterministic,
                                                   run);
                          });
  }
  return perkey_bwd_impl(dout, q, k, v, bias, key_rank, row_thr, out, lse, softmax_scale, is_causal, softcap,
                         bias_requires_grad, deterministic, run);
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

// perkey_select's packed form: each (sequence, head) plane is the sequence's slice of scores
// (heads, Tk); its ranks, thresholds and lists are within the sequence, written at its offsets.
// The lists take the CUDA selection's packed layout (sequence b's query tile t in row
// cu_seqlens_q[b] / tile_rows + b + t: its tiles never reach the next sequence's), zeros past a
// list's length and in rows no sequence has; the CPU kernels read none of them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> perkey_select_packed_cpu(const at::Tensor& scores, int64_t window,
                                                                        int64_t seqlen_q, bool is_causal,
                                                                        int64_t tile_rows, const Packed& s) {
  const int64_t heads = scores.size(0), tk = scores.size(1);
  const at::Tensor sc = scores.to(at::kFloat).contiguous();
  const int64_t cap = perkey_list_cap(s.max_k, window, tile_rows), list_rows = seqlen_q / tile_rows + s.batch;
  const auto opts = scores.options().dtype(at::kInt);
  at::Tensor key_rank = at::empty({heads, tk}, opts), row_thr = at::empty({heads, seqlen_q}, opts);
  at::Tensor lists = at::zeros({heads, list_rows, 1 + cap}, opts);
  const std::vector<Seq> seqs = packed_seqs(s, "flexdma::perkey_select");
  const int64_t n = static_cast<int64_t>(seqs.size());
  at::parallel_for(0, n * heads, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const Seq& x = seqs[i / heads];
      const int64_t h = i % heads;
      cpu::perkey_select_plane(sc.const_data_ptr<float>() + h * tk + x.k0, x.nk, x.nq, window, is_causal, tile_rows,
                               cap, key_rank.data_ptr<int32_t>() + h * tk + x.k0,
                               row_thr.data_ptr<int32_t>() + h * seqlen_q + x.q0,
                               lists.data_ptr<int32_t>() + (h * list_rows + x.q0 / tile_rows + i / heads) * (1 + cap));
    }
  });
  return {key_rank, row_thr, lists};
}

// The per-key top-W selection of every plane of `scores` (P1, P2, K), -inf = ineligible. Ranked in
// float32: the conversion from float16 / bfloat16 keeps every value and so the order.
std::tuple<at::Tensor, at::Tensor, at::Tensor> perkey_select_cpu(const at::Tensor& scores, int64_t window,
                                                                 int64_t seqlen_q, bool is_causal, int64_t tile_rows,
                                                                 const c10::optional<at::Tensor>& cu_q,
                                                                 const c10::optional<at::Tensor>& cu_k, int64_t max_q,
                                                                 int64_t max_k) {
  const bool packed = packed_form(cu_q, cu_k, max_q, max_k, "flexdma::perkey_select");
  perkey_select_check(scores, window, seqlen_q, tile_rows, packed);
  if (packed)
    return perkey_select_packed_cpu(scores, window, seqlen_q, is_causal, tile_rows,
                                    packed_offsets(*cu_q, *cu_k, max_q, max_k, seqlen_q, scores.size(1),
                                                   scores.device(), "flexdma::perkey_select"));
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

void decode_cpu_run(DecodeParams& p) { cpu::run_decode(p, kAtenParallelFor); }

at::Tensor decode_step_cpu(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& kept_idx, const at::Tensor& kept_valid, const at::Tensor& kept_score,
                           const at::Tensor& s_new, const at::Tensor& eligible, int64_t position,
                           const c10::optional<at::Tensor>& position_at, double softmax_scale, double softcap) {
  return decode_step_impl(q, key_cache, value_cache, kept_idx, kept_valid, kept_score, s_new, eligible, position,
                          position_at, softmax_scale, softcap, decode_cpu_run);
}

at::Tensor decode_append_cpu(const at::Tensor& q, const at::Tensor& key_new, const at::Tensor& value_new,
                             const at::Tensor& s_new, const at::Tensor& eligible, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& bias_cache,
                             const at::Tensor& padding_cache, const at::Tensor& kept_idx, const at::Tensor& kept_valid,
                             const at::Tensor& kept_score, int64_t position, double softmax_scale, double softcap) {
  return decode_append_impl(q, key_new, value_new, s_new, eligible, key_cache, value_cache, bias_cache, padding_cache,
                            kept_idx, kept_valid, kept_score, position, softmax_scale, softcap, decode_cpu_run);
}

at::Tensor perkey_last_row_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& scores,
                               int64_t window, double softmax_scale, double softcap) {
  return perkey_last_row_impl(q, k, v, scores, window, softmax_scale, softcap,
                              [](DecodeParams& p) { cpu::run_last_row(p, kAtenParallelFor); });
}

}  // namespace

TORCH_LIBRARY(flexdma, m) {
  // The packed form. fwd, bwd, perkey_select, perkey_fwd and perkey_bwd end in the optional
  // `cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k`. Without the offsets (the defaults) a
  // call is in the padded form each op's comment states. With both, it is in the packed form
  // (FlashAttention's varlen layout): `batch` sequences of their own lengths, packed along the token
  // dim: q / out / grad_out (Tq, H, D), k / v (Tk, KVH, D); sequence b is rows
  // [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k / v.
  // The offsets are contiguous 1-D int32 (batch + 1) on q's device, start at 0, do not decrease and
  // end at Tq / Tk; max_seqlen_q / max_seqlen_k are at least the longest sequence's lengths (they
  // size the CUDA grids). Each sequence attends within itself, as a padded batch of its own would
  // (causality bottom-right aligned within it). Operands along the tokens are packed the same way:
  // lse (H, Tq) (float32 on CUDA, the accumulation dtype on CPU), out_resid (Tq, H, D) or empty, a
  // per-key attn_bias (heads, Tk) with heads in {1, KVH, H} and its dbias (heads, Tk), key_rank
  // (heads, Tk), row_thr (heads, Tq). Rows of a sequence without keys get out 0, lse -inf and zero
  // gradients. The CUDA implementations never read the offsets on the host (no synchronisation):
  // the first kernel of a call checks them and stops at a device-side assert on invalid ones; the
  // CPU ones read them and raise a ValueError. One offset without the other, or a max_seqlen
  // without them, is an error.

  // Dense attention under attn_mask / attn_bias. out_resid is out's rounding error (the float
  // result minus out, in out's dtype and layout) where a kernel keeps out in float but returns it
  // rounded (the CUDA one, which writes it): its backward computes delta = rowsum(dout * out) in a
  // pass before its main kernel, and a bf16-rounded out is too coarse for a dbias summed over rows
  // or keys. Empty on CPU, whose backward computes the row sums itself, and where keep_resid is
  // false (no backward will follow: the API passes whether one can). bwd given none (or an empty
  // one) uses out alone. Packed: no attn_mask (so no tile_meta); attn_bias none or per key.
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? attn_bias, float softmax_scale, "
      "bool is_causal, float softcap, bool deterministic, Tensor? tile_meta=None, bool keep_resid=True, "
      "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, SymInt max_seqlen_q=0, SymInt max_seqlen_k=0) "
      "-> (Tensor out, Tensor lse, Tensor out_resid)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? attn_bias, Tensor out, "
      "Tensor lse, float softmax_scale, bool is_causal, float softcap, bool bias_requires_grad, "
      "bool deterministic, Tensor? tile_meta=None, Tensor? out_resid=None, Tensor? cu_seqlens_q=None, "
      "Tensor? cu_seqlens_k=None, SymInt max_seqlen_q=0, SymInt max_seqlen_k=0) "
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
  // tile count under torch.export). Packed: scores (heads, Tk), seqlen_q = Tq; each sequence's
  // ranks and thresholds are within the sequence; tile_keys (heads, Tq // tile_rows + batch, 1 + cap)
  // with cap = perkey_list_cap(max_seqlen_k, window, tile_rows), sequence b's query tile t in row
  // cu_seqlens_q[b] // tile_rows + b + t (a sequence's tiles never reach the next one's).
  m.def(
      "perkey_select(Tensor scores, int window, SymInt seqlen_q, bool is_causal, int tile_rows, "
      "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, SymInt max_seqlen_q=0, SymInt max_seqlen_k=0) -> "
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
  // (flexdma/perkey/ops.py). Packed: attn_bias, key_rank, row_thr and tile_keys as perkey_select's
  // packed form makes them (on CUDA with tile_rows = 128); the support check sees the sequences as
  // the batch and max_seqlen as the lengths.
  m.def(
      "perkey_fwd(Tensor q, Tensor k, Tensor v, Tensor attn_bias, Tensor key_rank, Tensor row_thr, "
      "float softmax_scale, bool is_causal, float softcap, bool deterministic, Tensor? tile_keys=None, "
      "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, SymInt max_seqlen_q=0, SymInt max_seqlen_k=0) "
      "-> (Tensor out, Tensor lse, Tensor out_resid)",
      {at::Tag::pt2_compliant_tag});
  // The gradients of perkey_fwd: the selection and lists of the forward's call (the backward makes
  // none of its own), out_resid as it returned it (empty: none). Returns (dq, dk, dv, dbias), dbias
  // empty unless bias_requires_grad.
  m.def(
      "perkey_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor attn_bias, Tensor key_rank, "
      "Tensor row_thr, Tensor out, Tensor lse, float softmax_scale, bool is_causal, float softcap, "
      "bool bias_requires_grad, bool deterministic, Tensor? tile_keys=None, Tensor? out_resid=None, "
      "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, SymInt max_seqlen_q=0, SymInt max_seqlen_k=0) "
      "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias)",
      {at::Tag::pt2_compliant_tag});
  // One decode step of the per-key path (csrc/flash_dma_params.h's DecodeParams states it): the
  // new key at `position` of each (batch, kv head) plane enters the plane's kept set (kept_idx
  // int64, kept_valid bool, kept_score, each (B, KVH, W); updated in place) as
  // flexdma/perkey/decode.py's append decides, and the new query row q (B, 1, H, D), query head h
  // on kv head h // (H // KVH), attends over the updated set: logits softcap(softmax_scale q.k) +
  // score, a set with no key gives output 0. Returns the output (B, 1, H, D). The caches are
  // (B, capacity, KVH, D) (the library's layout; any strides but a contiguous head_dim).
  // decode_step: the new key's rows are in the caches already, s_new (B, KVH) its score in
  // kept_score's dtype, eligible (B, KVH) bool; `position_at` (one int64 on the device) where given
  // holds the position instead (a static cache's step under a CUDA graph: no host synchronisation).
  // decode_append: nn.DMACache's step on the layer's own tensors: the new key's rows key_new /
  // value_new (B, 1, KVH, D), its bias_new (B, KVH, 1, 1) and padding_new (B, 1) bool, written into
  // the caches, bias_cache (B, KVH, capacity) and padding_cache (B, capacity) at `position` after the
  // step's reads. On CUDA the kernels take float16 / bfloat16 with at most 32 query heads a kv head
  // and head_dim <= 256 (scores ranked in float32: float64 scores are refused); the CPU kernel
  // takes every float dtype (float64 ranked and computed in float64).
  m.def(
      "decode_step(Tensor q, Tensor key_cache, Tensor value_cache, Tensor(a!) kept_idx, Tensor(b!) kept_valid, "
      "Tensor(c!) kept_score, Tensor s_new, Tensor eligible, SymInt position, Tensor? position_at, "
      "float softmax_scale, float softcap) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "decode_append(Tensor q, Tensor key_new, Tensor value_new, Tensor bias_new, Tensor padding_new, "
      "Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor(c!) bias_cache, Tensor(d!) padding_cache, "
      "Tensor(e!) kept_idx, Tensor(f!) kept_valid, Tensor(g!) kept_score, SymInt position, float softmax_scale, "
      "float softcap) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  // A per-key call of one query row that sees every key (a decode step through the API: causal,
  // or not, Q = 1), without autograd and without its LSE: q (B, 1, H, D) against k / v
  // (B, K, KVH, D); each selection plane of `scores` (P1, P2, K) (flexdma/perkey/contract.py's
  // selection_scores: P1 in {1, B}, P2 in {1, KVH, H}, -inf never kept) keeps its top-`window` keys
  // by (score desc, index asc), and the row attends over them adding their scores (a kept key's
  // score is its bias). Returns the output (B, 1, H, D). On CUDA (float16 / bfloat16; scores float16,
  // bfloat16 or float32) a radix select of the kept sets (two histogram launches for 16-bit scores,
  // four for float32, then their ordered write) and the decode step's attention.
  m.def(
      "perkey_last_row(Tensor q, Tensor k, Tensor v, Tensor scores, int window, float softmax_scale, "
      "float softcap) -> Tensor",
      {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(flexdma, CPU, m) {
  m.impl("decode_step", &decode_step_cpu);
  m.impl("decode_append", &decode_append_cpu);
  m.impl("perkey_last_row", &perkey_last_row_cpu);
  m.impl("fwd", &fwd_cpu);
  m.impl("bwd", &bwd_cpu);
  m.impl("tile_meta", &tile_meta_cpu);
  m.impl("perkey_select", &perkey_select_cpu);
  m.impl("perkey_fwd", &perkey_fwd_cpu);
  m.impl("perkey_bwd", &perkey_bwd_cpu);
}

}  // namespace flexdma
