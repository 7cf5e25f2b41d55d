// Device-independent bodies of flexdma::fwd / flexdma::bwd: allocate, fill params, call the
// device's kernel, finish dbias. Each device file supplies only its kernel call.
#pragma once
#include <functional>
#include <tuple>
#include <vector>

#include "../csrc/cuda/flash_dma_cuda.h"
#include "params_from_tensors.h"

namespace flexdma {

// The CUDA kernels' support check (cuda::unsupported_reason), reachable from the CPU-side module so
// that Python asks the kernels instead of copying their rules: set by the CUDA binding
// (flexdma_cuda.cpp) when the extension has CUDA kernels, null otherwise.
using SupportCheck = const char* (*)(const FwdParams&);
SupportCheck& cuda_support_check();
// The C++ per-key kernels' check (cuda::perkey_unsupported_reason), reachable the same way.
using PerkeySupportCheck = const char* (*)(const cuda::PerkeyCall&);
PerkeySupportCheck& perkey_support_check();

// `into`: where set (defined), the caller's out / lse (views of a packed call's own outputs, which
// must not be views themselves), filled and returned; else fresh ones.
using FwdOutputs = std::tuple<at::Tensor, at::Tensor>;
using BwdOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

inline std::tuple<at::Tensor, at::Tensor> fwd_impl(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
    const c10::optional<at::Tensor>& bias, double softmax_scale, bool is_causal, double softcap,
    const c10::optional<at::Tensor>& tile_meta, const std::function<void(const FwdParams&)>& run,
    const Broadcast4d& key_rank = {}, const Broadcast4d& row_thr = {}, const FwdOutputs& into = {}) {
  auto [out, lse] = std::get<0>(into).defined() ? into : alloc_fwd_outputs(q);
  FwdParams p;
  fill_fwd_params(p, q, k, v, mask, bias, softmax_scale, is_causal, softcap, out, lse, tile_meta);
  p.key_rank = key_rank;
  p.row_thr = row_thr;
  if (out.numel() > 0) run(p);
  return {out, lse};
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_impl(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& bias, const at::Tensor& out,
    const at::Tensor& lse, double softmax_scale, bool is_causal, double softcap, bool bias_requires_grad,
    bool deterministic, const c10::optional<at::Tensor>& tile_meta, const std::function<void(const BwdParams&)>& run,
    bool device_stores_dbias_dtype = false, const Broadcast4d& key_rank = {}, const Broadcast4d& row_thr = {},
    const BwdOutputs& into = {}) {
  const bool given = std::get<0>(into).defined();  // the caller's dq / dk / dv (as fwd_impl's `into`)
  auto dq = given ? std::get<0>(into) : at::empty(q.sizes(), q.options());
  auto dk = given ? std::get<1>(into) : at::empty(k.sizes(), k.options());
  auto dv = given ? std::get<2>(into) : at::empty(v.sizes(), v.options());
  const bool want_dbias = bias_requires_grad && bias.has_value() && bias->defined();
  // A bias constant along the keys (key dim 1) adds one number to every score of a row, which the
  // softmax ignores: its gradient is exactly zero on every device, and no kernel sums it (summed
  // from dS it would return the rounding of delta, the CUDA kernels' rowsum(dout * out)).
  const bool dbias_zero = want_dbias && bias->dim() == 4 && bias->size(3) == 1;
  // device_stores_dbias_dtype: the device's kernel honours BwdParams::dbias_in_dtype, and with
  // it writes every element of dbias (zeros too), so the buffer is not filled here first.
  const bool dbias_direct = want_dbias && device_stores_dbias_dtype && dbias_needs_no_finish(q, k, *bias);
  c10::optional<at::Tensor> accum;
  if (dbias_direct) {
    accum = at::empty(bias->sizes(), q.options().dtype(bias->scalar_type()));
  } else if (want_dbias && !dbias_zero) {
    accum = alloc_dbias_accum(q, k, *bias);
  }
  // Scratch for delta_i, the row term of dS = P * (dP - delta), (B, H, Q), in the accumulation
  // dtype, for the CPU kernel, which fills it with rowsum(P * dP). The CUDA one keeps its delta,
  // rowsum(dout * (out + out_resid)) from a pass before its main kernel, in its own workspace
  // (out alone, rounded to bf16, is too coarse for a dbias summed over rows or keys).
  const auto acc_opts = q.options().dtype(acc_type(q.scalar_type()));
  at::Tensor softmax_d =
      q.is_cuda() ? at::empty({0}, acc_opts) : at::empty({q.size(0), q.size(2), q.size(1)}, acc_opts);
  BwdParams p;
  fill_bwd_params(p, dout, q, k, v, mask, bias, out, lse, softmax_scale, is_causal, softcap, dq, dk, dv, accum,
                  softmax_d, tile_meta);
  p.key_rank = key_rank;
  p.row_thr = row_thr;
  p.dbias_in_dtype = dbias_direct;
  p.deterministic = deterministic;
  if (q.numel() > 0 && k.numel() > 0) {
    run(p);
  } else {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    if (dbias_direct) accum->zero_();  // e.g. batch 0 with a (1, H, Q, K) bias: no kernel wrote it
  }
  at::Tensor dbias = !want_dbias    ? at::empty({0}, q.options())
                     : dbias_zero   ? at::zeros(bias->sizes(), bias->options())
                     : dbias_direct ? *accum
                                    : finish_dbias(*accum, *bias);
  return {dq, dk, dv, dbias};
}

// flexdma::perkey_fwd / perkey_bwd: fwd / bwd with the per-key selection's keep rule in place of a mask
// (FwdParams::key_rank / row_thr) and a per-key bias. Their own checks run first, so that a
// wrong plane or bias is reported as such.
inline std::tuple<at::Tensor, at::Tensor> perkey_fwd_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                          const at::Tensor& bias, const at::Tensor& key_rank,
                                                          const at::Tensor& row_thr, double softmax_scale,
                                                          bool is_causal, double softcap,
                                                          const std::function<void(const FwdParams&)>& run) {
  check_qkv(q, k, v);
  FwdParams rule;
  fill_perkey_params(rule, q, k, bias, key_rank, row_thr);
  return fwd_impl(q, k, v, c10::nullopt, bias, softmax_scale, is_causal, softcap, c10::nullopt, run, rule.key_rank,
                  rule.row_thr);
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> perkey_bwd_impl(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
    const at::Tensor& key_rank, const at::Tensor& row_thr, const at::Tensor& out, const at::Tensor& lse,
    double softmax_scale, bool is_causal, double softcap, bool bias_requires_grad, bool deterministic,
    const std::function<void(const BwdParams&)>& run, bool device_stores_dbias_dtype = false) {
  check_qkv(q, k, v);
  FwdParams rule;
  fill_perkey_params(rule, q, k, bias, key_rank, row_thr);
  return bwd_impl(dout, q, k, v, c10::nullopt, bias, out, lse, softmax_scale, is_causal, softcap, bias_requires_grad,
                  deterministic, c10::nullopt, run, device_stores_dbias_dtype, rule.key_rank, rule.row_thr);
}

// flexdma::perkey_select's arguments, checked by every device's implementation.
inline void perkey_select_check(const at::Tensor& scores, int64_t window, int64_t seqlen_q, int64_t tile_rows) {
  const auto dt = scores.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
                   "flexdma::perkey_select: scores must be float32, float16 or bfloat16, got ", dt);
  TORCH_CHECK_VALUE(scores.dim() == 3, "flexdma::perkey_select: scores must be 3-D (planes, planes, K), got shape ",
                    scores.sizes());
  TORCH_CHECK_VALUE(window > 0, "flexdma::perkey_select: window must be positive, got ", window);
  TORCH_CHECK_VALUE(seqlen_q >= 0, "flexdma::perkey_select: seqlen_q must be >= 0, got ", seqlen_q);
  TORCH_CHECK_VALUE(tile_rows > 0, "flexdma::perkey_select: tile_rows must be positive, got ", tile_rows);
  TORCH_CHECK_VALUE(scores.size(2) < (int64_t(1) << 31) - 1, "flexdma::perkey_select: more keys than int32 ranks");
}

// flexdma::perkey_select's outputs for scores (P1, P2, K) (flexdma/perkey/contract.py's shapes) and
// its lists' capacity. tile_keys is zero-filled where `zero_lists` says so (the CPU op: entries past
// a list's length then depend on nothing but the input); the CUDA kernel leaves them unwritten.
struct SelectOutputs {
  at::Tensor key_rank, row_thr, tile_keys;
  int64_t list_cap;
};
inline SelectOutputs alloc_select_outputs(const at::Tensor& scores, int64_t window, int64_t seqlen_q, int64_t tile_rows,
                                          bool zero_lists) {
  const int64_t P1 = scores.size(0), P2 = scores.size(1), K = scores.size(2);
  const int64_t cap = perkey_list_cap(K, window, tile_rows), n_tiles = (seqlen_q + tile_rows - 1) / tile_rows;
  const auto opts = scores.options().dtype(at::kInt);
  const std::vector<int64_t> lists{P1, P2, n_tiles * (1 + cap)};
  return {at::empty({P1, P2, K}, opts), at::empty({P1, P2, seqlen_q}, opts),
          zero_lists ? at::zeros(lists, opts) : at::empty(lists, opts), cap};
}
}  // namespace flexdma
