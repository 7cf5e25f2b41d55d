"""Dynamic masks: which keys each query attends to, picked from importance scores (the bias)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import _ext, _tilebits
from .dense.naive import causal_mask
from .perkey import contract as perkey

# Rows are processed in chunks so the int32 tie-break scratch stays near this many elements.
_CHUNK_ELEMS = 1 << 26


def _padding_to_4d(attn_mask: torch.Tensor, batch: int) -> torch.Tensor:
    if attn_mask.dim() == 2:  # (B, K) padding mask, True = real token
        return attn_mask[:, None, None, :]
    if attn_mask.dim() > 4:
        raise ValueError(f"attn_mask must be (batch, key_len) or 4-D, got shape {tuple(attn_mask.shape)}")
    while attn_mask.dim() < 4:
        attn_mask = attn_mask.unsqueeze(0)
    return attn_mask


def _topk_rows(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask of the k largest entries of each row; ties go to the lowest key index."""
    thr = torch.topk(scores, k, dim=-1, sorted=True).values[..., -1:]
    above = scores > thr
    need = k - above.sum(-1, keepdim=True, dtype=torch.int32)
    at = scores == thr
    # Among entries equal to the threshold keep the first `need` by key index, so the result
    # does not depend on how topk orders ties.
    return above | (at & (torch.cumsum(at, dim=-1, dtype=torch.int32) <= need))


@torch.no_grad()
def create_mask(
    attn_bias: torch.Tensor,
    window_size: int,
    *,
    attn_mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
    query_len: Optional[int] = None,
    block_size: Optional[int] = None,
) -> torch.Tensor:
    """Top-`window_size` keys per query row of the (masked) bias, as a bool attention mask.

    Keys are ranked by (score desc, key index asc): equal scores go to the lower key index. Scores
    are compared in the bias's own precision: a float64 bias in float64 (two scores apart by less
    than float32's resolution do not tie), float32 / float16 / bfloat16 on their own values.

    Args:
        attn_bias: (B|1, H|KVH|1, Q|1, K) importance scores; a query dim of 1 is a per-key score.
        window_size: keys kept per query row (rows with fewer visible keys keep all of them).
        attn_mask: optional bool mask of allowed keys: (B, K) padding mask or 4-D broadcastable.
        is_causal: restrict to keys j <= i + (K - Q) (bottom-right aligned).
        query_len: the number of queries Q; needed when the bias is per-key (query dim 1) and the
            result must vary by row (causal); defaults to the bias's query dim.
        block_size: if set, keys are chosen in aligned blocks of this size: the top
            ceil(window_size / block_size) blocks by their best score, which gives masks whose
            tiles are all-true or all-false.

    Returns:
        bool tensor broadcastable to (B, H, Q, K) (the broadcast of the bias's and mask's shapes,
        with a full query dim when causal), True = attend. Outside torch.compile it carries which
        of its 64 x 64 tiles keep anything as the attribute `flexdma_tiles` (a
        flexdma._tilebits.TileActivity): passed as attn_mask, the CUDA kernels skip the empty
        tiles without a pass over the mask. A view, clone or in-place change of the mask drops
        that knowledge (the kernels then find the tiles themselves); the result is the same.
    """
    if not isinstance(attn_bias, torch.Tensor) or not attn_bias.is_floating_point():
        raise TypeError(
            f"attn_bias must be a floating-point tensor, got "
            f"{attn_bias.dtype if isinstance(attn_bias, torch.Tensor) else type(attn_bias).__name__}"
        )
    if attn_bias.dim() != 4:
        raise ValueError(f"attn_bias must be 4-D (B|1, H|KVH|1, Q|1, K), got shape {tuple(attn_bias.shape)}")
    if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size <= 0:
        raise ValueError(f"window_size must be a positive int, got {window_size!r}")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0):
        raise ValueError(f"block_size must be a positive int or None, got {block_size!r}")
    Bb, Hb, Qb, K = attn_bias.shape
    # A symbolic length (torch.export with a dynamic dim) must stay symbolic.
    Q = Qb if query_len is None else (query_len if isinstance(query_len, torch.SymInt) else int(query_len))
    if Qb not in (1, Q):
        raise ValueError(f"query_len={query_len} does not match attn_bias query dim {Qb}")
    if is_causal and Qb == 1 and query_len is None and K > 1:
        # Without it the causal cut would silently be the one of a single (last) query row.
        raise ValueError("a per-key attn_bias (query dim 1) with is_causal=True needs query_len")

    allowed = None
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype != torch.bool:
            raise TypeError("attn_mask must be a bool tensor (True = allowed key)")
        allowed = _padding_to_4d(attn_mask, Bb)
        if allowed.shape[-1] != K:
            raise ValueError(f"attn_mask key dim {allowed.shape[-1]} does not match attn_bias key dim {K}")
    if is_causal:
        c = causal_mask(Q, K, device=attn_bias.device)[None, None]
        allowed = c if allowed is None else allowed & c
    try:
        out_shape = torch.broadcast_shapes(attn_bias.shape, allowed.shape if allowed is not None else (1, 1, 1, 1))
    except RuntimeError as e:
        raise ValueError(
            f"attn_mask {tuple(allowed.shape)} does not broadcast with attn_bias {tuple(attn_bias.shape)}"
        ) from e

    if window_size >= K:
        if allowed is None:
            return torch.ones(out_shape, dtype=torch.bool, device=attn_bias.device)
        return allowed.expand(out_shape).contiguous()

    pad = None if attn_mask is None else _padding_to_4d(attn_mask, Bb)
    # Under torch.compile/export the dense top-k below stays: the selection op's fake tensor sizes
    # its tile lists with min(K, W + rows - 1), which a dynamic key length cannot satisfy as a guard.
    if (
        Qb == 1
        and block_size is None
        and (pad is None or pad.shape[2] == 1)
        and not torch.compiler.is_compiling()
        and _per_key_ok(attn_bias.device)
    ):
        # One score per key: the selection is flexdma.perkey's (ranks + one threshold per row, O(Q + K)),
        # and the dense mask is a comparison against the thresholds -- bound by writing the mask.
        return _per_key_mask(attn_bias, pad, window_size, out_shape, is_causal)

    result = torch.empty(out_shape, dtype=torch.bool, device=attn_bias.device)
    rows = out_shape[2]
    step = max(1, _CHUNK_ELEMS // max(1, out_shape[0] * out_shape[1] * K))
    # Under torch.compile/export the row count may be symbolic: one chunk, no data-dependent loop.
    if torch.compiler.is_compiling():
        bounds, tiles = [(0, rows)], None
    else:
        # Chunks of whole query tiles, each tile's activity taken while its chunk is at hand (not
        # where the extension, which defines the tiles, did not load: nothing would read them).
        T = _ext.TILE_SIZE
        if T is not None and step >= T:
            step -= step % T
        bounds = [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]
        aligned = T is not None and (step % T == 0 or rows <= step)
        tiles = _ChunkTiles(out_shape, T, attn_bias.device) if aligned else None
    for r0, r1 in bounds:
        b = attn_bias[:, :, r0:r1] if Qb > 1 else attn_bias
        a = None
        if allowed is not None:
            a = allowed[:, :, r0:r1] if allowed.shape[2] > 1 else allowed
        shape = (out_shape[0], out_shape[1], r1 - r0, K)
        # float64 scores are ranked as they are: rounded to float32, scores apart by less than its
        # resolution would tie and go to the lower key index. float16 / bfloat16 convert exactly.
        scores = (b if b.dtype == torch.float64 else b.float()).expand(shape)
        if a is not None:
            scores = scores.masked_fill(~a, float("-inf"))
        if block_size is None:
            keep = _topk_rows(scores, window_size)
        else:
            nblk = -(-K // block_size)
            pad = nblk * block_size - K
            padded = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
            best = padded.view(*shape[:3], nblk, block_size).amax(-1)
            kb = min(nblk, -(-window_size // block_size))
            keep = _topk_rows(best, kb).repeat_interleave(block_size, dim=-1)[..., :K]
        # A row with fewer than window_size visible keys "selects" some -inf entries; drop them.
        keep &= scores != float("-inf")
        result[:, :, r0:r1] = keep
        if tiles is not None:
            tiles.add(r0, keep)
    if tiles is not None:
        _tilebits.attach(result, tiles.active, False)
    return result


class _ChunkTiles:
    """Which 64 x 64 tiles of a mask keep anything, gathered from the row chunks create_mask writes
    (each a whole number of query tiles but the last): one more pass over a chunk it has just built,
    instead of flexdma::tile_meta's over the whole mask at every attention call."""

    def __init__(self, shape, T: int, device: torch.device):
        B, H, Q, K = shape
        self.T, self.kt = T, -(-K // T)
        self.active = torch.zeros(B, H, -(-Q // T), self.kt, dtype=torch.bool, device=device)

    def add(self, r0: int, keep: torch.Tensor) -> None:
        T, kt = self.T, self.kt
        B, H, n, K = keep.shape
        nt = -(-n // T)
        padded = F.pad(keep.view(torch.uint8), (0, kt * T - K, 0, nt * T - n))
        self.active[:, :, r0 // T : r0 // T + nt] = padded.view(B, H, nt, T, kt, T).amax(dim=(3, 5)).bool()


def _per_key_ok(device: torch.device) -> bool:
    # The selection op's kernels are the built extension's: C++ on the CPU, CUDA where it was built
    # with CUDA.
    if _ext.LOAD_ERROR is not None:
        return False
    if device.type == "cuda":
        return _ext.with_cuda()
    return device.type == "cpu"


def _per_key_mask(
    attn_bias: torch.Tensor, pad: Optional[torch.Tensor], window_size: int, out_shape, is_causal: bool
) -> torch.Tensor:
    """create_mask for a per-key bias (query dim 1) and a mask without a query dim: key j is kept by
    row i iff key_rank[j] <= row_thr[i] (and j is causally visible), which is the top-k of the dense
    path entry for entry (the same scores, float64 ranked in float64, the same (score desc, index asc)
    order)."""
    scores = perkey.selection_scores(attn_bias, pad, out_shape[1])
    rows, K = out_shape[2], out_shape[3]
    sel = perkey.select(scores, window_size, rows, is_causal, perkey.CPU_TILE_ROWS)
    rank = sel.key_rank.expand(out_shape[0], out_shape[1], K)[:, :, None, :]
    thr = sel.row_thr.expand(out_shape[0], out_shape[1], rows)[:, :, :, None]
    if not is_causal:
        result = (rank <= thr).expand(out_shape).contiguous()
    else:
        result = torch.empty(out_shape, dtype=torch.bool, device=attn_bias.device)
        step = max(1, _CHUNK_ELEMS // max(1, out_shape[0] * out_shape[1] * K))
        j = torch.arange(K, device=attn_bias.device)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            i = torch.arange(r0, r1, device=attn_bias.device)[:, None]
            # Rows chunked so the temporaries stay near _CHUNK_ELEMS; the bottom-right causal cut.
            result[:, :, r0:r1] = (rank <= thr[:, :, r0:r1]) & (j <= i + (K - rows))
    _tilebits.attach(result, _rank_tiles(sel.key_rank, sel.row_thr), is_causal)
    return result


def _rank_tiles(key_rank: torch.Tensor, row_thr: torch.Tensor) -> torch.Tensor:
    """(B, H, query tiles, key tiles) bool: some row of the query tile keeps some key of the key
    tile by the rank rule, without the causal cut."""
    T = _ext.TILE_SIZE
    K, Q = key_rank.shape[-1], row_thr.shape[-1]
    kt, qt = -(-K // T), -(-Q // T)
    rank_min = F.pad(key_rank, (0, kt * T - K), value=perkey.NEVER).view(*key_rank.shape[:2], kt, T).amin(-1)
    thr_max = F.pad(row_thr, (0, qt * T - Q), value=-1).view(*row_thr.shape[:2], qt, T).amax(-1)
    return rank_min[:, :, None, :] <= thr_max[:, :, :, None]
