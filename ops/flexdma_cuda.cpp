// CUDA implementation of the flexdma op family; built only when torch has CUDA and nvcc exists.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../csrc/cuda/flash_dma_cuda.h"
#include "decode_impl.h"
#include "op_impl.h"

namespace flexdma {
namespace {

void check_supported(const FwdParams& p) {
  const char* why = cuda::unsupported_reason(p);
  TORCH_CHECK(why == nullptr, "flexdma CUDA kernel does not support this call: ", why,
              " (use backend='auto' to fall back to FlexAttention)");
}

at::Tensor tile_meta_cuda(const at::Tensor& mask, int64_t seqlen_q, int64_t seqlen_k, bool is_causal) {
  c10::cuda::CUDAGuard guard(mask.device());
  const FwdParams p = tile_meta_params(mask, seqlen_q, seqlen_k, is_causal);
  const auto shape = tile_meta_shape(mask.sizes(), seqlen_q, seqlen_k);
  at::Tensor meta = at::zeros(shape, mask.options().dtype(at::kInt));
  cuda::run_tile_meta(p, shape[0], shape[1], meta.data_ptr(), shape[3], at::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return meta;
}

// The kernels' scratch comes from PyTorch's caching allocator (as FlashAttention's does): a failure
// is torch.OutOfMemoryError before any launch, and the bytes show in torch.cuda's statistics. The
// tensor is released when this returns; the allocator hands the block to later work on the same
// stream only, which runs after these kernels.
void launch_fwd(FwdParams p, const at::Tensor& like) {
  check_supported(p);
  const int64_t bytes = cuda::fwd_workspace_bytes(p);
  at::Tensor ws = bytes > 0 ? at::empty({bytes}, like.options().dtype(at::kByte)) : at::Tensor();
  p.workspace = bytes > 0 ? ws.data_ptr() : nullptr;
  cuda::run_fwd(p, at::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_bwd(BwdParams p, const at::Tensor& like) {
  check_supported(p);
  at::Tensor ws = at::empty({cuda::bwd_workspace_bytes(p)}, like.options().dtype(at::kByte));
  p.workspace = ws.data_ptr();
  cuda::run_bwd(p, at::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The kernels read the tile activity of every mask they get; a caller that did not pass it (a
// direct op call) pays for one pass over the mask here.
c10::optional<at::Tensor> meta_for(const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& tile_meta,
                                   const at::Tensor& q, const at::Tensor& k, bool is_causal) {
  if (tile_meta.has_value() && tile_meta->defined()) return tile_meta;
  if (!mask.has_value() || !mask->defined() || mask->dim() != 4 || mask->scalar_type() != at::kBool) return tile_meta;
  return tile_meta_cuda(*mask, q.size(1), k.size(1), is_causal);
}

// out_resid's data (null where it is absent or empty): the backward kernels index it with out's
// strides, so it must have out's shape, strides, dtype and device.
void* resid_ptr(const c10::optional<at::Tensor>& out_resid, const at::Tensor& out, const char* op) {
  if (!out_resid.has_value() || !out_resid->defined() || out_resid->numel() == 0) return nullptr;
  TORCH_CHECK_VALUE(out_resid->sizes() == out.sizes() && out_resid->strides() == out.strides() &&
                        out_resid->scalar_type() == out.scalar_type(),
                    op, ": out_resid must have out's shape, strides and dtype (", out.sizes(), ", ", out.strides(),
                    ", ", out.scalar_type(), "), got ", out_resid->sizes(), ", ", out_resid->strides(), ", ",
                    out_resid->scalar_type());
  TORCH_CHECK_VALUE(out_resid->device() == out.device(), op, ": out_resid must be on out's device (", out.device(),
                    "), got ", out_resid->device());
  return const_cast<void*>(out_resid->const_data_ptr());
}

// The per-key forward's params over each query tile's listed keys (perkey_fwd, padded or packed),
// writing the caller's out / lse / resid; perkey_fwd_cuda launches them. The callers check q / k / v
// before any kernel runs.
FwdParams perkey_fwd_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
                            const at::Tensor& key_rank, const at::Tensor& row_thr, const Broadcast4d& keys,
                            int64_t tile_rows, double softmax_scale, bool is_causal, double softcap, at::Tensor out,
                            at::Tensor lse, const at::Tensor& resid) {
  FwdParams rule;
  fill_perkey_params(rule, q, k, bias, key_rank, row_thr);
  FwdParams p;
  fill_fwd_params(p, q, k, v, c10::nullopt, bias, softmax_scale, is_causal, softcap, out, lse, c10::nullopt);
  p.key_rank = rule.key_rank;
  p.row_thr = rule.row_thr;
  p.tile_keys = keys;
  p.perkey_tile_rows = tile_rows;
  p.out_resid = resid.data_ptr();
  return p;
}

// q / k / v rows read 16 bytes at a time: 16-byte aligned rows, strides multiples of 8 elements.
bool rows_aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0 && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 &&
         t.stride(2) % 8 == 0;
}

int dtype_code(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf ? static_cast<int>(to_dtype(t))
                                                                                     : -1;
}

// The C++ per-key kernels' check of a call (cuda::perkey_unsupported_reason, which Python's route
// asks before choosing them), run before any launch: a call they do not take is refused with its
// reason. q / k / v are 4-D (a packed call's batch-1 views); a packed call (`packed` set) is checked
// as its sequences make it, max_seqlen long each (the kernels index rows from a sequence's first).
// The backward's conditions count torch's deterministic mode as `deterministic`.
void check_perkey(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
                  double softcap, bool backward, bool deterministic, const Packed* packed = nullptr) {
  // batch, num_heads, num_heads_k, head_dim, seqlen_q, seqlen_k
  cuda::PerkeyCall c{q.size(0), q.size(2), k.size(2), q.size(3), q.size(1), k.size(1)};
  if (packed != nullptr) {
    c.batch = packed->batch;
    c.seqlen_q = packed->max_q;
    c.seqlen_k = packed->max_k;
  }
  c.dtype = dtype_code(q.scalar_type());
  c.bias_dtype = dtype_code(bias.scalar_type());
  c.softcap = static_cast<float>(softcap);
  c.rows_aligned = rows_aligned16(q) && rows_aligned16(k) && rows_aligned16(v);
  c.kv_row_stride = std::max(k.stride(1), v.stride(1));
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(q.get_device());
  c.device_arch = props->major * 10 + props->minor;
  c.backward = backward;
  c.deterministic = deterministic || at::globalContext().deterministicAlgorithms();
  const char* why = cuda::perkey_unsupported_reason(c);
  TORCH_CHECK_VALUE(why == nullptr, op, " on CUDA (the C++ per-key kernels) does not take this call: ", why,
                    " (flash_dma_attention routes such calls to the Triton kernels, flexdma_triton::",
                    backward ? "perkey_bwd" : "perkey_fwd", ")");
}

// The lists of perkey_select's call with the C++ kernels' 128-row query tiles.
Broadcast4d perkey_lists(const char* op, const c10::optional<at::Tensor>& tile_keys, const at::Tensor& key_rank,
                         const at::Tensor& q) {
  TORCH_CHECK_VALUE(
      tile_keys.has_value() && tile_keys->defined(), op,
      " on CUDA needs tile_keys, the third output of flexdma::perkey_select called with tile_rows=", kPerkeyTileRows);
  return tile_keys_operand(*tile_keys, key_rank, q, kPerkeyTileRows);
}

// The per-key backward over the same lists (perkey_bwd_kernel.cuh; perkey_bwd, padded or packed) into
// dq (the caller's, as perkey_fwd_params' outputs are). dK / dV and the per-key dbias are sums over the query
// tiles that list a key: the kernel adds them into one zeroed float buffer, returned as
// (dk, dv, dbias) float views for the caller to cast. The callers check q / k / v first.
std::tuple<at::Tensor, at::Tensor, at::Tensor> perkey_bwd_run(
    const at::Tensor& dout_in, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
    const at::Tensor& key_rank, const at::Tensor& row_thr, const Broadcast4d& keys, int64_t tile_rows,
    const at::Tensor& out, const at::Tensor& lse, void* resid, double softmax_scale, bool is_causal,
    bool bias_requires_grad, at::Tensor dq, const std::function<void(BwdParams&)>& adjust) {
  FwdParams rule;
  fill_perkey_params(rule, q, k, bias, key_rank, row_thr);
  // Q / dO rows are copied 16 bytes at a time; out / dout / out_resid read in 4-byte pairs.
  const at::Tensor dout = rows_aligned16(dout_in) ? dout_in : dout_in.contiguous();
  TORCH_CHECK_VALUE(out.stride(0) % 2 == 0 && out.stride(1) % 2 == 0 && out.stride(2) % 2 == 0,
                    "flexdma::perkey_bwd: out's strides must be even (its rows are read in pairs), got ",
                    out.strides());
  const int64_t nk = k.numel(), nb = bias_requires_grad ? bias.numel() : 0;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  // Zeroed by a memset: the float buffer the kernel's reductions add into.
  at::Tensor acc = at::empty({2 * nk + nb}, q.options().dtype(at::kFloat));
  C10_CUDA_CHECK(cudaMemsetAsync(acc.data_ptr(), 0, acc.nbytes(), stream));
  at::Tensor dk = acc.narrow(0, 0, nk).view(k.sizes()), dv = acc.narrow(0, nk, nk).view(v.sizes());
  c10::optional<at::Tensor> db;
  if (bias_requires_grad) db = acc.narrow(0, 2 * nk, nb).view(bias.sizes());
  at::Tensor unused = at::empty({0}, q.options().dtype(at::kFloat));
  BwdParams p;
  fill_bwd_params(p, dout, q, k, v, c10::nullopt, bias, out, lse, softmax_scale, is_causal, 0.0, dq, dk, dv, db,
                  unused);
  p.key_rank = rule.key_rank;
  p.row_thr = rule.row_thr;
  p.tile_keys = keys;
  p.perkey_tile_rows = tile_rows;
  p.out_resid = resid;
  adjust(p);
  if (q.numel() > 0 && k.numel() > 0)
    launch_bwd(p, q);
  else
    dq.zero_();
  return {dk, dv, db.has_value() ? *db : at::Tensor()};
}

// perkey_bwd_run's float sums as dk / dv (k's and v's sizes and dtype) and dbias (the bias's; empty
// where db is undefined), cast in one launch.
std::tuple<at::Tensor, at::Tensor, at::Tensor> cast_sums(const at::Tensor& dk, const at::Tensor& dv,
                                                         const at::Tensor& db, const at::Tensor& k, const at::Tensor& v,
                                                         const at::Tensor& bias) {
  const auto dt = k.scalar_type();
  TORCH_CHECK(
      (dt == at::kBFloat16 || dt == at::kHalf) && v.scalar_type() == dt && (!db.defined() || bias.scalar_type() == dt),
      "flexdma: the per-key backward casts its sums to one 16-bit dtype (k, v and the bias share it)");
  at::Tensor dk_out = at::empty(k.sizes(), k.options()), dv_out = at::empty(v.sizes(), v.options());
  at::Tensor db_out = db.defined() ? at::empty(bias.sizes(), bias.options()) : at::empty({0}, k.options());
  CastParams p;
  p.dtype = to_dtype(k.scalar_type());
  const at::Tensor* from[] = {&dk, &dv, &db};
  const at::Tensor* to[] = {&dk_out, &dv_out, &db_out};
  for (int i = 0; i < CastParams::kSegments; ++i) {
    if (!from[i]->defined()) continue;
    p.src[i] = from[i]->const_data_ptr<float>();
    p.dst[i] = to[i]->data_ptr();
    p.n[i] = from[i]->numel();
  }
  cuda::run_cast(p, at::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dk_out, dv_out, db_out};
}

// The selection's scratch (from PyTorch's allocator, as the other kernels'), the zero fill of its
// counters and its one launch.
void launch_select(SelectParams& p, const at::Tensor& like) {
  at::Tensor ws = at::empty({cuda::select_workspace_bytes(p)}, like.options().dtype(at::kByte));
  p.workspace = ws.data_ptr();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  C10_CUDA_CHECK(cudaMemsetAsync(p.workspace, 0, cuda::select_counter_bytes(p), stream));
  cuda::run_select(p, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---- The packed form on CUDA ----
// The kernels read each sequence's offsets on the device (FwdParams' / SelectParams' cu_seqlens): a
// call is one kernel launch for all its sequences, with no host synchronisation (the host never
// reads the offsets; the first kernel of a call checks them and stops at a device-side assert on
// invalid ones). The packed rows go through the padded path's parameter fills as one batch
// (q (1, Tq, H, D), the bias (1, heads, 1, Tk), key_rank (1, heads, Tk), row_thr (1, heads, Tq));
// packed_params then makes the sequences of that batch. The outputs are tensors of their own at the
// packed shapes, filled through batch-1 views of them.

// The bias as the batch-1 fills take it, (1, heads, 1, Tk).
c10::optional<at::Tensor> packed_bias(const c10::optional<at::Tensor>& bias) {
  if (!bias.has_value() || !bias->defined()) return c10::nullopt;
  return bias->unsqueeze(0).unsqueeze(2);
}

void packed_params(FwdParams& p, const Packed& s) {
  p.cu_seqlens_q = s.cu_q.const_data_ptr<int32_t>();
  p.cu_seqlens_k = s.cu_k.const_data_ptr<int32_t>();
  p.batch = s.batch;
  p.seqlen_q = s.max_q;
  p.seqlen_k = s.max_k;
  p.total_q = s.total_q;
  p.total_k = s.total_k;
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = 0;
  p.bias.batch_stride = 0;
}

void packed_params(BwdParams& p, const Packed& s) {
  packed_params(static_cast<FwdParams&>(p), s);
  p.do_batch_stride = p.dq_batch_stride = p.dk_batch_stride = p.dv_batch_stride = 0;
  p.dbias_accum.batch_stride = 0;
}

// out_resid as resid_ptr takes it for out's batch-1 view.
c10::optional<at::Tensor> packed_resid(const c10::optional<at::Tensor>& out_resid) {
  if (!out_resid.has_value() || !out_resid->defined()) return c10::nullopt;
  return out_resid->unsqueeze(0);
}

// perkey_select's packed form: one launch over every (sequence, bias head) plane; key_rank
// (heads, Tk), row_thr (heads, Tq), tile_keys (heads, Tq / tile_rows + batch, 1 + cap) (SelectParams
// states the layout). Any tile_rows the selection kernel takes; perkey_fwd / perkey_bwd read only
// lists of kPerkeyTileRows-row tiles.
std::tuple<at::Tensor, at::Tensor, at::Tensor> perkey_select_packed_cuda(const at::Tensor& scores, int64_t window,
                                                                         bool is_causal, int64_t tile_rows,
                                                                         const Packed& s) {
  SelectParams p;
  p.scores = scores.const_data_ptr();
  p.dtype = to_dtype(scores.scalar_type());
  p.cu_seqlens_q = s.cu_q.const_data_ptr<int32_t>();
  p.cu_seqlens_k = s.cu_k.const_data_ptr<int32_t>();
  p.total_q = s.total_q;
  p.total_k = s.total_k;
  const int64_t heads = scores.size(0);
  p.planes2 = heads;
  p.planes = s.batch * heads;
  p.stride2 = scores.stride(0);
  p.stride_k = scores.stride(1);
  p.seqlen_q = s.max_q;
  p.seqlen_k = s.max_k;
  p.window = window;
  p.tile_rows = tile_rows;
  p.is_causal = is_causal;
  const char* why = cuda::select_unsupported_reason(p);
  TORCH_CHECK_VALUE(why == nullptr, "flexdma::perkey_select on CUDA does not take this packed call: ", why);
  p.list_cap = perkey_list_cap(s.max_k, window, tile_rows);
  const auto opts = scores.options().dtype(at::kInt);
  at::Tensor key_rank = at::empty({heads, s.total_k}, opts), row_thr = at::empty({heads, s.total_q}, opts);
  at::Tensor lists = at::empty({heads, s.total_q / tile_rows + s.batch, 1 + p.list_cap}, opts);
  p.key_rank = key_rank.data_ptr<int32_t>();
  p.row_thr = row_thr.data_ptr<int32_t>();
  p.tile_keys = lists.data_ptr<int32_t>();
  launch_select(p, scores);
  return {key_rank, row_thr, lists};
}

// The lists of perkey_select's packed form as the kernels' operand. The kernels' CTAs take
// kPerkeyTileRows query rows, and a sequence's first list is row cu_seqlens_q[b] / kPerkeyTileRows + b
// (SeqInfo::tile0): lists made with another tile_rows are refused by their row count.
Broadcast4d packed_lists(const char* op, const c10::optional<at::Tensor>& tile_keys, const at::Tensor& key_rank,
                         const at::Tensor& q, const Packed& s) {
  const int64_t rows = s.total_q / kPerkeyTileRows + s.batch;
  TORCH_CHECK_VALUE(tile_keys.has_value() && tile_keys->defined(), op,
                    " on CUDA needs tile_keys, the third output of flexdma::perkey_select's packed form called with "
                    "tile_rows=",
                    kPerkeyTileRows);
  const at::Tensor& x = *tile_keys;
  TORCH_CHECK_VALUE(x.scalar_type() == at::kInt && x.dim() == 3 && x.is_contiguous() && x.device() == q.device() &&
                        x.size(0) == key_rank.size(0) && x.size(1) == rows && x.size(2) >= 1,
                    op, ": in the packed form tile_keys must be a contiguous int32 (", key_rank.size(0), ", Tq / ",
                    kPerkeyTileRows, " + batch = ", rows, ", 1 + cap) tensor on ", q.device(),
                    " (flexdma::perkey_select's packed form with tile_rows=", kPerkeyTileRows, "), got ",
                    x.scalar_type(), " ", x.sizes(), " on ", x.device());
  Broadcast4d b;
  b.ptr = x.data_ptr();
  b.head_stride = x.size(0) == 1 ? 0 : x.stride(0);
  b.row_stride = x.size(2);
  b.col_stride = 1;
  b.head_ratio = q.size(1) / x.size(0);
  return b;
}

// fwd's packed form: the dense kernels (every built head dim), out_resid where keep_resid.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_packed_cuda(const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& v,
                                                               const c10::optional<at::Tensor>& bias,
                                                               double softmax_scale, bool is_causal, double softcap,
                                                               bool keep_resid, const Packed& s) {
  at::Tensor out = alloc_out(q), resid = keep_resid ? alloc_out(q) : at::empty({0}, q.options());
  at::Tensor lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  fwd_impl(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), c10::nullopt, packed_bias(bias), softmax_scale, is_causal,
           softcap, c10::nullopt,
           [&](const FwdParams& given) {
             FwdParams p = given;
             packed_params(p, s);
             p.out_resid = keep_resid ? resid.data_ptr() : nullptr;
             launch_fwd(p, q);
           },
           {}, {}, {out.unsqueeze(0), lse.unsqueeze(0)});
  return {out, lse, resid};
}

// bwd's packed form: the dense backward as a batch-1 call whose sequences packed_params makes. Its
// per-key dbias is summed over the rows in the kernel, each sequence's keys at their offset, and
// over the kv heads that share a bias head by bwd_impl.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_packed_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& bias, const at::Tensor& out, const at::Tensor& lse, double softmax_scale,
    bool is_causal, double softcap, bool bias_requires_grad, bool deterministic,
    const c10::optional<at::Tensor>& out_resid, const Packed& s) {
  const at::Tensor out4 = out.unsqueeze(0);
  void* resid = resid_ptr(packed_resid(out_resid), out4, "flexdma::bwd");
  const c10::optional<at::Tensor> bias4 = packed_bias(bias);
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options()), dv = at::empty(v.sizes(), v.options());
  const at::Tensor db = std::get<3>(
      bwd_impl(dout.unsqueeze(0), q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), c10::nullopt, bias4, out4,
               lse.unsqueeze(0), softmax_scale, is_causal, softcap, bias_requires_grad, deterministic, c10::nullopt,
               [&](const BwdParams& given) {
                 BwdParams p = given;
                 packed_params(p, s);
                 p.out_resid = resid;
                 launch_bwd(p, q);
               },
               /*device_stores_dbias_dtype=*/true, {}, {}, {dq.unsqueeze(0), dk.unsqueeze(0), dv.unsqueeze(0)}));
  // db has the batch-1 bias's shape (1, heads, 1, Tk): the packed one's, as a tensor of its own.
  at::Tensor dbias = bias_requires_grad && bias4.has_value() ? db.reshape(bias->sizes()).clone() : db;
  return {dq, dk, dv, dbias};
}

// perkey_bwd's packed form: the forward's selection and lists, as the padded op reads them (no
// selection made here).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> perkey_bwd_packed_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
    const at::Tensor& key_rank, const at::Tensor& row_thr, const at::Tensor& out, const at::Tensor& lse,
    double softmax_scale, bool is_causal, double softcap, bool bias_requires_grad, bool deterministic,
    const c10::optional<at::Tensor>& tile_keys, const c10::optional<at::Tensor>& out_resid, const Packed& s) {
  const char* op = "flexdma::perkey_bwd";
  const at::Tensor q4 = q.unsqueeze(0), k4 = k.unsqueeze(0), v4 = v.unsqueeze(0), out4 = out.unsqueeze(0);
  check_perkey(op, q4, k4, v4, bias, softcap, /*backward=*/true, deterministic, &s);
  const Broadcast4d keys = packed_lists(op, tile_keys, key_rank, q, s);
  void* resid = resid_ptr(packed_resid(out_resid), out4, op);
  at::Tensor dq = at::empty(q.sizes(), q.options());
  auto [dk, dv, db] =
      perkey_bwd_run(dout.unsqueeze(0), q4, k4, v4, *packed_bias(bias), key_rank.unsqueeze(0), row_thr.unsqueeze(0),
                     keys, kPerkeyTileRows, out4, lse.unsqueeze(0), resid, softmax_scale, is_causal, bias_requires_grad,
                     dq.unsqueeze(0), [&s](BwdParams& p) { packed_params(p, s); });
  // The casts make tensors of their own (not views of the float buffer), dbias at the bias's (heads, Tk).
  auto [dk_out, dv_out, dbias] = cast_sums(dk, dv, db, k, v, bias);
  return {dq, dk_out, dv_out, dbias};
}

// ---- The ops' CUDA implementations: the padded form here, the packed one above. ----

// out_resid is written where keep_resid says a backward will follow: its rowsum(dout * out) needs
// out in float. An inference call skips the store (one more out-sized write).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
    const c10::optional<at::Tensor>& bias, double softmax_scale, bool is_causal, double softcap, bool /*deterministic*/,
    const c10::optional<at::Tensor>& tile_meta, bool keep_resid, const c10::optional<at::Tensor>& cu_q,
    const c10::optional<at::Tensor>& cu_k, int64_t max_q, int64_t max_k) {
  c10::cuda::CUDAGuard guard(q.device());
  if (packed_form(cu_q, cu_k, max_q, max_k, "flexdma::fwd")) {
    packed_dense_check(mask, tile_meta, "flexdma::fwd");
    const Packed s = packed_check(q, k, v, cu_q, cu_k, max_q, max_k, bias, "flexdma::fwd");
    return fwd_packed_cuda(q, k, v, bias, softmax_scale, is_causal, softcap, keep_resid, s);
  }
  at::Tensor resid = keep_resid ? alloc_out(q) : at::empty({0}, q.options());
  auto [out, lse] = fwd_impl(q, k, v, mask, bias, softmax_scale, is_causal, softcap,
                             meta_for(mask, tile_meta, q, k, is_causal), [&](const FwdParams& given) {
                               FwdParams p = given;
                               p.out_resid = keep_resid ? resid.data_ptr() : nullptr;
                               launch_fwd(p, q);
                             });
  return {out, lse, resid};
}

// Without out_resid (or with an empty one) the kernel's row sums use out alone.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& bias, const at::Tensor& out,
    const at::Tensor& lse, double softmax_scale, bool is_causal, double softcap, bool bias_requires_grad,
    bool deterministic, const c10::optional<at::Tensor>& tile_meta, const c10::optional<at::Tensor>& out_resid,
    const c10::optional<at::Tensor>& cu_q, const c10::optional<at::Tensor>& cu_k, int64_t max_q, int64_t max_k) {
  c10::cuda::CUDAGuard guard(q.device());
  if (packed_form(cu_q, cu_k, max_q, max_k, "flexdma::bwd")) {
    packed_dense_check(mask, tile_meta, "flexdma::bwd");
    const Packed s = packed_check(q, k, v, cu_q, cu_k, max_q, max_k, bias, "flexdma::bwd");
    packed_bwd_check(dout, q, out, lse, "flexdma::bwd");
    return bwd_packed_cuda(dout, q, k, v, bias, out, lse, softmax_scale, is_causal, softcap, bias_requires_grad,
                           deterministic, out_resid, s);
  }
  void* resid = resid_ptr(out_resid, out, "flexdma::bwd");
  return bwd_impl(
      dout, q, k, v, mask, bias, out, lse, softmax_scale, is_causal, softcap, bias_requires_grad, deterministic,
      meta_for(mask, tile_meta, q, k, is_causal),
      [resid, &q](const BwdParams& given) {
        BwdParams p = given;
        p.out_resid = resid;
        launch_bwd(p, q);
      },
      /*device_stores_dbias_dtype=*/true);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> perkey_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias, const at::Tensor& key_rank,
    const at::Tensor& row_thr, double softmax_scale, bool is_causal, double softcap,
    bool /*deterministic: read by the backward*/, const c10::optional<at::Tensor>& tile_keys,
    const c10::optional<at::Tensor>& cu_q, const c10::optional<at::Tensor>& cu_k, int64_t max_q, int64_t max_k) {
  c10::cuda::CUDAGuard guard(q.device());
  const char* op = "flexdma::perkey_fwd";
  at::Tensor out, lse, resid = alloc_out(q);
  FwdParams p;
  if (packed_form(cu_q, cu_k, max_q, max_k, op)) {
    // The packed form: the padded kernels over the sequences (one batch whose rows packed_params
    // makes the sequences), reading the selection given; out / lse tensors of their own, filled
    // through batch-1 views.
    packed_perkey_check(q, k, bias, key_rank, row_thr, op);
    const Packed s = packed_check(q, k, v, cu_q, cu_k, max_q, max_k, bias, op);
    const at::Tensor q4 = q.unsqueeze(0), k4 = k.unsqueeze(0), v4 = v.unsqueeze(0);
    check_perkey(op, q4, k4, v4, bias, softcap, /*backward=*/false, /*deterministic=*/false, &s);
    const Broadcast4d keys = packed_lists(op, tile_keys, key_rank, q, s);
    out = alloc_out(q);
    lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
    p = perkey_fwd_params(q4, k4, v4, *packed_bias(bias), key_rank.unsqueeze(0), row_thr.unsqueeze(0), keys,
                          kPerkeyTileRows, softmax_scale, is_causal, softcap, out.unsqueeze(0), lse.unsqueeze(0),
                          resid);
    packed_params(p, s);
  } else {
    check_qkv(q, k, v);
    check_perkey(op, q, k, v, bias, softcap, /*backward=*/false, /*deterministic=*/false);
    const Broadcast4d keys = perkey_lists(op, tile_keys, key_rank, q);
    std::tie(out, lse) = alloc_fwd_outputs(q);
    p = perkey_fwd_params(q, k, v, bias, key_rank, row_thr, keys, kPerkeyTileRows, softmax_scale, is_causal, softcap,
                          out, lse, resid);
  }
  if (out.numel() > 0) launch_fwd(p, q);
  return {out, lse, resid};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> perkey_bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
    const at::Tensor& key_rank, const at::Tensor& row_thr, const at::Tensor& out, const at::Tensor& lse,
    double softmax_scale, bool is_causal, double softcap, bool bias_requires_grad, bool deterministic,
    const c10::optional<at::Tensor>& tile_keys, const c10::optional<at::Tensor>& out_resid,
    const c10::optional<at::Tensor>& cu_q, const c10::optional<at::Tensor>& cu_k, int64_t max_q, int64_t max_k) {
  c10::cuda::CUDAGuard guard(q.device());
  if (packed_form(cu_q, cu_k, max_q, max_k, "flexdma::perkey_bwd")) {
    packed_perkey_check(q, k, bias, key_rank, row_thr, "flexdma::perkey_bwd");
    const Packed s = packed_check(q, k, v, cu_q, cu_k, max_q, max_k, bias, "flexdma::perkey_bwd");
    packed_bwd_check(dout, q, out, lse, "flexdma::perkey_bwd");
    return perkey_bwd_packed_cuda(dout, q, k, v, bias, key_rank, row_thr, out, lse, softmax_scale, is_causal, softcap,
                                  bias_requires_grad, deterministic, tile_keys, out_resid, s);
  }
  check_qkv(q, k, v);
  check_perkey("flexdma::perkey_bwd", q, k, v, bias, softcap, /*backward=*/true, deterministic);
  const Broadcast4d keys = perkey_lists("flexdma::perkey_bwd", tile_keys, key_rank, q);
  void* resid = resid_ptr(out_resid, out, "flexdma::perkey_bwd");
  at::Tensor dq = at::empty(q.sizes(), q.options());
  auto [dk, dv, db] = perkey_bwd_run(dout, q, k, v, bias, key_rank, row_thr, keys, kPerkeyTileRows, out, lse, resid,
                                     softmax_scale, is_causal, bias_requires_grad, dq, [](BwdParams&) {});
  auto [dk_out, dv_out, dbias] = cast_sums(dk, dv, db, k, v, bias);
  return {dq, dk_out, dv_out, dbias};
}

// One launch after the zero fill of the kernel's counters (csrc/cuda/perkey_select.cu). Entries past
// a list's length are left unwritten (the kernels never read them).
std::tuple<at::Tensor, at::Tensor, at::Tensor> perkey_select_cuda(const at::Tensor& scores, int64_t window,
                                                                  int64_t seqlen_q, bool is_causal, int64_t tile_rows,
                                                                  const c10::optional<at::Tensor>& cu_q,
                                                                  const c10::optional<at::Tensor>& cu_k, int64_t max_q,
                                                                  int64_t max_k) {
  c10::cuda::CUDAGuard guard(scores.device());
  const bool packed = packed_form(cu_q, cu_k, max_q, max_k, "flexdma::perkey_select");
  perkey_select_check(scores, window, seqlen_q, tile_rows, packed);
  if (packed)
    return perkey_select_packed_cuda(scores, window, is_causal, tile_rows,
                                     packed_offsets(*cu_q, *cu_k, max_q, max_k, seqlen_q, scores.size(1),
                                                    scores.device(), "flexdma::perkey_select"));
  SelectParams p;
  p.scores = scores.const_data_ptr();
  p.dtype = to_dtype(scores.scalar_type());
  p.planes2 = scores.size(1);
  p.planes = scores.size(0) * scores.size(1);
  p.stride1 = scores.stride(0);
  p.stride2 = scores.stride(1);
  p.stride_k = scores.stride(2);
  p.seqlen_q = seqlen_q;
  p.seqlen_k = scores.size(2);
  p.window = window;
  p.tile_rows = tile_rows;
  p.is_causal = is_causal;
  const char* why = cuda::select_unsupported_reason(p);
  TORCH_CHECK_VALUE(why == nullptr, "flexdma::perkey_select on CUDA does not take this call: ", why);
  const SelectOutputs o = alloc_select_outputs(scores, window, seqlen_q, tile_rows, /*zero_lists=*/false);
  p.list_cap = o.list_cap;
  p.key_rank = o.key_rank.data_ptr<int32_t>();
  p.row_thr = o.row_thr.data_ptr<int32_t>();
  p.tile_keys = o.tile_keys.data_ptr<int32_t>();
  launch_select(p, scores);
  return {o.key_rank, o.row_thr, o.tile_keys};
}

// The decode ops' launches after their support check, their scratch from the caching allocator:
// the step's partial rows and (perkey_last_row) the selection's histogram rows.
void decode_cuda_launch(DecodeParams& p, const char* op) {
  const char* why = cuda::decode_unsupported_reason(p);
  TORCH_CHECK_VALUE(why == nullptr, op, " on CUDA does not take this call: ", why);
  // One allocation: the partial rows, then (16-byte aligned) the histogram rows.
  const int64_t n = (cuda::decode_workspace_bytes(p) + 15) / 16 * 16;
  const int64_t total = n + (p.scores ? cuda::last_row_select_bytes(p) : 0);
  const auto bytes = at::TensorOptions().dtype(at::kByte).device(at::kCUDA, at::cuda::current_device());
  const at::Tensor ws = total > 0 ? at::empty({total}, bytes) : at::Tensor();
  char* base = total > 0 ? static_cast<char*>(ws.data_ptr()) : nullptr;
  p.workspace = n > 0 ? base : nullptr;
  p.select_workspace = p.scores ? base + n : nullptr;
  if (p.scores)
    cuda::run_last_row(p, at::cuda::getCurrentCUDAStream().stream());
  else
    cuda::run_decode(p, at::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor decode_step_cuda(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& kept_idx, const at::Tensor& kept_valid, const at::Tensor& kept_score,
                            const at::Tensor& s_new, const at::Tensor& eligible, int64_t position,
                            const c10::optional<at::Tensor>& position_at, double softmax_scale, double softcap) {
  c10::cuda::CUDAGuard guard(q.device());
  return decode_step_impl(q, key_cache, value_cache, kept_idx, kept_valid, kept_score, s_new, eligible, position,
                          position_at, softmax_scale, softcap,
                          [](DecodeParams& p) { decode_cuda_launch(p, "flexdma::decode_step"); });
}

at::Tensor decode_append_cuda(const at::Tensor& q, const at::Tensor& key_new, const at::Tensor& value_new,
                              const at::Tensor& s_new, const at::Tensor& eligible, const at::Tensor& key_cache,
                              const at::Tensor& value_cache, const at::Tensor& bias_cache,
                              const at::Tensor& padding_cache, const at::Tensor& kept_idx, const at::Tensor& kept_valid,
                              const at::Tensor& kept_score, int64_t position, double softmax_scale, double softcap) {
  c10::cuda::CUDAGuard guard(q.device());
  return decode_append_impl(q, key_new, value_new, s_new, eligible, key_cache, value_cache, bias_cache, padding_cache,
                            kept_idx, kept_valid, kept_score, position, softmax_scale, softcap,
                            [](DecodeParams& p) { decode_cuda_launch(p, "flexdma::decode_append"); });
}

at::Tensor perkey_last_row_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& scores,
                                int64_t window, double softmax_scale, double softcap) {
  c10::cuda::CUDAGuard guard(q.device());
  return perkey_last_row_impl(q, k, v, scores, window, softmax_scale, softcap,
                              [](DecodeParams& p) { decode_cuda_launch(p, "flexdma::perkey_last_row"); });
}

}  // namespace

// Python's backend choice reads the kernels' own support check (ops/flexdma_ops.cpp).
const bool kSupportCheckSet = (cuda_support_check() = &cuda::unsupported_reason, true);
const bool kPerkeySupportCheckSet = (perkey_support_check() = &cuda::perkey_unsupported_reason, true);
const bool kDecodeSupportCheckSet = (decode_support_check() = &cuda::decode_unsupported_reason, true);

TORCH_LIBRARY_IMPL(flexdma, CUDA, m) {
  m.impl("decode_step", &decode_step_cuda);
  m.impl("decode_append", &decode_append_cuda);
  m.impl("perkey_last_row", &perkey_last_row_cuda);
  m.impl("perkey_select", &perkey_select_cuda);
  m.impl("perkey_fwd", &perkey_fwd_cuda);
  m.impl("perkey_bwd", &perkey_bwd_cuda);
  m.impl("fwd", &fwd_cuda);
  m.impl("bwd", &bwd_cuda);
  m.impl("tile_meta", &tile_meta_cuda);
}

}  // namespace flexdma
