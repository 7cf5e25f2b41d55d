"""The per-key path's naive reference: the selection as a dense (Q x K) bool mask, and the eager
reference attention over it. What the tests compare the per-key kernels against, and the
`reference` backend of the per-key path (tests and small problems only: it is Q x K)."""

from __future__ import annotations

import torch

from ..dense.naive import attention_ref, causal_mask
from .contract import Selection


def keep_mask(sel: Selection, seqlen_q: int, seqlen_k: int, is_causal: bool) -> torch.Tensor:
    """The dense (P1, P2, Q, K) bool mask the selection stands for (the reference path and tests
    only: it is Q x K)."""
    keep = sel.key_rank[:, :, None, :] <= sel.row_thr[:, :, :, None]
    if is_causal:
        keep = keep & causal_mask(seqlen_q, seqlen_k, device=keep.device)
    return keep


def attention(query, key, value, attn_bias, sel: Selection, *, scale: float, is_causal: bool, softcap: float):
    """(out, lse) of the per-key attention by the eager reference over the dense keep mask."""
    Q, K = query.shape[1], key.shape[1]
    return attention_ref(
        query,
        key,
        value,
        keep_mask(sel, Q, K, is_causal),
        attn_bias,
        is_causal=is_causal,
        softmax_scale=scale,
        softcap=softcap,
    )
