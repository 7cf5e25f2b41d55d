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

// out_resid is written where keep_resid says a backward will follow: its rowsum(dout * out) needs
// out in float. An inference call skips the store (one more out-sized write).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                        const c10::optional<at::Tensor>& mask,
                                                        const c10::optional<at::Tensor>& bias, double softmax_scale,
                                                        bool is_causal, double softcap, bool /*deterministic*/,
                                                        const c10::optional<at::Tensor>& tile_meta, bool keep_resid) {
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor resid = keep_resid ? alloc_out(q) : at::empty({0}, q.options());
  auto [out, lse] = fwd_impl(q, k, v, mask, bias, softmax_scale, is_causal, softcap,
                             meta_for(mask, tile_meta, q, k, is_causal), [&](const FwdParams& given) {
                               FwdParams p = given;
                               p.out_resid = keep_resid ? resid.data_ptr() : nullptr;
                               launch_fwd(p, q);
                             });
  return {out, lse, resid};
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

// Without out_resid (or with an empty one) the kernel's row sums use out alone.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& bias, const at::Tensor& out,
    const at::Tensor& lse, double softmax_scale, bool is_causal, double softcap, bool bias_requires_grad,
    bool deterministic, const c10::optional<at::Tensor>& tile_meta, const c10::optional<at::Tensor>& out_resid) {
  c10::cuda::CUDAGuard guard(q.device());
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

// flexdma::topk_fwd_sm90: the per-key forward over each query tile's listed keys.
std::tuple<at::Tensor, at::Tensor, at::Tensor> topk_fwd_sm90_cuda(const at::Tensor& q, const at::Tensor& k,
                                                                  const at::Tensor& v, const at::Tensor& bias,
                                                                  const at::Tensor& key_rank, const at::Tensor& row_thr,
                                                                  const at::Tensor& tile_keys, int64_t tile_rows,
                                                                  double softmax_scale, bool is_causal,
                                                                  double softcap) {
  c10::cuda::CUDAGuard guard(q.device());
  check_qkv(q, k, v);
  const Broadcast4d keys = tile_keys_operand(tile_keys, key_rank, q, tile_rows);
  at::Tensor resid = alloc_out(q);
  auto [out, lse] =
      topk_fwd_impl(q, k, v, bias, key_rank, row_thr, softmax_scale, is_causal, softcap, [&](const FwdParams& rule) {
        FwdParams p = rule;
        p.tile_keys = keys;
        p.topk_tile_rows = tile_rows;
        p.out_resid = resid.data_ptr();
        launch_fwd(p, q);
      });
  return {out, lse, resid};
}

// flexdma::topk_bwd_sm90: the per-key backward over the same lists (bwd_ws_kernel.cuh). dK / dV
// and the per-key dbias are sums over the query tiles that list a key: the kernel adds them into
// one zeroed float buffer, cast here to the operands' dtypes.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> topk_bwd_sm90_cuda(
    const at::Tensor& dout_in, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
    const at::Tensor& key_rank, const at::Tensor& row_thr, const at::Tensor& tile_keys, int64_t tile_rows,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& out_resid, double softmax_scale, bool is_causal,
    bool bias_requires_grad) {
  c10::cuda::CUDAGuard guard(q.device());
  check_qkv(q, k, v);
  FwdParams rule;
  fill_topk_params(rule, q, k, bias, key_rank, row_thr);
  const Broadcast4d keys = tile_keys_operand(tile_keys, key_rank, q, tile_rows);
  void* resid = resid_ptr(out_resid, out, "flexdma::topk_bwd_sm90");
  // Q / dO rows are copied 16 bytes at a time; out / dout / out_resid read in 4-byte pairs.
  const auto rows16 = [](const at::Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 &&
           t.stride(2) % 8 == 0;
  };
  const at::Tensor dout = rows16(dout_in) ? dout_in : dout_in.contiguous();
  TORCH_CHECK_VALUE(out.stride(0) % 2 == 0 && out.stride(1) % 2 == 0 && out.stride(2) % 2 == 0,
                    "flexdma::topk_bwd_sm90: out's strides must be even (its rows are read in pairs), got ",
                    out.strides());
  at::Tensor dq = at::empty(q.sizes(), q.options());
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
  p.topk_tile_rows = tile_rows;
  p.out_resid = resid;
  if (q.numel() > 0 && k.numel() > 0)
    launch_bwd(p, q);
  else
    dq.zero_();
  at::Tensor dbias = bias_requires_grad ? db->to(bias.scalar_type()) : at::empty({0}, q.options());
  return {dq, dk.to(k.scalar_type()), dv.to(v.scalar_type()), dbias};
}

// flexdma::topk_select: one launch after the zero fill of the kernel's counters (csrc/cuda/
// topk_select.cu). Entries past a list's length are left unwritten (the kernels never read them).
std::tuple<at::Tensor, at::Tensor, at::Tensor> topk_select_cuda(const at::Tensor& scores, int64_t window,
                                                                int64_t seqlen_q, bool is_causal, int64_t tile_rows) {
  c10::cuda::CUDAGuard guard(scores.device());
  topk_select_check(scores, window, seqlen_q, tile_rows);
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
  TORCH_CHECK_VALUE(why == nullptr, "flexdma::topk_select on CUDA does not take this call: ", why);
  const SelectOutputs o = alloc_select_outputs(scores, window, seqlen_q, tile_rows, /*zero_lists=*/false);
  p.list_cap = o.list_cap;
  p.key_rank = o.key_rank.data_ptr<int32_t>();
  p.row_thr = o.row_thr.data_ptr<int32_t>();
  p.tile_keys = o.tile_keys.data_ptr<int32_t>();
  at::Tensor ws = at::empty({cuda::select_workspace_bytes(p)}, scores.options().dtype(at::kByte));
  p.workspace = ws.data_ptr();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  C10_CUDA_CHECK(cudaMemsetAsync(p.workspace, 0, cuda::select_counter_bytes(p), stream));
  cuda::run_select(p, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {o.key_rank, o.row_thr, o.tile_keys};
}

}  // namespace

// Python's backend choice reads the kernels' own support check (ops/flexdma_ops.cpp).
const bool kSupportCheckSet = (cuda_support_check() = &cuda::unsupported_reason, true);

TORCH_LIBRARY_IMPL(flexdma, CUDA, m) {
  m.impl("topk_select", &topk_select_cuda);
  m.impl("topk_fwd_sm90", &topk_fwd_sm90_cuda);
  m.impl("topk_bwd_sm90", &topk_bwd_sm90_cuda);
  m.impl("fwd", &fwd_cuda);
  m.impl("bwd", &bwd_cuda);
  m.impl("tile_meta", &tile_meta_cuda);
}

}  // namespace flexdma
