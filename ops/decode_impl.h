// flexdma::decode_step / decode_append on every device: the checks and DecodeParams from tensors,
// then the device's kernel. Each device file supplies only its kernel call (and scratch).
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <functional>

#include "../csrc/flash_dma_params.h"
#include "params_from_tensors.h"

namespace flexdma {

// t's data as P* and its strides along dims 0, `head` and `inner` (the params' batch, head and
// row / slot strides).
template <class P>
void point3(const at::Tensor& t, P*& ptr, int64_t& batch, int64_t& head_stride, int64_t& inner_stride, int head,
            int inner) {
  ptr = static_cast<P*>(t.data_ptr());
  batch = t.stride(0);
  head_stride = t.stride(head);
  inner_stride = t.stride(inner);
}

// The operands' shapes, dtypes and devices as the schemas state them; a ValueError / TypeError
// naming the operand before anything runs. `appended`: decode_append's operands are given.
inline DecodeParams decode_params(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& kept_idx, const at::Tensor& kept_valid,
                                  const at::Tensor& kept_score, const at::Tensor& s_new, const at::Tensor& eligible,
                                  int64_t position, const c10::optional<at::Tensor>& position_at, double softmax_scale,
                                  double softcap, const at::Tensor& out, const char* op,
                                  const at::Tensor* key_new = nullptr, const at::Tensor* value_new = nullptr,
                                  const at::Tensor* bias_cache = nullptr, const at::Tensor* padding_cache = nullptr,
                                  bool own_kept = false) {
  // own_kept: the op allocated the kept sets itself (perkey_last_row), and there is no new key.
  const bool appended = key_new != nullptr;
  TORCH_CHECK_VALUE(q.dim() == 4 && q.size(1) == 1, op, ": q must be (batch, 1, heads, head_dim), got ", q.sizes());
  const int64_t B = q.size(0), H = q.size(2), D = q.size(3);
  TORCH_CHECK_VALUE(key_cache.dim() == 4 && key_cache.size(0) == B && key_cache.size(3) == D &&
                        value_cache.sizes() == key_cache.sizes(),
                    op, ": key_cache and value_cache must be (", B, ", capacity, kv_heads, ", D, "), got ",
                    key_cache.sizes(), " and ", value_cache.sizes());
  const int64_t KVH = key_cache.size(2), cap = key_cache.size(1);
  TORCH_CHECK_VALUE(KVH > 0 && H % KVH == 0, op, ": ", H, " query heads do not group onto ", KVH, " kv heads");
  TORCH_CHECK_TYPE(key_cache.scalar_type() == q.scalar_type() && value_cache.scalar_type() == q.scalar_type(), op,
                   ": q, key_cache and value_cache must share a dtype, got ", q.scalar_type(), ", ",
                   key_cache.scalar_type(), ", ", value_cache.scalar_type());
  if (!own_kept) {
    TORCH_CHECK_VALUE(kept_idx.dim() == 3 && kept_idx.size(0) == B && kept_idx.size(1) == KVH && kept_idx.size(2) >= 1,
                      op, ": kept_idx must be (", B, ", ", KVH, ", window >= 1), got ", kept_idx.sizes());
    TORCH_CHECK_VALUE(kept_valid.sizes() == kept_idx.sizes() && kept_score.sizes() == kept_idx.sizes(), op,
                      ": kept_valid and kept_score must be kept_idx's shape ", kept_idx.sizes(), ", got ",
                      kept_valid.sizes(), " and ", kept_score.sizes());
    TORCH_CHECK_TYPE(kept_idx.scalar_type() == at::kLong && kept_valid.scalar_type() == at::kBool, op,
                     ": kept_idx must be int64 and kept_valid bool, got ", kept_idx.scalar_type(), " and ",
                     kept_valid.scalar_type());
    TORCH_CHECK_TYPE(at::isFloatingType(kept_score.scalar_type()) && s_new.scalar_type() == kept_score.scalar_type(),
                     op, ": kept_score and s_new must share a floating dtype, got ", kept_score.scalar_type(), " and ",
                     s_new.scalar_type());
    // decode_append: the layer's own tensors, bias_new (B, KVH, 1, 1) and padding_new (B, 1).
    const char* s_name = appended ? "bias_new" : "s_new";
    const char* e_name = appended ? "padding_new" : "eligible";
    TORCH_CHECK_VALUE(
        s_new.dim() == (appended ? 4 : 2) && s_new.size(0) == B && s_new.size(1) == KVH && s_new.numel() == B * KVH, op,
        ": ", s_name, " must be (", B, ", ", KVH, appended ? ", 1, 1" : "", "), got ", s_new.sizes());
    TORCH_CHECK_VALUE(eligible.dim() == 2 && eligible.size(0) == B && eligible.size(1) == (appended ? 1 : KVH), op,
                      ": ", e_name, " must be (", B, ", ", appended ? 1 : KVH, "), got ", eligible.sizes());
    TORCH_CHECK_TYPE(eligible.scalar_type() == at::kBool, op, ": ", e_name, " must be bool, got ",
                     eligible.scalar_type());
  }
  TORCH_CHECK_VALUE(softcap >= 0, op, ": softcap must be >= 0, got ", softcap);
  if (position_at.has_value() && position_at->defined()) {
    TORCH_CHECK_VALUE(position_at->numel() == 1 && position_at->scalar_type() == at::kLong, op,
                      ": position_at must be one int64, got ", position_at->sizes(), " ", position_at->scalar_type());
  } else {
    TORCH_CHECK_VALUE(position >= 0 && position < cap, op, ": position ", position, " is outside the caches' ", cap,
                      " rows");
  }
  std::vector<const at::Tensor*> all = {&q,          &key_cache,  &value_cache, &kept_idx,
                                        &kept_valid, &kept_score, &s_new,       &eligible};
  if (appended) {
    TORCH_CHECK_VALUE(key_new->dim() == 4 && key_new->size(0) == B && key_new->size(1) == 1 &&
                          key_new->size(2) == KVH && key_new->size(3) == D && value_new->sizes() == key_new->sizes(),
                      op, ": key_new and value_new must be (", B, ", 1, ", KVH, ", ", D, "), got ", key_new->sizes(),
                      " and ", value_new->sizes());
    TORCH_CHECK_TYPE(key_new->scalar_type() == q.scalar_type() && value_new->scalar_type() == q.scalar_type(), op,
                     ": key_new and value_new must be q's dtype ", q.scalar_type());
    TORCH_CHECK_VALUE(
        bias_cache->dim() == 3 && bias_cache->size(0) == B && bias_cache->size(1) == KVH && bias_cache->size(2) == cap,
        op, ": bias_cache must be (", B, ", ", KVH, ", ", cap, "), got ", bias_cache->sizes());
    TORCH_CHECK_TYPE(bias_cache->scalar_type() == kept_score.scalar_type(), op,
                     ": bias_cache must be kept_score's dtype ", kept_score.scalar_type(), ", got ",
                     bias_cache->scalar_type());
    TORCH_CHECK_VALUE(padding_cache->dim() == 2 && padding_cache->size(0) == B && padding_cache->size(1) == cap, op,
                      ": padding_cache must be (", B, ", ", cap, "), got ", padding_cache->sizes());
    TORCH_CHECK_TYPE(padding_cache->scalar_type() == at::kBool, op, ": padding_cache must be bool");
    for (const at::Tensor* t : {key_new, value_new, bias_cache, padding_cache}) all.push_back(t);
  }
  if (position_at.has_value() && position_at->defined()) all.push_back(&*position_at);
  for (const at::Tensor* t : all)
    TORCH_CHECK_VALUE(t->device() == q.device(), op, ": every operand must be on q's device ", q.device(), ", got ",
                      t->device());
  for (const at::Tensor* t : {&q, &key_cache, &value_cache})
    TORCH_CHECK_VALUE(t->stride(-1) == 1, op, ": q, key_cache and value_cache need a contiguous head_dim");
  if (appended)
    TORCH_CHECK_VALUE(key_new->stride(-1) == 1 && value_new->stride(-1) == 1, op,
                      ": key_new and value_new need a contiguous head_dim");

  DecodeParams p;
  p.batch = B;
  p.num_heads = H;
  p.num_heads_k = KVH;
  p.planes_per_batch = KVH;
  p.head_dim = D;
  p.window = kept_idx.size(2);
  p.capacity = cap;
  p.dtype = to_dtype(q.scalar_type());
  p.score_dtype = to_dtype(kept_score.scalar_type());
  p.q = q.data_ptr();
  p.q_batch_stride = q.stride(0);
  p.q_head_stride = q.stride(2);
  // The caches (B, capacity, KVH, D) as (batch, head, row) strides; the kept set's (B, KVH, W) as
  // (batch, head, slot).
  point3(key_cache, p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, 2, 1);
  point3(value_cache, p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, 2, 1);
  point3(kept_idx, p.kept_idx, p.idx_batch_stride, p.idx_head_stride, p.idx_slot_stride, 1, 2);
  point3(kept_valid, p.kept_valid, p.valid_batch_stride, p.valid_head_stride, p.valid_slot_stride, 1, 2);
  point3(kept_score, p.kept_score, p.score_batch_stride, p.score_head_stride, p.score_slot_stride, 1, 2);
  p.s_new = s_new.data_ptr();
  p.s_new_batch_stride = s_new.stride(0);
  p.s_new_head_stride = s_new.stride(1);
  p.eligible = reinterpret_cast<const uint8_t*>(eligible.data_ptr<bool>());
  p.eligible_batch_stride = eligible.stride(0);
  p.eligible_head_stride = appended ? 0 : eligible.stride(1);  // decode_append: one flag a batch row
  p.position = position;
  if (position_at.has_value() && position_at->defined()) p.position_at = position_at->data_ptr<int64_t>();
  p.out = out.data_ptr();
  p.o_batch_stride = out.stride(0);
  p.o_head_stride = out.stride(2);
  p.softmax_scale = softmax_scale;
  p.softcap = softcap;
  if (appended) {
    p.k_new = key_new->data_ptr();
    p.k_new_batch_stride = key_new->stride(0);
    p.k_new_head_stride = key_new->stride(2);
    p.v_new = value_new->data_ptr();
    p.v_new_batch_stride = value_new->stride(0);
    p.v_new_head_stride = value_new->stride(2);
    p.bias_cache = bias_cache->data_ptr();
    p.bias_batch_stride = bias_cache->stride(0);
    p.bias_head_stride = bias_cache->stride(1);
    p.bias_row_stride = bias_cache->stride(2);
    p.padding_cache = reinterpret_cast<uint8_t*>(padding_cache->data_ptr<bool>());
    p.padding_batch_stride = padding_cache->stride(0);
    p.padding_row_stride = padding_cache->stride(1);
  }
  return p;
}

using DecodeRun = std::function<void(DecodeParams&)>;

inline at::Tensor decode_step_impl(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                   const at::Tensor& kept_idx, const at::Tensor& kept_valid,
                                   const at::Tensor& kept_score, const at::Tensor& s_new, const at::Tensor& eligible,
                                   int64_t position, const c10::optional<at::Tensor>& position_at, double softmax_scale,
                                   double softcap, const DecodeRun& run) {
  at::Tensor out = at::empty(q.sizes(), q.options());
  DecodeParams p = decode_params(q, key_cache, value_cache, kept_idx, kept_valid, kept_score, s_new, eligible, position,
                                 position_at, softmax_scale, softcap, out, "flexdma::decode_step");
  run(p);
  return out;
}

inline at::Tensor decode_append_impl(const at::Tensor& q, const at::Tensor& key_new, const at::Tensor& value_new,
                                     const at::Tensor& s_new, const at::Tensor& eligible, const at::Tensor& key_cache,
                                     const at::Tensor& value_cache, const at::Tensor& bias_cache,
                                     const at::Tensor& padding_cache, const at::Tensor& kept_idx,
                                     const at::Tensor& kept_valid, const at::Tensor& kept_score, int64_t position,
                                     double softmax_scale, double softcap, const DecodeRun& run) {
  at::Tensor out = at::empty(q.sizes(), q.options());
  DecodeParams p = decode_params(q, key_cache, value_cache, kept_idx, kept_valid, kept_score, s_new, eligible, position,
                                 c10::nullopt, softmax_scale, softcap, out, "flexdma::decode_append", &key_new,
                                 &value_new, &bias_cache, &padding_cache);
  run(p);
  return out;
}

// flexdma::perkey_last_row: q (B, 1, H, D) against every key of k / v (B, K, KVH, D), each plane
// keeping its top-`window` keys by the selection scores (P1, P2, K) (P1 in {1, B}, P2 in {1, KVH,
// H}; -inf never kept) and adding their scores: the kept sets are written into scratch kept sets
// (P1, P2, W) by the device's selection, then the decode step's attention runs over them.
inline at::Tensor perkey_last_row_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& scores, int64_t window, double softmax_scale, double softcap,
                                       const DecodeRun& run) {
  const char* op = "flexdma::perkey_last_row";
  TORCH_CHECK_VALUE(q.dim() == 4 && q.size(1) == 1, op, ": q must be (batch, 1, heads, head_dim), got ", q.sizes());
  TORCH_CHECK_VALUE(k.dim() == 4 && k.size(0) == q.size(0) && k.size(3) == q.size(3) && v.sizes() == k.sizes(), op,
                    ": k and v must be (", q.size(0), ", keys, kv_heads, ", q.size(3), "), got ", k.sizes(), " and ",
                    v.sizes());
  const int64_t B = q.size(0), H = q.size(2), K = k.size(1), KVH = k.size(2);
  TORCH_CHECK_VALUE(window >= 1, op, ": window must be >= 1, got ", window);
  TORCH_CHECK_VALUE(K >= 1, op, ": k must hold at least one key");
  TORCH_CHECK_VALUE(scores.dim() == 3 && (scores.size(0) == 1 || scores.size(0) == B) &&
                        (scores.size(1) == 1 || scores.size(1) == KVH || scores.size(1) == H) && scores.size(2) == K,
                    op, ": scores must be ({1|", B, "}, {1|", KVH, "|", H, "}, ", K, "), got ", scores.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(scores.scalar_type()), op, ": scores must be floating, got ",
                   scores.scalar_type());
  TORCH_CHECK_VALUE(scores.device() == q.device(), op, ": scores must be on q's device ", q.device());
  const int64_t P1 = scores.size(0), P2 = scores.size(1);
  const at::Tensor sc = scores.stride(2) == 1 ? scores : scores.contiguous();
  const auto opts = scores.options();
  const at::Tensor idx = at::empty({P1, P2, window}, opts.dtype(at::kLong));
  const at::Tensor valid = at::empty({P1, P2, window}, opts.dtype(at::kBool));
  const at::Tensor score = at::empty({P1, P2, window}, opts);
  const at::Tensor eligible = at::empty({0, 0}, opts.dtype(at::kBool));  // no new key
  at::Tensor out = at::empty(q.sizes(), q.options());
  DecodeParams p = decode_params(q, k, v, idx, valid, score, score, eligible, 0, c10::nullopt, softmax_scale, softcap,
                                 out, op, nullptr, nullptr, nullptr, nullptr, /*own_kept=*/true);
  // One kept set a plane; per query head where the scores are (P2 = H > KVH).
  p.planes_per_batch = P2 == H ? H : KVH;
  p.idx_batch_stride = p.valid_batch_stride = p.score_batch_stride = P1 == 1 ? 0 : P2 * window;
  p.idx_head_stride = p.valid_head_stride = p.score_head_stride = P2 == 1 ? 0 : window;
  p.s_new = nullptr;
  p.eligible = nullptr;
  p.scores = sc.data_ptr();
  p.score_planes1 = P1;
  p.score_planes2 = P2;
  p.seqlen_k = K;
  p.scores_batch_stride = sc.stride(0);
  p.scores_head_stride = sc.stride(1);
  if (B > 0) run(p);
  return out;
}

}  // namespace flexdma
