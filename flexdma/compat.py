"""The seed project's (flash-dmattn) names, so its code runs by changing the import:

from flexdma.compat import flash_dmattn_func_auto, create_mask, get_available_backends
"""

from __future__ import annotations

import numbers
from typing import Callable, List, Optional

import torch

from ._dispatch import available_backends
from .api import flash_dma_attention
from .dense.naive import causal_mask
from .dense.naive import causal_mask as _causal
from .dynamic import dynamic_mask_attention
from .masks import create_mask as _create_mask
from .perkey.contract import check_window

__all__ = [
    "fwd",
    "flash_dmattn_func",
    "flash_dmattn_func_auto",
    "get_available_backends",
    "create_mask",
    "apply_dynamic_mask_attention",
]

# The seed called the FlexAttention path "flex" and its own kernels "cuda"/"triton"; flexdma has
# no Triton kernel of its own, so "triton" maps to FlexAttention (Triton-generated).
_SEED_BACKENDS = {
    "cuda": "cuda",
    "triton": "flex",
    "flex": "flex",
    "auto": "auto",
    "cpu": "cpu",
    "reference": "reference",
}


def _one_of(name: str, value, alias: str, alias_value):
    if value is not None and alias_value is not None:
        raise TypeError(f"flash_dmattn_func got both {name}= and {alias}=; pass one of them")
    if value is None and alias_value is None:
        raise TypeError(f"flash_dmattn_func is missing {name} (or {alias}=)")
    return value if value is not None else alias_value


def flash_dmattn_func(
    query=None,
    key=None,
    value=None,
    attn_mask=None,
    attn_bias=None,
    scale=None,
    is_causal=None,
    softcap=None,
    deterministic=None,
    return_attn_probs=None,
    *,
    softmax_scale=None,
    backend: str = "auto",
    q=None,
    k=None,
    v=None,
):
    """flash-dmattn's function: (batch, seqlen, heads, head_dim) tensors, returns the output.

    attn_mask: bool (True = attend) or, as the seed's float form, 0/1 in a floating dtype (1.0 =
    attend, 0.0 = masked; other values raise a ValueError).
    As in the seed: query / key / value may be passed as q= / k= / v=; a float32 attn_bias with a
    float16 / bfloat16 query is cast to the query's dtype (one cast per call, its gradient comes
    back in float32); return_attn_probs=True returns (out, softmax_lse, S_dmask) with the LSE
    (batch, heads, seqlen_q) in float32 (float64 for float64 inputs) and S_dmask None, since the
    attention probabilities are never materialised.
    """
    query = _one_of("query", query, "q", q)
    key = _one_of("key", key, "k", k)
    value = _one_of("value", value, "v", v)
    if scale is not None and softmax_scale is not None and scale != softmax_scale:
        raise ValueError(f"scale={scale} and softmax_scale={softmax_scale} disagree")
    attn_mask = _float_keep_flags(attn_mask, "attn_mask")
    if (
        isinstance(attn_bias, torch.Tensor)
        and isinstance(query, torch.Tensor)
        and attn_bias.dtype == torch.float32
        and query.dtype in (torch.float16, torch.bfloat16)
    ):
        attn_bias = attn_bias.to(query.dtype)
    res = flash_dma_attention(
        query,
        key,
        value,
        attn_mask,
        attn_bias,
        is_causal=bool(is_causal),
        softmax_scale=softmax_scale if softmax_scale is not None else scale,
        softcap=softcap or 0.0,
        deterministic=bool(deterministic),
        backend=backend,
        return_lse=bool(return_attn_probs),
    )
    if return_attn_probs:
        out, lse = res
        return out, lse, None
    return res


def _float_keep_flags(mask, name: str):
    """The seed's float mask (before its masks became bool: 1.0 = attend, 0.0 = masked, in the
    query's dtype) as a bool mask; other masks pass through to flexdma's own checks."""
    if not isinstance(mask, torch.Tensor) or not mask.is_floating_point():
        return mask
    # The check reads values: eager only (traced, the mask is read as != 0, the seed kernels' rule).
    if not torch.compiler.is_compiling() and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(
            f"a floating-point {name} must hold keep flags, 1.0 = attend and 0.0 = masked (the seed's float "
            f"mask), got {mask.dtype} values {_values(mask[(mask != 0) & (mask != 1)])}"
        )
    return mask != 0


def _check_dense_operand(name: str, t, q: torch.Tensor, k: torch.Tensor) -> None:
    B, Q, H, _ = q.shape
    K, KVH = k.shape[1], k.shape[2]
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4 or t.shape[0] != B or t.shape[1] not in (KVH, H) or tuple(t.shape[2:]) != (Q, K):
        raise ValueError(
            f"{name} must be (batch, kv heads, seqlen_q, seqlen_k) = ({B}, {KVH}, {Q}, {K}) (or {H} query "
            f"heads), got shape {tuple(t.shape)}"
        )


def fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    zoh: torch.Tensor,
    active_mask: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    p_dropout: float = 0.0,
    softmax_scale: Optional[float] = None,
    is_causal: bool = False,
    keep_window_size: int = 2048,
    softcap: float = 0.0,
    return_softmax: bool = False,
    gen: Optional[torch.Generator] = None,
    *,
    backend: str = "auto",
) -> List[torch.Tensor]:
    """The seed's first low-level call, its extension's `fwd` (its README calls it as
    fwd(q=, k=, v=, zoh=, active_mask=, softmax_scale=, keep_window_size=, is_causal=)), with the
    extension's argument order and its result [out, softmax_lse, p, rng_state].

    q (B, Q, H, D); k, v (B, K, KVH, D). zoh (B, KVH, Q, K): the bias (the seed's zero-order-hold
    states), added to softcap(softmax_scale * q.k). active_mask (B, KVH, Q, K): the entries each
    row attends to, 1.0 / 0.0 in a floating dtype (or bool); the caller picks them (the seed's
    reference keeps each row's top keep_window_size zoh entries). As in the seed, the active mask
    applies only when K > keep_window_size: with at most keep_window_size keys every key is active.
    zoh and active_mask may also have the H query heads. is_causal: bottom-right aligned.
    softmax_scale: default 1 / sqrt(D). out: filled with the output and returned, when given.
    The seed's dropout is not here: p_dropout must be 0 and return_softmax False (the seed returned
    the probabilities only with dropout); gen, the dropout's generator, is not read.

    Returns [out (B, Q, H, D); softmax_lse (B, H, Q), float32 (float64 for float64 inputs), +inf
    where a row attends to nothing, as the seed's; p, an empty tensor (no probabilities); rng_state,
    two int64 zeros (no dropout draws)]. Gradients flow to q, k, v and zoh.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D (batch, seqlen, heads, head_dim) tensor")
    _check_dense_operand("zoh", zoh, q, k)
    _check_dense_operand("active_mask", active_mask, q, k)
    if zoh.dtype != q.dtype:
        raise TypeError(f"zoh must have q's dtype {q.dtype}, got {zoh.dtype}")
    if active_mask.dtype != torch.bool and not active_mask.is_floating_point():
        raise TypeError(
            f"active_mask must be floating point (1.0 = active, 0.0 = masked) or bool, got {active_mask.dtype}"
        )
    keep_window_size = check_window(keep_window_size)
    if isinstance(p_dropout, bool) or not isinstance(p_dropout, numbers.Real) or p_dropout != 0:
        raise ValueError(f"p_dropout must be 0: flexdma has no attention dropout, got {p_dropout!r}")
    if not isinstance(return_softmax, bool):
        raise TypeError(f"return_softmax must be a bool, got {type(return_softmax).__name__}")
    if return_softmax:
        raise ValueError("return_softmax=True needs dropout in the seed (p_dropout > 0), which flexdma does not have")
    if gen is not None and not isinstance(gen, torch.Generator):
        raise TypeError(f"gen must be a torch.Generator or None, got {type(gen).__name__}")
    if out is not None and (not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype):
        got = f"{out.dtype} of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out must be a tensor like q ({q.dtype} of shape {tuple(q.shape)}), got {got}")
    mask = _float_keep_flags(active_mask, "active_mask") if k.shape[1] > keep_window_size else None
    res, lse = flash_dma_attention(
        q,
        k,
        v,
        mask,
        zoh,
        is_causal=is_causal,
        softmax_scale=softmax_scale,
        softcap=softcap,
        return_lse=True,
        backend=backend,
    )
    if out is not None:
        res = out.copy_(res)
    # flexdma's LSE of an empty row is -inf (log 0); the seed's kernels wrote +inf there.
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    return [res, lse, q.new_empty(0), torch.zeros(2, dtype=torch.int64, device=q.device)]


def flash_dmattn_func_auto(backend: Optional[str] = None, **kwargs) -> Callable:
    """Return flash_dmattn_func bound to a backend (None = "auto")."""
    name = "auto" if backend is None else backend
    if name not in _SEED_BACKENDS:
        raise ValueError(f"backend must be one of {sorted(_SEED_BACKENDS)}, got {backend!r}")
    mapped = _SEED_BACKENDS[name]
    if mapped != "auto" and mapped not in available_backends():
        raise RuntimeError(f"backend {backend!r} is not available here; available: {get_available_backends()}")

    def func(*args, **kw):
        kw.setdefault("backend", mapped)
        return flash_dmattn_func(*args, **kw)

    return func


def get_available_backends() -> List[str]:
    names = available_backends()
    return [n for n in names if n != "reference"] or names


MASK_TYPES = ("topk", "relu")

# Additive masks mark dropped keys with a large negative number: finfo(dtype).min (transformers),
# -1e30 / -1e4 (the seed, for bfloat16 / float16) or -inf. Values at or below this count as
# dropped: exp() of them is 0 in every float dtype, so attention ignores them either way.
ADDITIVE_DROP = -1e4


def _values(t: torch.Tensor) -> str:
    vals = torch.unique(t.detach().flatten()[:100_000].cpu())[:6].tolist()
    return ", ".join(f"{x:g}" if isinstance(x, float) else str(x) for x in vals)


def _keep_flags(attention_mask: torch.Tensor, drop_at: float) -> torch.Tensor:
    """A bool keep mask (True = attend) from a bool, 0/1 integer, 0/1 float or additive float mask."""
    m = attention_mask
    if m.dtype == torch.bool:
        return m
    if m.is_complex():
        raise TypeError(f"attention_mask must be bool, integer or floating point, got {m.dtype}")
    checking = not torch.compiler.is_compiling()  # the checks read values: eager only
    if not m.is_floating_point():
        if checking and not bool(((m == 0) | (m == 1)).all()):
            raise ValueError(
                f"an integer attention_mask must hold keep flags, 1 = attend and 0 = masked (a "
                f"Hugging Face padding mask); got {m.dtype} values {_values(m[(m != 0) & (m != 1)])}"
            )
        return m != 0
    flags = (m == 0) | (m == 1)
    additive = (m == 0) | (m <= drop_at)
    # 0/1 with some 1: keep flags. 0 / large negative: additive. All zeros is both; read as additive
    # it keeps every key, read as flags it would keep none, so additive it is.
    as_flags = flags.all() & (m == 1).any()
    if checking and not bool(as_flags | additive.all()):
        raise ValueError(
            f"a floating-point attention_mask must hold keep flags (1 = attend, 0 = masked) or be additive "
            f"(0 = attend, <= {drop_at:g} or -inf = masked); got {m.dtype} values "
            f"{_values(m[~(flags | additive)])}"
        )
    return torch.where(as_flags, m == 1, m > drop_at)


def _mask_4d(keep: torch.Tensor, batch_size: int, query_len: int, key_len: int) -> torch.Tensor:
    if keep.dim() != 2:
        return keep
    # The seed's 2-D forms: a (batch, key_len) padding mask, or (batch, query_len) when the keys
    # are a cache in front of the queries (the cached keys are kept).
    if keep.shape[0] == batch_size and keep.shape[1] == key_len:
        return keep[:, None, None, :]
    if keep.shape[0] == batch_size and keep.shape[1] == query_len and query_len < key_len:
        pad = keep.new_ones((batch_size, key_len - query_len))
        return torch.cat((pad, keep), dim=1)[:, None, None, :]
    raise ValueError(
        f"a 2-D attention_mask must be (batch_size, key_len) = ({batch_size}, {key_len}) or "
        f"(batch_size, query_len) = ({batch_size}, {query_len}), got {tuple(keep.shape)}"
    )


def _block_majority(sel: torch.Tensor, block_size: int) -> torch.Tensor:
    """The seed's block smoothing: each aligned key block (and the tail) is kept whole when more
    than half of it is kept, dropped whole otherwise."""
    K = sel.shape[-1]
    nblk = -(-K // block_size)
    counts = torch.nn.functional.pad(sel.to(torch.int32), (0, nblk * block_size - K))
    counts = counts.view(*sel.shape[:-1], nblk, block_size).sum(-1)
    sizes = torch.full((nblk,), block_size, dtype=torch.int32, device=sel.device)
    sizes[-1] = K - (nblk - 1) * block_size
    return (2 * counts > sizes).repeat_interleave(block_size, dim=-1)[..., :K]


def _smoothed(sel: torch.Tensor, allowed: Optional[torch.Tensor], block_size: Optional[int]) -> torch.Tensor:
    """The seed's block smoothing of a selection, then `allowed` again: smoothing may fill a block
    around a padded or causally hidden key, which stays dropped (the seed would attend to it)."""
    if block_size is None or block_size == 1:
        return sel
    sel = _block_majority(sel, block_size)
    return sel if allowed is None else sel & allowed


@torch.no_grad()
def _relu_mask(bias: torch.Tensor, allowed: Optional[torch.Tensor], query_len: int) -> torch.Tensor:
    if not bias.is_floating_point() or bias.dim() != 4:
        raise ValueError(
            f"attention_bias must be a 4-D floating-point tensor, got {bias.dtype} of shape {tuple(bias.shape)}"
        )
    if bias.shape[2] not in (1, query_len):
        raise ValueError(f"attention_bias query dim {bias.shape[2]} must be 1 or query_len {query_len}")
    sel = bias > 0
    return sel if allowed is None else sel & allowed


def create_mask(
    attention_bias: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    batch_size: int,
    query_len: int,
    key_len: int,
    window_size: int,
    min_dtype: Optional[float] = None,
    block_size: Optional[int] = None,
    type: str = "topk",
    is_causal: bool = False,
) -> torch.Tensor:
    """The seed's create_mask: a bool mask (True = attend) from the bias and an optional mask.

    attention_mask: None, bool (True = attend), integer 0/1 or float 0/1 keep flags (Hugging Face
    padding masks), or an additive float mask (0 = attend, masked keys at or below
    max(min_dtype, -1e4) or -inf; an all-zero float mask keeps everything). Any other float values
    raise a ValueError. Shapes: (batch_size, key_len), (batch_size, query_len) for queries at the
    end of the keys, or 4-D broadcastable.
    min_dtype: the seed's fill value for masked keys; flexdma masks are bool, so it only tells
    which additive values mean "masked".
    type: "topk" (the window_size best keys per query row, ties to the lower key index; a float64
    bias ranked in float64) or "relu" (every key with a positive bias).
    block_size: as the seed, the selection is smoothed by aligned key blocks of this size (and the
    shorter tail block): a block more than half of whose keys are selected is kept whole, any other
    dropped whole; unlike the seed, a masked (padded or causally hidden) key is never kept.
    is_causal: also drop keys after each query (bottom-right aligned); flexdma's addition.
    """
    if not isinstance(type, str) or type not in MASK_TYPES:
        raise ValueError(
            f"type must be one of {', '.join(repr(t) for t in MASK_TYPES)} (the seed's mask types), got {type!r}"
        )
    if not isinstance(attention_bias, torch.Tensor):
        raise TypeError(f"attention_bias must be a torch.Tensor, got {attention_bias.__class__.__name__}")
    if attention_bias.shape[-1] != key_len:
        raise ValueError(f"attention_bias key dim {attention_bias.shape[-1]} != key_len {key_len}")
    if attention_bias.shape[0] not in (1, batch_size):
        raise ValueError(f"attention_bias batch dim {attention_bias.shape[0]} must be 1 or batch_size {batch_size}")
    if min_dtype is not None and (
        isinstance(min_dtype, bool) or not isinstance(min_dtype, (int, float)) or not min_dtype < 0
    ):
        raise ValueError(
            f"min_dtype must be a negative number (e.g. torch.finfo(dtype).min) or None, got {min_dtype!r}"
        )
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0):
        raise ValueError(f"block_size must be a positive int or None, got {block_size!r}")
    drop_at = ADDITIVE_DROP if min_dtype is None else max(float(min_dtype), ADDITIVE_DROP)
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a torch.Tensor or None, got {attention_mask.__class__.__name__}")
        attention_mask = _mask_4d(_keep_flags(attention_mask, drop_at), batch_size, query_len, key_len)
    allowed = attention_mask
    if is_causal:
        c = causal_mask(query_len, key_len, device=attention_bias.device)[None, None]
        allowed = c if allowed is None else allowed & c
    if type == "relu":
        return _smoothed(_relu_mask(attention_bias, allowed, query_len), allowed, block_size)
    sel = _create_mask(attention_bias, window_size, attn_mask=attention_mask, is_causal=is_causal, query_len=query_len)
    return _smoothed(sel, allowed, block_size)


def apply_dynamic_mask_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dt_proj: torch.Tensor,
    A: torch.Tensor,
    causal_mask: Optional[torch.Tensor] = None,
    keep_window_size: int = 2048,
    is_causal: bool = True,
    *,
    softmax_scale: float = 1.0,
    backend: str = "auto",
) -> torch.Tensor:
    """The seed's dynamic mask attention, (batch, heads, seqlen, head_dim) in and out.

    query (B, H, Q, D); key, value (B, KVH, K, D); dt_proj (KVH, KVH * D); A (KVH,). Each key gets
    the score exp(softplus(v_flat @ dt_proj.T) * A); each query row attends to its
    `keep_window_size` best-scoring allowed keys (all of them when K <= keep_window_size), with the
    score added to the logits. causal_mask: optional float (B, 1, Q|1, K), 0 = keep, anything else
    (-inf, the dtype's min) = masked; is_causal adds the bottom-right causal cut. A row with no
    allowed key gives 0. The seed's code takes the plain dot product q.k as the logit, hence
    softmax_scale=1.0 (pass 1/sqrt(D) for the usual scaling).

    It runs on the keep_window_size path (no Q x K tensor) when causal_mask has a query dim of 1
    or is the causal cut of one padding row (the usual causal_mask & padding); another causal_mask
    varies by row and is applied through a dense create_mask.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D (batch, heads, seqlen, head_dim) tensor")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    Q, K = q.shape[1], k.shape[1]
    allowed = None
    if causal_mask is not None:
        if not isinstance(causal_mask, torch.Tensor) or not causal_mask.is_floating_point():
            raise TypeError(
                "causal_mask must be a float tensor, 0 = keep and -inf (or the dtype's min) = masked, as in the seed"
            )
        if causal_mask.dim() != 4 or causal_mask.shape[1] != 1 or causal_mask.shape[2] not in (1, Q):
            raise ValueError(f"causal_mask must be (batch, 1, {Q} or 1, key_len), got {tuple(causal_mask.shape)}")
        allowed = causal_mask[..., :K] == 0
        if allowed.shape[2] > 1:
            # The usual seed mask is causal & padding: its last row is the padding (the last row sees
            # every key) and every row is that row cut causally. Then the keys allowed are per-key
            # plus the causal cut, which is what the keep_window_size path takes.
            vis = _causal(Q, K, device=allowed.device)
            eff = allowed & vis if is_causal else allowed
            last = eff[:, :, -1:, :]
            if torch.equal(eff, last & vis):
                allowed, is_causal = last, True
            elif torch.equal(eff, last.expand_as(eff)):
                allowed = last
    return dynamic_mask_attention(
        q,
        k,
        v,
        dt_proj,
        A,
        keep_window_size=keep_window_size,
        is_causal=is_causal,
        attn_mask=allowed,
        softmax_scale=softmax_scale,
        backend=backend,
    ).transpose(1, 2)
