"""Hugging Face transformers integration: `attn_implementation="flexdma"`.

    import flexdma.integrations.transformers as fx
    fx.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="flexdma")

Models hand the attention function q/k/v as (batch, heads, seqlen, head_dim) and either a bool mask
(True = attend) or a float additive mask. A float mask is split into a bool mask (entries at the
dtype's minimum are masked out) and a bias (the rest), so models that fold a learned bias into the
mask -- Doge's dynamic mask does -- get it back as a differentiable flexdma bias.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import types
import weakref
from typing import Optional, Tuple

import torch

from .. import distributed
from .._install import extra_install_command
from ..api import flash_dma_attention
from ..perkey import cache as perkey_cache
from ..perkey import decode
from ..varlen import flash_dma_attention_varlen

NAME = "flexdma"


def _split_mask(mask: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    if mask.dtype == torch.bool:
        return mask, None
    # HF builds masked entries as finfo(dtype).min (sometimes summed twice, so <= half of it).
    allowed = mask > torch.finfo(mask.dtype).min / 2
    # Always a bias, even an all-zero one: skipping it would take a branch on tensor values, which
    # syncs with the device and breaks torch.compile(fullgraph=True). Masks without a bias arrive
    # as bool (register() installs the sdpa mask builder), so the zero case is rare.
    bias = mask.masked_fill(~allowed, 0).to(dtype)
    return allowed, bias


# Keyword arguments models pass the attention function that flexdma_attention_forward understands:
# position_ids / cache_position (positions are in q and k already; packed rows arrive as the mask
# transformers builds from them), sliding_window (in the mask: register() installs transformers'
# sdpa mask builder), the per-call flags that do not change attention, and the packed-row kwargs.
# Anything else with a value is an error: an attention sink or a new option would be dropped.
_ATTENTION_KWARGS = frozenset(
    {
        "position_ids",
        "cache_position",
        "sliding_window",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "num_items_in_batch",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
    }
)


def flexdma_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    backend: str = "auto",
    **kwargs,
) -> Tuple[torch.Tensor, None]:
    """transformers AttentionInterface function; returns (output (B, Q, H, D), None)."""
    if dropout and module.training:
        raise ValueError(f"flexdma attention has no dropout; got dropout={dropout} in training mode")
    if kwargs.get("output_attentions"):
        raise ValueError("flexdma attention does not return attention weights (output_attentions=True)")
    unknown = sorted(n for n, x in kwargs.items() if x is not None and n not in _ATTENTION_KWARGS)
    if unknown:
        raise TypeError(f"flexdma attention got keyword arguments it does not understand: {unknown}")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    Q, K = q.shape[1], k.shape[1]
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        return _packed_attention(module, q, k, v, scaling, softcap, is_causal, backend, kwargs), None
    mask = bias = None
    if attention_mask is not None:
        if attention_mask.dim() != 4:
            raise ValueError(f"attention_mask must be 4-D, got shape {tuple(attention_mask.shape)}")
        mask, bias = _split_mask(attention_mask[..., :K], q.dtype)
        causal = False  # HF masks already contain the causal structure
    else:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = bool(causal) and Q > 1
    out = flash_dma_attention(
        q, k, v, mask, bias, is_causal=causal, softmax_scale=scaling, softcap=float(softcap or 0.0), backend=backend
    )
    return out, None


def _packed_attention(module, q, k, v, scaling, softcap, is_causal, backend, kwargs) -> torch.Tensor:
    """A packed row (DataCollatorWithFlattening's FlashAttention kwargs) through
    flash_dma_attention_varlen: each sequence attends within itself; a mask built beside the
    kwargs adds nothing the offsets do not say."""
    missing = [n for n in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k") if kwargs.get(n) is None]
    if missing:
        raise ValueError(
            f"flexdma attention: packed sequences need cu_seq_lens_q / _k and max_length_q / _k, missing {missing}"
        )
    if q.shape[0] != 1:
        raise ValueError(f"flexdma attention: packed sequences come as one row, got batch {q.shape[0]}")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = flash_dma_attention_varlen(
        q[0],
        k[0],
        v[0],
        kwargs["cu_seq_lens_q"].to(torch.int32),
        kwargs["cu_seq_lens_k"].to(torch.int32),
        int(kwargs["max_length_q"]),
        int(kwargs["max_length_k"]),
        is_causal=bool(causal),
        softmax_scale=scaling,
        softcap=float(softcap or 0.0),
        backend=backend,
    )
    return out[None]


def register(name: str = NAME) -> None:
    """Register flexdma with transformers' AttentionInterface (and its mask interface) under `name`."""
    try:
        from transformers import AttentionInterface
    except ImportError as e:
        raise ImportError(f"flexdma.integrations.transformers needs transformers: {extra_install_command('hf')}") from e
    AttentionInterface.register(name, flexdma_attention_forward)
    try:  # transformers >= 4.53 picks the mask format per attention implementation
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionMaskInterface.register(name, sdpa_mask)
    except ImportError:
        pass


# ----------------------------------------------------------------------------- Doge
DOGE_NAME = "flexdma_doge"


def _doge_padding_mask(
    batch_size: int,
    q_length: Optional[int] = None,
    kv_length: Optional[int] = None,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Optional[torch.Tensor] = None,
    cache_position: Optional[torch.Tensor] = None,
    **kwargs,
):
    """AttentionMaskInterface function of patch_doge: the (B, K) bool padding mask (True = real
    token) or None -- never a (B, 1, Q, K) mask; the causal cut is flexdma's is_causal. Only the key
    length matters: older transformers pass the query rows as cache_position, newer ones as
    q_length / q_offset; the other keyword arguments choose a mask format this function does not
    build."""
    from transformers.masking_utils import causal_mask_function

    if kv_length is None or kv_length <= 0:
        raise ValueError(f"patch_doge: the mask interface needs the key length (kv_length), got {kv_length!r}")
    if mask_function is not causal_mask_function and not _is_packed_causal(
        mask_function, causal_mask_function, attention_mask, kwargs.get("use_vmap", False)
    ):
        raise NotImplementedError(
            "patch_doge takes transformers' causal mask (with padding, or with the packed sequences it "
            "finds in position ids) only: sliding windows and custom mask overlays vary by row"
        )
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(f"patch_doge needs a (batch, {kv_length}) padding mask, got {tuple(attention_mask.shape)}")
    mask = attention_mask[:, -kv_length:].bool()
    if mask.shape[-1] < kv_length:
        # A static cache's key length is its capacity, and its mask covers the keys written so far:
        # padded with False to the capacity (as transformers pads its own masks), so a compiled
        # step's mask has one width from token to token and nothing retraces.
        mask = torch.nn.functional.pad(mask, (0, kv_length - mask.shape[-1]))
    return mask


def _is_packed_causal(mask_function, causal, attention_mask, use_vmap: bool) -> bool:
    """Whether mask_function is transformers' causal mask restricted to packed sequences (what it
    builds for position ids that restart, and traced for any position ids: it cannot read them
    there): the patched layers read the packing from the position ids themselves. Recognised by
    its parts, in the releases tested (README): and_masks of the causal mask (4.56; 5.x wraps it in
    remap_positions_for_packed_sequence) and packed_sequence_mask_function."""

    def cells(f):
        return [c.cell_contents for c in (getattr(f, "__closure__", None) or ())]

    def name(f):
        return getattr(f, "__qualname__", "")

    if torch.compiler.is_compiling():
        # Traced, a function made inside the graph shows no closure, and not every dynamo reads its
        # __qualname__ (torch 2.11's stops the graph there). By what transformers passes: it
        # composes a mask for packing only without a padding mask, and 5.x says use_vmap for a
        # custom overlay (4.56 does not: there a traced and_mask_function overlay without padding
        # passes unseen).
        return attention_mask is None and not use_vmap
    if not name(mask_function).startswith("and_masks."):
        return False
    parts = next((c for c in cells(mask_function) if isinstance(c, tuple)), ())
    packed = [p for p in parts if name(p).startswith("packed_sequence_mask_function.")]
    rest = [p for p in parts if p not in packed]
    causal_part = len(rest) == 1 and (
        rest[0] is causal
        or (name(rest[0]).startswith("remap_positions_for_packed_sequence.") and causal in cells(rest[0]))
    )
    return len(packed) == 1 and causal_part


# The parameters of transformers' DogeAttention.forward that the patched forward understands. The
# cache arrives as `past_key_values` (transformers <= 5.23) or `cache` (5.24 on); `cache_position`
# (<= 5.0) tells where a static cache writes.
_DOGE_PARAMS = ("hidden_states", "position_embeddings", "attention_mask", "past_key_values", "cache", "cache_position")
# Keyword arguments the decoder layer passes on that do not change attention: ignored.
# (num_items_in_batch: the Trainer's loss normaliser, passed down with the model's kwargs.)
_DOGE_IGNORED_KWARGS = frozenset({"use_cache", "output_router_logits", "output_hidden_states", "num_items_in_batch"})
# Packed sequences: DataCollatorWithFlattening's FlashAttention kwargs, or position ids that restart
# (read as transformers reads them: a new sequence wherever a position is not the previous one + 1).
_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _check_doge_signature(forward) -> None:
    """Raise unless `forward` (the DogeAttention.forward patch_doge replaces) takes only parameters
    the patched forward understands: a new one would otherwise be dropped without a word."""
    params = inspect.signature(forward).parameters
    named = [n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != "self"]
    unknown = [n for n in named if n not in _DOGE_PARAMS]
    missing = [n for n in ("hidden_states", "position_embeddings", "attention_mask") if n not in named]
    no_cache = "past_key_values" not in named and "cache" not in named
    if unknown or missing or no_cache:
        import transformers

        raise TypeError(
            f"patch_doge: DogeAttention.forward of transformers {transformers.__version__} takes "
            f"{tuple(named)}; the patch understands {_DOGE_PARAMS} (with the cache as past_key_values or "
            f"cache){'; unknown: ' + str(tuple(unknown)) if unknown else ''}"
            f"{'; missing: ' + str(tuple(missing)) if missing else ''}. This transformers release is not "
            "supported by this flexdma (see README for the tested versions)"
        )


def _doge_projections(layer, hidden_states, position_embeddings, cache, cache_position):
    """A DogeAttention's rows as transformers computes them: (query, key, value, new values), the
    queries (B, H, T, D) with q_norm and rotary, the keys and values (B, KVH, K, D) as the cache
    holds them after its update (the new rows alone without a cache), and the new rows' values
    before it (what their scores come from)."""
    from transformers.models.doge.modeling_doge import apply_rotary_pos_emb

    shape = (*hidden_states.shape[:-1], -1, layer.head_dim)
    q_norm, k_norm = getattr(layer, "q_norm", torch.nn.Identity()), getattr(layer, "k_norm", torch.nn.Identity())
    query_states = q_norm(layer.q_proj(hidden_states).view(shape)).transpose(1, 2)
    key_states = k_norm(layer.k_proj(hidden_states).view(shape)).transpose(1, 2)
    new_values = value_states = layer.v_proj(hidden_states).view(shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
    if cache is not None:
        # transformers <= 5.0 writes a static cache at cache_position (Doge passes it with the rotary
        # tables); later releases count the keys in the cache's layers.
        extra = () if cache_position is None else ({"sin": sin, "cos": cos, "cache_position": cache_position},)
        key_states, value_states = cache.update(key_states, value_states, layer.layer_idx, *extra)
    return query_states, key_states, value_states, new_values


def _doge_attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: Tuple[torch.Tensor, torch.Tensor],
    attention_mask: Optional[torch.Tensor] = None,
    past_key_values=None,
    cache=None,
    cache_position=None,
    **kwargs,
):
    """DogeAttention.forward with the dynamic mask as flexdma's keep_window_size selection: the same
    projections, rotary, cache update and dt_states as transformers' Doge, then one
    flash_dma_attention call with the per-key dt_states as the bias; no (B, H, Q, K) tensor."""
    if past_key_values is not None and cache is not None and past_key_values is not cache:
        raise ValueError("patch_doge: got two different caches (past_key_values and cache)")
    cache = cache if cache is not None else past_key_values
    if kwargs.get("output_attentions"):
        raise ValueError("patch_doge: attention weights are never materialised (output_attentions=True)")
    if kwargs.get("seq_idx") is not None:
        raise ValueError("patch_doge: seq_idx (a Mamba layer's packed-sequence index) is not an attention argument")
    if kwargs.get("is_causal") is False:
        raise ValueError("patch_doge: Doge's attention is causal; got is_causal=False")
    unknown = sorted(
        n
        for n, v in kwargs.items()
        if v is not None
        and n not in _DOGE_IGNORED_KWARGS | set(_PACKED_KWARGS) | {"output_attentions", "is_causal", "position_ids"}
    )
    if unknown:
        raise TypeError(f"patch_doge: DogeAttention got keyword arguments it does not understand: {unknown}")
    if self.training and self.attention_dropout:
        raise ValueError(f"patch_doge: flexdma attention has no dropout; attention_dropout={self.attention_dropout}")
    input_shape = hidden_states.shape[:-1]
    query_states, key_states, value_states, new_values = _doge_projections(
        self, hidden_states, position_embeddings, cache, cache_position
    )
    static = cache is not None and getattr(cache, "is_compileable", False)
    grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
    # The mask the kept sets remember: a static cache's at its capacity's width, as its steps get it.
    kept_padding = attention_mask
    if static:
        # A static cache returns its capacity, unwritten slots included. The keys written so far:
        # a one-token step with kept sets attends through them, the new key's position a device
        # tensor (no host wait: a CUDA graph can hold the step); any other call reads the count on
        # the host and runs on the written keys alone (traced, on a window of the capacity).
        end = _static_end(cache, self.layer_idx, cache_position)
        state = _kept_state(cache, self)
        how = _step_route(self, state, grad, query_states, key_states)
        if how != perkey_cache.SELECTION:
            return _doge_decode_step(
                self, how, query_states, key_states, value_states, new_values, attention_mask, cache, state,
                end - input_shape[1], -1,
            )  # fmt: skip
        if torch.compiler.is_compiling():
            return _doge_static_traced(self, query_states, key_states, value_states, attention_mask, cache, end)
        n = int(end)
        key_states, value_states = key_states[:, :, :n], value_states[:, :, :n]
        if attention_mask is not None:
            if attention_mask.shape[-1] < n:
                raise ValueError(
                    f"patch_doge: the padding mask covers {attention_mask.shape[-1]} keys, the static cache holds {n}"
                )
            attention_mask = attention_mask[:, :n]

    K = key_states.shape[-2]
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape != (input_shape[0], K)):
        raise ValueError(
            f"patch_doge: expected a (batch, {K}) padding mask from the model, got "
            f"{tuple(attention_mask.shape)}; was the model's attn_implementation changed after "
            "patch_doge? (static caches and prepared 4-D masks are not supported)"
        )
    state = _kept_state(cache, self) if cache is not None else None
    T = input_shape[1]
    if not static and state is not None and state.length == K - T:
        how = _step_route(self, state, grad, query_states, key_states)
        if how != perkey_cache.SELECTION:
            return _doge_decode_step(
                self, how, query_states, key_states, value_states, new_values, attention_mask, cache, state, K - T, K
            )

    # Doge's dt_states, op for op: one importance score per key and kv head, (B, KVH, K).
    dt_states = _doge_scores(self, value_states)
    packed = _packed_offsets(kwargs, attention_mask, K != input_shape[1], input_shape)
    if packed is None:
        out = _doge_dense(self, attention_mask, query_states, key_states, value_states, dt_states)
    else:
        out = _doge_varlen(self, *packed, query_states, key_states, value_states, dt_states)
    if cache is not None:
        # After a packed prompt too: the next token sees every key, as a selection over the cache would.
        _keep_newest_row(self, cache, dt_states, attention_mask, K, kept_padding, static)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), None


def _keep_newest_row(self, cache, dt_states, eligible, length: int, padding, static: bool) -> None:
    """Keep in the cache the kept set of the newest row, which sees every key: what the next
    token's step updates. `eligible`: None, or (B, K) False where a key is not one (padding);
    `length` and `padding`: what the kept state records (_KeptState)."""
    scores = dt_states.detach()
    if eligible is not None:
        scores = scores.masked_fill(~eligible[:, None, :].bool(), float("-inf"))
    kept = decode.last_row(scores, self.keep_window_size)
    if static and not torch.compiler.is_compiling():
        # The compiled decode steps update these in place: static addresses to CUDA graphs.
        for t in kept:
            torch._dynamo.mark_static_address(t)
    _set_kept_state(cache, self, _KeptState(kept, length, padding))


def _doge_static_traced(self, query_states, key_states, value_states, attention_mask, cache, end):
    """New tokens against a static cache without its kept sets, traced (torch.compile): the key
    count `end` stays a device tensor, so the written keys cannot be sliced off. The rows attend to
    the window of the capacity that ends at the last written key (slots before the first one masked
    out), whose bottom-right causal cut is theirs; the kept sets come from every slot's score, the
    unwritten ones masked out, and index the cache's slots."""
    B, _, cap, _ = key_states.shape
    if attention_mask is not None and tuple(attention_mask.shape) != (B, cap):
        raise ValueError(
            f"patch_doge: expected the static cache's ({B}, {cap}) padding mask from the model, got "
            f"{tuple(attention_mask.shape)}"
        )
    slot = torch.arange(cap, device=key_states.device)
    written = (slot < end).expand(B, cap)
    if attention_mask is not None:
        written = written & attention_mask.bool()
    window = end - cap + slot
    rows = window.clamp(min=0)
    dt_states = _doge_scores(self, value_states)
    out = _doge_dense(
        self,
        written.index_select(1, rows) & (window >= 0),
        query_states,
        key_states.index_select(2, rows),
        value_states.index_select(2, rows),
        dt_states.index_select(2, rows),
    )
    _keep_newest_row(self, cache, dt_states, written, -1, attention_mask, True)
    return self.o_proj(out.reshape(*out.shape[:2], -1).contiguous()), None


def _doge_dense(self, attention_mask, query_states, key_states, value_states, dt_states) -> torch.Tensor:
    """One sequence a batch row: flash_dma_attention with the padding mask, (B, Q, H, D). The query
    rows are the last Q of the K keys (cache or not): bottom-right causal."""
    # The padding mask goes in 4-D: a 2-D one would read as (Q, K) when batch == Q.
    pad = None if attention_mask is None else attention_mask[:, None, None, :]
    return flash_dma_attention(
        query_states.transpose(1, 2),
        key_states.transpose(1, 2),
        value_states.transpose(1, 2),
        pad,
        dt_states[:, :, None, :],
        is_causal=True,
        softmax_scale=self.scaling,
        keep_window_size=self.keep_window_size,
        backend=getattr(self, "_flexdma_backend", "auto"),
    )


def _doge_varlen(self, cu, longest: int, query_states, key_states, value_states, dt_states) -> torch.Tensor:
    """Packed rows: every (batch row, sequence) a sequence of its own, the rows flattened into one
    token axis, through flash_dma_attention_varlen; (B, L, H, D)."""
    B, _, L, D = query_states.shape
    out = flash_dma_attention_varlen(
        query_states.transpose(1, 2).reshape(B * L, -1, D),
        key_states.transpose(1, 2).reshape(B * L, -1, D),
        value_states.transpose(1, 2).reshape(B * L, -1, D),
        cu,
        cu,
        longest,
        longest,
        dt_states.transpose(0, 1).reshape(dt_states.shape[1], B * L),
        is_causal=True,
        softmax_scale=self.scaling,
        keep_window_size=self.keep_window_size,
        backend=getattr(self, "_flexdma_backend", "auto"),
    )
    return out.reshape(B, L, *out.shape[1:])


def _packed_offsets(kwargs, attention_mask, cached: bool, input_shape) -> Optional[Tuple[torch.Tensor, int]]:
    """(cu_seqlens over the flattened batch, the longest sequence) of a packed batch, or None: from
    DataCollatorWithFlattening's FlashAttention kwargs, else from position ids that restart where
    transformers looks for packing (no padding mask) and the patched layer can take it (no cached
    keys before the call). Reading the position ids waits for the device, as transformers' own
    check does. Traced (torch.compile, torch.export), whether they restart is not asked on the host:
    the offsets come for every such call (as many as the sequences: a data-dependent size, no
    graph break), with the row length as the longest, and one sequence a row runs through the
    packed call too. (torch.cond would choose on the device, but in torch 2.13 attributes set after
    it on objects made in the graph -- the cache's layers, with use_cache -- are lost.)"""
    B, L = input_shape
    given = {n: kwargs.get(n) for n in _PACKED_KWARGS if kwargs.get(n) is not None}
    if given:
        if len(given) != len(_PACKED_KWARGS):
            raise ValueError(f"patch_doge: packed sequences need all of {_PACKED_KWARGS}, got {tuple(given)}")
        cu_q, cu_k = given["cu_seq_lens_q"], given["cu_seq_lens_k"]
        if B != 1 or attention_mask is not None or cached:
            raise ValueError(
                "patch_doge: packed sequences (cu_seq_lens_q / _k) come as one row without attention_mask "
                f"or earlier cached keys, got batch {B}, attention_mask {attention_mask is not None}, "
                f"cached keys {cached}"
            )
        if not torch.equal(cu_q, cu_k):
            raise ValueError("patch_doge: self-attention needs cu_seq_lens_q == cu_seq_lens_k")
        return cu_q.to(torch.int32), int(given["max_length_q"])
    pos = kwargs.get("position_ids")
    if pos is None or attention_mask is not None or cached or L < 2:
        return None
    if pos.dim() != 2 or pos.shape[-1] != L or pos.shape[0] not in (1, B):
        raise ValueError(f"patch_doge: position_ids must be (batch, {L}), got {tuple(pos.shape)}")
    new = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1
    new = new.expand(B, L).clone()
    new[:, 0] = True  # every batch row starts a sequence
    starts = new.flatten().nonzero().flatten()
    traced = torch.compiler.is_compiling()
    if not traced and starts.numel() == B:  # one sequence a row: not packed
        return None
    cu = torch.cat((starts, starts.new_tensor([B * L]))).to(torch.int32)
    return cu, L if traced else int(cu.diff().max())


def _doge_scores(layer, value_states: torch.Tensor) -> torch.Tensor:
    """Doge's dt_states of the keys whose values are given ((B, KVH, K, D)), op for op: one
    importance score per key and kv head, (B, KVH, K), in the values' dtype."""
    B, _, K, _ = value_states.shape
    # Turned to (B, KVH, K) and made contiguous before the elementwise ops (the same values), so
    # that their gradients, from the per-key ops' contiguous dbias, have their inputs' layout.
    # Transposed after them, a compiled graph run by eager kernels (aot_eager) fails in the
    # backward: torch's fake softplus_backward lays a transposed gradient out otherwise than its
    # kernel does, and a view of the kernel's result then fails.
    dt = layer.dt_proj(value_states.transpose(1, 2).reshape(B, K, -1)).transpose(1, 2).contiguous()
    return torch.exp(layer.A[:, None] * torch.nn.functional.softplus(dt)).to(value_states.dtype)


# A number per patch_doge call (copies of a cache keep it, as they keep the kept sets).
_MODEL_IDS = itertools.count()


class _KeptState:
    """What a patched Doge layer keeps beside the transformers cache between decode steps: the
    newest row's kept set (flexdma.perkey.decode), the key count it covers, and the padding mask
    it was built with (a later step's earlier columns must equal it)."""

    def __init__(self, kept: decode.KeptSet, length: int, padding: Optional[torch.Tensor]):
        self.kept, self.length, self.padding = kept, length, padding


# The cache methods that change its batch rows or drop keys, and what they do to the kept sets:
# reorder or select the same batch rows, repeat them, or forget the sets (the next step then runs
# the full selection again and rebuilds them).
_CACHE_HOOKS = {
    "reorder_cache": lambda st, beam_idx: _rows(st, beam_idx),
    "batch_select_indices": lambda st, indices: _rows(st, indices),
    "batch_repeat_interleave": lambda st, repeats: _rows(
        st, torch.arange(st.kept.idx.shape[0], device=st.kept.idx.device).repeat_interleave(repeats)
    ),
    "crop": lambda st, *a, **k: None,
    "reset": lambda st, *a, **k: None,
}


def _rows(st: "_KeptState", index) -> "_KeptState":
    index = torch.as_tensor(index, device=st.kept.idx.device)
    pad = None if st.padding is None else st.padding.index_select(0, index.to(st.padding.device))
    return _KeptState(decode.select_batch(st.kept, index), st.length, pad)


def _kept_state(cache, layer) -> Optional[_KeptState]:
    states = getattr(cache, "_flexdma_kept", None)
    if not states:
        return None
    owner, per_layer = states
    if owner != layer._flexdma_model_id:
        raise ValueError(
            "patch_doge: this cache was filled by another model (its kept sets belong to that model's "
            "layers); start generation with a new cache"
        )
    return per_layer.get(layer.layer_idx)


def _set_kept_state(cache, layer, state: _KeptState) -> None:
    states = getattr(cache, "_flexdma_kept", None)
    if states is None:
        states = (layer._flexdma_model_id, {})
        cache._flexdma_kept = states
        for name, update in _CACHE_HOOKS.items():
            method = getattr(type(cache), name, None)
            if method is not None:
                setattr(cache, name, _CacheHook(cache, method, update))
    elif states[0] != layer._flexdma_model_id:
        raise ValueError(
            "patch_doge: this cache was filled by another model (its kept sets belong to that model's "
            "layers); start generation with a new cache"
        )
    states[1][layer.layer_idx] = state


class _CacheHook:
    """`method` of the cache's class, then `update` on every layer's kept set: an instance
    attribute of the cache in place of its class's method. A plain object, not a bound method, so
    that torch.compile traces its creation inside a compiled forward (the cache is made there with
    use_cache); a deep copy of the cache copies it with its `cache` set to the copy."""

    def __init__(self, cache, method, update):
        self.cache, self.method, self.update = cache, method, update

    def __call__(self, *args, **kwargs):
        out = self.method(self.cache, *args, **kwargs)
        per_layer = self.cache._flexdma_kept[1]
        for i, st in list(per_layer.items()):
            new = self.update(st, *args, **kwargs)
            if new is None:
                del per_layer[i]
            else:
                per_layer[i] = new
        return out


def _check_padding(cache, state: "_KeptState", attention_mask: Optional[torch.Tensor], earlier) -> None:
    """Raise (on CUDA: a device-side assert, no host wait) unless the step's attention_mask keeps
    the padding the kept sets were built with in its first `earlier` columns. `earlier` is an int,
    or for a static cache (whose masks span its capacity) a device tensor. Once a step: every
    layer of a step gets the same mask tensor and holds the same earlier one, so the layers after
    the first skip the O(K) compare (its launches are most of a decode step's extra host time)."""
    # Traced (torch.compile): the compare is in the graph and asserts on the device; no memo.
    compiling = torch.compiler.is_compiling()
    memo = None if compiling else getattr(cache, "_flexdma_checked", None)
    if memo is not None and memo[0]() is attention_mask and memo[1] is state.padding:
        return
    if attention_mask is not None:
        if isinstance(earlier, torch.Tensor):
            # Both masks span the static cache's capacity: the columns before `earlier` compared.
            if state.padding is not None and state.padding.shape != attention_mask.shape:
                raise ValueError(
                    f"patch_doge: the padding mask is {tuple(attention_mask.shape)}, the kept sets were built "
                    f"with a {tuple(state.padding.shape)} one"
                )
            later = torch.arange(attention_mask.shape[-1], device=attention_mask.device) >= earlier
            mask = attention_mask.bool()
            same = (mask | later) if state.padding is None else ((mask == state.padding.bool()) | later)
            same = same.all()
        else:
            if state.padding is not None and state.padding.shape[-1] != earlier:
                raise ValueError(
                    f"patch_doge: the padding mask covers {earlier} keys before the new tokens, the kept "
                    f"sets were built over {state.padding.shape[-1]}"
                )
            mask = attention_mask[:, :earlier].bool()
            same = mask.all() if state.padding is None else (mask == state.padding.bool()).all()
        what = "patch_doge: the attention_mask's earlier columns changed between decode steps"
        why = "; the cache's kept sets were selected with the old ones (start again with a new cache)"
    elif state.padding is not None:
        same = state.padding.bool().all()
        what, why = "patch_doge: a decode step without attention_mask after a padded prompt", ""
    else:
        same = None
    if same is not None:
        if same.device.type == "cpu" and not compiling:
            if not bool(same):
                raise ValueError(what + why)
        else:
            torch._assert_async(same, what)
    if compiling:
        return
    # A weak reference: the memo must not keep a step's mask alive.
    ref = (lambda: None) if attention_mask is None else weakref.ref(attention_mask)
    cache._flexdma_checked = (ref, state.padding)


def _static_end(cache, layer_idx: int, cache_position: Optional[torch.Tensor]) -> torch.Tensor:
    """The number of keys a static cache holds after this call's update, as a device tensor: the
    position after the last written one (transformers <= 5.0: cache_position; later: the layer's
    cumulative_length)."""
    if cache_position is not None:
        return cache_position[-1] + 1
    layers = getattr(cache, "layers", None)
    count = getattr(layers[layer_idx], "cumulative_length", None) if layers is not None else None
    if not isinstance(count, torch.Tensor):
        raise ValueError(
            f"patch_doge: this static cache ({type(cache).__name__}) says neither where it writes "
            "(cache_position) nor how many keys it holds (cumulative_length)"
        )
    return count


def _step_route(self, state: Optional["_KeptState"], grad: bool, query_states, key_states) -> str:
    """How this call's new tokens run (flexdma.perkey.cache.route): through the cache's kept sets
    (a few tokens of kept sets of this layer's shape; one kernel where it takes the step) or the
    selection over every cached key. The step attends with the kept sets' scores, detached: with
    autograd recording, the selection, which recomputes every key's score, so gradients reach
    them all."""
    return perkey_cache.route(
        query_states.transpose(1, 2),
        key_states.transpose(1, 2),
        None if state is None else state.kept,
        self.keep_window_size,
        grad=grad,
    )


def _doge_decode_step(
    self, how, query_states, key_states, value_states, new_values, attention_mask, cache, state, start, length
):
    """T new tokens, keys start .. start + T - 1 of the cache, in O(W) each: their scores (from
    new_values, their value rows), the kept set updated with one key after the other (a key enters
    if a slot is free or it outranks the worst kept key), and each row attending to its own kept set
    among the old slots and the new keys; the same kept sets as the full selection's rows
    (tests/test_doge.py). `start` is an int, or for a static cache (key_states / value_states: its
    whole capacity) a device tensor: no host wait, so a CUDA graph can hold the step. The padding
    mask covers the keys written so far (its last T columns: the new tokens); `length`: the key
    count the kept state records (-1 for a static cache, which counts its keys itself)."""
    B, T = key_states.shape[0], query_states.shape[2]
    if attention_mask is not None and isinstance(start, torch.Tensor):
        # A static cache: the mask spans its capacity, the new tokens' columns start at `start`.
        _check_padding(cache, state, attention_mask, start)
        cols = start + torch.arange(T, device=attention_mask.device)
        eligible = attention_mask.index_select(1, cols).bool()
    elif attention_mask is not None:
        _check_padding(cache, state, attention_mask, attention_mask.shape[-1] - T)
        eligible = attention_mask[:, -T:].bool()
    else:
        _check_padding(cache, state, None, 0)
        eligible = torch.ones(B, T, dtype=torch.bool, device=key_states.device)
    s_new = _doge_scores(self, new_values)  # (B, KVH, T)
    # The kept set updated in place (this cache's own state), each row attending to its own.
    backend = getattr(self, "_flexdma_backend", "auto")
    out = perkey_cache.attend(
        how, query_states.transpose(1, 2), key_states.transpose(1, 2), value_states.transpose(1, 2), None,
        kept=state.kept, scores=s_new, start=start, eligible=eligible, scale=self.scaling,
        dense=functools.partial(flash_dma_attention, is_causal=False, softmax_scale=self.scaling, backend=backend),
    )  # fmt: skip
    padding = attention_mask if attention_mask is not None else state.padding
    _set_kept_state(cache, self, _KeptState(state.kept, length, padding))
    return self.o_proj(out.reshape(B, T, -1).contiguous()), None


def patch_doge(model: torch.nn.Module, backend: str = "auto", cp_group=None) -> torch.nn.Module:
    """Run a transformers Doge model's dynamic mask attention through flexdma's per-key top-W path.

    Every DogeAttention gets a forward that computes Doge's dt_states per key and calls
    flash_dma_attention(attn_bias=dt_states, attn_mask=padding, is_causal=True,
    keep_window_size=config.keep_window_size); the model's attention mask becomes the (B, K) padding
    mask (attn_implementation "flexdma_doge"), so no (B, H, Q, K) tensor is built, in training or in
    generate (DynamicCache). Returns the model, patched in place.

    With `cp_group` (a ProcessGroup or 1-D DeviceMesh: context parallel) the model takes this rank's
    tokens of a sequence sharded in the head-tail layout (flexdma.distributed.shard_sequence of
    input_ids, position_ids with the tokens' global positions, and the labels shifted before
    sharding) and every attention layer attends over the whole sequence
    (flexdma.distributed.context_parallel_attention); training and prefill only.
    """
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.models.doge.modeling_doge import DogeAttention
    except ImportError as e:
        raise ImportError(f"patch_doge needs a transformers with the Doge model: {extra_install_command('hf')}") from e
    _check_doge_signature(DogeAttention.forward)
    config = model.config
    if getattr(config, "sliding_window", None) is not None:
        raise ValueError("patch_doge: a sliding window varies the visible keys by row; set config.sliding_window=None")
    layers = [m for m in model.modules() if isinstance(m, DogeAttention)]
    if not layers:
        raise ValueError("patch_doge: the model has no DogeAttention module")
    # The patched forward calls flexdma itself; the attention function is registered so that
    # set_attn_implementation accepts the name (and a non-Doge attention module would still work).
    AttentionInterface.register(DOGE_NAME, flexdma_attention_forward)
    AttentionMaskInterface.register(DOGE_NAME, _doge_padding_mask)
    # Names the model whose layers filled a cache's kept sets (a cache passed to another model is
    # an error, not a silent mix).
    model_id = next(_MODEL_IDS)
    for m in layers:
        m.forward = types.MethodType(_doge_attention_forward if cp_group is None else _doge_cp_forward, m)
        m._flexdma_cp_group = cp_group
        m._flexdma_backend = backend
        m._flexdma_model_id = model_id
    model.set_attn_implementation(DOGE_NAME)
    return model


def _doge_cp_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: Tuple[torch.Tensor, torch.Tensor],
    attention_mask: Optional[torch.Tensor] = None,
    past_key_values=None,
    cache=None,
    cache_position=None,
    **kwargs,
):
    """DogeAttention.forward under context parallel (patch_doge's cp_group): the projections of this
    rank's tokens as transformers computes them, then context_parallel_attention over the whole
    sequence with the per-key dt_states as the bias and the local (B, S) padding mask."""
    cache = cache if cache is not None else past_key_values
    given = sorted(n for n, v in kwargs.items() if v is not None and n not in _DOGE_IGNORED_KWARGS | {"position_ids"})
    if given:
        raise TypeError(
            f"patch_doge with cp_group: DogeAttention got {given}; a context-parallel layer takes one sequence "
            "sharded over the ranks (no packed sequences, attention weights or causality switch)"
        )
    if self.training and self.attention_dropout:
        raise ValueError(f"patch_doge: flexdma attention has no dropout; attention_dropout={self.attention_dropout}")
    input_shape = hidden_states.shape[:-1]
    q, k, v, _ = _doge_projections(self, hidden_states, position_embeddings, cache, cache_position)
    if k.shape[-2] != input_shape[1]:
        raise ValueError(
            "patch_doge with cp_group: a step over cached keys (decoding) is not supported under context "
            "parallel; generate with a model patched without cp_group"
        )
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape != input_shape):
        raise ValueError(
            f"patch_doge with cp_group: expected this rank's (batch, {input_shape[1]}) padding mask, got "
            f"{tuple(attention_mask.shape)}"
        )
    out = distributed.context_parallel_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        _doge_scores(self, v)[:, :, None, :],
        keep_window_size=self.keep_window_size,
        group=self._flexdma_cp_group,
        attn_mask=None if attention_mask is None else attention_mask.bool(),
        softmax_scale=self.scaling,
    )
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), None
