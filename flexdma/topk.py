"""Old name of the per-key path's public names: they live in flexdma.perkey (its contract is
flexdma/perkey/contract.py). Kept so `flexdma.topk.*` keeps working."""

from .perkey import (
    CPU_TILE_ROWS,
    NEVER,
    Selection,
    check_operands,
    check_window,
    cuda_unsupported_reason,
    keep_mask,
    list_cap,
    select,
    selection_scores,
    tile_lists,
)

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
