"""flexdma: Flash Dynamic Mask Attention for PyTorch.

Attention with an additive (learnable) bias and a boolean key mask, computed FlashAttention-style
(O(N) memory) with gradients for query, key, value and the bias.
"""
from . import _dispatch
from ._dispatch import available_backends
from . import nn
from .api import flash_dma_attention
from .dynamic import dynamic_mask_attention
from .masks import create_mask
from .reference import attention_ref

__version__ = "0.1.0"

# Load the op family now, so torch.ops.flexdma.* exists once flexdma is imported.
if _dispatch._ops_loaded() is not None:  # pragma: no cover - only without a built extension
    import warnings as _warnings

    _warnings.warn(f"flexdma: {_dispatch._ops_loaded()}; only the 'flex' and 'reference' backends work")

__all__ = ["flash_dma_attention", "dynamic_mask_attention", "create_mask", "available_backends", "attention_ref", "nn",
           "__version__"]
