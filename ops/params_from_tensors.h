// Fills the torch-free kernel params (csrc/flash_dma_params.h) from tensors, with the checks
// that protect the kernels. User-facing argument errors are raised earlier, in Python, with
// friendlier messages; these are the last line for direct torch.ops.flexdma.* callers.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <vector>

#include "../csrc/flash_dma_params.h"

namespace flexdma {

inline DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kDouble:
      return DType::kFloat64;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kFloat16;
    default:
      TORCH_CHECK(false, "flexdma: unsupported dtype ", t, " (need float32, float64, bfloat16 or float16)");
  }
}

inline at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

inline void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "flexdma: query/key/value must be 4-D (batch, seqlen, heads, head_dim), got ", q.sizes(), ", ", k.sizes(),
              ", ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes(), "flexdma: key and value shapes differ: ", k.sizes(), " vs ", v.sizes());
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3), "flexdma: query ", q.sizes(), " and key ", k.sizes(),
              " disagree on batch or head_dim");
  TORCH_CHECK(k.size(2) > 0 && q.size(2) % k.size(2) == 0, "flexdma: query heads ", q.size(2),
              " not divisible by kv heads ", k.size(2));
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "flexdma: query/key/value dtypes differ");
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(), "flexdma: query/key/value devices differ");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(3) == 1, "flexdma: head_dim must be contiguous (stride 1)");
}

// Points b at a 4-D operand: element strides, 0 on its size-1 (broadcast) dims.
inline void point_at(Broadcast4d& b, const at::Tensor& x) {
  b.ptr = x.data_ptr();
  b.batch_stride = x.size(0) == 1 ? 0 : x.stride(0);
  b.head_stride = x.size(1) == 1 ? 0 : x.stride(1);
  b.row_stride = x.size(2) == 1 ? 0 : x.stride(2);
  b.col_stride = x.size(3) == 1 ? 0 : x.stride(3);
}

// name is "attn_mask" or "attn_bias"; returns a Broadcast4d with stride 0 on size-1 dims.
inline Broadcast4d broadcast4d(const c10::optional<at::Tensor>& t, const char* name, const at::Tensor& q,
                               int64_t seqlen_k, int64_t kv_heads) {
  Broadcast4d b;
  if (!t.has_value() || !t->defined()) return b;
  const at::Tensor& x = *t;
  const int64_t B = q.size(0), Q = q.size(1), H = q.size(2);
  TORCH_CHECK(x.dim() == 4, "flexdma: ", name, " must be 4-D, got ", x.sizes());
  TORCH_CHECK(x.device() == q.device(), "flexdma: ", name, " is on ", x.device(), ", query on ", q.device());
  TORCH_CHECK(x.size(0) == 1 || x.size(0) == B, "flexdma: ", name, " batch dim ", x.size(0), " must be 1 or ", B);
  TORCH_CHECK(x.size(1) == 1 || x.size(1) == kv_heads || x.size(1) == H, "flexdma: ", name, " head dim ", x.size(1),
              " must be 1, ", kv_heads, " or ", H);
  TORCH_CHECK(x.size(2) == 1 || x.size(2) == Q, "flexdma: ", name, " query dim ", x.size(2), " must be 1 or ", Q);
  TORCH_CHECK(x.size(3) == 1 || x.size(3) == seqlen_k, "flexdma: ", name, " key dim ", x.size(3), " must be 1 or ",
              seqlen_k);
  point_at(b, x);
  b.head_ratio = H / x.size(1);
  return b;
}

// Shape of flexdma::tile_meta's result for a mask of `mask_sizes` (B|1, heads|1, ., .).
inline std::vector<int64_t> tile_meta_shape(at::IntArrayRef mask_sizes, int64_t seqlen_q, int64_t seqlen_k) {
  const int64_t key_tiles = (seqlen_k + kTileSize - 1) / kTileSize;
  return {mask_sizes[0], mask_sizes[1], (seqlen_q + kTileSize - 1) / kTileSize,
          (key_tiles + kTilesPerWord - 1) / kTilesPerWord};
}

// The tile activity bits (FwdParams::tile_meta) of `mask`, checked against the mask they claim
// to describe: a stale or foreign buffer would make the kernels skip kept tiles.
inline Broadcast4d tile_meta_operand(const c10::optional<at::Tensor>& meta, const c10::optional<at::Tensor>& mask,
                                     const at::Tensor& q, int64_t seqlen_k) {
  Broadcast4d b;
  if (!meta.has_value() || !meta->defined()) return b;
  TORCH_CHECK(mask.has_value() && mask->defined(), "flexdma: tile_meta given without attn_mask");
  const at::Tensor& m = *meta;
  const auto want = tile_meta_shape(mask->sizes(), q.size(1), seqlen_k);
  TORCH_CHECK(m.scalar_type() == at::kInt && m.sizes() == at::IntArrayRef(want) && m.is_contiguous() &&
                  m.device() == q.device(),
              "flexdma: tile_meta must be a contiguous int32 tensor of shape ", at::IntArrayRef(want), " on ",
              q.device(), " (flexdma::tile_meta of this attn_mask), got ", m.scalar_type(), " ", m.sizes());
  point_at(b, m);  // the kernels index words from a row's start, never through col_stride
  b.head_ratio = q.size(2) / m.size(1);
  return b;
}

// FwdParams for flexdma::tile_meta: lengths, causality and the mask plane by plane (head_ratio
// 1: the kernel walks the mask's own heads). Checks what the op needs of the mask alone.
inline FwdParams tile_meta_params(const at::Tensor& mask, int64_t seqlen_q, int64_t seqlen_k, bool is_causal) {
  TORCH_CHECK(mask.dim() == 4 && mask.scalar_type() == at::kBool, "flexdma: tile_meta needs a 4-D bool attn_mask, got ",
              mask.scalar_type(), " ", mask.sizes());
  TORCH_CHECK(seqlen_q >= 0 && seqlen_k >= 0, "flexdma: tile_meta lengths must be >= 0, got ", seqlen_q, ", ",
              seqlen_k);
  TORCH_CHECK((mask.size(2) == 1 || mask.size(2) == seqlen_q) && (mask.size(3) == 1 || mask.size(3) == seqlen_k),
              "flexdma: attn_mask ", mask.sizes(), " does not broadcast to ", seqlen_q, " queries x ", seqlen_k,
              " keys");
  FwdParams p;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.is_causal = is_causal;
  point_at(p.mask, mask);
  return p;
}

// A (batch, seqlen, heads, head_dim) tensor's data pointer and batch / row / head strides.
template <typename Ptr>
inline void point_rows(const at::Tensor& x, Ptr& ptr, int64_t& batch_stride, int64_t& row_stride,
                       int64_t& head_stride) {
  ptr = x.data_ptr();
  batch_stride = x.stride(0);
  row_stride = x.stride(1);
  head_stride = x.stride(2);
}

inline void fill_fwd_params(FwdParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& bias,
                            double softmax_scale, bool is_causal, double softcap, at::Tensor& out, at::Tensor& lse,
                            const c10::optional<at::Tensor>& tile_meta = c10::nullopt) {
  check_qkv(q, k, v);
  p.batch = q.size(0);
  p.seqlen_q = q.size(1);
  p.num_heads = q.size(2);
  p.head_dim = q.size(3);
  p.seqlen_k = k.size(1);
  p.num_heads_k = k.size(2);
  p.dtype = to_dtype(q.scalar_type());
  point_rows(q, p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
  point_rows(k, p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  point_rows(v, p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  point_rows(out, p.out, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
  p.lse = lse.data_ptr();
  if (mask.has_value() && mask->defined())
    TORCH_CHECK(mask->scalar_type() == at::kBool, "flexdma: attn_mask must be bool, got ", mask->scalar_type());
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->scalar_type() == q.scalar_type(), "flexdma: attn_bias dtype ", bias->scalar_type(),
                " must match query dtype ", q.scalar_type());
  p.mask = broadcast4d(mask, "attn_mask", q, p.seqlen_k, p.num_heads_k);
  p.bias = broadcast4d(bias, "attn_bias", q, p.seqlen_k, p.num_heads_k);
  p.tile_meta = tile_meta_operand(tile_meta, mask, q, p.seqlen_k);
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.softcap = static_cast<float>(softcap);
  p.is_causal = is_causal;
}

// The (batch, head) part of a 3-D selection-plane operand (key_rank, row_thr, tile_keys): its
// pointer, batch / head strides (0 on size-1 dims) and head ratio; the caller sets the last dim's.
inline Broadcast4d plane_dims(const at::Tensor& x, int64_t num_heads) {
  Broadcast4d b;
  b.ptr = x.data_ptr();
  b.batch_stride = x.size(0) == 1 ? 0 : x.stride(0);
  b.head_stride = x.size(1) == 1 ? 0 : x.stride(1);
  b.head_ratio = num_heads / x.size(1);
  return b;
}

// One plane operand of the top-k rank rule: int32 (Bs, Hs, n), Bs in {1, B}, Hs in {1, KVH, H},
// n = `len` (K for key_rank, Q for row_thr), contiguous along n. Seen by the kernel as 4-D with
// the n entries along `along_rows` ? rows (row_thr: (Bs, Hs, Q, 1)) : keys (key_rank: (Bs, Hs, 1, K)).
inline Broadcast4d perkey_plane(const at::Tensor& x, const char* name, const char* len_name, int64_t len,
                                bool along_rows, const at::Tensor& q, int64_t kv_heads) {
  const int64_t B = q.size(0), H = q.size(2);
  TORCH_CHECK(x.scalar_type() == at::kInt, "flexdma: ", name, " must be int32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 3, "flexdma: ", name, " must be 3-D (batch, heads, ", len_name, "), got ", x.sizes());
  TORCH_CHECK(x.device() == q.device(), "flexdma: ", name, " is on ", x.device(), ", query on ", q.device());
  TORCH_CHECK(x.size(0) == 1 || x.size(0) == B, "flexdma: ", name, " batch dim ", x.size(0), " must be 1 or ", B);
  TORCH_CHECK(x.size(1) == 1 || x.size(1) == kv_heads || x.size(1) == H, "flexdma: ", name, " head dim ", x.size(1),
              " must be 1, ", kv_heads, " or ", H);
  TORCH_CHECK(x.size(2) == len, "flexdma: ", name, " last dim ", x.size(2), " must be ", len_name, " = ", len);
  TORCH_CHECK(x.size(2) <= 1 || x.stride(2) == 1, "flexdma: ", name, " must be contiguous in its last dim (stride ",
              x.stride(2), "); call .contiguous()");
  Broadcast4d b = plane_dims(x, H);
  (along_rows ? b.row_stride : b.col_stride) = x.size(2) == 1 ? 0 : 1;
  return b;
}

// The checks of flexdma::perkey_fwd / perkey_bwd besides fwd / bwd's: a per-key bias
// ({1|B}, {1|KVH|H}, 1, K) and the two rank planes. Fills the rank rule into p.
inline void fill_perkey_params(FwdParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& bias,
                               const at::Tensor& key_rank, const at::Tensor& row_thr) {
  TORCH_CHECK(bias.dim() == 4 && bias.size(2) == 1 && bias.size(3) == k.size(1),
              "flexdma: the per-key attn_bias must be a per-key bias of shape (1|B, 1|KVH|H, 1, K=", k.size(1),
              "), got ", bias.sizes());
  p.key_rank = perkey_plane(key_rank, "key_rank", "K", k.size(1), /*along_rows=*/false, q, k.size(2));
  p.row_thr = perkey_plane(row_thr, "row_thr", "Q", q.size(1), /*along_rows=*/true, q, k.size(2));
}

// tile_keys of flexdma::perkey_select for the CUDA kernels: int32
// (P1, P2, ceil(Q / tile_rows) * (1 + cap)), planes as key_rank's, contiguous. Seen by the kernel
// as rows of 1 + cap words, one a query tile.
inline Broadcast4d tile_keys_operand(const at::Tensor& x, const at::Tensor& key_rank, const at::Tensor& q,
                                     int64_t tile_rows) {
  TORCH_CHECK_VALUE(tile_rows > 0 && tile_rows % kTileSize == 0, "flexdma: tile_rows must be a positive multiple of ",
                    kTileSize, ", got ", tile_rows);
  const int64_t n_tiles = (q.size(1) + tile_rows - 1) / tile_rows;
  TORCH_CHECK_VALUE(x.scalar_type() == at::kInt && x.dim() == 3 && x.is_contiguous() && x.device() == q.device(),
                    "flexdma: tile_keys must be a contiguous 3-D int32 tensor on ", q.device(), ", got ",
                    x.scalar_type(), " ", x.sizes());
  TORCH_CHECK_VALUE(x.size(0) == key_rank.size(0) && x.size(1) == key_rank.size(1), "flexdma: tile_keys planes ",
                    x.sizes(), " differ from key_rank's ", key_rank.sizes());
  TORCH_CHECK_VALUE(n_tiles > 0 && x.size(2) % n_tiles == 0 && x.size(2) / n_tiles >= 1, "flexdma: tile_keys of shape ",
                    x.sizes(), " does not hold ", n_tiles, " lists of ", tile_rows,
                    "-row query tiles (flexdma::perkey_select with tile_rows=", tile_rows, ")");
  Broadcast4d b = plane_dims(x, q.size(2));
  b.row_stride = x.size(2) / n_tiles;
  b.col_stride = 1;
  return b;
}

// out, and out's rounding error (FwdParams::out_resid), which the kernels index with out's strides.
inline at::Tensor alloc_out(const at::Tensor& q) { return at::empty(q.sizes(), q.options()); }

inline std::tuple<at::Tensor, at::Tensor> alloc_fwd_outputs(const at::Tensor& q) {
  auto out = alloc_out(q);
  auto lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(acc_type(q.scalar_type())));
  return {out, lse};
}

// The dbias accumulator: the bias's own shape, except that batch / head dims the bias
// broadcasts but separate kernel work items cover are kept, to be summed afterwards.
inline at::Tensor alloc_dbias_accum(const at::Tensor& q, const at::Tensor& k, const at::Tensor& bias) {
  const int64_t B = q.size(0), KVH = k.size(2);
  const int64_t nb = (bias.size(0) == 1 && B > 1) ? B : bias.size(0);
  const int64_t nh = (bias.size(1) == 1 && KVH > 1) ? KVH : bias.size(1);
  return at::zeros({nb, nh, bias.size(2), bias.size(3)}, q.options().dtype(acc_type(q.scalar_type())));
}

// Whether alloc_dbias_accum's buffer would have the bias's own shape and the kernel sums no rows
// or keys: then finish_dbias would only cast, and a kernel able to store the final values in the
// bias dtype (BwdParams::dbias_in_dtype) can write dbias itself.
inline bool dbias_needs_no_finish(const at::Tensor& q, const at::Tensor& k, const at::Tensor& bias) {
  if (bias.dim() != 4) return false;  // rejected with a clear message by fill_fwd_params
  const bool batch_left = bias.size(0) == 1 && q.size(0) > 1;
  const bool heads_left = bias.size(1) == 1 && k.size(2) > 1;
  return !batch_left && !heads_left && bias.size(2) != 1 && bias.size(3) != 1;
}

inline at::Tensor finish_dbias(const at::Tensor& accum, const at::Tensor& bias) {
  at::Tensor d = accum;
  if (d.size(0) != bias.size(0)) d = d.sum(0, /*keepdim=*/true);
  if (d.size(1) != bias.size(1)) d = d.sum(1, /*keepdim=*/true);
  return d.to(bias.scalar_type());
}

inline void fill_bwd_params(BwdParams& p, const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const c10::optional<at::Tensor>& mask,
                            const c10::optional<at::Tensor>& bias, const at::Tensor& out, const at::Tensor& lse,
                            double softmax_scale, bool is_causal, double softcap, at::Tensor& dq, at::Tensor& dk,
                            at::Tensor& dv, const c10::optional<at::Tensor>& dbias_accum, at::Tensor& softmax_d,
                            const c10::optional<at::Tensor>& tile_meta = c10::nullopt) {
  at::Tensor out_ = out, lse_ = lse;
  fill_fwd_params(p, q, k, v, mask, bias, softmax_scale, is_causal, softcap, out_, lse_, tile_meta);
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), "flexdma: grad_out/out must have query's shape");
  TORCH_CHECK(dout.stride(3) == 1 && out.stride(3) == 1, "flexdma: grad_out/out head_dim must be contiguous");
  TORCH_CHECK(lse.is_contiguous() && lse.scalar_type() == acc_type(q.scalar_type()), "flexdma: lse must be contiguous ",
              acc_type(q.scalar_type()));
  point_rows(dout, p.dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride);
  point_rows(dq, p.dq, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride);
  point_rows(dk, p.dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);
  point_rows(dv, p.dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
  if (dbias_accum.has_value()) {
    p.dbias_accum = broadcast4d(dbias_accum, "dbias", q, p.seqlen_k, p.num_heads_k);
  }
  p.softmax_d = softmax_d.data_ptr();
}

}  // namespace flexdma
