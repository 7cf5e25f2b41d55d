"""The kept set of a cached row and the rows of a step against it: the types and the score order
that the torch updates (decode.py) and the decode kernels (triton_rows.py; the C++ decode step's
kernels follow order_key) share. A module of its own, below them, so that none of them imports
another for a type."""

from __future__ import annotations

from typing import NamedTuple

import torch


class KeptSet(NamedTuple):
    idx: torch.Tensor  # (B, P, W) int64 key index of each slot
    valid: torch.Tensor  # (B, P, W) bool: the slot holds a kept key
    score: torch.Tensor  # (B, P, W) the kept keys' scores, in the scores' dtype


class Rows(NamedTuple):
    """T new rows against a kept set: the union of their kept sets (the W slots before the step,
    then the T new keys) and which entries each row keeps."""

    idx: torch.Tensor  # (B, P, W + T) int64 key index of each entry
    score: torch.Tensor  # (B, P, W + T) its score
    keep: torch.Tensor  # (B, P, T, W + T) bool: row t keeps entry e
    kept: KeptSet  # the kept set after the last new key


def order_key(s: torch.Tensor) -> torch.Tensor:
    """An integer that orders like the scores, NaN above +inf and -0.0 equal to +0.0 (the
    selection's order without the index tie-break): int64 for float64 scores, which the selection
    ranks in float64 (contract.float64_order), else int32 of the float32 value (float16 / bfloat16
    convert exactly)."""
    if s.dtype == torch.float64:
        bits, flip = s.view(torch.int64), 0x7FFFFFFFFFFFFFFF
    else:
        bits, flip = s.float().view(torch.int32), 0x7FFFFFFF
    # A negative number's bits grow with its magnitude: all but the sign flipped, they fall.
    key = torch.where(bits < 0, bits ^ flip, bits)
    key = torch.where(s == 0, torch.zeros_like(key), key)
    return torch.where(s.isnan(), torch.full_like(key, flip), key)
