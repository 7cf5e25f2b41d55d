"""The per-key path's contract and selection: the dynamic mask of Doge-style layers without a
Q x K tensor.

When the importance of a key does not depend on the query (a bias of shape
({1|B}, {1|KVH|H}, 1, K)), row i keeps the W best keys by (score desc, key index asc) among
the keys it may see (causal cut, attn_mask). Causality makes the kept sets nest, so the whole
mask fits in O(Q + K) per selection plane (docs/perkey.md, "Why it fits in O(N)"):

- `key_rank[p, j]`: rank of key j in its plane, 0-based, in that order, among eligible keys
  (allowed by attn_mask and with a score other than -inf); `NEVER` (int32 max, csrc/flash_dma_constants.h's kNeverKept) for the others.
- `row_thr[p, i]`: the largest rank row i keeps, -1 when it keeps nothing. Row i keeps key j iff
  `key_rank[p, j] <= row_thr[p, i]` and, when causal, `j <= i + K - Q` (bottom-right aligned).
- `tile_keys[p]`: for each query tile t of `tile_rows` rows, 1 + cap entries from t * (1 + cap)
  on: the number n of listed keys, then n key indices in rank order: every key some row of the
  tile keeps, and the keys its last row sees up to the tile's largest threshold (at most
  cap = min(K, W + tile_rows - 1); entries past n are unspecified). `tile_lists` views it per
  tile. The GPU kernels gather K / V rows from it; the CPU kernel and FlexAttention need only the
  first two.

This is the mask `create_mask(attn_bias, W, attn_mask=..., is_causal=..., query_len=Q)` builds
densely, entry for entry (tests/perkey/test_perkey.py checks it; flexdma/perkey/naive.py is that dense
reference). A plane is one (batch, head) entry of the broadcast of the bias's and the mask's batch
/ head dims.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import _ext
from ..dense.naive import expand_heads

# key_rank of a key no row keeps: int32 max (kNeverKept, csrc/flash_dma_constants.h).
NEVER = _ext.NEVER_KEPT

# Query rows per tile of the CPU selection's lists (the CPU kernel does not read the lists).
CPU_TILE_ROWS = _ext.PERKEY_CPU_TILE_ROWS

# Query rows per CTA of the C++ per-key kernels (flexdma::perkey_fwd / perkey_bwd on CUDA;
# csrc/cuda/fwd_ws_kernel.cuh): they read lists of tiles of this many rows.
CUDA_TILE_ROWS = _ext.PERKEY_TILE_ROWS

# Rows of q per Triton program (perkey/triton.py): PACK query heads x tile_rows rows. Head dims
# above WIDE_FROM: half the rows per program (triton.py's WIDE_* launch configurations). The route
# picks the tile rows (perkey/route.py's `triton_tiles`); the kernels take the pack they imply.
BLOCK_M = 128
WIDE_FROM = 128
WIDE_BLOCK_M = 64


def block_m(head_dim: int) -> int:
    return WIDE_BLOCK_M if head_dim > WIDE_FROM else BLOCK_M


def pack_size(num_heads: int, num_kv_heads: int, plane_heads: int) -> int:
    """Query heads one Triton program may serve: they must share a kv head and a selection plane."""
    group = num_heads // num_kv_heads
    if plane_heads == num_heads or group == 1:
        return 1
    pack = 1
    while pack * 2 <= 8 and group % (pack * 2) == 0:
        pack *= 2
    return pack


class Selection(NamedTuple):
    key_rank: torch.Tensor  # int32 (P1, P2, K)
    row_thr: torch.Tensor  # int32 (P1, P2, Q)
    tile_keys: torch.Tensor  # int32 (P1, P2, n_tiles * (1 + cap))


def plane_heads(num_heads: int, bias_heads: int, mask_heads: int) -> int:
    """Head count of the selection planes: the broadcast of the bias's and the mask's head dims,
    both onto the query heads where they differ (one per kv head, the other per query head)."""
    if bias_heads != mask_heads and bias_heads > 1 and mask_heads > 1:
        return num_heads
    return max(bias_heads, mask_heads)


def selection_scores(
    attn_bias: torch.Tensor, attn_mask: Optional[torch.Tensor], num_heads: int, *, float64_ranks: bool = True
) -> torch.Tensor:
    """(P1, P2, K) scores of the selection planes: the per-key bias with the keys the mask drops
    set to -inf, in the bias's dtype where the selection takes it (float32, float16, bfloat16;
    without a mask a view of the bias, no copy). float64 scores come back as their order
    (`float64_order`), so that scores apart by less than float32's resolution are not ranked as
    ties; other dtypes as float32 (`float64_ranks=False`: float64 scores as they are, for a kernel
    that ranks in float64 and adds the kept scores: flexdma::perkey_last_row's CPU kernel). Planes
    are the broadcast of the bias's and the mask's (batch, head)."""
    s = attn_bias.select(2, 0)
    if s.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        s = s.float()
    if attn_mask is not None:
        m = attn_mask[:, :, 0, :]
        P = plane_heads(num_heads, s.shape[1], m.shape[1])
        if s.shape[1] not in (1, P) or m.shape[1] not in (1, P):
            s = expand_heads(s.unsqueeze(2), num_heads).squeeze(2)
            m = expand_heads(m.unsqueeze(2), num_heads).squeeze(2)
        s = torch.where(m, s, float("-inf"))
    return float64_order(s) if s.dtype == torch.float64 and float64_ranks else s


# float32 bit patterns from the smallest normal number up: positive, finite, ordered as the
# integers are, and never flushed to zero (no denormals).
_FLT_MIN_BITS = 0x00800000
# The keys float64_order can order: its last key's bit pattern stays below +inf's (0x7F800000).
FLOAT64_MAX_KEYS = 0x7F800000 - _FLT_MIN_BITS


def float64_order(scores: torch.Tensor) -> torch.Tensor:
    """float32 scores (P1, P2, K) in the order of the float64 `scores`, every one distinct: key j
    gets a value that falls with its rank by (score desc, key index asc; NaN first, as
    torch.sort and the selection op order them), -inf stays -inf (not eligible). The selection
    (flexdma::perkey_select, float32) of them is the selection of the float64 scores: it ranks only
    by order, and rounding the float64 scores themselves would tie scores that differ below
    float32's resolution."""
    K = scores.shape[-1]
    if isinstance(K, int) and K > FLOAT64_MAX_KEYS:
        raise ValueError(f"a float64 attn_bias takes at most {FLOAT64_MAX_KEYS} keys to select from, got {K}")
    by_rank = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    ranks = torch.arange(K, device=scores.device).expand_as(by_rank)
    rank = torch.empty_like(by_rank).scatter_(-1, by_rank, ranks)
    order = (K - 1 - rank + _FLT_MIN_BITS).to(torch.int32).view(torch.float32)
    return order.masked_fill(scores == float("-inf"), float("-inf"))


def list_cap(K: int, window: int, tile_rows: int) -> int:
    """Entries of a tile's list: at most W + tile_rows - 1 keys (and never more than K). The rule
    is csrc/flash_dma_constants.h's perkey_list_cap (flexdma._C.perkey_list_cap); it is written here
    again because the fake kernels call it with symbolic sizes, which the C++ one cannot take
    (tests/perkey/test_perkey.py checks that the two agree)."""
    return min(K, window + tile_rows - 1)


def select(
    scores: torch.Tensor, window: int, seqlen_q: int, is_causal: bool, tile_rows: int, packed: tuple = ()
) -> Selection:
    """The selection of every plane of scores (P1, P2, K) (float32, float16 or bfloat16:
    selection_scores'), with lists of query tiles of `tile_rows` rows (the route's,
    flexdma/perkey/route.py: what the forward that follows reads). A packed call's `packed`:
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), scores (heads, Tk), seqlen_q the
    query tokens; each sequence selects within itself (the op's packed form, flexdma/_ops.py)."""
    # The op's fake kernel: flexdma/perkey/ops.py (imported by the package); its kernels are C++.
    return Selection(*torch.ops.flexdma.perkey_select(scores, window, seqlen_q, is_causal, tile_rows, *packed))


def tile_lists(sel: Selection, seqlen_q: int, tile_rows: int) -> torch.Tensor:
    """tile_keys as (P1, P2, n_tiles, 1 + cap): [..., 0] is each tile's list length."""
    n_tiles = -(-seqlen_q // tile_rows)
    # The width spelled out: a view with -1 of an empty tensor (no rows, or no planes) is ambiguous.
    width = sel.tile_keys.shape[2] // n_tiles if n_tiles else 0
    return sel.tile_keys.view(*sel.tile_keys.shape[:2], n_tiles, width)


def check_window(keep_window_size) -> int:
    if isinstance(keep_window_size, bool) or not isinstance(keep_window_size, int) or keep_window_size <= 0:
        raise ValueError(f"keep_window_size must be a positive int, got {keep_window_size!r}")
    return keep_window_size


def check_operands(attn_mask: Optional[torch.Tensor], attn_bias: Optional[torch.Tensor], seqlen_k: int) -> None:
    """The per-key path's limits on the (already broadcast-checked, 4-D) mask and bias. With one key
    (a one-token prompt, a cache's first step) a key dim of 1 is the per-key shape."""
    if attn_bias is None:
        raise ValueError(
            "keep_window_size picks the top keys by attn_bias: pass a per-key attn_bias of shape "
            "({1|B}, {1|KVH|H}, 1, K)"
        )
    if attn_bias.shape[2] != 1 or (attn_bias.shape[3] == 1 and seqlen_k > 1):
        raise ValueError(
            f"keep_window_size needs a per-key attn_bias ({{1|B}}, {{1|KVH|H}}, 1, K) (one score per "
            f"key, shared by every query row), got shape {tuple(attn_bias.shape)}; for a bias that "
            "varies by row, build the mask with create_mask and pass it as attn_mask"
        )
    if attn_mask is not None and attn_mask.shape[2] != 1:
        raise ValueError(
            f"with keep_window_size, attn_mask may only drop keys for every row (a (B, K) padding "
            f"mask or a query dim of 1), got shape {tuple(attn_mask.shape)}"
        )
