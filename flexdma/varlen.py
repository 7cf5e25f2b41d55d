"""Packed sequences (varlen): many documents in one row of tokens, each attending only within itself,
in FlashAttention's varlen layout (`flash_attn_varlen_func`).

One op family on every device, flexdma::varlen_fwd / varlen_bwd: on the CPU the C++ op
(ops/flexdma_ops.cpp), on CUDA the implementation below (`_varlen_fwd_impl` / `_varlen_bwd_impl`),
so torch.compile and torch.export take the call whole. On CUDA the kernels that take a call run it
through flexdma::varlen_fwd_cuda / varlen_bwd_cuda: the dense kernels (no window) and the per-key
ones (keep_window_size, the C++ sm_90a kernels' head dims; the selection too) read each sequence's
offsets on the device, one launch each for all sequences, no host synchronisation (the kernel that
reads the offsets first checks them and stops at a device-side assert on invalid ones, as torch's
index checks on CUDA do). The per-key calls those kernels do not take (softcap or the deterministic
mode in the backward) read the offsets on the host (a device wait per call) and run the padded
path's kernels sequence by sequence on views of the packed rows (no padded copy); the CPU op does
the same. Where the CUDA kernels do not take a call without a window, and with backend="flex", it
is one FlexAttention call over the packed rows with a document mask from the offsets (flex.py's
`flex_varlen_attention`); elsewhere (a window there, the reference) each sequence is one
flash_dma_attention call on views, with its fallback. Either way nothing attends
across a boundary, and the per-key selection runs within each sequence.
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch

from . import _checks, _dispatch, _ext, _ops
from .api import flash_dma_attention
from .perkey import contract as perkey
from .perkey import ops as perkey_ops
from .perkey import route as perkey_route


def _check_offsets(name: str, cu: torch.Tensor, device: torch.device) -> None:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be a 1-D int32 tensor of batch + 1 offsets, got {cu.dtype} {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device}, the tokens on {device}")


def _offsets(name: str, cu: torch.Tensor, total: int, max_seqlen: int) -> List[int]:
    offs = cu.tolist()  # the per-document loop needs them on the host
    if offs[0] != 0 or offs[-1] != total:
        raise ValueError(f"{name} must start at 0 and end at the token count {total}, got {offs[0]} ... {offs[-1]}")
    lengths = [b - a for a, b in zip(offs, offs[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} must not decrease, got {offs}")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"a sequence of {max(lengths)} tokens is longer than max_seqlen {max_seqlen} ({name})")
    return offs


def flash_dma_attention_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    attn_bias: Optional[torch.Tensor] = None,
    *,
    is_causal: bool = False,
    softmax_scale: Optional[float] = None,
    softcap: float = 0.0,
    keep_window_size: Optional[int] = None,
    return_lse: bool = False,
    deterministic: bool = False,
    backend: str = "auto",
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Attention over packed sequences, FlashAttention's varlen layout.

    Args:
        query: (total_q, num_heads, head_dim); key, value: (total_k, num_kv_heads, head_dim).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) offsets of each sequence's tokens (0 first,
            the token count last; empty sequences allowed), on the tokens' device.
        max_seqlen_q, max_seqlen_k: Python ints, at least the longest sequence.
        attn_bias: None, or a per-key bias (num_kv_heads or num_heads, total_k) (Doge's scores of
            packed documents), same dtype as query; gets a gradient in its own shape. A general
            mask or a per-row bias is not taken (pad the batch and call flash_dma_attention).
        is_causal: causal within each sequence, bottom-right aligned where its query and key
            lengths differ.
        keep_window_size: each row keeps the keep_window_size keys of its own sequence with the
            highest bias (the selection never crosses a boundary); needs attn_bias.
        softmax_scale, softcap, deterministic, backend: as flash_dma_attention.
        return_lse: also return the log-sum-exp (num_heads, total_q), float32 (float64 for float64
            inputs), FlashAttention's varlen layout.
    Returns: out (total_q, num_heads, head_dim) [, lse].
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be 3-D (total tokens, heads, head_dim) in the varlen layout, got {tuple(t.shape)}"
            )
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise TypeError(f"{name} must be a non-negative Python int (not a tensor: no sync), got {n!r}")
    _check_offsets("cu_seqlens_q", cu_seqlens_q, query.device)
    _check_offsets("cu_seqlens_k", cu_seqlens_k, query.device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same sequences, got {cu_seqlens_q.numel() - 1} and "
            f"{cu_seqlens_k.numel() - 1}"
        )
    KVH, H = key.shape[1], query.shape[1]
    if attn_bias is not None:
        if not isinstance(attn_bias, torch.Tensor):
            raise TypeError(f"attn_bias must be a tensor or None, got {type(attn_bias).__name__}")
        if attn_bias.dim() != 2 or attn_bias.shape[0] not in (1, KVH, H) or attn_bias.shape[1] != key.shape[0]:
            raise ValueError(
                f"packed sequences take a per-key attn_bias ({{1|num_kv_heads|num_heads}}, total_k) = "
                f"({{1|{KVH}|{H}}}, {key.shape[0]}), got shape {tuple(attn_bias.shape)}; for a general mask or a "
                "per-row bias, pad the batch and call flash_dma_attention"
            )
    if keep_window_size is not None and attn_bias is None:
        raise ValueError("keep_window_size picks the top keys by attn_bias: pass a per-key attn_bias (heads, total_k)")
    # The checks of a padded call, once for every path (dtypes, devices, heads, scale, window).
    _checks.check_qkv(query[None], key[None], value[None])
    if attn_bias is not None and attn_bias.dtype != query.dtype:
        raise TypeError(f"attn_bias must have query's dtype {query.dtype}, got {attn_bias.dtype}")
    scale, softcap = _checks.check_scalars(query.shape[-1], softmax_scale, softcap, is_causal)
    if keep_window_size is not None:
        keep_window_size = perkey.check_window(keep_window_size)
    if _op_takes(query, key, value, attn_bias, is_causal, softcap, keep_window_size, backend):
        requires_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (query, key, value, attn_bias)
        )
        out, lse, _ = _varlen_fwd_autograd(
            *(_checks.last_dim_contiguous(t) for t in (query, key, value)),
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            attn_bias,
            scale,
            bool(is_causal),
            softcap,
            keep_window_size or 0,
            bool(deterministic),
            requires_grad,
        )
        return (out, lse) if return_lse else out
    if keep_window_size is None and _flex_takes(query, key, value, attn_bias, is_causal, softcap, backend):
        out, lse = _dispatch.flex_module().flex_varlen_attention(
            *(_checks.last_dim_contiguous(t) for t in (query, key, value)), cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, attn_bias, is_causal=bool(is_causal), softmax_scale=scale, softcap=softcap,
        )  # fmt: skip
        return (out, lse) if return_lse else out
    outs, lses = [], []
    for s in _sequences(cu_seqlens_q, cu_seqlens_k, query.shape[0], key.shape[0], max_seqlen_q, max_seqlen_k):
        qs, ks, vs, bias = _seq_views(query, key, value, attn_bias, s)
        res = flash_dma_attention(
            qs,
            ks,
            vs,
            None,
            bias,
            is_causal=is_causal,
            softmax_scale=scale,
            softcap=softcap,
            return_lse=True,
            backend=backend,
            deterministic=deterministic,
            keep_window_size=keep_window_size,
        )
        outs.append(res[0][0])
        lses.append(res[1][0])
    if outs:
        out = torch.cat(outs, 0)
        lse = torch.cat(lses, 1)
    else:  # no sequences: no tokens
        out = query.new_zeros(query.shape)
        lse = query.new_zeros((H, 0), dtype=_ops.acc_dtype(query.dtype))
    return (out, lse) if return_lse else out


def _flex_takes(query, key, value, attn_bias, is_causal, softcap, backend: str) -> bool:
    """Whether a call without a window runs as one FlexAttention call with a document mask from the
    offsets: backend "flex", or "auto" where flexdma's own kernels do not take it (asked as for one
    of its sequences, the packed rows' lengths)."""
    if backend not in ("auto", "flex"):
        return False
    call = _sequence_call(query, key, value, attn_bias, is_causal, softcap, rows=None)
    why = _dispatch.unsupported_reason("dense", "flex", call)
    if why and backend == "flex":
        raise ValueError(f"backend='flex' cannot run this packed call: {why}")
    return why is None


def _sequence_call(query, key, value, attn_bias, is_causal, softcap, window=None, rows: Optional[int] = 1):
    """The dispatch's Call of the packed rows seen as one sequence ((1, rows, heads, D), the bias
    (1, heads, 1, keys)): what the backends' checks ask of dtype, heads and head dim. rows=1 where
    the lengths do not matter (one row each), None for all of them."""
    bias = None if attn_bias is None else attn_bias[None, :, None, :rows]
    return _dispatch.Call.of(
        query[None, :rows], key[None, :rows], value[None, :rows], None, bias, is_causal=is_causal, softcap=softcap,
        keep_window_size=window, requires_grad=False,
    )  # fmt: skip


def _op_takes(query, key, value, attn_bias, is_causal, softcap, window, backend: str) -> bool:
    """Whether the call goes to flexdma::varlen_fwd: on the CPU its C++ kernels, on CUDA where the
    CUDA kernels take the call's dtype, heads and head dim (asked as for one of its sequences).
    backend="cuda" on a call they do not take is an error, as in flash_dma_attention."""
    if not _ops.LOADED:
        return False
    if query.device.type == "cpu":
        return backend in ("auto", "cpu")
    if query.device.type != "cuda" or backend not in ("auto", "cuda"):
        return False
    call = _sequence_call(query, key, value, attn_bias, is_causal, softcap, window)
    why = _dispatch.unsupported_reason(call.path, "cuda", call)
    if why and backend == "cuda":
        raise ValueError(f"backend='cuda' cannot run this packed call: {why}")
    return why is None


# ---- flexdma::varlen_fwd / varlen_bwd: CUDA implementation (the CPU one is ops/flexdma_ops.cpp) ----


def _sequences(cu_q, cu_k, total_q: int, total_k: int, max_q: int, max_k: int) -> List[Tuple[int, int, int, int]]:
    """(q0, nq, k0, nk) of every sequence, the offsets read on the host and checked as the C++ op
    checks them."""
    a = _offsets("cu_seqlens_q", cu_q, total_q, max_q)
    b = _offsets("cu_seqlens_k", cu_k, total_k, max_k)
    return [(a[i], a[i + 1] - a[i], b[i], b[i + 1] - b[i]) for i in range(len(a) - 1)]


def _cuda_packed(q, k, v, cu_q, attn_bias, softcap, window, backward=False, deterministic=False) -> bool:
    """Whether flexdma::varlen_fwd_cuda (varlen_bwd_cuda where `backward`) takes the call: a grid
    row per sequence, and the dense kernels' conditions (no window: dtype, heads, head dim, as for
    one of its sequences) or the C++ per-key kernels' on the packed rows seen as one batch."""
    if q.device.type != "cuda" or not _ext.with_cuda() or cu_q.numel() - 1 > _ext.MAX_GRID_DIM:
        return False
    if window <= 0:
        return _dispatch.cuda_unsupported_reason(_sequence_call(q, k, v, attn_bias, False, softcap)) is None
    if attn_bias is None:
        return False
    call = _sequence_call(q, k, v, attn_bias, False, softcap, window, rows=None)
    return perkey_route.kernels_reason(call, backward, deterministic) is None


def _perkey_selection(q, k, v, bias, is_causal, softcap, window, backward=False, deterministic=False):
    """One sequence's route (flexdma/perkey/route.py; `backward`: the backward's too) and selection
    (its views (1, n, heads, D), bias (1, heads, 1, nk)) with the route's tile rows, and the lists
    where the kernels read them (the CUDA kernels gather by them; the CPU kernel does not)."""
    call = _dispatch.Call.of(
        q, k, v, None, bias, is_causal=is_causal, softcap=softcap, keep_window_size=window, requires_grad=backward
    )
    r = perkey_route.decide("cuda" if q.device.type == "cuda" else "cpu", call, deterministic)
    scores = perkey.selection_scores(bias, None, q.shape[2])
    sel = perkey.select(scores, window, q.shape[1], is_causal, r.tile_rows)
    return r, sel, sel.tile_keys if q.device.type == "cuda" else None


def _seq_views(q, k, v, bias, s):
    q0, nq, k0, nk = s
    b = None if bias is None else bias[None, :, None, k0 : k0 + nk]
    return q[None, q0 : q0 + nq], k[None, k0 : k0 + nk], v[None, k0 : k0 + nk], b


def _varlen_fwd_impl(
    q, k, v, cu_q, cu_k, max_q, max_k, attn_bias, softmax_scale, is_causal, softcap, window, deterministic=False,
    keep_resid=True,
):  # fmt: skip
    """flexdma::varlen_fwd on CUDA: varlen_fwd_cuda where it takes the call, else sequence by sequence
    through the padded path's ops (on CPU tensors those are the CPU ops, which the tests compare
    with the C++ op)."""
    keep = keep_resid and _ops.keeps_residual(q)
    if _cuda_packed(q, k, v, cu_q, attn_bias, softcap, window):
        out, lse, resid = torch.ops.flexdma.varlen_fwd_cuda(
            q, k, v, cu_q, cu_k, max_q, max_k, attn_bias, softmax_scale, is_causal, softcap, window
        )
        return out, lse, resid if keep else q.new_empty((0,))
    out = q.new_zeros(q.shape)  # rows of a sequence without keys: 0, LSE -inf
    lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=_ops.acc_dtype(q.dtype))
    resid = q.new_zeros(q.shape) if keep else q.new_empty((0,))
    for s in _sequences(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k):
        q0, nq, _, nk = s
        if nq == 0 or nk == 0:
            continue
        qs, ks, vs, b = _seq_views(q, k, v, attn_bias, s)
        if window > 0:
            route, sel, lists = _perkey_selection(qs, ks, vs, b, is_causal, softcap, window)
            o, lse_s, r = perkey_ops.run_forward(
                route, qs, ks, vs, b, sel.key_rank, sel.row_thr, softmax_scale, is_causal, softcap, deterministic, lists
            )
        else:
            o, lse_s, r = torch.ops.flexdma.fwd(
                qs, ks, vs, None, b, softmax_scale, is_causal, softcap, deterministic, None, keep
            )
        out[q0 : q0 + nq] = o[0]
        lse[:, q0 : q0 + nq] = lse_s[0]
        if keep and r.numel():
            resid[q0 : q0 + nq] = r[0]
    return out, lse, resid


def _varlen_bwd_impl(
    grad_out, q, k, v, cu_q, cu_k, max_q, max_k, attn_bias, out, lse, softmax_scale, is_causal, softcap, window,
    bias_requires_grad, deterministic=False, out_resid=None,
):  # fmt: skip
    """flexdma::varlen_bwd as _varlen_fwd_impl: varlen_bwd_cuda, else each sequence's backward op on
    views (the per-key selection made again, as the C++ op makes it)."""
    want = bias_requires_grad and attn_bias is not None
    has_resid = out_resid is not None and out_resid.numel() > 0
    if _cuda_packed(q, k, v, cu_q, attn_bias, softcap, window, backward=True, deterministic=deterministic):
        resid = out_resid if has_resid else q.new_empty((0,))
        return torch.ops.flexdma.varlen_bwd_cuda(
            grad_out, q, k, v, cu_q, cu_k, max_q, max_k, attn_bias, out, lse, resid, softmax_scale, is_causal, softcap,
            window, want, deterministic,
        )  # fmt: skip
    dq, dk, dv = q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    dbias = attn_bias.new_zeros(attn_bias.shape) if want else q.new_empty((0,))
    for s in _sequences(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k):
        q0, nq, k0, nk = s
        if nq == 0 or nk == 0:
            continue
        qs, ks, vs, b = _seq_views(q, k, v, attn_bias, s)
        d, o = grad_out[None, q0 : q0 + nq], out[None, q0 : q0 + nq]
        lse_s = lse[None, :, q0 : q0 + nq].contiguous()
        r = out_resid[None, q0 : q0 + nq] if has_resid else None
        if window > 0:
            route, sel, lists = _perkey_selection(qs, ks, vs, b, is_causal, softcap, window, True, deterministic)
            g = perkey_ops.run_backward(
                route, d, qs, ks, vs, b, sel.key_rank, sel.row_thr, o, lse_s, softmax_scale, is_causal, softcap, want,
                deterministic, lists, r,
            )  # fmt: skip
        else:
            g = torch.ops.flexdma.bwd(
                d, qs, ks, vs, None, b, o, lse_s, softmax_scale, is_causal, softcap, want, deterministic, None, r
            )
        dq[q0 : q0 + nq] = g[0][0]
        dk[k0 : k0 + nk] = g[1][0]
        dv[k0 : k0 + nk] = g[2][0]
        if want:
            dbias[:, k0 : k0 + nk] = g[3].reshape(-1, nk)
    return dq, dk, dv, dbias


# ---- flexdma::varlen_fwd / varlen_bwd: fake kernels and autograd (schemas and CPU kernels: ops/) ----


def _varlen_fwd_fake(
    q, k, v, cu_q, cu_k, max_q, max_k, attn_bias, softmax_scale, is_causal, softcap, window, deterministic=False,
    keep_resid=True,
):  # fmt: skip
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=_ops.acc_dtype(q.dtype))
    resid = q.new_empty(q.shape) if keep_resid and _ops.keeps_residual(q) else q.new_empty((0,))
    return q.new_empty(q.shape), lse, resid


def _varlen_bwd_fake(
    grad_out, q, k, v, cu_q, cu_k, max_q, max_k, attn_bias, out, lse, softmax_scale, is_causal, softcap, window, want,
    deterministic=False, out_resid=None,
):  # fmt: skip
    return _ops.grads_like(q, k, v, attn_bias, want)


def _varlen_fwd_cuda_fake(
    q, k, v, cu_q, cu_k, max_q, max_k, attn_bias, softmax_scale, is_causal, softcap, window
):  # fmt: skip
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32), q.new_empty(q.shape)


def _varlen_bwd_cuda_fake(
    grad_out, q, k, v, cu_q, cu_k, max_q, max_k, attn_bias, out, lse, out_resid, softmax_scale, is_causal, softcap,
    window, want, deterministic,
):  # fmt: skip
    return _ops.grads_like(q, k, v, attn_bias, want)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, bias = inputs[:8]
    ctx.save_for_backward(q, k, v, cu_q, cu_k, bias, *output)
    ctx.cfg = (max_q, max_k) + tuple(inputs[8:13])  # scale, causal, softcap, window, deterministic
    # lse: for inspection and merging; out_resid: out's rounding error, for the backward.
    ctx.mark_non_differentiable(output[1], output[2])


def _backward(ctx, grad_out, grad_lse, grad_resid):
    q, k, v, cu_q, cu_k, bias, out, lse, resid = ctx.saved_tensors
    max_q, max_k, scale, causal, softcap, window, deterministic = ctx.cfg
    want = bias is not None and ctx.needs_input_grad[7]
    dq, dk, dv, dbias = _ops.below_autograd(
        torch.ops.flexdma.varlen_bwd, grad_out.contiguous(), q, k, v, cu_q, cu_k, max_q, max_k, bias, out, lse, scale,
        causal, softcap, window, want, deterministic, resid if resid.numel() else None,
    )  # fmt: skip
    return (dq, dk, dv, None, None, None, None, dbias if want else None) + (None,) * 6


if _ops.LOADED:
    torch.library.register_fake("flexdma::varlen_fwd")(_varlen_fwd_fake)
    torch.library.register_fake("flexdma::varlen_bwd")(_varlen_bwd_fake)
    torch.library.register_fake("flexdma::varlen_fwd_cuda")(_varlen_fwd_cuda_fake)
    torch.library.register_fake("flexdma::varlen_bwd_cuda")(_varlen_bwd_cuda_fake)
    torch.library.register_kernel("flexdma::varlen_fwd", "cuda", _varlen_fwd_impl)
    torch.library.register_kernel("flexdma::varlen_bwd", "cuda", _varlen_bwd_impl)
    torch.library.register_autograd("flexdma::varlen_fwd", _backward, setup_context=_setup_context)
    _varlen_fwd_autograd = _ops.eager_autograd(torch.ops.flexdma.varlen_fwd, _setup_context, _backward)
    _ops.forbid_double_backward("flexdma::varlen_bwd")
