"""Hugging Face transformers integration: `attn_implementation="flexdma"`.

    import flexdma.integrations.transformers as fx
    fx.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="flexdma")

Models hand the attention function q/k/v as (batch, heads, seqlen, head_dim) and either a bool mask
(True = attend) or a float additive mask. A float mask is split into a bool mask (entries at the
dtype's minimum are masked out) and a bias (the rest), so models that fold a learned bias into the
mask -- Doge's dynamic mask does -- get it back as a differentiable flexdma bias.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..api import flash_dma_attention

NAME = "flexdma"


def _split_mask(mask: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    if mask.dtype == torch.bool:
        return mask, None
    # HF builds masked entries as finfo(dtype).min (sometimes summed twice, so <= half of it).
    allowed = mask > torch.finfo(mask.dtype).min / 2
    # Always a bias, even an all-zero one: skipping it would take a branch on tensor values, which
    # syncs with the device and breaks torch.compile(fullgraph=True). Masks without a bias arrive
    # as bool (register() installs the sdpa mask builder), so the zero case is rare.
    bias = mask.masked_fill(~allowed, 0).to(dtype)
    return allowed, bias


def flexdma_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    backend: str = "auto",
    **kwargs,
) -> Tuple[torch.Tensor, None]:
    """transformers AttentionInterface function; returns (output (B, Q, H, D), None)."""
    if dropout and module.training:
        raise ValueError(f"flexdma attention has no dropout; got dropout={dropout} in training mode")
    if kwargs.get("output_attentions"):
        raise ValueError("flexdma attention does not return attention weights (output_attentions=True)")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    Q, K = q.shape[1], k.shape[1]
    mask = bias = None
    if attention_mask is not None:
        if attention_mask.dim() != 4:
            raise ValueError(f"attention_mask must be 4-D, got shape {tuple(attention_mask.shape)}")
        mask, bias = _split_mask(attention_mask[..., :K], q.dtype)
        causal = False  # HF masks already contain the causal structure
    else:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = bool(causal) and Q > 1
    out = flash_dma_attention(q, k, v, mask, bias, is_causal=causal, softmax_scale=scaling,
                              softcap=float(softcap or 0.0), backend=backend)
    return out, None


def register(name: str = NAME) -> None:
    """Register flexdma with transformers' AttentionInterface (and its mask interface) under `name`."""
    try:
        from transformers import AttentionInterface
    except ImportError as e:
        raise ImportError("flexdma.integrations.transformers needs transformers: pip install 'flexdma[hf]'") from e
    AttentionInterface.register(name, flexdma_attention_forward)
    try:  # transformers >= 4.53 picks the mask format per attention implementation
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
        AttentionMaskInterface.register(name, sdpa_mask)
    except ImportError:
        pass
