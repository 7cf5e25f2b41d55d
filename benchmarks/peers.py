"""The implementations compared, each behind the same small interface.

`prepare(peer, case, t)` returns a zero-argument callable that computes the attention output in
flexdma's layout (B, Q, H, D) from the tensors in `t` (q, k, v, mask, bias; q/k/v/bias may
require grad), plus the tensors its backward differentiates. Everything a peer needs before its
first call (block masks, compilation) happens in prepare, outside the timed region. A peer that
cannot run raises Unavailable with the reason, which the sweep records.
"""

from __future__ import annotations

import functools
import importlib
from types import SimpleNamespace
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F

import flexdma
from flexdma.dense.flex import KEY_TILE_64, ONE_STAGE, SMALL_BLOCKS

from .configs import FLEXDMA_PEERS, KVH, Case, H

# FlexAttention runs at its best options: each timing tries its defaults, flexdma's small blocks
# (they fit every head dim with a captured bias that needs a gradient), one forward stage and the
# forward's 64-key tile (the sm_90 head-dim-64 case, flex.KEY_TILE_64), and keeps the fastest.
FLEX_OPTION_SETS = {"defaults": None, "small": SMALL_BLOCKS, "one_stage": ONE_STAGE, "key_tile_64": KEY_TILE_64}


class Unavailable(Exception):
    """This peer cannot run this case (not installed, unsupported shape...)."""


def _flexdma():
    if not hasattr(flexdma, "flash_dma_attention") or not hasattr(flexdma, "available_backends"):
        raise Unavailable("flexdma.flash_dma_attention / available_backends are missing")
    return flexdma


def flexdma_backend_note(name: str) -> Optional[str]:
    """Why a flexdma backend cannot run on this machine, or None."""
    try:
        fd = _flexdma()
    except Unavailable as e:
        return str(e)
    if name != "auto" and name not in fd.available_backends():
        return f"backend {name!r} not in flexdma.available_backends() = {fd.available_backends()}"
    return None


def _flexdma_peer(backend: str, case: Case, t: SimpleNamespace):
    fd = _flexdma()
    why = flexdma_backend_note(backend)
    if why:
        raise Unavailable(why)

    def fn():
        return fd.flash_dma_attention(
            t.q, t.k, t.v, attn_mask=t.mask, attn_bias=t.bias, is_causal=True, backend=backend
        )

    return fn, [t.q, t.k, t.v, t.bias]


def _bhsd(x):
    return x.transpose(1, 2)


def _sdpa_peer(case: Case, t: SimpleNamespace):
    def fn():
        bias = t.bias.masked_fill(~t.mask, float("-inf"))
        out = F.scaled_dot_product_attention(_bhsd(t.q), _bhsd(t.k), _bhsd(t.v), attn_mask=bias, enable_gqa=True)
        return out.transpose(1, 2)

    return fn, [t.q, t.k, t.v, t.bias]


def _dense_peer(case: Case, t: SimpleNamespace):
    # SDPA's is_causal is top-left aligned: only right for Q == K. One query sees every key anyway.
    causal = case.Q == case.K and case.Q > 1

    def fn():
        out = F.scaled_dot_product_attention(_bhsd(t.q), _bhsd(t.k), _bhsd(t.v), is_causal=causal, enable_gqa=True)
        return out.transpose(1, 2)

    return fn, [t.q, t.k, t.v]


@functools.lru_cache(None)
def compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Every shape is its own graph; the default cache limit (8) would fall back to eager mode.
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 1024))
    # The backward is timed with retain_graph=True, which donated buffers forbid.
    torch._functorch.config.donated_buffer = False
    return torch.compile(flex_attention, dynamic=False)


def _flexattn_peer(case: Case, t: SimpleNamespace, *, options: Optional[str]):
    if t.q.device.type != "cuda":
        raise Unavailable("compiled FlexAttention is benchmarked on CUDA only")
    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError as e:
        raise Unavailable(f"torch has no FlexAttention ({e})")
    flex = compiled_flex()
    G = H // KVH
    mask, bias = t.mask, t.bias

    def mask_mod(b, h, q_idx, kv_idx):
        return mask[b, h // G, q_idx, kv_idx]

    if case.bias == "per-row":

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[b, h // G, q_idx, kv_idx]
    else:

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[b, h // G, 0, kv_idx]

    # B=None/H=None: one block mask broadcast over batch and heads (the mask has one of each).
    block_mask = create_block_mask(
        mask_mod, None, None, case.Q, case.K, device=t.q.device, BLOCK_SIZE=128, _compile=True
    )
    opts = FLEX_OPTION_SETS[options or "defaults"]

    def fn():
        out = flex(
            _bhsd(t.q),
            _bhsd(t.k),
            _bhsd(t.v),
            score_mod=score_mod,
            block_mask=block_mask,
            enable_gqa=True,
            kernel_options=opts,
        )
        return out.transpose(1, 2)

    return fn, [t.q, t.k, t.v, t.bias]


def flash_dmattn_note() -> Optional[str]:
    try:
        importlib.import_module("flash_dmattn")
    except Exception as e:
        return f"flash_dmattn is not importable ({type(e).__name__})"
    return None


def _flash_dmattn_peer(case: Case, t: SimpleNamespace):
    why = flash_dmattn_note()
    if why:
        raise Unavailable(why)
    fdm = importlib.import_module("flash_dmattn")
    if hasattr(fdm, "flash_dmattn_func_auto"):
        func = fdm.flash_dmattn_func_auto(backend="cuda")
    elif hasattr(fdm, "flash_dmattn_func"):
        func = fdm.flash_dmattn_func
    else:
        raise Unavailable("flash_dmattn has neither flash_dmattn_func_auto nor flash_dmattn_func")
    # Its kernel reads a (B, KVH, Q, K) mask and bias; a per-key bias is expanded (not copied).
    bias = t.bias.expand(1, KVH, case.Q, case.K)

    def fn():
        return func(t.q, t.k, t.v, attn_mask=t.mask, attn_bias=bias, is_causal=True)

    return fn, [t.q, t.k, t.v, t.bias]


def option_sets(peer: str) -> List[Optional[str]]:
    """The option sets a peer is timed with (the best one is reported); [None]: its only one."""
    return list(FLEX_OPTION_SETS) if peer == "flexattn" else [None]


def prepare(
    peer: str, case: Case, t: SimpleNamespace, *, backward: bool, options: Optional[str] = None
) -> Tuple[Callable, List[torch.Tensor]]:
    if peer.startswith("flexdma-"):
        return _flexdma_peer(peer[len("flexdma-") :], case, t)
    if peer == "sdpa":
        return _sdpa_peer(case, t)
    if peer == "dense":
        return _dense_peer(case, t)
    if peer == "flexattn":
        return _flexattn_peer(case, t, options=options)
    if peer == "flash_dmattn":
        return _flash_dmattn_peer(case, t)
    raise ValueError(f"unknown peer {peer!r}")


def peer_note(peer: str) -> Optional[str]:
    """Machine-wide reason a peer cannot run at all (recorded once per run), or None."""
    if peer.startswith("flexdma-"):
        return flexdma_backend_note(peer[len("flexdma-") :])
    if peer == "flash_dmattn":
        return flash_dmattn_note()
    if peer == "flexattn" and not torch.cuda.is_available():
        return "compiled FlexAttention is benchmarked on CUDA only"
    return None


def equivalence_peers() -> List[str]:
    """Every implementation of the masked-bias attention that can run here (not the dense ceiling)."""
    names = list(FLEXDMA_PEERS)
    try:
        # The cpu backend takes CPU tensors: it joins only where the check runs on the CPU.
        skip = ("cuda", "flex", "reference") + (("cpu",) if torch.cuda.is_available() else ())
        extra = [f"flexdma-{b}" for b in _flexdma().available_backends() if b not in skip]
    except Unavailable:
        extra = []
    return names + extra + ["sdpa", "flexattn", "flash_dmattn"]
