"""The dispatch layer, in one place: the call described once, the backends' limits, the `auto`
policy, and one table of (path, backend) -> implementation.

- `Call`: a small frozen record of a validated call (shapes, dtype, device, is_causal, softcap,
  the mask's and bias's shapes, whether a backward will follow, keep_window_size; on the per-key
  path the bias's dtype and the operands' alignment), built once by flexdma.api (`Call.of`).
  Backends decide from it, not from the tensors.
- `unsupported_reason(path, backend, call)`: why a backend cannot take the call (None: it can).
- `select(backend, call)`: auto is the CUDA kernels where they support the call, FlexAttention
  where they do not, the eager reference last; on CPU the C++ kernel of the op family, then the
  reference. Each fallback is warned once per reason. The same policy for both paths.
- `IMPLEMENTATIONS[(path, backend)]`: path "dense" (attn_mask / attn_bias) or "perkey"
  (keep_window_size, flexdma/perkey/); backend "cuda", "flex", "cpu" or "reference". Each is
  `impl(call, q, k, v, mask, bias, scale, deterministic, need_lse) -> (out, lse)`.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import _ext, _ops, _tilebits
from ._device import device_capability
from ._warnings import warn_once as _warn_once
from .perkey import attention as perkey_attention
from .perkey import cache as perkey_cache
from .perkey import route as perkey_route
from .reference import attention_ref

# Cached by hand, not with functools.lru_cache: torch.compile traces this on every call of the
# API and warns about (and ignores) an lru_cache wrapper; a plain module global is read as a constant.
_UNSET = object()
_flex_state = _UNSET


def flex_module():
    """flexdma.flex, loaded on first use; for callers that asked unsupported_reason(..., "flex", ...)
    first (it is then available)."""
    return _flex_module()[0]


def _flex_module():
    """(flexdma.flex, None), or (None, why) where FlexAttention is unavailable."""
    global _flex_state
    if _flex_state is _UNSET:
        try:
            # Optional and heavy (torch's FlexAttention, and triton through flexdma._block_tiles):
            # loaded by the first call that asks, not by `import flexdma`. No cycle: flex imports
            # nothing of the dispatcher.
            from . import flex
        except Exception as e:  # pragma: no cover - torch without FlexAttention
            _flex_state = (None, f"FlexAttention is unavailable ({e})")
        else:
            _flex_state = (flex, None)
    return _flex_state


BACKENDS = ("auto", "cuda", "flex", "cpu", "reference")


class Call(NamedTuple):
    """One validated call, described once (flexdma.api builds it)."""

    device: torch.device
    dtype: torch.dtype
    batch: int
    seqlen_q: int
    num_heads: int
    head_dim: int
    seqlen_k: int
    num_kv_heads: int
    is_causal: bool
    softcap: float
    mask_shape: Optional[Tuple[int, ...]]  # 4-D, after the broadcast checks; None: no mask
    bias_shape: Optional[Tuple[int, ...]]
    requires_grad: bool  # a backward will follow (grad mode on, an input requires grad)
    keep_window_size: Optional[int]  # None: the dense path
    # The per-key path's operand properties its C++ kernels' check reads (perkey/route.py); on the
    # dense path these defaults.
    bias_dtype: Optional[torch.dtype] = None
    rows_aligned: bool = True  # q / k / v: 16-byte aligned rows, strides multiples of 8 elements
    kv_row_stride: int = 0  # the larger of k's and v's row strides, in elements

    @property
    def path(self) -> str:
        return "dense" if self.keep_window_size is None else "perkey"

    @staticmethod
    def of(q, k, v, mask, bias, *, is_causal: bool, softcap: float, keep_window_size=None, requires_grad=None):
        if requires_grad is None:
            requires_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, bias))
        B, Q, H, D = q.shape
        # The per-key fields: the bias's dtype, the operands' alignment, the larger K / V row stride.
        perkey = ()
        if keep_window_size is not None:
            ks, vs = k.stride(1), v.stride(1)
            # (torch.sym_max only for symbolic strides: dynamo before 2.13 cannot trace it on ints.)
            stride = max(ks, vs) if isinstance(ks, int) and isinstance(vs, int) else torch.sym_max(ks, vs)
            perkey = (bias.dtype, _rows_aligned(q, k, v), stride)
        return Call(
            q.device,
            q.dtype,
            B,
            Q,
            H,
            D,
            k.shape[1],
            k.shape[2],
            is_causal,
            softcap,
            None if mask is None else tuple(mask.shape),
            None if bias is None else tuple(bias.shape),
            bool(requires_grad),
            keep_window_size,
            *perkey,
        )


def _rows_aligned(*tensors) -> bool:
    """Whether the rows of each tensor (4-D) start on 16 bytes, with strides of multiples of 8
    elements (a stride the trace leaves symbolic counts where it is settled without a guard).
    Traced tensors have no data and a graph serves later tensors too: their pointers count as
    aligned (PyTorch's allocators align them), and the op refuses one that is not, naming why."""
    eager = _ops.plain_eager(tensors)
    for t in tensors:
        if not all(statically_known_true(s % 8 == 0) for s in t.stride()[:3]):
            return False
        if eager and t.data_ptr() % 16:
            return False
    return True


def available_backends() -> List[str]:
    """Backends that can run on this machine, fastest first (`auto` picks among them per call)."""
    out = []
    if _ext.with_cuda() and torch.cuda.is_available():
        out.append("cuda")
    if _flex_module()[0] is not None:
        out.append("flex")
    if _ext.LOAD_ERROR is None:
        out.append("cpu")
    out.append("reference")
    return out


# ------------------------------------------------------------------------------ backend limits


_KERNEL_REASONS: dict = {}


# The kernels' check is a C function of the extension, which dynamo cannot trace: run eagerly while
# a model is traced (its answer depends on these Python ints only) and cached by them.
@torch.compiler.assume_constant_result
def _kernels_reason(batch: int, heads: int, heads_k: int, head_dim: int, dtype_code: int, softcap: float):
    key = (batch, heads, heads_k, head_dim, dtype_code, softcap)
    if key not in _KERNEL_REASONS:
        _KERNEL_REASONS[key] = _ext.C.cuda_unsupported_reason(*key)
    return _KERNEL_REASONS[key]


def cuda_unsupported_reason(call: Call) -> Optional[str]:
    """Why the dense CUDA kernels cannot take the call: the device and its architecture against
    the build (setup.py's build info), then the kernels' own check (C++ `cuda::unsupported_reason`,
    through flexdma._C), which the op runs again before launching."""
    if call.device.type != "cuda":
        return f"inputs are on {call.device.type}, not cuda"
    why = _ext.LOAD_ERROR
    if why:
        return why
    if not _ext.with_cuda():
        return "flexdma was built without CUDA kernels"
    info = _ext.BUILD_INFO
    major, minor = device_capability(call.device)
    archs = {str(a).rstrip("a") for a in info.CUDA_ARCHS}
    if f"{major}{minor}" not in archs:
        return f"the CUDA kernels were built for sm_{'/'.join(sorted(archs))}, this GPU is sm_{major}{minor}"
    why = _kernels_reason(
        call.batch, call.num_heads, call.num_kv_heads, call.head_dim, _ext.DTYPE_CODES.get(call.dtype, -1), call.softcap
    )
    if why:
        return (
            f"{why} (got head_dim {call.head_dim}, {call.dtype}, {call.num_heads} heads, batch {call.batch}; "
            f"built head dims {list(info.CUDA_HEAD_DIMS)})"
        )
    return None


def flex_unsupported_reason(call: Call) -> Optional[str]:
    if call.path == "perkey" and call.device.type == "cpu" and call.requires_grad:
        return "FlexAttention has no CPU backward for the per-key path"
    flex, why = _flex_module()
    if flex is None:
        return why
    # The per-key path hands FlexAttention no mask (the selection is its mask_mod).
    mask_key_dim = None if call.mask_shape is None or call.path == "perkey" else call.mask_shape[-1]
    return flex.limits_reason(call.device, call.dtype, call.seqlen_q, call.seqlen_k, call.head_dim, mask_key_dim)


def cpu_unsupported_reason(call: Call) -> Optional[str]:
    if call.device.type != "cpu":
        return f"inputs are on {call.device.type}; the cpu backend takes CPU tensors"
    return _ext.LOAD_ERROR


def unsupported_reason(path: str, backend: str, call: Call) -> Optional[str]:
    """Why `backend` cannot run `call` on `path` (None: it can)."""
    if backend == "cuda":
        return cuda_unsupported_reason(call) if path == "dense" else perkey_route.cuda_unsupported_reason(call)
    if backend == "flex":
        return flex_unsupported_reason(call)
    if backend == "cpu":
        return cpu_unsupported_reason(call)
    return None  # the reference runs anywhere


_WHAT = {"dense": "", "perkey": "per-key (keep_window_size) "}


def select(backend: str, call: Call) -> str:
    """The backend that runs this call; raises if an explicitly named one cannot."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    path, what = call.path, _WHAT[call.path]
    if backend != "auto":
        why = unsupported_reason(path, backend, call)
        if why:
            raise ValueError(f"backend={backend!r} cannot run this {what}call: {why}")
        return backend
    chain: Tuple[str, ...] = ("cuda", "flex", "reference") if call.device.type == "cuda" else ("cpu", "reference")
    previous, reason = None, None
    for name in chain:
        why = unsupported_reason(path, name, call)
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


# ------------------------------------------------------------------------------ implementations


def _dense_op(call: Call, q, k, v, mask, bias, scale, deterministic, need_lse):
    # The CUDA kernels skip empty tiles by the mask's tile activity bits: computed here once,
    # handed to the forward and kept by autograd for the backward. Without a backward to share
    # them with (inference, decoding) the op computes them itself: one Python op call less a step.
    # The CPU kernel needs none.
    meta = None
    if mask is not None and call.device.type == "cuda":
        # A mask create_mask built carries its tiles' activity (mask.flexdma_tiles): the bits from it.
        meta = _tilebits.tile_meta_of(mask, call.seqlen_q, call.seqlen_k, call.is_causal)
        if meta is None and call.requires_grad:
            meta = _ops.tile_meta(mask, call.seqlen_q, call.seqlen_k, call.is_causal)
    # out_resid (kept only where a backward can follow) stays with autograd, which hands it on.
    out, lse, _ = _ops.fwd_autograd(
        q, k, v, mask, bias, scale, call.is_causal, call.softcap, deterministic, meta, call.requires_grad
    )
    return out, lse


def _dense_flex(call: Call, q, k, v, mask, bias, scale, deterministic, need_lse):
    return _flex_module()[0].flex_dma_attention(
        q,
        k,
        v,
        mask,
        bias,
        is_causal=call.is_causal,
        softmax_scale=scale,
        softcap=call.softcap,
        need_lse=need_lse,
        training=call.requires_grad,
    )


def _dense_reference(call: Call, q, k, v, mask, bias, scale, deterministic, need_lse):
    return attention_ref(q, k, v, mask, bias, is_causal=call.is_causal, softmax_scale=scale, softcap=call.softcap)


def _perkey(backend: str) -> Callable:
    # A few query rows (decoding through the API, a short chunk): their kept sets from one sort of
    # the keys and O(W) updates, then this backend's dense kernels (_dense_op, called directly)
    # over the gathered entries, where they take that call: flexdma/perkey/cache.py decides and
    # runs it. The reference stays the dense mask; FlexAttention selects in its mask_mod.
    dense_reason = (lambda c: unsupported_reason("dense", backend, c)) if backend in ("cuda", "cpu") else None

    def run(call: Call, q, k, v, mask, bias, scale, deterministic, need_lse):
        how = perkey_cache.route(q, k, call=call, dense_reason=dense_reason)
        if how != perkey_cache.SELECTION:
            dense = perkey_cache.gathered_call(call)
            return perkey_cache.attend(
                how, q, k, v, bias, call=call, mask=mask,
                dense=functools.partial(_dense_op, dense, scale=scale, deterministic=deterministic, need_lse=need_lse),
            )  # fmt: skip
        # FlexAttention loaded only where it runs the call.
        flex = _flex_module()[0] if backend == "flex" else None
        return perkey_attention.run(backend, call, q, k, v, mask, bias, scale, deterministic, flex=flex)

    return run


IMPLEMENTATIONS: Dict[Tuple[str, str], Callable] = {
    ("dense", "cuda"): _dense_op,
    ("dense", "cpu"): _dense_op,
    ("dense", "flex"): _dense_flex,
    ("dense", "reference"): _dense_reference,
    **{("perkey", b): _perkey(b) for b in ("cuda", "cpu", "flex", "reference")},
}


def run(backend: str, call: Call, q, k, v, mask, bias, scale: float, deterministic: bool, need_lse: bool):
    """(out, lse) of the call by the backend `select` picks."""
    name = select(backend, call)
    return IMPLEMENTATIONS[(call.path, name)](call, q, k, v, mask, bias, scale, deterministic, need_lse)
