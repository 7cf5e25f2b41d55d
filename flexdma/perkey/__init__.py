"""The per-key (keep_window_size) path, in one place:

- contract.py: what a selection is (key_rank, row_thr, tile_keys), the selection op's front,
  the path's argument checks and constants (from csrc/flash_dma_constants.h via flexdma._C);
- naive.py: the dense-mask reference of the path (keep_mask + attention_ref), which tests and
  the `reference` backend use;
- route.py: which kernels run a call (C++ sm_90a forward, Triton, CPU op, FlexAttention,
  reference) and the selection's tile rows, decided once before any data moves;
- ops.py: the per-key ops' fake kernels, autograd and CUDA registrations;
- triton.py: the Triton kernels and launchers (imports triton; loaded by the first CUDA call);
- attention.py: the path's entry from the dispatcher.
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
