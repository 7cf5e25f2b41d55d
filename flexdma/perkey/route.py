"""Which kernels run a per-key (keep_window_size) call, decided once, before any data moves.

`decide(backend, call, deterministic)` returns a `Route`: the backend, the forward and backward
implementations, and the rows per query tile of the selection's lists (what the forward reads),
from the call (flexdma/_dispatch.py's Call: shapes, dtypes, device, the operands' alignment) and
the build; flexdma/_dispatch.py's `plan` asks it once a call. The selection is then made with
`route.tile_rows`, and the forward and its backward run as routed (perkey/attention.py,
perkey/ops.py), without a second decision:

  backend   forward and backward                                  tile rows
  cuda      "cuda": the C++ kernels, flexdma::perkey_fwd /          CUDA_TILE_ROWS (128)
            perkey_bwd (ops/flexdma_cuda.cpp), where their own
            check takes the call (`kernels_reason`: C++,
            through flexdma._C), the backward's conditions too
            where a backward follows (no softcap, not
            deterministic); else "triton":
            flexdma_triton::perkey_fwd / perkey_bwd (triton.py)   `triton_tiles`'
  cpu       "cpu": flexdma::perkey_fwd / perkey_bwd's CPU kernels   CPU_TILE_ROWS
  flex      "flex": FlexAttention (perkey/flex.py); on CPU no       `triton_tiles`' on CUDA,
            backward                                              else CPU_TILE_ROWS
  reference "reference": naive.py's dense mask, under autograd   (neither reads the lists)

A packed call (the Call's "packed" layout) takes the C++ kernels with a grid row per sequence; on
the other routes it runs sequence by sequence (flexdma/_dispatch.py's `by_sequence`).

Each forward op's autograd runs its own backward op (perkey/ops.py pairs them), so a call a
backward follows takes the C++ forward only where the C++ backward takes it too.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import _ext
from .._device import device_capability
from .contract import CPU_TILE_ROWS, CUDA_TILE_ROWS, block_m, pack_size, plane_heads


def triton_tiles(num_heads: int, num_kv_heads: int, plane_heads_: int, head_dim: int) -> tuple:
    """(pack, tile_rows) of the Triton kernels: the query heads a program serves (its block_m rows
    are `pack` heads x tile_rows) and the rows of a selection tile."""
    rows = block_m(head_dim)
    pack = min(pack_size(num_heads, num_kv_heads, plane_heads_), rows // 16)
    return pack, rows // pack


def kernels_reason(call, backward: bool, deterministic: bool) -> Optional[str]:
    """Why the C++ per-key kernels cannot take a call (a flexdma._dispatch.Call; None: they can):
    their own check (C++ `cuda::perkey_unsupported_reason`, through flexdma._C), which the ops run
    again before launching. `backward`: the backward's conditions too (no softcap, not
    deterministic, torch's deterministic algorithms off)."""
    if call.device.type != "cuda":
        return f"inputs are on {call.device.type}, not cuda"
    if _ext.LOAD_ERROR:
        return _ext.LOAD_ERROR
    if not _ext.with_cuda():
        return "flexdma was built without CUDA kernels"
    major, minor = device_capability(call.device)
    codes, known = _ext.DTYPE_CODES, _ext.known_size
    # A packed Call holds what the op asks its check: the sequences as the batch, the longest lengths.
    key = (
        known(call.batch), call.num_heads, call.num_kv_heads, call.head_dim, known(call.seqlen_q),
        known(call.seqlen_k),
        codes.get(call.dtype, -1), codes.get(call.bias_dtype, -1), float(call.softcap), bool(call.rows_aligned),
        known(call.kv_row_stride), major * 10 + minor, bool(backward),
        bool(deterministic) or torch.are_deterministic_algorithms_enabled(),
    )  # fmt: skip
    return _ext.kernels_reason("perkey_unsupported_reason", key)


def triton_reason(call) -> Optional[str]:
    """Why the Triton per-key kernels (perkey/triton.py) cannot take a CUDA call (None: they can)."""
    if not _ext.HAVE_TRITON:
        return "triton is not installed"
    if call.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {call.dtype} (the per-key Triton kernels take float16 and bfloat16)"
    d = call.head_dim
    if d < 16 or d > 256 or d % 16:
        return f"head_dim {d} (the per-key Triton kernels take multiples of 16 from 16 to 256)"
    return None


def cuda_unsupported_reason(call) -> Optional[str]:
    """Why the per-key CUDA backend cannot take a call (a flexdma._dispatch.Call; None: it can):
    neither the C++ kernels nor the Triton ones take it."""
    if call.device.type != "cuda":
        return f"inputs are on {call.device.type}, not cuda"
    if _ext.LOAD_ERROR:  # every per-key backend needs the selection op
        return _ext.LOAD_ERROR
    if not _ext.with_cuda():  # the selection's CUDA kernel is the extension's
        return (
            "flexdma was built without its CUDA kernels (FLEXDMA_SKIP_CUDA=1, or torch or nvcc without CUDA at install)"
        )
    why_triton = triton_reason(call)
    if why_triton is None:
        return None
    why_cpp = kernels_reason(call, call.requires_grad, False)
    return None if why_cpp is None else f"the C++ per-key kernels: {why_cpp}; the Triton ones: {why_triton}"


class Route(NamedTuple):
    backend: str  # cuda, cpu, flex, reference
    forward: str  # cuda (the C++ kernels), triton, cpu, flex, reference
    backward: str  # the same names: what the forward's autograd runs
    tile_rows: int  # rows per query tile of the selection's lists


def decide(backend: str, call, deterministic: bool = False) -> Route:
    """The route of a call (a flexdma._dispatch.Call) the dispatcher gave `backend`; `deterministic`
    as the API's argument (with torch's deterministic algorithms, it keeps the backward off the
    C++ kernels' float atomics)."""
    if backend == "cpu":
        return Route("cpu", "cpu", "cpu", CPU_TILE_ROWS)
    if backend == "cuda":
        why = kernels_reason(call, call.requires_grad, deterministic)
        if why is None:
            return Route("cuda", "cuda", "cuda", CUDA_TILE_ROWS)
        if not _ext.HAVE_TRITON:
            raise ValueError(f"the C++ per-key kernels cannot take this call ({why}), and triton is not installed")
    if call.device.type != "cuda":
        return Route(backend, backend, backend, CPU_TILE_ROWS)
    mask_heads = 1 if call.mask_shape is None else call.mask_shape[1]
    ph = plane_heads(call.num_heads, call.bias_shape[1], mask_heads)
    tile_rows = triton_tiles(call.num_heads, call.num_kv_heads, ph, call.head_dim)[1]
    name = "triton" if backend == "cuda" else backend
    return Route(backend, name, name, tile_rows)
