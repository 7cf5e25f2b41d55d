"""Which kernels run a per-key (keep_window_size) call, decided once, before any data moves.

`decide` returns a `Route`: the backend, the forward and backward kernels, and the rows per query
tile of the selection's lists (what the forward reads), from the call's shapes, dtype, device and
the build. The selection is then made with `route.tile_rows`, and the forward and backward run as
routed:

  backend   forward                                         backward
  cuda      "sm90": C++ flexdma::topk_fwd_sm90 (sm_90a       "triton" (perkey/triton.py)
            build, head dim 64 / 128, fp16 / bf16), else
            "triton" (perkey/triton.py)
  cpu       "cpu": the C++ CPU op                           "cpu"
  flex      "flex": FlexAttention (flexdma/flex.py)          FlexAttention (CUDA); on CPU no backward
  reference "reference": naive.py's dense mask              autograd

The CUDA forward is the op flexdma::topk_fwd (autograd and torch.compile see the op); its CUDA
implementation, `cuda_fwd` below, runs the C++ kernel when the route's static conditions
(`sm90_forward`) hold and the operands are aligned for it (`sm90_takes`, per call: direct op
callers too), else Triton.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import _ext
from .._device import device_capability
from .contract import CPU_TILE_ROWS, plane_heads

# Rows of q per Triton program: PACK query heads x TILE_ROWS rows. Head dims above WIDE_FROM: half
# the rows per program (perkey/triton.py's WIDE_* launch configurations).
BLOCK_M = 128
WIDE_FROM = 128
WIDE_BLOCK_M = 64


def block_m(head_dim: int) -> int:
    return WIDE_BLOCK_M if head_dim > WIDE_FROM else BLOCK_M


def pack_size(num_heads: int, num_kv_heads: int, plane_heads: int) -> int:
    """Query heads one program serves: they must share a kv head and a selection plane."""
    group = num_heads // num_kv_heads
    if plane_heads == num_heads or group == 1:
        return 1
    pack = 1
    while pack * 2 <= 8 and group % (pack * 2) == 0:
        pack *= 2
    return pack


# Query rows per CTA of the C++ forward (flexdma::topk_fwd_sm90; csrc/cuda/fwd_ws_kernel.cuh): it
# reads lists of tiles of a multiple of this many rows.
SM90_TILE_ROWS = _ext.TOPK_TILE_ROWS


def sm90_forward(head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether topk_fwd on `device` runs the C++ sm_90a kernel for this head dim and dtype (what
    the selection's tile rows depend on; operand alignment is checked per call)."""
    info = _ext.BUILD_INFO
    if info is None or head_dim not in (64, 128) or head_dim not in info.CUDA_HEAD_DIMS:
        return False
    if tuple(info.CUDA_ARCHS) != ("90",) or dtype not in (torch.float16, torch.bfloat16):
        return False
    return device.type == "cuda" and device_capability(device) == (9, 0)


def plan(num_heads: int, num_kv_heads: int, plane_heads: int, head_dim: int, dtype, device) -> tuple:
    """(pack, tile_rows): the query heads a Triton program serves (its block_m rows are `pack`
    heads x tile_rows) and the rows of a selection tile. The C++ forward's 128-row tiles need
    lists of at least 128 rows, so with it a program serves one head."""
    rows = block_m(head_dim)
    pack = min(pack_size(num_heads, num_kv_heads, plane_heads), rows // 16)
    if sm90_forward(head_dim, dtype, device):
        pack = min(pack, rows // SM90_TILE_ROWS)
    return pack, rows // pack


def tile_rows_for(device: torch.device, num_heads, num_kv_heads, plane_heads_, head_dim, dtype) -> int:
    """Rows per query tile of the selection lists, as the kernels of the device read them."""
    if device.type == "cuda":
        return plan(num_heads, num_kv_heads, plane_heads_, head_dim, dtype, device)[1]
    return CPU_TILE_ROWS


def cuda_unsupported_reason(call) -> Optional[str]:
    """Why the per-key CUDA kernels cannot take a call (None: they can): a flexdma._dispatch.Call,
    or a query tensor."""
    head_dim = call.head_dim if hasattr(call, "head_dim") else call.shape[-1]
    if call.device.type != "cuda":
        return f"inputs are on {call.device.type}, not cuda"
    if _ext.LOAD_ERROR:  # every per-key backend needs the selection op
        return _ext.LOAD_ERROR
    if not _ext.with_cuda():  # the selection's CUDA kernel is the extension's
        return (
            "flexdma was built without its CUDA kernels (FLEXDMA_SKIP_CUDA=1, or torch or nvcc without CUDA at install)"
        )
    if not _ext.HAVE_TRITON:  # pragma: no cover - a torch without triton
        return "triton is unavailable (the per-key CUDA kernels are Triton)"
    if call.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {call.dtype} (the per-key CUDA kernels take float16 and bfloat16)"
    d = head_dim
    if d < 16 or d > 256 or d % 16:
        return f"head_dim {d} (the per-key CUDA kernels take multiples of 16 from 16 to 256)"
    return None


class Route(NamedTuple):
    backend: str  # cuda, cpu, flex, reference
    forward: str  # sm90, triton, cpu, flex, reference
    backward: str  # sm90, triton, cpu, flex, reference
    tile_rows: int  # rows per query tile of the selection's lists


_BACKWARD = {"sm90": "sm90", "triton": "triton", "cpu": "cpu", "flex": "flex", "reference": "reference"}


def decide(backend: str, call) -> Route:
    """The route of a call (a flexdma._dispatch.Call) the dispatcher gave `backend`. "sm90": the
    C++ kernels where the operands are aligned for them (cuda_fwd / cuda_bwd check them), else
    Triton."""
    mask_heads = 1 if call.mask_shape is None else call.mask_shape[1]
    ph = plane_heads(call.num_heads, call.bias_shape[1], mask_heads)
    tile_rows = tile_rows_for(call.device, call.num_heads, call.num_kv_heads, ph, call.head_dim, call.dtype)
    if backend == "cuda":
        forward = "sm90" if sm90_forward(call.head_dim, call.dtype, call.device) else "triton"
    else:
        forward = backend
    return Route(backend, forward, _BACKWARD[forward], tile_rows)


# ---- the CUDA implementation of flexdma::topk_fwd (registered by perkey/ops.py) ----


def sm90_takes(q, k, v, attn_bias, softcap) -> bool:
    """The C++ forward's conditions on this call's operands (16-byte rows, bias in q's dtype)."""
    if not sm90_forward(q.shape[3], q.dtype, q.device) or attn_bias.dtype != q.dtype or softcap < 0:
        return False
    if q.shape[0] > _ext.MAX_GRID_DIM or q.shape[2] > _ext.MAX_GRID_DIM:
        return False
    # The kernel indexes K / V rows in 32 bits.
    if k.shape[1] * max(k.stride(1), v.stride(1), 1) >= 2**31:
        return False
    for t in (q, k, v):
        st = t.stride()
        if t.data_ptr() % 16 or (st[0] | st[1] | st[2]) % 8:  # strides are never negative
            return False
    return True


def need_tiles(tile_keys):
    if tile_keys is None:
        raise ValueError(
            "flexdma::topk_fwd / topk_bwd on CUDA need tile_keys, the third output of "
            "flexdma::topk_select (called with the tile_rows of flexdma.perkey.route.decide)"
        )
    return tile_keys


def cuda_fwd(q, k, v, attn_bias, key_rank, row_thr, softmax_scale, is_causal, softcap, deterministic, tile_keys=None):
    """flexdma::topk_fwd on CUDA: the C++ sm_90a forward where it takes the call, else Triton."""
    tile_keys = need_tiles(tile_keys)
    if sm90_takes(q, k, v, attn_bias, softcap):
        # The lists of the C++ kernels' calls are of SM90_TILE_ROWS-row tiles (`plan`'s tile rows
        # wherever sm90_forward holds); the op checks that tile_keys holds them.
        return torch.ops.flexdma.topk_fwd_sm90(
            q, k, v, attn_bias, key_rank, row_thr, tile_keys, SM90_TILE_ROWS, softmax_scale, is_causal, softcap
        )
    # triton is an optional dependency, imported by the first call that needs it (not by `import flexdma`).
    from . import triton as kernels

    return kernels.fwd(q, k, v, attn_bias, key_rank, row_thr, tile_keys, softmax_scale, is_causal, softcap)


def sm90_bwd_takes(q, k, v, attn_bias, softcap, deterministic) -> bool:
    """The C++ backward's conditions besides the forward's: no softcap, and its float atomics
    allowed (not deterministic, torch's deterministic algorithms off)."""
    if softcap != 0 or deterministic or torch.are_deterministic_algorithms_enabled():
        return False
    return sm90_takes(q, k, v, attn_bias, softcap)


def cuda_bwd(grad_out, q, k, v, attn_bias, key_rank, row_thr, out, lse, softmax_scale, is_causal, softcap,
             bias_requires_grad, deterministic, tile_keys=None, out_resid=None):  # fmt: skip
    """flexdma::topk_bwd on CUDA: the C++ sm_90a backward where it takes the call, else Triton
    (softcap, the deterministic mode, unaligned operands, the other head dims)."""
    tile_keys = need_tiles(tile_keys)
    if sm90_bwd_takes(q, k, v, attn_bias, softcap, deterministic):
        resid = out_resid if out_resid is not None else out.new_empty((0,))
        return torch.ops.flexdma.topk_bwd_sm90(
            grad_out, q, k, v, attn_bias, key_rank, row_thr, tile_keys, SM90_TILE_ROWS, out, lse, resid,
            softmax_scale, is_causal, bias_requires_grad,
        )  # fmt: skip
    from . import triton as kernels

    return kernels.bwd(
        grad_out, q, k, v, attn_bias, key_rank, row_thr, out, lse, softmax_scale, is_causal, softcap,
        bias_requires_grad, deterministic, tile_keys, out_resid,
    )  # fmt: skip
