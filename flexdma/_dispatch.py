"""The dispatch, in one place: the call described once (`Call`, in its layout), the backends'
limits, the `auto` policy, and one table of (path, layout, kernels) -> implementation, decided
once per call into a `Plan` before any data moves.

- `Call`: a small frozen record of a validated call (shapes, dtype, device, is_causal, softcap,
  the mask's and bias's shapes, whether a backward will follow and the LSE is wanted,
  keep_window_size; on the per-key path the bias's dtype and the operands' alignment), built once
  by the public function (`Call.of`: flexdma.api, padded; `Call.packed`: flexdma.varlen,
  FlashAttention's varlen layout).
  Backends decide from it, not from the tensors.
- `unsupported_reason(path, backend, call)`: why a backend cannot take the call (None: it can).
- `select(backend, call)`: auto is the CUDA kernels where they support the call, FlexAttention
  where they do not, the eager reference last; on CPU the C++ kernel of the op family, then the
  reference. Each fallback is warned once per reason. The same policy for every path and layout.
- `plan(backend, call, deterministic)`: the backend, the per-key route (flexdma/perkey/route.py:
  which kernels run the forward and the backward, binding for both) and the layout: "padded",
  "packed", or "cache" (a per-key call of a few query rows after a long context, which
  flexdma/perkey/cache.py runs over kept sets instead of the selection). `Plan.run` is
  `IMPLEMENTATIONS[(path, layout, kernels)]`, kernels the backend or, on the per-key path, the
  route's forward ("cuda": the C++ kernels, "triton"). The public function calls it:
  padded / cache `run(plan, q, k, v, mask, bias, scale, deterministic, need_lse)`, packed
  `run(plan, q, k, v, cu_seqlens_q, cu_seqlens_k, bias, scale, deterministic, need_lse)`, each
  -> (out, lse).
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import _ext, _ops
from ._device import device_capability
from ._warnings import warn_once as _warn_once
from .dense import attention as dense_attention
from .perkey import attention as perkey_attention
from .perkey import cache as perkey_cache
from .perkey import route as perkey_route

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
    rows_aligned: bool = True  # q / k / v: 16-byte aligned rows, strides multiples of 8 (asked on CUDA)
    kv_row_stride: int = 0  # the larger of k's and v's row strides, in elements
    # "padded" (q (B, Q, H, D)) or "packed" (q (Tq, H, D) with offsets: `batch` sequences of at
    # most seqlen_q / seqlen_k tokens (max_seqlen), total_q / total_k tokens in all).
    layout: str = "padded"
    total_q: int = 0
    total_k: int = 0
    need_lse: bool = False  # the caller wants the LSE too (return_lse; a packed call run by sequence)

    @property
    def path(self) -> str:
        return "dense" if self.keep_window_size is None else "perkey"

    @staticmethod
    def of(
        q, k, v, mask, bias, *, is_causal: bool, softcap: float, keep_window_size=None, requires_grad=None,
        need_lse: bool = False,
    ):  # fmt: skip
        if requires_grad is None:
            requires_grad = _backward_follows(q, k, v, bias)
        B, Q, H, D = q.shape
        perkey = _perkey_fields(q, k, v, bias, 1) if keep_window_size is not None else ()
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
            need_lse=need_lse,
        )

    @staticmethod
    def packed(
        q, k, v, bias, cu_seqlens_q, max_seqlen_q, max_seqlen_k, *, is_causal, softcap, keep_window_size,
        need_lse: bool = False,
    ):  # fmt: skip
        """The Call of a packed call: q (Tq, H, D), k / v (Tk, KVH, D), the per-key bias (heads, Tk)
        or None, as flexdma.varlen validated them; the bias's shape as a padded call's of one
        sequence holding every row ((1, heads, 1, Tk))."""
        requires_grad = _backward_follows(q, k, v, bias)
        Tq, H, D = q.shape
        Tk, KVH = k.shape[:2]
        perkey = _perkey_fields(q, k, v, bias, 0) if keep_window_size is not None else ()
        return Call(
            q.device, q.dtype, cu_seqlens_q.shape[0] - 1, max_seqlen_q, H, D, max_seqlen_k, KVH, is_causal, softcap,
            None, None if bias is None else (1, bias.shape[0], 1, Tk), bool(requires_grad), keep_window_size,
            *perkey, layout="packed", total_q=Tq, total_k=Tk, need_lse=need_lse,
        )  # fmt: skip


def _backward_follows(*tensors) -> bool:
    """Grad mode on and an input (None allowed) that requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _perkey_fields(q, k, v, bias, row_dim: int) -> tuple:
    """The per-key fields of a Call: the bias's dtype, the operands' alignment (read by the CUDA
    kernels' check only: True elsewhere) and the larger K / V row stride (rows along `row_dim`)."""
    ks, vs = k.stride(row_dim), v.stride(row_dim)
    # (torch.sym_max only for symbolic strides: dynamo before 2.13 cannot trace it on ints.)
    stride = max(ks, vs) if isinstance(ks, int) and isinstance(vs, int) else torch.sym_max(ks, vs)
    return bias.dtype, q.device.type != "cuda" or _rows_aligned(q, k, v), stride


class Plan(NamedTuple):
    """How a call runs, decided once by `plan` before any data moves."""

    call: Call
    backend: str  # the backend `select` picked
    layout: str  # the call's, or "cache" (a per-key call's few rows over kept sets)
    # The per-key path's kernels (forward and backward) and tile rows (perkey/route.py); for the
    # "cache" layout how its rows run (perkey/cache.py's ONE_KERNEL or KEPT_SETS).
    route: Union[perkey_route.Route, str, None]
    run: Callable  # IMPLEMENTATIONS[(path, layout, kernels)]


def _rows_aligned(*tensors) -> bool:
    """Whether the rows of each tensor (4-D, or 3-D packed) start on 16 bytes, with strides of multiples of 8
    elements (a stride the trace leaves symbolic counts where it is settled without a guard).
    Traced tensors have no data and a graph serves later tensors too: their pointers count as
    aligned (PyTorch's allocators align them), and the op refuses one that is not, naming why."""
    eager = _ops.plain_eager(tensors)
    for t in tensors:
        # Every stride but the last (1, checked by the API): the rows', heads' and (padded) batch's.
        if not all(s % 8 == 0 if isinstance(s, int) else statically_known_true(s % 8 == 0) for s in t.stride()[:-1]):
            return False
        if eager and t.data_ptr() % 16:
            return False
    return True


def available_backends() -> List[str]:
    """Backends that can run on this machine, fastest first (`auto` picks among them per call)."""
    out = []
    if _ext.with_cuda() and torch.cuda.is_available():
        out.append("cuda")
    if dense_attention.flex_module()[0] is not None:
        out.append("flex")
    if _ext.LOAD_ERROR is None:
        out.append("cpu")
    out.append("reference")
    return out


# ------------------------------------------------------------------------------ backend limits


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
    why = _ext.kernels_reason(
        "cuda_unsupported_reason",
        (
            _ext.known_size(call.batch),
            call.num_heads,
            call.num_kv_heads,
            call.head_dim,
            _ext.DTYPE_CODES.get(call.dtype, -1),
            call.softcap,
        ),
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
    flex, why = dense_attention.flex_module()
    if flex is None:
        return why
    # The per-key path hands FlexAttention no mask (the selection is its mask_mod).
    mask_key_dim = None if call.mask_shape is None or call.path == "perkey" else call.mask_shape[-1]
    if call.layout == "packed" and call.path == "dense":
        # One FlexAttention call over every packed row, a document mask from the offsets (a packed
        # per-key call runs sequence by sequence: the lengths below are its longest sequence's).
        return flex.limits_reason(call.device, call.dtype, call.total_q, call.total_k, call.head_dim, None)
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


# ------------------------------------------------------------------------------ the plan


# Plans of eager calls by (backend, call, deterministic, torch's deterministic algorithms): a call
# of a signature seen before (a training loop's steps, a static cache's decode steps) skips the
# support checks. Everything `_decide` reads is in that key or fixed for the process (the build,
# the GPU, whether triton and FlexAttention import). Bounded: a call's record holds its lengths,
# which generation through the API changes every step.
_PLANS: Dict[tuple, Plan] = {}
_MAX_PLANS = 1024


def plan(backend: str, call: Call, deterministic: bool) -> Plan:
    """The plan of a call: the backend `select` picks, on the per-key path the route (which binds
    the forward's kernels and its backward's) and whether a few rows run over kept sets; then the
    implementation of (path, layout, kernels). Raises if an explicitly named backend cannot."""
    # Traced (dynamo), the decision is made in the trace: a lookup in a module-level dict there
    # would be guarded on its contents.
    if torch.compiler.is_compiling():
        return _decide(backend, call, deterministic)
    key = (backend, call, deterministic, torch.are_deterministic_algorithms_enabled())
    try:
        hit = _PLANS.get(key)
    except TypeError:  # symbolic sizes (torch.export's non-strict trace): decided each time
        return _decide(backend, call, deterministic)
    if hit is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        hit = _PLANS[key] = _decide(backend, call, deterministic)
    return hit


def _decide(backend: str, call: Call, deterministic: bool) -> Plan:
    name = select(backend, call)
    layout, route, kernels = call.layout, None, name
    if call.path == "perkey":
        if layout == "padded" and name in ("cuda", "cpu"):
            dense_reason = functools.partial(unsupported_reason, "dense", name)
            how = perkey_cache.route(None, None, call=call, dense_reason=dense_reason)
            if how != perkey_cache.SELECTION:
                layout, route = "cache", how
        if layout != "cache":
            route = perkey_route.decide(name, call, deterministic)
            kernels = route.forward
    return Plan(call, name, layout, route, IMPLEMENTATIONS[(call.path, layout, kernels)])


def by_sequence(packed: Plan, q, k, v, cu_q, cu_k, bias, scale, deterministic, need_lse):
    """A packed call that no kernel takes in its packed form, as one padded call a sequence on views
    of its rows (the offsets read on the host: a device wait), each planned on the call's backend.
    Rows of a sequence without keys: out 0, LSE -inf."""
    call = packed.call
    a = _offsets("cu_seqlens_q", cu_q, call.total_q, call.seqlen_q)
    b = _offsets("cu_seqlens_k", cu_k, call.total_k, call.seqlen_k)
    H, acc = call.num_heads, _ops.acc_dtype(call.dtype)
    outs, lses = [], []
    for i in range(call.batch):
        q0, nq, k0, nk = a[i], a[i + 1] - a[i], b[i], b[i + 1] - b[i]
        if nq == 0:
            continue
        if nk == 0:
            outs.append(q.new_zeros((nq, H, call.head_dim)))
            lses.append(q.new_full((H, nq), float("-inf"), dtype=acc))
            continue
        views = q[None, q0 : q0 + nq], k[None, k0 : k0 + nk], v[None, k0 : k0 + nk]
        b_s = None if bias is None else bias[None, :, None, k0 : k0 + nk]
        one = Call.of(
            *views, None, b_s, is_causal=call.is_causal, softcap=call.softcap, keep_window_size=call.keep_window_size,
            requires_grad=call.requires_grad, need_lse=True,
        )  # fmt: skip
        p = plan(packed.backend, one, deterministic)
        out, lse = p.run(p, *views, None, b_s, scale, deterministic, True)
        outs.append(out[0])
        lses.append(lse[0])
    if not outs:  # no rows
        return q.new_zeros(q.shape), q.new_zeros((H, 0), dtype=acc)
    return torch.cat(outs, 0), torch.cat(lses, 1)


def _offsets(name: str, cu: torch.Tensor, total: int, longest: int) -> List[int]:
    offs = cu.tolist()  # the sequences' loop needs them on the host
    if offs[0] != 0 or offs[-1] != total:
        raise ValueError(f"{name} must start at 0 and end at the token count {total}, got {offs[0]} ... {offs[-1]}")
    lengths = [y - x for x, y in zip(offs, offs[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} must not decrease, got {offs}")
    if lengths and max(lengths) > longest:
        raise ValueError(f"a sequence of {max(lengths)} tokens is longer than max_seqlen {longest} ({name})")
    return offs


# (path, layout, kernels) -> implementation. The per-key path's kernels are its route's forward
# ("cuda": the C++ kernels; "triton": their fallback), the dense path's the backend.
IMPLEMENTATIONS: Dict[Tuple[str, str, str], Callable] = {
    ("dense", "padded", "cuda"): dense_attention.op,
    ("dense", "padded", "cpu"): dense_attention.op,
    ("dense", "padded", "flex"): dense_attention.flex,
    ("dense", "padded", "reference"): dense_attention.reference,
    ("dense", "packed", "cuda"): dense_attention.packed_op,
    ("dense", "packed", "cpu"): dense_attention.packed_op,
    ("dense", "packed", "flex"): dense_attention.packed_flex,
    ("dense", "packed", "reference"): by_sequence,
    **{("perkey", "padded", k): perkey_attention.run for k in ("cuda", "triton", "cpu", "flex", "reference")},
    ("perkey", "cache", "cuda"): perkey_attention.few_rows,
    ("perkey", "cache", "cpu"): perkey_attention.few_rows,
    ("perkey", "packed", "cuda"): perkey_attention.packed,
    ("perkey", "packed", "cpu"): perkey_attention.packed,
    **{("perkey", "packed", k): by_sequence for k in ("triton", "flex", "reference")},
}
