// Entry points of the CUDA kernels: what is supported, and dispatch on (dtype, head dim).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

#include "flash_dma_cuda.h"
#include "head_dims.h"
#include "launch.h"

namespace flexdma {
namespace cuda {

namespace {
#define FLEXDMA_IS_DIM(D) \
  if (d == D) return true;
bool head_dim_built(int64_t d) {
  FLEXDMA_FOR_EACH_HEAD_DIM(FLEXDMA_IS_DIM)
  return false;
}
bool head_dim_implemented(int64_t d) {
  FLEXDMA_ALL_HEAD_DIMS(FLEXDMA_IS_DIM)
  return false;
}
#undef FLEXDMA_IS_DIM

template <typename Fn>
void dispatch(const FwdParams& p, Fn&& fn) {
  const bool bf16 = p.dtype == DType::kBFloat16;
#define FLEXDMA_DISPATCH(D)                                                                                        \
  if (p.head_dim == D) {                                                                                           \
    bf16 ? fn(__nv_bfloat16{}, std::integral_constant<int, D>{}) : fn(__half{}, std::integral_constant<int, D>{}); \
    return;                                                                                                        \
  }
  FLEXDMA_FOR_EACH_HEAD_DIM(FLEXDMA_DISPATCH)
#undef FLEXDMA_DISPATCH
}

#ifdef FLEXDMA_SM90A
constexpr bool kSm90aBuild = true;
#else
constexpr bool kSm90aBuild = false;
#endif

// The per-key kernels' limits that the sizes and the operands' layout set (both checks below).
const char* perkey_limits_reason(int64_t batch, int64_t heads, int64_t seqlen_q, int64_t seqlen_k, bool rows_aligned,
                                 int64_t kv_row_stride) {
  if (ceil_div(seqlen_q, kPerkeyTileRows) * heads * batch >= (int64_t(1) << 31))
    return "the per-key forward counts its query tiles x heads x batch in 32 bits";
  if (!rows_aligned) return "the per-key kernels need 16-byte aligned q / k / v rows (strides multiples of 8)";
  if (kv_row_stride < 0 || kv_row_stride >= (int64_t(1) << 31) || seqlen_k * kv_row_stride >= (int64_t(1) << 31))
    return "the per-key kernels index key / value rows in 32 bits: seqlen_k x row stride must be below 2^31";
  return nullptr;
}
}  // namespace

const char* unsupported_reason(const FwdParams& p) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return "dtype must be bfloat16 or float16";
  if (!head_dim_implemented(p.head_dim)) return "head_dim must be 32, 64, 96, 128, 192 or 256";
  if (!head_dim_built(p.head_dim)) return "head_dim not built (FLEXDMA_HEAD_DIMS)";
  if (p.num_heads_k <= 0 || p.num_heads % p.num_heads_k != 0) return "num_heads must be a multiple of num_heads_k";
  if (p.num_heads > kMaxGridDim || p.batch > kMaxGridDim) return "batch and num_heads must be <= 65535";
  if (p.softcap < 0.f) return "softcap must be >= 0";
  if ((p.cu_seqlens_q == nullptr) != (p.cu_seqlens_k == nullptr)) return "packed sequences need both cu_seqlens";
  if (p.cu_seqlens_q) {
    if (p.mask.ptr || p.tile_meta.ptr) return "packed sequences take no attn_mask";
    if (p.bias.ptr && p.bias.row_stride != 0) return "packed sequences take a per-key bias only (heads, total_k)";
  }
  if (p.key_rank.ptr || p.row_thr.ptr || p.tile_keys.ptr) {
    if (!p.key_rank.ptr || !p.row_thr.ptr || !p.tile_keys.ptr)
      return "the top-k rank rule needs key_rank, row_thr and tile_keys together";
    if (!perkey_head_dim(p.head_dim)) return "the C++ per-key kernels take head dims 64 and 128, on sm_90a builds";
    if (p.mask.ptr) return "the C++ per-key kernels take no attn_mask (the selection holds it)";
    if (p.perkey_tile_rows <= 0 || p.perkey_tile_rows % kPerkeyTileRows != 0)
      return "the C++ per-key kernels read lists of query tiles of a multiple of 128 rows (their CTAs' rows)";
    const bool aligned = aligned16(p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride) &&
                         aligned16(p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride) &&
                         aligned16(p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
    const int64_t rs = p.k_row_stride < 0 || p.v_row_stride < 0 ? -1 : std::max(p.k_row_stride, p.v_row_stride);
    return perkey_limits_reason(p.batch, p.num_heads, p.seqlen_q, p.seqlen_k, aligned, rs);
  }
  return nullptr;
}

const char* perkey_unsupported_reason(const PerkeyCall& c) {
  const int bf16 = static_cast<int>(DType::kBFloat16), fp16 = static_cast<int>(DType::kFloat16);
  if (c.dtype != bf16 && c.dtype != fp16) return "the per-key kernels take bfloat16 and float16";
  if (!kSm90aBuild) return "the per-key kernels are in sm_90a-only builds (FLEXDMA_CUDA_ARCHS=90), not this one";
  if (!perkey_head_dim(c.head_dim) || !head_dim_built(c.head_dim))
    return "the per-key kernels take head dims 64 and 128 where the build has them (FLEXDMA_HEAD_DIMS)";
  if (c.device_arch != 90) return "the per-key kernels run on sm_90 GPUs (H100, H200)";
  if (c.bias_dtype != c.dtype) return "the per-key kernels take the bias in q's dtype";
  if (c.num_heads_k <= 0 || c.num_heads % c.num_heads_k != 0) return "num_heads must be a multiple of num_heads_k";
  if (c.num_heads > kMaxGridDim || c.batch > kMaxGridDim) return "batch and num_heads must be <= 65535";
  if (c.softcap < 0.f) return "softcap must be >= 0";
  if (c.backward && c.softcap != 0.f) return "the per-key backward takes no softcap";
  if (c.backward && c.deterministic)
    return "the per-key backward adds dK / dV / dbias with float atomics: not deterministic";
  return perkey_limits_reason(c.batch, c.num_heads, c.seqlen_q, c.seqlen_k, c.rows_aligned, c.kv_row_stride);
}

int64_t fwd_workspace_bytes(const FwdParams& p) {
  int64_t bytes = 0;
  dispatch(p, [&](auto t, auto d) { bytes = fwd_workspace_bytes<decltype(t), decltype(d)::value>(p); });
  return bytes;
}

int64_t bwd_workspace_bytes(const BwdParams& p) {
  int64_t bytes = 0;
  dispatch(p, [&](auto t, auto d) { bytes = bwd_workspace_bytes<decltype(t), decltype(d)::value>(p); });
  return bytes;
}

void run_fwd(const FwdParams& p, void* stream) {
  dispatch(p,
           [&](auto t, auto d) { launch_fwd<decltype(t), decltype(d)::value>(p, static_cast<cudaStream_t>(stream)); });
}

void run_bwd(const BwdParams& p, void* stream) {
  dispatch(p,
           [&](auto t, auto d) { launch_bwd<decltype(t), decltype(d)::value>(p, static_cast<cudaStream_t>(stream)); });
}

}  // namespace cuda
}  // namespace flexdma
