// CUDA kernels of the flexdma op family (declarations only: no CUDA types leak to the binding).
#pragma once
#include "../flash_dma_params.h"

namespace flexdma {
namespace cuda {

// nullptr when the kernel handles these params, else a short reason ("head_dim 80 not built").
// The binding checks this before launching, and Python's backend choice asks it through
// flexdma._C.cuda_unsupported_reason (flexdma/_dispatch.py).
const char* unsupported_reason(const FwdParams& params);

// A per-key (keep_window_size) call as its C++ kernels see it, in plain values: what the padded
// per-key ops (flexdma::perkey_fwd / perkey_bwd on CUDA) check before launching, and what Python's
// per-key route asks through flexdma._C.perkey_unsupported_reason (flexdma/perkey/route.py).
struct PerkeyCall {
  int64_t batch = 0, num_heads = 0, num_heads_k = 0, head_dim = 0, seqlen_q = 0, seqlen_k = 0;
  int dtype = -1;       // q / k / v's DType value; -1: none of DType's
  int bias_dtype = -1;  // the per-key bias's
  float softcap = 0.f;
  bool rows_aligned = true;    // q / k / v: 16-byte aligned rows, strides multiples of 8 elements
  int64_t kv_row_stride = 0;   // the larger of k's and v's row strides, in elements
  int device_arch = 0;         // the GPU's compute capability, major * 10 + minor
  bool backward = false;       // the backward's conditions too
  bool deterministic = false;  // a bitwise reproducible backward wanted
};

// nullptr when the C++ per-key kernels (the forward; with call.backward the backward too) take the
// call, else why not ("the per-key backward takes no softcap").
const char* perkey_unsupported_reason(const PerkeyCall& call);

// Bytes of device scratch a launch with these params needs (0: none). The caller allocates them,
// through its own allocator (so that a failure is its out-of-memory error and the memory counts in
// its statistics), and passes them as params.workspace; they may be freed once the launch's stream
// has passed it.
int64_t fwd_workspace_bytes(const FwdParams& params);
int64_t bwd_workspace_bytes(const BwdParams& params);

// stream is a cudaStream_t passed as void* so that this header needs no CUDA headers.
void run_fwd(const FwdParams& params, void* stream);
void run_bwd(const BwdParams& params, void* stream);

// Fills `meta` (zero-filled by the caller, mask_batches x mask_heads x ceil(Q / 64) x n_words
// uint32) with the tile activity of params.mask (FwdParams::tile_meta).
void run_tile_meta(const FwdParams& params, int64_t mask_batches, int64_t mask_heads, void* meta, int64_t n_words,
                   void* stream);

// The per-key selection (flexdma::perkey_select): nullptr when the kernel takes these params, else
// why not; the scratch it needs (its first select_counter_bytes zeroed by the caller on the
// launch's stream); one launch over every plane.
const char* select_unsupported_reason(const SelectParams& params);
int64_t select_workspace_bytes(const SelectParams& params);
int64_t select_counter_bytes(const SelectParams& params);
void run_select(const SelectParams& params, void* stream);

// The per-key decode step (flexdma::decode_step / decode_append): nullptr when the kernels take
// these params, else why not; the scratch they need; one or two launches (csrc/cuda/decode_step.cu).
const char* decode_unsupported_reason(const DecodeParams& params);
int64_t decode_workspace_bytes(const DecodeParams& params);
void run_decode(const DecodeParams& params, void* stream);
// flexdma::perkey_last_row: the kept sets selected from params.scores (a launch a radix pass, then
// the ordered write; its scratch params.select_workspace), then the step.
int64_t last_row_select_bytes(const DecodeParams& params);
void run_last_row(const DecodeParams& params, void* stream);

// CastParams' segments in one launch.
void run_cast(const CastParams& params, void* stream);

}  // namespace cuda
}  // namespace flexdma
