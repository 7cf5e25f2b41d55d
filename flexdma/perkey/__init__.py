"""The per-key (keep_window_size) path, in one place:

- contract.py: what a selection is (key_rank, row_thr, tile_keys), the selection op's front,
  the path's argument checks and constants (from csrc/flash_dma_constants.h via flexdma._C);
- naive.py: the dense-mask reference of the path (keep_mask + attention_ref), which tests and
  the `reference` backend use;
- route.py: which kernels run a call, forward and backward (the C++ kernels where their own check,
  asked through flexdma._C, takes the call; else Triton; the CPU op, FlexAttention, the
  reference), and the selection's tile rows, decided once before any data moves;
- ops.py: the per-key ops' fake kernels and autograd (flexdma::perkey_select / perkey_fwd /
  perkey_bwd and the decode steps flexdma::decode_step / decode_append, whose kernels are C++),
  and the Triton kernels as the internal ops flexdma_triton::perkey_fwd / perkey_bwd;
- triton.py: the Triton kernels and launchers (imports triton; loaded by the first call that runs
  them);
- attention.py: the path's entry from the dispatcher: route, selection, the routed forward;
- cache.py: a cache step (a few new query rows against cached keys), decided and run in one place
  for the API, nn and the Hugging Face integration;
- kept.py: the kept set of a cached row, the types decode.py and the decode kernels share;
- decode.py: the kept set's O(W) updates as keys arrive, in torch, and the one-row step as the op
  flexdma::decode_step (its update and its attention in one call, C++ kernels);
- triton_rows.py: a few rows' updates as one Triton kernel (imports triton; loaded by decode.py
  when a step runs it).
"""

from . import contract, naive, ops, route  # noqa: F401
from .contract import (
    CPU_TILE_ROWS,
    NEVER,
    Selection,
    check_operands,
    check_window,
    list_cap,
    select,
    selection_scores,
    tile_lists,
)
from .naive import keep_mask
from .route import cuda_unsupported_reason

__all__ = [
    "CPU_TILE_ROWS",
    "NEVER",
    "Selection",
    "check_operands",
    "check_window",
    "cuda_unsupported_reason",
    "keep_mask",
    "list_cap",
    "select",
    "selection_scores",
    "tile_lists",
]
