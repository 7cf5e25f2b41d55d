"""flexdma: Flash Dynamic Mask Attention for PyTorch.

Attention with an additive (learnable) bias and a boolean key mask, computed FlashAttention-style
(O(N) memory) with gradients for query, key, value and the bias.
"""

import warnings as _py_warnings

from . import _ext, nn
from ._dispatch import available_backends
from .api import flash_dma_attention
from .dense.naive import attention_ref
from .dynamic import dynamic_mask_attention
from .masks import create_mask
from .varlen import flash_dma_attention_varlen

__version__ = "0.1.0"

# Load the op family now, so torch.ops.flexdma.* exists once flexdma is imported.
if _ext.LOAD_ERROR is not None:  # pragma: no cover - only without a built extension
    _py_warnings.warn(f"flexdma: {_ext.LOAD_ERROR}; only the 'flex' and 'reference' backends work")
elif getattr(_ext.BUILD_INFO, "STATIC_LIBSTDCXX", False):  # pragma: no cover - toolchain-specific
    # The failure it warns of is a crash, which no test can catch in-process: say it up front.
    _py_warnings.warn(
        "flexdma: flexdma._C was built with a compiler that links libstdc++ statically; an input "
        "error detected inside the C++ ops will crash the process instead of raising. Rebuild "
        "with CXX set to a compiler that has a shared libstdc++."
    )

__all__ = [
    "flash_dma_attention",
    "flash_dma_attention_varlen",
    "dynamic_mask_attention",
    "create_mask",
    "available_backends",
    "attention_ref",
    "nn",
    "__version__",
]
