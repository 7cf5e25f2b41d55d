"""The per-key path through FlexAttention: the selection (flexdma/perkey/contract.py) read by the
mask_mod, O(Q + K) per plane, on the dense path's FlexAttention machinery (flexdma/dense/flex.py)."""

from __future__ import annotations

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
    training: bool,
    need_lse: bool = True,
):
    """The per-key top-W path through FlexAttention: the selection (flexdma/perkey/contract.py) read by the
    mask_mod, O(Q + K) per plane; every causally visible tile is visited (no tile skipping).
    training: a backward will follow (the dispatcher's Call knows it)."""
    keep = (key_rank[:, :, None, :], row_thr[:, :, :, None])
    return forward(query, key, value, None, attn_bias, is_causal, softmax_scale, softcap, training, need_lse, keep)
