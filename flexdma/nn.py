"""Attention layers built on dynamic mask attention."""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch
import torch.nn as nn

from . import distributed
from .api import flash_dma_attention
from .dynamic import dynamic_bias, dynamic_mask_attention
from .perkey import cache as perkey_cache
from .perkey import contract as perkey
from .perkey import decode
from .varlen import flash_dma_attention_varlen

KVCache = Tuple[torch.Tensor, torch.Tensor]


def _append(buf: torch.Tensor, n: int, new: torch.Tensor, dim: int) -> torch.Tensor:
    """buf's first n entries along dim followed by new, as a buffer with spare room: amortized
    O(len(new)) per call when autograd does not track the buffer (decoding), a plain cat otherwise
    (writing into a buffer that an earlier step saved for backward would break that backward)."""
    m = new.shape[dim]
    if torch.is_grad_enabled() and (buf.requires_grad or new.requires_grad):
        return torch.cat((buf.narrow(dim, 0, n), new), dim)
    buf = _room(buf, n, m, dim)
    buf.narrow(dim, n, m).copy_(new)
    return buf


def _room(buf: torch.Tensor, n: int, m: int, dim: int) -> torch.Tensor:
    """buf, or where its first n entries along dim leave no room for m more, a buffer of twice the
    size holding them."""
    if n + m <= buf.shape[dim]:
        return buf
    shape = list(buf.shape)
    shape[dim] = max(2 * buf.shape[dim], n + m, 16)
    grown = buf.new_empty(shape)
    grown.narrow(dim, 0, n).copy_(buf.narrow(dim, 0, n))
    return grown


class DMACache(tuple):
    """The cache DynamicMaskAttention returns with use_cache=True: the (key, value) pair of the old
    tuple form (it unpacks and indexes the same), plus what lets a decode step skip the selection
    over all keys: the per-key bias (B, KVH, K), the padding mask (B, K), and the kept set of the
    last row (flexdma.perkey.decode.KeptSet): at most W key indices per (batch, kv head),
    `sel_idx` / `sel_valid` (B, KVH, W), with their scores."""

    def __new__(cls, bufs, length: int, kept: decode.KeptSet):
        self = super().__new__(cls, (bufs[0][:, :length], bufs[1][:, :length]))
        self._bufs, self.length, self.kept_set = bufs, length, kept
        return self

    @property
    def sel_idx(self) -> torch.Tensor:
        return self.kept_set.idx

    @property
    def sel_valid(self) -> torch.Tensor:
        return self.kept_set.valid

    @property
    def bias(self) -> torch.Tensor:
        return self._bufs[2][:, :, : self.length]

    @property
    def padding(self) -> torch.Tensor:
        return self._bufs[3][:, : self.length]

    @classmethod
    def from_full(cls, key, value, bias, padding, window: int) -> "DMACache":
        """After a forward over all K keys: the last row sees every key, so its kept set is the
        top-W eligible keys by (score desc, index asc)."""
        B, K = key.shape[:2]
        if padding is None:
            padding = torch.ones(B, K, dtype=torch.bool, device=key.device)
        scores = bias.detach()[:, :, 0, :].expand(B, -1, K).masked_fill(~padding[:, None, :], float("-inf"))
        return cls((key, value, bias[:, :, 0, :], padding), K, decode.last_row(scores, window))

    def step(self, key, value, bias, padding) -> "DMACache":
        """Append one key (key, value (B, 1, KVH, D), bias (B, KVH, 1, 1), padding (B,)) and update
        the kept set in O(W) (flexdma.perkey.decode.append): no selection over all keys."""
        return self.extend(key, value, bias, padding[:, None])[0]

    def grown(self, key, value, bias, padding) -> "DMACache":
        """The cache with T keys appended (key, value (B, T, KVH, D), bias (B, KVH, 1, T), padding
        (B, T)) and this cache's kept set, which the step that grows it updates in place to the
        newest row's (a step consumes the cache it extends, as the key / value buffers do)."""
        n = self.length
        bufs = (
            _append(self._bufs[0], n, key, 1),
            _append(self._bufs[1], n, value, 1),
            _append(self._bufs[2], n, bias[:, :, 0, :], 2),
            _append(self._bufs[3], n, padding, 1),
        )
        return DMACache(bufs, n + key.shape[1], self.kept_set)

    def extend(self, key, value, bias, padding):
        """Append T keys (key, value (B, T, KVH, D), bias (B, KVH, 1, T), padding (B, T)): the new
        cache, and the T new rows' kept sets over the old slots and the new keys
        (flexdma.perkey.decode.Rows), one O(W) update a key."""
        cache = self.grown(key, value, bias, padding)
        B, P = self.kept_set.idx.shape[:2]
        T = key.shape[1]
        s_new = bias[:, :, 0, :].detach().expand(B, P, T)
        return cache, decode.append_rows(self.kept_set, s_new, self.length, padding[:, None, :].expand(B, P, T))

    def attend(self, how, query, key, value, bias, padding, *, scale: float, backend: str = "auto"):
        """A cached step that perkey_cache.route sent to ONE_KERNEL or KEPT_SETS: the S new query
        rows (B, S, H, D) against this cache grown by their keys (key, value (B, S, KVH, D), bias
        (B, KVH, 1, S), padding (B, S)), each row over its own kept set. Returns (output (B, S, H,
        D), the grown cache); this cache's kept set becomes the newest row's."""
        if how == perkey_cache.ONE_KERNEL:
            # One call: the new key's rows, bias and padding written into the buffers by the op that
            # updates the kept set and attends (route sends no step autograd records here).
            n = self.length
            bufs = tuple(_room(buf, n, 1, dim) for buf, dim in zip(self._bufs, (1, 1, 2, 1)))
            out = decode.append_one(query, key, value, bias, padding, bufs, self.kept_set, n, scale)
            return out, DMACache(bufs, n + 1, self.kept_set)
        cache = self.grown(key, value, bias, padding)
        # The biases from the cache (not the kept set's detached scores): gradients reach them.
        out = perkey_cache.attend(
            how, query, cache[0], cache[1], cache.bias[:, :, None, :], kept=self.kept_set,
            scores=bias[:, :, 0, :].detach(), start=self.length, eligible=padding, scale=scale,
            dense=functools.partial(flash_dma_attention, is_causal=False, softmax_scale=scale, backend=backend),
        )  # fmt: skip
        return out, cache

    def kept(self):
        """(key, value (B, W, KVH, D), bias (B, KVH, 1, W), mask (B, KVH, 1, W)) of the kept set:
        a gather of W rows."""
        idx = self.kept_set.idx
        B, W = idx.shape[0], idx.shape[-1]
        rows = idx.transpose(1, 2)[..., None].expand(B, W, idx.shape[1], self[0].shape[-1])
        return (
            self[0].gather(1, rows),
            self[1].gather(1, rows),
            self.bias.gather(-1, idx)[:, :, None, :],
            self.kept_set.valid[:, :, None, :],
        )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, Hugging Face Llama convention; x (B, S, H, D), cos/sin (B|1, S, D) or (S, D)."""
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    return x * cos + rotate_half(x) * sin


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float32
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of shape positions.shape + (head_dim,) for apply_rotary."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class DynamicMaskAttention(nn.Module):
    """Doge-style self-attention: GQA projections plus a learned per-key importance (dt_proj, A)
    that picks the `keep_window_size` keys each query attends to and is added to the logits.

    forward(hidden_states (B, S, hidden_size), position_embeddings=(cos, sin) or None,
    attention_mask=(B, S_total) bool padding mask (True = real token) or None,
    past_key_value=(k, v) each (B, S_past, num_kv_heads, head_dim) or None, use_cache=False)
    returns the output (B, S, hidden_size), and with use_cache=True also the updated (k, v).
    With a cache, S_total = S_past + S and the new queries attend causally (bottom-right) to all keys.

    With `cp_group` (a ProcessGroup or 1-D DeviceMesh; context parallel) hidden_states are this
    rank's tokens of a sequence sharded in the head-tail layout (flexdma.distributed.shard_sequence),
    position_embeddings those of their global positions, attention_mask a (B, S_local) padding mask;
    the attention runs over the whole sequence (flexdma.distributed.context_parallel_attention).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        *,
        keep_window_size: int = 2048,
        bias: bool = False,
        is_causal: bool = True,
        backend: str = "auto",
        cp_group=None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")
            head_dim = hidden_size // num_heads
        fk = {"device": device, "dtype": dtype}
        self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim = (
            hidden_size,
            num_heads,
            num_kv_heads,
            head_dim,
        )
        self.keep_window_size = perkey.check_window(keep_window_size)
        self.is_causal, self.backend = is_causal, backend
        # Context parallel: the layer's input is this rank's tokens of a sequence sharded over the
        # group (flexdma.distributed.shard_sequence), and attention runs over the whole sequence.
        self.cp_group = cp_group
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias, **fk)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, **fk)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, **fk)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias, **fk)
        self.dt_proj = nn.Parameter(torch.empty(num_kv_heads, num_kv_heads * head_dim, **fk))
        # A = 0 starts as plain attention over the first keys; training grows the importance scores.
        self.A = nn.Parameter(torch.zeros(num_kv_heads, **fk))
        nn.init.kaiming_uniform_(self.dt_proj, a=math.sqrt(5))

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
        attention_mask: Optional[torch.Tensor] = None,
        past_key_value: Optional[KVCache] = None,
        use_cache: bool = False,
        *,
        cu_seqlens: Optional[torch.Tensor] = None,
        max_seqlen: Optional[int] = None,
    ):
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states must be (batch, seqlen, {self.hidden_size}), got {tuple(hidden_states.shape)}"
            )
        B, S, _ = hidden_states.shape
        if self.cp_group is not None:
            return self._context_parallel(
                hidden_states, position_embeddings, attention_mask, past_key_value, use_cache, cu_seqlens
            )
        if cu_seqlens is not None:
            return self._packed(
                hidden_states, position_embeddings, attention_mask, past_key_value, use_cache, cu_seqlens, max_seqlen
            )
        q, k, v = self._qkv(hidden_states, position_embeddings)
        total = S + (0 if past_key_value is None else past_key_value[0].shape[1])
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool or attention_mask.dim() != 2 or attention_mask.shape != (B, total):
                raise ValueError(
                    f"attention_mask must be a bool (batch, {total}) padding mask, got "
                    f"{attention_mask.dtype} {tuple(attention_mask.shape)}"
                )
        kept = past_key_value.kept_set if isinstance(past_key_value, DMACache) else None
        # The bias (dynamic_bias of v, dt_proj and A) records a backward where one of them does.
        tracked = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, self.dt_proj, self.A))
        how = perkey_cache.route(q, k, kept, self.keep_window_size, grad=tracked, gathers_bias=True)
        if how != perkey_cache.SELECTION:
            # Decoding (or a few tokens a step): the kept set is updated with each new key and each
            # row attends to its own, O(W) a token -- the earlier columns of attention_mask must be
            # the ones the cache was built with.
            pad = (
                torch.ones(B, S, dtype=torch.bool, device=q.device)
                if attention_mask is None
                else attention_mask[:, -S:]
            )
            bias = dynamic_bias(v, self.dt_proj, self.A).to(q.dtype)
            out, cache = past_key_value.attend(
                how, q, k, v, bias, pad, scale=1.0 / math.sqrt(self.head_dim), backend=self.backend
            )
            return self.o_proj(out.reshape(B, S, self.num_heads * self.head_dim)), cache
        if past_key_value is not None:
            pk, pv = past_key_value
            k, v = torch.cat((pk, k), dim=1), torch.cat((pv, v), dim=1)
        bias = dynamic_bias(v, self.dt_proj, self.A).to(q.dtype)
        pad = None if attention_mask is None else attention_mask[:, None, None, :]
        out = flash_dma_attention(
            q, k, v, pad, bias, is_causal=self.is_causal, backend=self.backend, keep_window_size=self.keep_window_size
        )
        out = self.o_proj(out.reshape(B, S, self.num_heads * self.head_dim))
        if not use_cache:
            return out
        return out, DMACache.from_full(k, v, bias, attention_mask, self.keep_window_size)

    def _qkv(self, hidden_states, position_embeddings):
        """q (B, S, H, D), k, v (B, S, KVH, D) of hidden_states, rotary applied where given."""
        B, S, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, S, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(B, S, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(B, S, self.num_kv_heads, self.head_dim)
        if position_embeddings is not None:
            cos, sin = position_embeddings
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, k, v

    def _context_parallel(self, hidden_states, position_embeddings, attention_mask, past_key_value, use_cache, cu):
        """This rank's tokens (B, S_local, hidden) of a sequence sharded over `cp_group` in the
        head-tail layout; position_embeddings are the caller's, for the tokens' global positions;
        attention_mask a (B, S_local) bool padding mask of the local tokens."""
        if past_key_value is not None or use_cache or cu is not None:
            raise ValueError(
                "a context-parallel layer (cp_group set) takes no past_key_value, use_cache or cu_seqlens: "
                "it runs training / prefill calls over a sharded sequence"
            )
        B, S, _ = hidden_states.shape
        q, k, v = self._qkv(hidden_states, position_embeddings)
        bias = dynamic_bias(v, self.dt_proj, self.A).to(q.dtype)
        out = distributed.context_parallel_attention(
            q,
            k,
            v,
            bias,
            keep_window_size=self.keep_window_size,
            group=self.cp_group,
            attn_mask=attention_mask,
            is_causal=self.is_causal,
        )
        return self.o_proj(out.reshape(B, S, self.num_heads * self.head_dim))

    def _packed(self, hidden_states, position_embeddings, attention_mask, past_key_value, use_cache, cu, max_seqlen):
        """Packed sequences (hidden_states (1, total, hidden_size), int32 offsets cu (batch + 1,), the
        longest sequence max_seqlen): each attends and selects within itself
        (flexdma.flash_dma_attention_varlen); position_embeddings are the caller's, per token."""
        if hidden_states.shape[0] != 1:
            raise ValueError(
                f"with cu_seqlens, hidden_states must be one packed row (1, total, hidden), got {tuple(hidden_states.shape)}"
            )
        if attention_mask is not None or past_key_value is not None or use_cache:
            raise ValueError("cu_seqlens (packed sequences) takes no attention_mask, past_key_value or use_cache")
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
            raise TypeError(f"max_seqlen must be a Python int with cu_seqlens, got {max_seqlen!r}")
        S = hidden_states.shape[1]
        q, k, v = self._qkv(hidden_states, position_embeddings)
        bias = dynamic_bias(v, self.dt_proj, self.A).to(q.dtype)[0, :, 0, :]  # (KVH, total)
        out = flash_dma_attention_varlen(
            q[0],
            k[0],
            v[0],
            cu,
            cu,
            max_seqlen,
            max_seqlen,
            bias,
            is_causal=self.is_causal,
            keep_window_size=self.keep_window_size,
            backend=self.backend,
        )
        return self.o_proj(out.reshape(1, S, self.num_heads * self.head_dim))


class MultiheadDynamicMaskAttention(nn.Module):
    """Drop-in for torch.nn.MultiheadAttention (same parameters and call), attending to the
    `keep_window_size` most important keys of each query.

    Supported subset: dropout=0, kdim=vdim=None, need_weights=False, bool masks. With A = 0 (the
    initial value) and keep_window_size >= the key length it computes exactly what
    torch.nn.MultiheadAttention computes with the same weights. Returns (output, None).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim=None,
        vdim=None,
        batch_first: bool = False,
        device=None,
        dtype=None,
        *,
        keep_window_size: int = 2048,
        backend: str = "auto",
    ):
        super().__init__()
        if dropout != 0.0:
            raise ValueError(f"dropout must be 0, got {dropout}")
        if add_bias_kv or add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn are not supported")
        if (kdim is not None and kdim != embed_dim) or (vdim is not None and vdim != embed_dim):
            raise ValueError("kdim and vdim must be None (or equal to embed_dim)")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        fk = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.batch_first, self.backend = batch_first, backend
        self.keep_window_size = perkey.check_window(keep_window_size)
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **fk))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim, **fk)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **fk)
        self.dt_proj = nn.Parameter(torch.empty(num_heads, embed_dim, **fk))
        self.A = nn.Parameter(torch.zeros(num_heads, **fk))
        nn.init.xavier_uniform_(self.in_proj_weight)
        if bias:
            nn.init.zeros_(self.out_proj.bias)
        nn.init.kaiming_uniform_(self.dt_proj, a=math.sqrt(5))

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: Optional[torch.Tensor] = None,
        need_weights: bool = False,
        attn_mask: Optional[torch.Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ):
        if need_weights:
            raise ValueError("need_weights=True is not supported: the attention weights are never materialized")
        if query.dim() != 3:
            raise ValueError(f"query must be 3-D, got shape {tuple(query.shape)}")
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        B, L, E = query.shape
        S = key.shape[1]
        H, D = self.num_heads, self.head_dim
        w, b = (
            self.in_proj_weight.chunk(3),
            (self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None,) * 3),
        )
        q = nn.functional.linear(query, w[0], b[0]).view(B, L, H, D)
        k = nn.functional.linear(key, w[1], b[1]).view(B, S, H, D)
        v = nn.functional.linear(value, w[2], b[2]).view(B, S, H, D)

        allowed = None
        if key_padding_mask is not None:
            if key_padding_mask.dtype != torch.bool or key_padding_mask.shape != (B, S):
                raise ValueError(
                    f"key_padding_mask must be a bool ({B}, {S}) tensor, got "
                    f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
                )
            allowed = (~key_padding_mask)[:, None, None, :]
        if attn_mask is not None:
            if attn_mask.dtype != torch.bool:
                raise TypeError(f"attn_mask must be a bool tensor (True = not allowed), got {attn_mask.dtype}")
            if attn_mask.shape == (L, S):
                am = (~attn_mask)[None, None]
            elif attn_mask.shape == (B * H, L, S):
                am = (~attn_mask).view(B, H, L, S)
            else:
                raise ValueError(f"attn_mask must be ({L}, {S}) or ({B * H}, {L}, {S}), got {tuple(attn_mask.shape)}")
            allowed = am if allowed is None else allowed & am
        out = dynamic_mask_attention(
            q,
            k,
            v,
            self.dt_proj,
            self.A,
            keep_window_size=self.keep_window_size,
            is_causal=is_causal,
            attn_mask=allowed,
            backend=self.backend,
        )
        out = self.out_proj(out.reshape(B, L, E))
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, None
