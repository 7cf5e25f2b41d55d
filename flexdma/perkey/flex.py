"""The per-key path through FlexAttention: the selection (flexdma/perkey/contract.py) read by the
mask_mod, O(Q + K) per plane, on the dense path's FlexAttention machinery (flexdma/dense/flex.py)."""

from __future__ import annotations

from typing import Optional

import torch

from ..dense.flex import forward


def attention(
    query,
    key,
    value,
    attn_bias,
    key_rank,
    row_thr,
    *,
    is_causal: bool,
    softmax_scale: float,
    softcap: float,
    need_lse: bool = True,
    training: Optional[bool] = None,
):
    """The per-key top-W path through FlexAttention: the selection (flexdma/perkey/contract.py) read by the
    mask_mod, O(Q + K) per plane; every causally visible tile is visited (no tile skipping).
    training: as flex_dma_attention's."""
    if training is None:
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, attn_bias))
    keep = (key_rank[:, :, None, :], row_thr[:, :, :, None])
    return forward(query, key, value, None, attn_bias, is_causal, softmax_scale, softcap, training, need_lse, keep)
