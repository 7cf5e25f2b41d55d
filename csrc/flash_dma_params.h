// The contract between the dispatcher binding (ops/) and every kernel (csrc/cpu, csrc/cuda).
// Torch-free on purpose: kernels see raw pointers and element strides only, so they can be
// compiled and tested without PyTorch (nvcc on a machine without a GPU, a plain C++ compiler).
//
// Conventions every kernel implements (flexdma/reference.py is the ground truth):
//   layout        q (B, Q, H, D), k/v (B, K, KVH, D), out (B, Q, H, D), lse (B, H, Q)
//                 head_dim is contiguous (stride 1) for q, k, v, out, dout, dq, dk, dv.
//   GQA           query head h reads kv head h / (H / KVH).
//   score         s = softcap > 0 ? softcap * tanh(scale * q.k / softcap) : scale * q.k
//                 s += bias (added after the softcap: the bias is a logit, never squashed)
//                 s = -inf where mask is false or (is_causal and k > q + (K - Q))
//                 (causal is bottom-right aligned when Q != K).
//   empty rows    a row with no finite score writes out = 0, lse = -inf, and contributes zero
//                 to every gradient.
//   mask / bias   4-D, each dim either broadcast (stride 0) or full: ({1|B}, {1|KVH|H}, {1|Q}, {1|K}).
//                 Head index = h / head_ratio, head_ratio = H / (number of heads of that tensor);
//                 with one head its head stride is 0, so the ratio does not matter.
//   dbias         accumulated in float into `dbias_accum` (see BwdParams), never with atomics:
//                 each (batch, kv head, key tile) work item loops over all query rows and its
//                 query heads in a fixed order, so the result is bitwise reproducible. A kernel
//                 may store the final values in the bias dtype instead (`dbias_in_dtype`).
#pragma once
#include <cstdint>

#include "flash_dma_constants.h"

namespace flexdma {

enum class DType : int32_t { kFloat32 = 0, kFloat64 = 1, kBFloat16 = 2, kFloat16 = 3 };

// A broadcastable 4-D operand (mask or bias). Strides are in elements; 0 on broadcast dims.
struct Broadcast4d {
  const void* ptr = nullptr;  // nullptr: operand absent
  int64_t batch_stride = 0, head_stride = 0, row_stride = 0, col_stride = 0;
  int64_t head_ratio = 1;  // H / heads of this operand
};

struct FwdParams {
  int64_t batch = 0, seqlen_q = 0, seqlen_k = 0, num_heads = 0, num_heads_k = 0, head_dim = 0;
  DType dtype = DType::kFloat32;  // of q, k, v, out and bias; lse is float64 for kFloat64, else float32

  const void* q = nullptr;
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  const void* k = nullptr;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  const void* v = nullptr;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  void* out = nullptr;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;
  void* lse = nullptr;  // contiguous (B, H, Q)

  Broadcast4d mask;  // bool stored as uint8 (0 / 1)
  Broadcast4d bias;  // same dtype as q

  // Tile activity of the mask (optional; CUDA kernels only): bit (kt % 32) of word
  // (b, mask head, qt, kt / 32) says whether the 64 x 64 tile (query tile qt, key tile kt) keeps
  // anything once mask, bounds and causality apply. Laid out like a mask plane with rows = query
  // tiles and columns = 32-bit words (col_stride 1); batch / head dims broadcast as the mask's.
  // Computed once per mask (flexdma::tile_meta) and read by the forward and both backward
  // kernels, so an empty tile is skipped without reading its mask bytes.
  Broadcast4d tile_meta;

  // Top-k rank keep rule (optional; flexdma::perkey_fwd / perkey_bwd; the CPU kernels and the CUDA
  // forward, which also needs tile_keys below): key j
  // is kept for row i iff key_rank[b, h, j] <= row_thr[b, h, i], on top of the mask and causality.
  // Both int32. key_rank is seen as a (Bs, Hs, 1, K) operand (row_stride 0), row_thr as
  // (Bs, Hs, Q, 1) (col_stride 0); batch / head dims broadcast like the mask's. It describes a
  // per-row top-W selection without a Q x K tensor: ranks order the keys of a plane once, and a
  // row's threshold says how far down that order it goes. A kernel that does not implement the
  // rule must refuse params with either pointer set.
  Broadcast4d key_rank;
  Broadcast4d row_thr;
  // The keys each query tile of perkey_tile_rows rows lists (flexdma::perkey_select's tile_keys), for
  // the CUDA forward of the rank rule: row qt of a plane holds the count n, then n key indices
  // (row_stride = 1 + the list capacity, col_stride 1; batch / head dims broadcast like
  // key_rank's). The kernel gathers K / V rows from the list instead of walking every key tile;
  // its 64-row tiles read the list of the tile they lie in (perkey_tile_rows a multiple of 64).
  Broadcast4d tile_keys;
  int64_t perkey_tile_rows = 64;
  // Packed sequences (FlashAttention's varlen layout): where set, batch b is the rows
  // [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q / out and [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of
  // k / v (int32 device offsets, batch + 1 of them), the batch strides are 0, and seqlen_q / seqlen_k
  // are the longest sequence's (they size the grid). No mask; a bias only per key (row stride 0),
  // packed along its keys: (heads, total_k). The per-key operands are packed along their rows / keys
  // alike (batch strides 0): key_rank (heads, total_k), row_thr (heads, total_q); tile_keys holds
  // sequence b's query tile t in row cu_seqlens_q[b] / perkey_tile_rows + b + t (total_q /
  // perkey_tile_rows + batch rows a head: a sequence's tiles never reach the next one's); lse is
  // (H, total_q). The kernel that reads the offsets first checks them on the device (seq_info.cuh).
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int64_t total_q = 0, total_k = 0;
  // out's rounding error (out - out rounded to its dtype, in out's dtype and strides), written
  // where non-null: the per-key backward's rowsum(dout * out) needs out in float.
  void* out_resid = nullptr;

  // Rounded to float: what the CUDA kernels (bf16 / fp16 inputs, float math) read. The CPU
  // kernels take both in double beside the params (ScoreConsts), for float64 inputs.
  float softmax_scale = 1.f;
  float softcap = 0.f;  // 0: off
  bool is_causal = false;

  // Device scratch of the CUDA kernels (split forward's partial rows, the backward's dQ accumulator
  // and row terms), allocated by the caller at the size the kernels ask for
  // (cuda::fwd_workspace_bytes / bwd_workspace_bytes); unused by the CPU kernel.
  void* workspace = nullptr;
};

// FwdParams' softmax_scale and softcap as the caller gave them, in double, for the kernels that
// compute float64 inputs (the CPU ones): 1/sqrt(D) rounded to float is ~1e-8 off wherever it is
// no power of two (D = 32, 96, 128), which float64 results would show. The kernels check that the
// params hold these values rounded to float. They travel beside FwdParams, not in it: the CUDA
// kernels take FwdParams by value as a kernel parameter, where a field added would move the
// parameters after it in constant memory, and so change those kernels' machine code.
struct ScoreConsts {
  double softmax_scale = 1.0;
  double softcap = 0.0;  // 0: off
};

// The per-key selection (flexdma::perkey_select; flexdma/perkey/contract.py states its outputs) of
// every plane of a (P1, P2, K) score tensor, -inf = ineligible. Planes are numbered p = p1 * P2 + p2;
// the outputs are contiguous: key_rank (P, K), row_thr (P, Q), tile_keys (P, n_tiles, 1 + cap).
//
// Packed sequences (cu_seqlens_q / cu_seqlens_k set: P1 = batch, the sequences): plane (b, p2)'s
// keys are scores[p2, cu_seqlens_k[b] + j] (stride1 unused), seqlen_q / seqlen_k the longest
// sequence's; the outputs are packed as FwdParams states: key_rank (P2, total_k), row_thr
// (P2, total_q), tile_keys (P2, total_q / tile_rows + batch, 1 + cap).
struct SelectParams {
  const void* scores = nullptr;
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int64_t total_q = 0, total_k = 0;
  DType dtype = DType::kFloat32;                   // kFloat32, kFloat16 or kBFloat16
  int64_t planes2 = 1, planes = 0;                 // P2 and P = P1 * P2
  int64_t stride1 = 0, stride2 = 0, stride_k = 0;  // of scores, in elements
  int64_t seqlen_q = 0, seqlen_k = 0, window = 1, tile_rows = 1, list_cap = 0;
  bool is_causal = false;
  int32_t* key_rank = nullptr;
  int32_t* row_thr = nullptr;
  int32_t* tile_keys = nullptr;
  // Scratch of cuda::select_workspace_bytes(params) bytes; its first 4 (1 + 2 P) bytes zeroed by
  // the caller (the kernel's work counters).
  void* workspace = nullptr;
};

// One decode step of the per-key path (flexdma::decode_step / decode_append): a new key at
// `position` of each (batch, kv head) plane against the plane's kept set of W slots (key index,
// whether the slot holds a key, the key's score), the state flexdma/perkey/decode.py keeps. Each
// plane decides as decode.append does whether the new key enters its kept set (eligible, not -inf,
// and a slot is free or it outranks the worst kept key: the lowest score, among equal ones the
// highest index; order of flexdma/perkey/kept.py's order_key), attends its query heads' rows over
// the updated set (logits softcap(scale q.k) + score; a set with no key gives output 0; a NaN logit
// makes the row NaN), then writes the slot it changed. Strides in elements.
//
// flexdma::perkey_last_row runs the same attention without a new key (s_new and eligible null):
// the kept sets are the top-W keys of `scores`, a row that sees every key (decode.last_row), which
// its own step writes first.
struct DecodeParams {
  int64_t batch = 0, num_heads = 0, num_heads_k = 0, head_dim = 0, window = 0;
  // Attention planes a batch row: num_heads_k (a plane = a kv head and its query heads), or
  // num_heads where each query head has a kept set of its own (perkey_last_row with per-head
  // scores). Plane a reads kv head a * num_heads_k / planes_per_batch and the kept set at head
  // index a (a head stride of 0 where one set serves every plane).
  int64_t planes_per_batch = 0;
  int64_t capacity = 0;                  // the caches' key rows
  DType dtype = DType::kBFloat16;        // of q, the caches, the new rows and out
  DType score_dtype = DType::kBFloat16;  // of kept_score, s_new and bias_cache
  const void* q = nullptr;               // (B, 1, H, D)
  int64_t q_batch_stride = 0, q_head_stride = 0;
  void* k = nullptr;  // (B, capacity, KVH, D) the key cache
  int64_t k_batch_stride = 0, k_head_stride = 0, k_row_stride = 0;
  void* v = nullptr;
  int64_t v_batch_stride = 0, v_head_stride = 0, v_row_stride = 0;
  // decode_append: the new key's rows (B, 1, KVH, D), written into the caches at `position` after the
  // step has read the kept set (no slot holds the position before the new key enters), with its
  // score into bias_cache (B, KVH, capacity) and its eligibility into padding_cache (B, capacity).
  // nullptr (decode_step): the new key's rows are in the caches already.
  const void* k_new = nullptr;
  int64_t k_new_batch_stride = 0, k_new_head_stride = 0;
  const void* v_new = nullptr;
  int64_t v_new_batch_stride = 0, v_new_head_stride = 0;
  void* bias_cache = nullptr;
  int64_t bias_batch_stride = 0, bias_head_stride = 0, bias_row_stride = 0;
  uint8_t* padding_cache = nullptr;  // bool stored as uint8
  int64_t padding_batch_stride = 0, padding_row_stride = 0;
  int64_t* kept_idx = nullptr;  // (B, KVH, W) each
  int64_t idx_batch_stride = 0, idx_head_stride = 0, idx_slot_stride = 0;
  uint8_t* kept_valid = nullptr;
  int64_t valid_batch_stride = 0, valid_head_stride = 0, valid_slot_stride = 0;
  void* kept_score = nullptr;
  int64_t score_batch_stride = 0, score_head_stride = 0, score_slot_stride = 0;
  const void* s_new = nullptr;  // (B, KVH); decode_append: its bias_new (B, KVH, 1, 1)
  int64_t s_new_batch_stride = 0, s_new_head_stride = 0;
  const uint8_t* eligible = nullptr;  // (B, KVH) bool; decode_append: its padding_new (B, 1), head stride 0
  int64_t eligible_batch_stride = 0, eligible_head_stride = 0;
  int64_t position = 0;
  // Where set, the position is read here on the device (a static cache's step under a CUDA graph:
  // no host synchronisation), and `position` is ignored.
  const int64_t* position_at = nullptr;
  void* out = nullptr;  // (B, 1, H, D)
  int64_t o_batch_stride = 0, o_head_stride = 0;
  double softmax_scale = 1.0;
  double softcap = 0.0;  // 0: off
  // perkey_last_row: the selection scores (P1, P2, seqlen_k), contiguous along the keys, -inf =
  // not eligible; the kept sets (P1, P2, W) are written from them (contiguous) first.
  const void* scores = nullptr;
  int64_t score_planes1 = 0, score_planes2 = 0, seqlen_k = 0;
  int64_t scores_batch_stride = 0, scores_head_stride = 0;
  // The CUDA step's scratch (cuda::decode_workspace_bytes): each split's partial rows; and the
  // last row's selection's (cuda::last_row_select_bytes): each pass's histogram rows.
  void* workspace = nullptr;
  void* select_workspace = nullptr;
};

// Float sums cast to the operands' dtype in one launch (the per-key backward's dK, dV and dbias):
// segment i is n[i] contiguous floats at src[i], written as n[i] contiguous elements of `dtype` at
// dst[i] (n[i] = 0: unused).
struct CastParams {
  static constexpr int kSegments = 3;
  const float* src[kSegments] = {};
  void* dst[kSegments] = {};
  int64_t n[kSegments] = {};
  DType dtype = DType::kBFloat16;  // kBFloat16 or kFloat16
};

struct BwdParams : FwdParams {
  // Inputs of the backward besides FwdParams' (out and lse are read, not written).
  const void* dout = nullptr;
  int64_t do_batch_stride = 0, do_row_stride = 0, do_head_stride = 0;

  // Outputs, same dtypes and layouts as q / k / v.
  void* dq = nullptr;
  int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  void* dk = nullptr;
  int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  void* dv = nullptr;
  int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;

  // dbias: float32 (float64 for kFloat64) buffer (the bias dtype under dbias_in_dtype below),
  // zero-filled by the caller (not under dbias_in_dtype), or nullptr when
  // the bias needs no gradient; kernels write through it (ptr is const only because the struct
  // is shared with the read-only operands). Its strides follow the same rules as Broadcast4d: a
  // kernel adds dS(b, h, i, j) into element (b * batch_stride + (h / head_ratio) * head_stride +
  // i * row_stride + j * col_stride). The caller sizes the batch and head dims so that two
  // different (batch, kv head) work items never share an element: such a dim is broadcast
  // (stride 0) only if one work item covers all of it (the query heads of one kv head); the
  // caller sums the leftover dims (batch; kv heads) in a fixed order and casts. Query rows and
  // keys keep the bias's own extent: a bias broadcast over rows (per-key) leaves the kernel to
  // sum over them, in a fixed order (no atomics). A bias broadcast over keys gets no accumulator
  // (null): its gradient is exactly zero, written by the caller.
  Broadcast4d dbias_accum;

  // When true, dbias_accum has the bias dtype (not float) and receives the final gradient: no
  // float buffer (4 GiB at 32K x 32K) and no cast pass. The caller sets it only when nothing is
  // left to sum afterwards (accumulator dims = the bias's, bias broadcast over neither rows nor
  // keys), and only for kernels that sum every head of a plane per tile in float before one
  // store (the CUDA backward). The buffer then comes uninitialised, dense in the bias's own
  // shape: the kernels write every element themselves, zeros included for the tiles no work
  // item keeps. Kernels that add per head (the CPU one) are never given it.
  bool dbias_in_dtype = false;

  // Scratch owned by the caller, (B, H, Q) float32 (float64 for kFloat64), uninitialised, for the
  // CPU kernel: it writes delta = rowsum(P * dP) into it, summed from the P and dP it forms dS
  // from (a one-hot row's dS is then exactly 0; rowsum(dout * out) differs from its dP in the last
  // bits, and from an out rounded to bf16/fp16 it is too coarse for a broadcast dbias), and reads
  // it back. The CUDA backward computes delta from out + out_resid into its own workspace (null
  // here).
  void* softmax_d = nullptr;

  // dq's reduction order. The CUDA backward adds each key tile's dQ contribution into a float
  // buffer: in arrival order by default, in key-tile order (bitwise reproducible) when set.
  bool deterministic = false;
};

}  // namespace flexdma
