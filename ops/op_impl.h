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
// The CUDA decode kernels' check (cuda::decode_unsupported_reason), reachable the same way.
using DecodeSupportCheck = const char* (*)(const DecodeParams&);
DecodeSupportCheck& decode_support_check();

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

// flexdma::perkey_select's arguments, checked by every device's implementation: scores
// (P1, P2, K), or in the packed form (heads, Tk) with seqlen_q = Tq.
inline void perkey_select_check(const at::Tensor& scores, int64_t window, int64_t seqlen_q, int64_t tile_rows,
                                bool packed) {
  const auto dt = scores.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
                   "flexdma::perkey_select: scores must be float32, float16 or bfloat16, got ", dt);
  TORCH_CHECK_VALUE(scores.dim() == (packed ? 2 : 3), "flexdma::perkey_select: scores must be ",
                    packed ? "2-D (heads, Tk) in the packed form" : "3-D (planes, planes, K)", ", got shape ",
                    scores.sizes());
  TORCH_CHECK_VALUE(window > 0, "flexdma::perkey_select: window must be positive, got ", window);
  TORCH_CHECK_VALUE(seqlen_q >= 0, "flexdma::perkey_select: seqlen_q must be >= 0, got ", seqlen_q);
  TORCH_CHECK_VALUE(tile_rows > 0, "flexdma::perkey_select: tile_rows must be positive, got ", tile_rows);
  TORCH_CHECK_VALUE(scores.size(-1) < (int64_t(1) << 31) - 1, "flexdma::perkey_select: more keys than int32 ranks");
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

// ---- The packed form (FlashAttention's varlen layout; ops/flexdma_ops.cpp's schema comment states
// it): the checks every device runs before any kernel. The CUDA kernels read the offsets on the
// device only (the first kernel of a call checks them there); the CPU implementations read them on
// the host.

// Whether a call is in the packed form: cu_seqlens_q and cu_seqlens_k both given. One of them
// alone, or a max_seqlen without them, is refused (nothing else would read it).
inline bool packed_form(const c10::optional<at::Tensor>& cu_q, const c10::optional<at::Tensor>& cu_k, int64_t max_q,
                        int64_t max_k, const char* op) {
  const bool has_q = cu_q.has_value() && cu_q->defined(), has_k = cu_k.has_value() && cu_k->defined();
  TORCH_CHECK_VALUE(has_q == has_k, op, ": the packed form needs both cu_seqlens_q and cu_seqlens_k, got only ",
                    has_q ? "cu_seqlens_q" : "cu_seqlens_k");
  TORCH_CHECK_VALUE(has_q || (max_q == 0 && max_k == 0), op, ": max_seqlen_q / max_seqlen_k (", max_q, " / ", max_k,
                    ") are read only with cu_seqlens_q / cu_seqlens_k (the packed form), which are absent");
  return has_q;
}

// A packed call's sequences: the offsets (int32, batch + 1 of them, on the operands' device), the
// longest lengths the caller states (they size the CUDA grids) and the token counts.
struct Packed {
  at::Tensor cu_q, cu_k;
  int64_t batch, max_q, max_k, total_q, total_k;
};

// The offsets' checks that need not read them. The CUDA grids are sized by max_seqlen, and the
// kernel that checks the offsets on the device runs only where the grid has a tile: lengths that
// cannot reach the token counts are caught here.
inline Packed packed_offsets(const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t max_q, int64_t max_k,
                             int64_t total_q, int64_t total_k, const at::Device& device, const char* op) {
  for (const at::Tensor* cu : {&cu_q, &cu_k})
    TORCH_CHECK_VALUE(cu->scalar_type() == at::kInt && cu->dim() == 1 && cu->numel() >= 1 && cu->is_contiguous() &&
                          cu->device() == device,
                      op, ": cu_seqlens must be contiguous 1-D int32 (batch + 1) on ", device, ", got ",
                      cu->scalar_type(), " ", cu->sizes(), " on ", cu->device());
  TORCH_CHECK_VALUE(cu_q.numel() == cu_k.numel(), op, ": cu_seqlens_q and cu_seqlens_k differ in length (",
                    cu_q.numel(), " and ", cu_k.numel(), ")");
  TORCH_CHECK_VALUE(max_q >= 0 && max_k >= 0, op, ": max_seqlen must be >= 0, got ", max_q, " and ", max_k);
  const int64_t batch = cu_q.numel() - 1;
  TORCH_CHECK_VALUE(max_q * batch >= total_q && max_k * batch >= total_k, op, ": ", batch,
                    " sequences of at most max_seqlen_q = ", max_q, " / max_seqlen_k = ", max_k, " tokens cannot hold ",
                    total_q, " / ", total_k, " tokens: a sequence is longer than max_seqlen");
  return {cu_q, cu_k, batch, max_q, max_k, total_q, total_k};
}

// q (Tq, H, D), k / v (Tk, KVH, D), the offsets, and attn_bias none or per key (heads, Tk) with heads
// in {1, KVH, H}.
inline Packed packed_check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const c10::optional<at::Tensor>& cu_q, const c10::optional<at::Tensor>& cu_k, int64_t max_q,
                           int64_t max_k, const c10::optional<at::Tensor>& bias, const char* op) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, op,
                    ": in the packed form q, k, v must be (tokens, heads, head_dim), got ", q.sizes(), ", ", k.sizes(),
                    ", ", v.sizes());
  check_qkv(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0));
  const Packed s = packed_offsets(*cu_q, *cu_k, max_q, max_k, q.size(0), k.size(0), q.device(), op);
  if (bias.has_value() && bias->defined()) {
    const int64_t heads = bias->dim() == 2 ? bias->size(0) : -1;
    TORCH_CHECK_VALUE(
        bias->dim() == 2 && bias->size(1) == k.size(0) && (heads == 1 || heads == k.size(1) || heads == q.size(1)), op,
        ": in the packed form attn_bias must be per key (heads, Tk=", k.size(0), ") with heads 1, ", k.size(1), " or ",
        q.size(1), ", got ", bias->sizes());
  }
  return s;
}

// fwd / bwd's packed form: no attn_mask (a mask is per (query, key) pair, which the packed layout
// has no operand for), and so no tile_meta.
inline void packed_dense_check(const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& tile_meta,
                               const char* op) {
  TORCH_CHECK_VALUE(!mask.has_value() || !mask->defined(), op,
                    ": the packed form (cu_seqlens given) takes no attn_mask, got one of shape ", mask->sizes());
  TORCH_CHECK_VALUE(!tile_meta.has_value() || !tile_meta->defined(), op,
                    ": the packed form (cu_seqlens given) takes no tile_meta (there is no attn_mask)");
}

// perkey_fwd / perkey_bwd's packed form: the bias, key_rank (heads, Tk) and row_thr (heads, Tq);
// the padded checks (fill_perkey_params) then run on their batch-1 views.
inline void packed_perkey_check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& bias,
                                const at::Tensor& key_rank, const at::Tensor& row_thr, const char* op) {
  TORCH_CHECK_VALUE(bias.dim() == 2, op, ": in the packed form attn_bias must be (heads, Tk=", k.size(0), "), got ",
                    bias.sizes());
  TORCH_CHECK_VALUE(key_rank.dim() == 2 && key_rank.size(1) == k.size(0), op,
                    ": in the packed form key_rank must be (heads, Tk=", k.size(0),
                    ") (flexdma::perkey_select's packed output), got ", key_rank.sizes());
  TORCH_CHECK_VALUE(row_thr.dim() == 2 && row_thr.size(1) == q.size(0), op,
                    ": in the packed form row_thr must be (heads, Tq=", q.size(0),
                    ") (flexdma::perkey_select's packed output), got ", row_thr.sizes());
}

// The backward's packed operands besides q / k / v: grad_out and out (Tq, H, D), lse (H, Tq).
inline void packed_bwd_check(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& out, const at::Tensor& lse,
                             const char* op) {
  TORCH_CHECK_VALUE(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), op,
                    ": in the packed form grad_out and out must have q's shape ", q.sizes(), ", got ", dout.sizes(),
                    " and ", out.sizes());
  TORCH_CHECK_VALUE(lse.dim() == 2 && lse.size(0) == q.size(1) && lse.size(1) == q.size(0), op,
                    ": in the packed form lse must be (H, Tq) = (", q.size(1), ", ", q.size(0), "), got ", lse.sizes());
}
}  // namespace flexdma
