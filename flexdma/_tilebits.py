"""Tile activity bits: which 64 x 64 tiles of a mask keep anything, as the CUDA kernels read them.

The format is flexdma::tile_meta's (its kernels: csrc/cuda/tile_meta.cu and the CPU op in ops/):
int32 (mask batch, mask heads, query tiles, words), bit kt % TILES_PER_WORD of word
kt // TILES_PER_WORD set when key tile kt of the query tile keeps some key (bit 31 is int32's sign).
`pack` is the one Python writer of it.

A mask built by flexdma.create_mask carries what create_mask knew of its tiles while it selected,
as the attribute `mask.flexdma_tiles` (a `TileActivity`): the dispatcher reads it (`tile_meta_of`)
and hands the CUDA kernels bits that cost O(tiles) instead of flexdma::tile_meta's pass over the
whole mask. The attribute belongs to that tensor: a view, a clone or an in-place change of the
mask (its version moves) leaves the kernels to compute the bits from the mask's bytes, as for any
other mask.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch
import torch.nn.functional as F

from . import _ext

__all__ = ["ATTR", "TileActivity", "attach", "pack", "tile_meta_of"]

ATTR = "flexdma_tiles"


def pack(active: torch.Tensor, causal: bool, seqlen_q: int, seqlen_k: int, mask_shape) -> torch.Tensor:
    """The flexdma::tile_meta bits of a mask of shape `mask_shape` (B|1, H|1, Q|1, K) for a call of
    seqlen_q x seqlen_k, from its tiles' activity `active` (bool (B|1, H|1, query tiles | 1, key
    tiles)); causal: apply the bottom-right causal cut by tile (a key tile no row of the query tile
    can see is dropped, a tile the diagonal crosses keeps its bit)."""
    T, per_word = _ext.TILE_SIZE, _ext.TILES_PER_WORD
    qt, kt = -(-seqlen_q // T), active.shape[-1]
    # A mask with a query dim of 1 (not causal) is one row for every query.
    active = active.expand(*active.shape[:2], qt, kt) if mask_shape[2] == 1 else active
    if causal:
        # Some key of tile kt is visible from the tile's last row: kt * T <= last row + K - Q.
        dev = active.device
        last_row = torch.clamp((torch.arange(qt, device=dev) + 1) * T, max=seqlen_q) - 1
        active = active & (torch.arange(kt, device=dev)[None, :] * T <= (last_row + seqlen_k - seqlen_q)[:, None])
    words = -(-kt // per_word)
    active = F.pad(active, (0, words * per_word - kt)).view(*active.shape[:3], words, per_word)
    bits = (active.to(torch.int64) << torch.arange(per_word, device=active.device)).sum(-1)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)  # bit 31 as int32's sign
    return bits.expand(mask_shape[0], mask_shape[1], qt, words).contiguous()


class TileActivity:
    """What create_mask knew of a mask's 64 x 64 tiles: `active` (bool (B|1, H|1, query tiles of
    the mask's rows, key tiles): some entry of the tile is kept), `causal` (the causal cut is still
    to apply, by tile), the mask's version when it was built, and the bits already packed per call
    signature (a model's layers share one mask)."""

    __slots__ = ("version", "active", "causal", "packed")

    def __init__(self, version: int, active: torch.Tensor, causal: bool):
        self.version, self.active, self.causal, self.packed = version, active, causal, {}

    def __reduce__(self):
        # Not saved with the mask (torch.save, pickle, deepcopy): a copy gets an empty OrderedDict,
        # which tile_meta_of ignores, and torch.load(weights_only=True) still loads the mask.
        return (OrderedDict, ())


def attach(mask: torch.Tensor, active: torch.Tensor, causal: bool) -> torch.Tensor:
    """Give `mask` its tile activity (`mask.flexdma_tiles`); returns the mask."""
    setattr(mask, ATTR, TileActivity(mask._version, active, causal))
    return mask


def tile_meta_of(mask: torch.Tensor, seqlen_q: int, seqlen_k: int, is_causal: bool) -> Optional[torch.Tensor]:
    """flexdma::tile_meta(mask, seqlen_q, seqlen_k, is_causal) from the tile activity the mask
    carries; None for a mask without one, one changed since, of other lengths (and under
    torch.compile / torch.export, which trace the op).

    Tiles wholly on one side of the causal diagonal get the exact bit; a tile the diagonal crosses
    may get a bit the mask does not (a per-key selection's rank test without the cut, or a mask
    built without the call's causality): the kernels build such a tile's keep tile from the mask
    bytes and skip it when that is empty."""
    if torch.compiler.is_compiling():
        return None
    tiles = getattr(mask, ATTR, None)
    if not isinstance(tiles, TileActivity):
        return None
    if mask._version != tiles.version or mask.shape[2] not in (1, seqlen_q) or mask.shape[3] != seqlen_k:
        return None
    # Kept per call signature: a model's layers share one mask, and the bits are a dozen small
    # kernels whose launches would cost about what the pass over the mask does.
    key = (seqlen_q, seqlen_k, bool(is_causal))
    if key not in tiles.packed:
        tiles.packed[key] = pack(tiles.active, tiles.causal or is_causal, seqlen_q, seqlen_k, mask.shape)
    return tiles.packed[key]
