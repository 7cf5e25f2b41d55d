"""Context-parallel per-key attention: each rank's rows attend over the whole sequence, and what a
rank fetches from the others is at most W key rows per selection plane and chunk, whatever L is.

Why that is exact (docs/context_parallel.md): row i keeps the W best keys it may see by
(score desc, index asc). For a chunk of rows starting at a, every row sees all allowed keys before
a, so a key before a that some row keeps is among the W best of that prefix. Row i's kept set is
then the W best of (the prefix's W best, in index order) followed by the chunk's own keys up to
i: an ordinary causal per-key call with the candidates prepended, bottom-right aligned.

A call, per rank:
1. the ranks agree on the call's shapes and arguments (one small all-gather; bad input raises
   on every rank before data moves);
2. each rank ranks its two chunks' keys by score and all-gathers the W best of each
   (score, index) per selection plane: 2P lists of at most W entries, not L scores;
3. every rank merges those lists into each chunk's candidates (the W best of the lists of the
   chunks before it; every rank computes every chunk's, so an owner knows what to send without
   being asked);
4. one all-to-all moves the candidates' K, V and bias rows from their owners (a rank's own
   candidates are gathered locally);
5. one per-key call per local chunk over its candidates and its own keys.
Autograd runs the local calls' backward and sends the candidates' gradient rows back to their
owners by the reverse all-to-all, where they are added (`_Assemble`). The selection has no
gradient.

Without causality every row sees every key, so every row keeps the same W keys: the W best of
all 2P lists, fetched and attended by one call over the local rows.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional

import torch
import torch.distributed as dist

from .. import _checks
from ..api import flash_dma_attention
from ..perkey import contract as perkey
from ..perkey.decode import order_key
from . import _group
from .layout import chunk_of, owner_of

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_NEG_INF = float("-inf")
# What every rank of a call must agree on (one int64 each, floats by their bits); each entry
# point adds its own fields.
SIGNATURE = (
    "batch",
    "heads",
    "kv_heads",
    "head_dim",
    "dtype",
    "bias_batch",
    "bias_heads",
    "attn_mask",
    "keep_window_size",
    "softmax_scale",
    "softcap",
)


def signature(query, key, bias, attn_mask, window: int, scale: float, softcap: float) -> dict:
    """The SIGNATURE fields of a checked call."""
    return dict(
        batch=query.shape[0],
        heads=query.shape[2],
        kv_heads=key.shape[2],
        head_dim=query.shape[3],
        dtype=_DTYPE_CODES[query.dtype],
        bias_batch=bias.shape[0],
        bias_heads=bias.shape[1],
        attn_mask=attn_mask is not None,
        keep_window_size=window,
        softmax_scale=_group.float_bits(scale),
        softcap=_group.float_bits(softcap),
    )


# ---------------------------------------------------------------------------------------------
# Ranking: the W best keys by (score desc, index asc), the order the per-key selection uses.


def _order_key(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One int64 per entry that orders like (score desc, index asc): the kept sets' order of the
    float32 score (perkey.decode.order_key) in the high word, the complement of the index
    (< 2^32) in the low word. Unique per key, so torch.topk's unspecified tie order cannot matter."""
    return order_key(scores).to(torch.int64) * (1 << 32) + ((1 << 32) - 1 - index)


def _best(scores: torch.Tensor, index: torch.Tensor, k: int):
    """The k best entries along the last dim by (score desc, index asc), returned in index order.
    `index` ascends along the last dim. float64 scores rank in float64 (a stable sort keeps equal
    scores in index order); others rank as float32, which holds bf16 / fp16 exactly."""
    if scores.dtype == torch.float64:
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    else:
        order = torch.topk(_order_key(scores, index), k, dim=-1, sorted=False).indices
    best_index, perm = index.gather(-1, order).sort(dim=-1)
    return scores.gather(-1, order.gather(-1, perm)), best_index


# ---------------------------------------------------------------------------------------------
# The exchange: which rows move where, and the autograd function that moves them.


class _Plan(NamedTuple):
    group: dist.ProcessGroup
    send_counts: List[int]
    recv_counts: List[int]
    send_kv: torch.Tensor  # rows of key.view(-1, D) this rank sends, grouped by destination
    send_bias: torch.Tensor  # the matching entries of the flattened per-key bias
    recv_pos: torch.Tensor  # where the received rows go in the candidate grid, grouped by source
    local_kv: torch.Tensor  # this rank's own candidates: rows of key.view(-1, D) ...
    local_bias: torch.Tensor
    local_pos: torch.Tensor  # ... and their places in the grid
    grid: tuple  # (targets, batch, fetch heads, width): the candidate grid's shape
    n_cand: List[int]  # candidates of each local target (a prefix of its grid row)
    own_rows: List[Optional[slice]]  # each target's own chunk of the local keys (None: candidates only)
    bias_shape: tuple  # (Bb, Hb, L): the per-key bias's planes


def _sum_heads(g: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """Sum a gradient over `dim` down to `heads` entries: the adjoint of a broadcast (heads == 1)
    or of repeating each entry for the query heads of its group."""
    n = g.shape[dim]
    if n == heads:
        return g
    return g.unflatten(dim, (heads, n // heads)).sum(dim + 1)


class _Assemble(torch.autograd.Function):
    """Each local target's keys, values and per-key bias: its candidates' rows, fetched from their
    owners (one all-to-all), followed (causal) by its own chunk's rows. Returns (k, v, bias) per
    target: (B, n + C, fetch heads, D) twice and (B, fetch heads, n + C).

    Backward: a key's gradient is the part from its own chunk's call plus the parts from the calls
    that fetched it (sent back by the reverse all-to-all, in the kernels' dtype, which is what
    they were computed in), written straight into the local gradient: no full-size temporaries
    beside it."""

    @staticmethod
    def forward(ctx, key, value, bias_flat, plan: _Plan):
        D = key.shape[-1]
        k2, v2 = key.reshape(-1, D), value.reshape(-1, D)

        def rows(kv, b):
            return torch.cat([k2[kv], v2[kv], bias_flat[b].unsqueeze(1)], dim=1)

        recv = _group.all_to_all_rows(
            plan.group, rows(plan.send_kv, plan.send_bias), plan.send_counts, plan.recv_counts, "forward"
        )
        grid = key.new_zeros((math.prod(plan.grid), 2 * D + 1))
        grid[plan.recv_pos] = recv
        grid[plan.local_pos] = rows(plan.local_kv, plan.local_bias)
        grid = grid.view(*plan.grid, 2 * D + 1)
        B, Hk = plan.grid[1], plan.grid[2]
        Bb, Hb, L = plan.bias_shape
        bias = bias_flat.view(Bb, Hb, L)
        out = []
        for t, (n, own) in enumerate(zip(plan.n_cand, plan.own_rows)):
            k, v, b = (
                grid[t, :, :, :n, :D].transpose(1, 2),
                grid[t, :, :, :n, D : 2 * D].transpose(1, 2),
                grid[t, :, :, :n, 2 * D],
            )
            if own is not None:
                k_own, v_own = key[:, own], value[:, own]
                if Hk != key.shape[2]:  # per-query-head candidates: each query head its own keys
                    k_own, v_own = (x.repeat_interleave(Hk // key.shape[2], dim=2) for x in (k_own, v_own))
                k, v = torch.cat([k, k_own], dim=1), torch.cat([v, v_own], dim=1)
                b = torch.cat([b, bias[:, :, own].expand(B, Hk, -1)], dim=-1)
            out += [k.contiguous(), v.contiguous(), b.contiguous()]
        ctx.plan, ctx.key_shape, ctx.dtype = plan, key.shape, key.dtype
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        plan = ctx.plan
        B, L, KVH, D = ctx.key_shape
        Bb, Hb, _ = plan.bias_shape
        acc = torch.float64 if ctx.dtype == torch.float64 else torch.float32
        need_k, need_v, need_b, _ = ctx.needs_input_grad
        # The candidates' gradient rows, in the grid's layout, for their owners.
        grid = grads[0].new_zeros((*plan.grid, 2 * D + 1))
        own_k, own_v, own_b = [], [], []
        for t, (n, own) in enumerate(zip(plan.n_cand, plan.own_rows)):
            g_k, g_v, g_b = grads[3 * t : 3 * t + 3]
            grid[t, :, :, :n, :D] = g_k[:, :n].transpose(1, 2)
            grid[t, :, :, :n, D : 2 * D] = g_v[:, :n].transpose(1, 2)
            grid[t, :, :, :n, 2 * D] = g_b[:, :, :n]
            if own is not None:
                own_k.append(g_k[:, n:])
                own_v.append(g_v[:, n:])
                own_b.append(g_b[:, :, n:])
        grid = grid.view(-1, 2 * D + 1)
        back = _group.all_to_all_rows(plan.group, grid[plan.recv_pos], plan.recv_counts, plan.send_counts, "backward")
        rows = torch.cat([back, grid[plan.local_pos]])
        kv = torch.cat([plan.send_kv, plan.local_kv])

        def own_part(parts, dim, shape, fold):
            # A key's gradient from its own chunk's call, folded onto its shape (in float32 where
            # heads or batches are summed); then the parts from the calls that fetched it.
            if not parts:
                return rows.new_zeros(shape)
            g = torch.cat(parts, dim=dim)
            folded = fold(g.to(acc)) if tuple(g.shape) != tuple(shape) else g
            return folded.to(ctx.dtype)

        gk = gv = gb = None
        if need_k:
            gk = own_part(own_k, 1, (B, L, KVH, D), lambda g: _sum_heads(g, KVH, 2))
            gk.view(-1, D).index_add_(0, kv, rows[:, :D])
        if need_v:
            gv = own_part(own_v, 1, (B, L, KVH, D), lambda g: _sum_heads(g, KVH, 2))
            gv.view(-1, D).index_add_(0, kv, rows[:, D : 2 * D])
        if need_b:
            gb = own_part(own_b, 2, (Bb, Hb, L), lambda g: _sum_heads(_sum_heads(g, Bb, 0), Hb, 1))
            gb = gb.reshape(-1)
            gb.index_add_(0, torch.cat([plan.send_bias, plan.local_bias]), rows[:, 2 * D])
        return gk, gv, gb, None


# ---------------------------------------------------------------------------------------------
# The public function.


def _check_local(query, key, value, attn_bias, attn_mask, keep_window_size, is_causal, softmax_scale, softcap):
    _checks.check_qkv(query, key, value)
    window = perkey.check_window(keep_window_size)
    L = query.shape[1]
    if key.shape[1] != L:
        raise ValueError(
            f"key and value hold the same local tokens as query: key length {key.shape[1]} != query length {L}"
        )
    if L % 2:
        raise ValueError(
            f"the local length is {L}; a rank holds two equal chunks of the head-tail layout "
            "(flexdma.distributed.shard_sequence), so it must be even"
        )
    bias = _checks.check_bias(attn_bias, query, key)
    perkey.check_operands(None, bias, L)
    if attn_mask is not None:
        _checks.check_tensor("attn_mask", attn_mask, ndim=None)
        if attn_mask.dtype != torch.bool or attn_mask.shape != (query.shape[0], L):
            raise ValueError(
                f"attn_mask must be a bool (batch, local length) = {(query.shape[0], L)} key padding mask, got "
                f"{attn_mask.dtype} of shape {tuple(attn_mask.shape)}"
            )
        if attn_mask.device != query.device:
            raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {query.device}")
    scale, softcap = _checks.check_scalars(query.shape[-1], softmax_scale, softcap, is_causal)
    return bias, window, scale, softcap


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor,
    *,
    keep_window_size: int,
    group=None,
    attn_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    softmax_scale: Optional[float] = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The per-key call (`flash_dma_attention(..., keep_window_size=W)`) over a sequence sharded
    over the ranks of `group` in the head-tail layout (`shard_sequence`).

    Args:
        query: this rank's tokens, (batch, L_local, heads, head_dim); key, value:
            (batch, L_local, kv_heads, head_dim). L_local is even and the same on every rank.
        attn_bias: the local keys' per-key scores, ({1|B}, {1|KVH|H}, 1, L_local), query's dtype.
        keep_window_size: W, the keys each row keeps (the W best by attn_bias among those it sees,
            ties to the lower global index).
        group: None (the default group), a ProcessGroup or a 1-D DeviceMesh; its backend must
            carry the tensors' device (NCCL for CUDA, gloo for CPU).
        attn_mask: optional bool (batch, L_local) key padding mask, True = a real token.
        is_causal, softmax_scale, softcap: as in `flash_dma_attention`.

    Returns this rank's output (batch, L_local, heads, head_dim), equal to the rows of the
    one-process call over the whole sequence; autograd gives the local gradients of query, key,
    value and attn_bias. Per call, a rank receives at most 2 W rows of K, V and bias per (batch,
    kv head) (per query head for a per-query-head bias) and the ranks' top-W lists; nothing of
    size L. Every rank must make the call (it is a collective), with the same shapes and arguments:
    a mismatch, or bad input on any rank, raises on every rank before data moves.
    """
    pg = _group.resolve(group)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    fields = dict.fromkeys(SIGNATURE + ("local_length", "is_causal", "requires_grad"), 0)
    device = query.device if isinstance(query, torch.Tensor) else torch.device("cpu")
    with _group.agreement(pg, _group.comm_device(pg, device), fields):
        bias, W, scale, softcap = _check_local(
            query, key, value, attn_bias, attn_mask, keep_window_size, is_causal, softmax_scale, softcap
        )
        _group.check_device(pg, device, "query")
        B, L, H, D = query.shape
        # Whether the exchange's backward (a collective) runs: only key, value and bias reach it.
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (key, value, bias))
        fields.update(
            signature(query, key, bias, attn_mask, W, scale, softcap),
            local_length=L,
            is_causal=is_causal,
            requires_grad=needs_grad,
        )
    _group.count_call()

    C = L // 2
    if C == 0:
        return flash_dma_attention(
            query, key, value, None, bias, is_causal=is_causal, softmax_scale=scale, softcap=softcap, keep_window_size=W
        )
    KVH = key.shape[2]
    Bb, Hb = bias.shape[0], bias.shape[1]
    # Candidates are fetched per (batch, fetch head): per kv head for a bias shared by a kv head's
    # query heads (a bias of one head is the same list for every kv head), per query head else.
    Hk = H if Hb == H and H != KVH else KVH

    # 1. Each local chunk's W best keys by score (masked keys score -inf), as (score, global index).
    scores = bias[:, :, 0, :].detach()
    scores = scores.to(torch.float64 if scores.dtype == torch.float64 else torch.float32)
    if attn_mask is not None:
        scores = torch.where(attn_mask[:, None, :], scores, _NEG_INF)
    Bs = scores.shape[0]
    first, second = chunk_of(rank, world)
    Wc = min(W, C)
    # Each chunk ranked on its own positions (the same order as the global ones), then moved to
    # the chunk's place. Index tensors are made on the device: a host list copied to the GPU
    # would wait for the stream's queued work first.
    pos = torch.arange(C, device=device).expand(2, Bs, Hb, C)
    top_s, top_i = _best(scores.view(Bs, Hb, 2, C).permute(2, 0, 1, 3), pos, Wc)
    top_i[0] += first * C
    top_i[1] += second * C

    # 2. Every chunk's list, from every rank: one all-gather of (scores as float64, indices).
    c = top_i.numel()
    payload = torch.cat([top_s.double().reshape(-1).view(torch.int64), top_i.reshape(-1)])
    gathered = _group.all_gather(pg, payload, "forward").view(world, 2, c)
    lists_s = gathered[:, 0].view(torch.float64).to(top_s.dtype).view(world, 2, Bs, Hb, Wc)
    lists_i = gathered[:, 1].view(world, 2, Bs, Hb, Wc)
    G = 2 * world
    # Chunk g is rank g's first (g < P), rank 2P-1-g's second (g >= P): chunk_of, as two slices.
    list_s = torch.cat([lists_s[:, 0], lists_s[:, 1].flip(0)])
    list_i = torch.cat([lists_i[:, 0], lists_i[:, 1].flip(0)])

    # 3. Candidates of every target: causal, each chunk's (the W best of the chunks before it);
    #    otherwise one target, the W best of all. Entries of later chunks rank below every entry
    #    of the earlier ones (-inf score, higher index), so a target's own candidates come first.
    flat_s = list_s.permute(1, 2, 0, 3).reshape(Bs, Hb, G * Wc)
    flat_i = list_i.permute(1, 2, 0, 3).reshape(Bs, Hb, G * Wc)
    if is_causal:
        entry_chunk = torch.arange(G, device=device).repeat_interleave(Wc)
        seen = entry_chunk[None, :] < torch.arange(G, device=device)[:, None]  # (target, entry)
        cand_s = torch.where(seen[:, None, None, :], flat_s, _NEG_INF)
        cand_i = flat_i.expand(G, Bs, Hb, G * Wc)
        n_cand = [min(W, g * Wc) for g in range(G)]
        targets_of = [chunk_of(r, world) for r in range(world)]
    else:
        cand_s, cand_i = flat_s[None], flat_i[None]
        n_cand = [min(W, G * Wc)]
        targets_of = [(0,)] * world
    width = max(n_cand)
    cand_s, cand_i = _best(cand_s, cand_i, width)
    # To fetch planes (batch, fetch head): a plane shared by batches or heads serves each of them.
    cand_s = cand_s.expand(-1, B, Hk, -1)
    cand_i = cand_i.expand(-1, B, Hk, -1)

    # 4. The exchange plan: every rank's targets' entries, their owners and rows there.
    T = len(targets_of[0])
    ranks = torch.arange(world, device=device)
    if is_causal:
        targets = torch.stack([ranks, 2 * world - 1 - ranks], dim=1)  # (world, T): chunk_of
        n_target = torch.clamp(targets * Wc, max=W)
    else:
        targets = torch.zeros(world, 1, dtype=torch.long, device=device)
        n_target = torch.full_like(targets, n_cand[0])
    wanted = cand_i[targets]  # (world, T, B, Hk, width)
    valid = torch.arange(width, device=device) < n_target[:, :, None, None, None]
    owner, slot = owner_of(wanted // C, world)
    local_row = slot * C + wanted % C
    N = T * B * Hk * width
    owner, valid, local_row = (
        owner.reshape(world, N),
        valid.expand_as(wanted).reshape(world, N),
        local_row.reshape(world, N),
    )
    grid_pos = torch.arange(N, device=device)
    b_of = grid_pos // (Hk * width) % B
    h_of = grid_pos // width % Hk
    kvh_of = h_of if Hk == KVH else h_of // (H // KVH)
    bias_b = b_of if Bb > 1 else torch.zeros_like(b_of)
    bias_h = h_of if Hb > 1 else torch.zeros_like(h_of)

    def rows_at(pos, lrow):
        return (b_of[pos] * L + lrow) * KVH + kvh_of[pos], (bias_b[pos] * Hb + bias_h[pos]) * L + lrow

    # What moves: every rank's wanted entries it owns go to their rank (grouped by destination),
    # the entries this rank wants from others arrive grouped by source. Their counts are the one
    # host read of the exchange (the all-to-all takes its split sizes on the host).
    sending = valid & (owner == rank)
    sending[rank] = False
    mine = owner[rank]
    remote = valid[rank] & (mine != rank)
    local = valid[rank] & (mine == rank)
    recv_from = ((mine[None, :] == ranks[:, None]) & remote[None, :]).sum(1)
    counts = torch.cat([sending.sum(1), recv_from, local.sum().view(1)]).tolist()
    send_counts, recv_counts = counts[:world], counts[world : 2 * world]
    flat = torch.nonzero_static(sending.view(-1), size=sum(send_counts)).squeeze(1)
    dest, pos = flat // N, flat % N
    send_kv, send_bias = rows_at(pos, local_row[dest, pos])
    recv_pos = torch.nonzero_static(remote, size=sum(recv_counts)).squeeze(1)
    recv_pos = recv_pos[torch.sort(mine[recv_pos], stable=True).indices]
    local_pos = torch.nonzero_static(local, size=counts[-1]).squeeze(1)
    local_kv, local_bias = rows_at(local_pos, local_row[rank, local_pos])
    my_targets = targets_of[rank]
    plan = _Plan(
        pg,
        send_counts,
        recv_counts,
        send_kv,
        send_bias,
        recv_pos,
        local_kv,
        local_bias,
        local_pos,
        (T, B, Hk, width),
        [n_cand[g] for g in my_targets],
        [slice(t * C, (t + 1) * C) if is_causal else None for t in range(T)],
        (Bb, Hb, L),
    )
    parts = _Assemble.apply(key, value, bias[:, :, 0, :].reshape(-1), plan)

    # 5. One per-key call per target over its candidates (and, causal, its chunk's own keys).
    # The query's chunks as one split (its backward is one concatenation of their gradients).
    queries = query.split(C, dim=1) if is_causal else (query,)
    outs = []
    for t, target in enumerate(my_targets):
        k_all, v_all, b_all = parts[3 * t : 3 * t + 3]
        n = n_cand[target]
        # Keys that may not be kept score -inf: candidates that scored -inf (padding, or a -inf
        # bias) and the chunk's padding.
        keep = cand_s[target, :, :, :n] > _NEG_INF
        own = plan.own_rows[t]
        if own is not None:
            pad = torch.ones(B, 1, C, dtype=torch.bool, device=device) if attn_mask is None else attn_mask[:, None, own]
            keep = torch.cat([keep, pad.expand(B, Hk, C)], dim=-1)
        b_all = torch.where(keep, b_all, _NEG_INF)
        outs.append(
            flash_dma_attention(
                queries[t],
                k_all,
                v_all,
                None,
                b_all.unsqueeze(2),
                is_causal=is_causal,
                softmax_scale=scale,
                softcap=softcap,
                keep_window_size=W,
            )
        )
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
