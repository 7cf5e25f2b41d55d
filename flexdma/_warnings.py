"""The library's one-time warnings (a fallback, a changed option): each message once a process."""

from __future__ import annotations

import warnings

import torch

_warned: set = set()


# Under torch.compile this runs once, when the call is traced (dynamo calls a function marked
# assume_constant_result eagerly instead of tracing it), so a fullgraph model still gets the
# warning and no graph break.
@torch._dynamo.assume_constant_result
def warn_once(msg: str) -> bool:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, stacklevel=5)
    return True
