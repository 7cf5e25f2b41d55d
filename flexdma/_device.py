"""Facts about the CUDA device a call runs on, looked up once per device and safe to call while
torch.compile traces a model."""

from __future__ import annotations

import torch

# A dict, not functools.lru_cache: torch.compile traces the lookup (the per-key plan, the
# FlexAttention options) and warns about an lru_cache wrapper. assume_constant_result: torch.compile
# runs the function at trace time and keeps its result, so the dict's fill is not traced (a traced
# fill would guard on the empty dict and make the next call compile again).
_CAPABILITY: dict = {}


@torch.compiler.assume_constant_result
def capability(index: int):
    """(major, minor) compute capability of CUDA device `index`."""
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


def device_capability(device: torch.device):
    """Of a tensor's device (which always names its index)."""
    return capability(device.index if device.index is not None else 0)
