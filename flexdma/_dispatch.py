"""Backends and the `auto` policy, in one place.

auto: the CUDA kernel where it supports the call, FlexAttention where it does not, the eager
reference last. On CPU the C++ kernel of the op family. Each fallback is warned once per reason.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from . import _ext, _ops, masks
from ._warnings import warn_once as _warn_once
from .reference import attention_ref

BACKENDS = ("auto", "cuda", "flex", "cpu", "reference")


# Cached by hand, not with functools.lru_cache: torch.compile traces these on every call of the
# API and warns about (and ignores) an lru_cache wrapper; a plain module global is read as a constant.
_UNSET = object()
_flex_state = _UNSET


def _ops_load_error() -> Optional[str]:
    """None when the C++ op family loaded, else why not."""
    return _ext.LOAD_ERROR


def _build_info():
    return _ext.BUILD_INFO


def _flex_module():
    global _flex_state
    if _flex_state is _UNSET:
        try:
            from . import flex
        except Exception as e:  # pragma: no cover - torch without FlexAttention
            _flex_state = (None, f"FlexAttention is unavailable ({e})")
        else:
            _flex_state = (flex, None)
    return _flex_state


def available_backends() -> List[str]:
    """Backends that can run on this machine, fastest first (`auto` picks among them per call)."""
    out = []
    info = _build_info()
    if _ops_load_error() is None and info is not None and info.WITH_CUDA and torch.cuda.is_available():
        out.append("cuda")
    if _flex_module()[0] is not None:
        out.append("flex")
    if _ops_load_error() is None:
        out.append("cpu")
    out.append("reference")
    return out


def cuda_unsupported_reason(q, k, v, mask, bias, *, is_causal, softcap) -> Optional[str]:
    if q.device.type != "cuda":
        return f"inputs are on {q.device.type}, not cuda"
    why = _ops_load_error()
    if why:
        return why
    info = _build_info()
    if info is None or not info.WITH_CUDA:
        return "flexdma was built without CUDA kernels"
    major, minor = torch.cuda.get_device_capability(q.device)
    archs = {str(a).rstrip("a") for a in info.CUDA_ARCHS}
    if f"{major}{minor}" not in archs:
        return f"the CUDA kernels were built for sm_{'/'.join(sorted(archs))}, this GPU is sm_{major}{minor}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (the CUDA kernel takes float16 and bfloat16)"
    d = q.shape[-1]
    if d not in info.CUDA_HEAD_DIMS:
        return (
            f"head_dim {d} (CUDA kernels built for {list(info.CUDA_HEAD_DIMS)}; "
            f"FLEXDMA_HEAD_DIMS picks them at build time)"
        )
    MAX_GRID_DIM = _ext.MAX_GRID_DIM
    if q.shape[0] > MAX_GRID_DIM or q.shape[2] > MAX_GRID_DIM:
        return f"batch and num_heads must be <= {MAX_GRID_DIM} (CUDA grid limits)"
    return None


def flex_unsupported_reason(q, k, v, mask, bias, *, is_causal, softcap, requires_grad) -> Optional[str]:
    flex, why = _flex_module()
    if flex is None:
        return why
    return flex.unsupported_reason(
        q, k, v, mask, bias, is_causal=is_causal, softcap=softcap, requires_grad=requires_grad
    )


def _op_backend(q, k, v, mask, bias, scale, is_causal, softcap, deterministic):
    # The CUDA kernels skip empty tiles by the mask's tile activity bits: computed here once,
    # handed to the forward and kept by autograd for the backward. Without a backward to share
    # them with (inference, decoding) the op computes them itself: one Python op call less a step.
    # The CPU kernel needs none.
    train = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, bias))
    meta = None
    if mask is not None and q.is_cuda:
        # A mask create_mask built from a per-key selection: its bits come from the selection.
        meta = masks.selection_tile_meta(mask, q.shape[1], k.shape[1], is_causal)
        if meta is None and train:
            meta = _ops.tile_meta(mask, q.shape[1], k.shape[1], is_causal)
    # out_resid (kept only where a backward can follow) stays with autograd, which hands it on.
    out, lse, _ = _ops.fwd(q, k, v, mask, bias, scale, is_causal, softcap, deterministic, meta, train)
    return out, lse


def _flex_backend(q, k, v, mask, bias, scale, is_causal, softcap, deterministic, need_lse=True):
    flex, _ = _flex_module()
    return flex.flex_dma_attention(
        q, k, v, mask, bias, is_causal=is_causal, softmax_scale=scale, softcap=softcap, need_lse=need_lse
    )


def _reference_backend(q, k, v, mask, bias, scale, is_causal, softcap, deterministic):
    return attention_ref(q, k, v, mask, bias, is_causal=is_causal, softmax_scale=scale, softcap=softcap)


RUNNERS: Dict[str, Callable] = {
    "cuda": _op_backend,
    "cpu": _op_backend,
    "flex": _flex_backend,
    "reference": _reference_backend,
}


def unsupported_reason(name: str, q, k, v, mask, bias, *, is_causal, softcap, requires_grad) -> Optional[str]:
    if name == "cuda":
        return cuda_unsupported_reason(q, k, v, mask, bias, is_causal=is_causal, softcap=softcap)
    if name == "flex":
        return flex_unsupported_reason(
            q, k, v, mask, bias, is_causal=is_causal, softcap=softcap, requires_grad=requires_grad
        )
    if name == "cpu":
        if q.device.type != "cpu":
            return f"inputs are on {q.device.type}; the cpu backend takes CPU tensors"
        return _ops_load_error()
    return None  # the reference runs anywhere


def select(backend: str, q, k, v, mask, bias, *, is_causal, softcap, requires_grad, why_not=None, what="") -> str:
    """The backend that runs this call; raises if an explicitly named one cannot. `why_not(name)`
    replaces unsupported_reason for a path with its own limits (the per-key one), `what` names it
    in messages."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if why_not is None:
        kw = dict(is_causal=is_causal, softcap=softcap, requires_grad=requires_grad)

        def why_not(name):
            return unsupported_reason(name, q, k, v, mask, bias, **kw)

    if backend != "auto":
        why = why_not(backend)
        if why:
            raise ValueError(f"backend={backend!r} cannot run this {what}call: {why}")
        return backend
    chain: Tuple[str, ...] = ("cuda", "flex", "reference") if q.device.type == "cuda" else ("cpu", "reference")
    previous, reason = None, None
    for name in chain:
        why = why_not(name)
        if why is None:
            if previous is not None:
                _warn_once(
                    f"flexdma: backend 'auto' falls back from {previous!r} to {name!r}{what and ' for a ' + what.strip()}: {reason}"
                )
            return name
        if previous is None:
            previous, reason = name, why
        else:
            reason = f"{reason}; {name!r}: {why}"
    raise AssertionError("unreachable: the reference supports every call")
