"""The FlexAttention backend: the bias as a `score_mod`, the mask as a `BlockMask`.

- The bias is captured by the score_mod and indexed with its broadcast dims mapped to 0 (or to
  the kv head under GQA): no expanded copy.
- The BlockMask is built straight from the dense bool mask by one tile classification (per
  128x128 tile: nothing kept = skipped, all kept = full, else partial) instead of
  `create_block_mask`'s vmap over all Q*K: on CUDA a Triton kernel (`_block_tiles`) that reads
  each tile at most once and needs no host sync, elsewhere torch reductions. The mask_mod indexes
  the dense mask exactly, so eager and compiled runs agree. Bottom-right causal is folded into both.
- Every BlockMask tensor (the q side only when training) is computed before the compiled region;
  the compiled graph holds flex_attention alone. One compiled callable per (device, shape
  family, static config): new mask/bias contents with the same shapes reuse it.
- FlexAttention has no CPU backward: on CPU the forward runs through FlexAttention and the
  backward through the flexdma C++ op (same conventions, so the saved out/lse are valid for it).
"""

from __future__ import annotations

import functools
import inspect
import operator
from typing import Optional, Tuple

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention, noop_mask

from .._device import device_capability
from .._warnings import warn_once
from .naive import expand_heads

try:
    from . import _block_tiles
except ImportError:  # no triton: the torch tile reduction below
    _block_tiles = None

BLOCK = 128

__all__ = ["flex_dma_attention", "unsupported_reason", "block_mask_from_dense"]


# FlexAttention's kernel options, chosen per (compute capability, head dim, element size, training)
# from the fastest that fit in scripts/dev/flex_options.py (flexdma's own calls with a general
# mask and a bias that needs a gradient; its numbers are in benchmarks/perf-log.md, 'Issue 28: workspaces
# through the op layer, wide-head per-key tiles, FlexAttention options'):
# - None: FlexAttention's own defaults.
# - SMALL_BLOCKS: backward tiles that fit an H100's shared memory at every head dim up to 256 with a
#   captured bias that needs a gradient, and one pipeline stage in both directions (a stage count
#   that always fits; the default forward pipelining can be several times slower).
# - ONE_STAGE: the defaults with one forward pipeline stage.
# - KEY_TILE_64: the forward's key tile at 64, the rest of its config and the backward's at the
#   defaults. On sm_90 at head dim 64, 16-bit, FlexAttention's default forward tile is 128 x 128 on
#   four warps; with a score_mod that reads a captured bias its forward ran 24-26x slower than at
#   128 x 64 (scripts/dev/flex_window_probe.py; perf log, 'FlexAttention at head dim 64 on sm_90').
#   Prefixed fwd_ so the backward keeps its tiles; a call flex_decoding takes (fewer than 128 query
#   rows) already uses 64-key tiles on sm_90, so it is unchanged.
# Where nothing was measured a training call takes SMALL_BLOCKS (they always fit) and an inference
# call the defaults. Defaults whose forward raises a resource error are remembered and replaced; one
# whose backward did would raise, so only measured keys run a training call at the defaults.
# Keyed by element size, not dtype: bfloat16 was measured, float16 has the same tiles.
SMALL_BLOCKS = {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32, "num_stages": 1}
ONE_STAGE = {"fwd_num_stages": 1}
KEY_TILE_64 = {"fwd_BLOCK_N": 64}
MEASURED_OPTIONS: dict = {
    ((9, 0), 64, 2, False): KEY_TILE_64,
    ((9, 0), 64, 2, True): KEY_TILE_64,
    ((9, 0), 128, 2, False): None,
    ((9, 0), 128, 2, True): None,
    ((9, 0), 256, 2, False): None,
    ((9, 0), 256, 2, True): None,
}
# An inference call's choice with a block mask that skips most tiles, where it differs from the
# defaults (sparse_mask_kernel_options).
SPARSE_MEASURED_OPTIONS: dict = {((9, 0), 64, 2, False): KEY_TILE_64}
_DEFAULTS_FAILED: set = set()


def _options_key(device: torch.device, head_dim: int, dtype: torch.dtype, training: bool) -> tuple:
    return (device_capability(device), head_dim, dtype.itemsize, training)


def sparse_mask_kernel_options(
    device: torch.device, head_dim: int, dtype: torch.dtype, training: bool
) -> Optional[dict]:
    """kernel_options for a block mask that skips most tiles (documents of packed sequences, a
    sliding window), where the general masks MEASURED_OPTIONS comes from keep most. A forward at
    FlexAttention's defaults measured 6.5x faster than ONE_STAGE at head dim 64 with a document mask
    (H100, the varlen bench's 64K mix: 4.1 against 27.0 ms) and 1.3x at 128 (7.4 against 9.9), so an
    inference call takes the defaults (ONE_STAGE where they failed for resources), except on sm_90 at
    head dim 64, where the defaults' 128-key forward tile is the slow part (KEY_TILE_64; measured with
    a sliding window, the document mask not again). A training call keeps kernel_options."""
    if training or device.type != "cuda":
        return kernel_options(device, head_dim, dtype, training)
    key = _options_key(device, head_dim, dtype, training)
    if key in SPARSE_MEASURED_OPTIONS:
        return SPARSE_MEASURED_OPTIONS[key]
    return ONE_STAGE if key in _DEFAULTS_FAILED else None


def kernel_options(device: torch.device, head_dim: int, dtype: torch.dtype, training: bool) -> Optional[dict]:
    if device.type != "cuda":
        return None
    key = _options_key(device, head_dim, dtype, training)
    if key in MEASURED_OPTIONS:
        chosen = MEASURED_OPTIONS[key]
    else:
        chosen = SMALL_BLOCKS if training else None
    if chosen is None and key in _DEFAULTS_FAILED:
        return SMALL_BLOCKS if training else ONE_STAGE
    return chosen


def _is_resource_error(e: BaseException) -> bool:
    """Triton's OutOfResources (shared memory, registers), however Inductor wraps it."""
    while e is not None:
        if type(e).__name__ == "OutOfResources" or "OutOfResources" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def limits_reason(
    device: torch.device, dtype: torch.dtype, seqlen_q: int, seqlen_k: int, head_dim: int, mask_key_dim: Optional[int]
) -> Optional[str]:
    """Why FlexAttention cannot take a call of these shapes (None: it can); mask_key_dim: the
    attn_mask's key dim, None without a mask."""
    if device.type not in ("cuda", "cpu"):
        return f"FlexAttention does not run on {device.type}"
    if seqlen_q == 0 or seqlen_k == 0:
        return "empty sequence"
    d = head_dim
    if d < 16 or (d & (d - 1)) != 0:
        return f"head_dim {d} is not a power of two >= 16 (FlexAttention's kernels)"
    if device.type == "cpu" and dtype == torch.float16:
        return "float16 on CPU"
    if device.type == "cuda" and dtype == torch.float64:
        # Seen on an H100 (torch 2.11): Inductor's FlexAttention kernel fails to compile (its
        # accumulator's dtype assertion in tl.dot).
        return "float64 on CUDA"
    if device.type == "cuda" and seqlen_k < 16:
        # Seen on an H100 (torch 2.11): wrong results / dbias for 1..5 keys.
        return f"seqlen_k {seqlen_k} < 16 on CUDA"
    if mask_key_dim is not None and mask_key_dim == 1 and seqlen_k > 1:
        return "attn_mask broadcast over keys (key dim 1)"
    return None


def unsupported_reason(query, key, value, attn_mask, attn_bias, *, is_causal, softcap, requires_grad) -> Optional[str]:
    """limits_reason of these tensors (flexdma's dispatcher asks limits_reason with its call's shapes)."""
    return limits_reason(
        query.device,
        query.dtype,
        query.shape[1],
        key.shape[1],
        query.shape[-1],
        None if attn_mask is None else attn_mask.shape[-1],
    )


def _tile_any_all(mask: torch.Tensor, Q: int, K: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per (128 x 128) tile of a (b, h, q|1, K) bool mask: (any kept, all kept), (b, h, nq|1, nk).

    Two amax/amin passes on a uint8 view: the key-direction pass reads the mask once along its
    contiguous dim, the query-direction pass works on a 128x smaller tensor. Padding (tail tiles)
    counts as dropped; tail tiles are made partial by the caller anyway."""
    if mask.shape[-1] != K:  # broadcast over keys: count it per key like any other mask
        mask = mask.expand(*mask.shape[:3], K)
    b, h, mq, mk = mask.shape
    nk = -(-K // BLOCK)
    pad_k = nk * BLOCK - K
    m = mask.view(torch.uint8) if mask.is_contiguous() else mask.contiguous().view(torch.uint8)
    if pad_k:
        m = torch.nn.functional.pad(m, (0, pad_k))
    m = m.view(b, h, mq, nk, BLOCK)
    row_any, row_all = m.amax(-1), m.amin(-1)  # (b, h, q|1, nk)
    if mq == 1:
        return row_any.bool(), row_all.bool()
    nq = -(-Q // BLOCK)
    pad_q = nq * BLOCK - Q
    if pad_q:
        row_any = torch.nn.functional.pad(row_any, (0, 0, 0, pad_q))
        row_all = torch.nn.functional.pad(row_all, (0, 0, 0, pad_q))
    return (row_any.view(b, h, nq, BLOCK, nk).amax(3).bool(), row_all.view(b, h, nq, BLOCK, nk).amin(3).bool())


def _causal_tiles(Q: int, K: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(nq, nk) bool: tiles with any / all entries visible under bottom-right causal."""
    nq, nk = -(-Q // BLOCK), -(-K // BLOCK)
    off = K - Q
    q0 = torch.arange(nq, device=device)[:, None] * BLOCK
    q1 = torch.clamp(q0 + BLOCK - 1, max=Q - 1)
    k0 = torch.arange(nk, device=device)[None, :] * BLOCK
    k1 = torch.clamp(k0 + BLOCK - 1, max=K - 1)
    return k0 <= q1 + off, k1 <= q0 + off


def _recount_diagonal(mask: torch.Tensor, any_: torch.Tensor, Q: int, K: int) -> torch.Tensor:
    """any_ with the tiles the causal edge cuts recomputed as any(mask & causal) over the tile.

    The edge of query tile i crosses keys (q0 + off, q1 + off], fewer than 128, so at most two
    key tiles: the one holding key q0 + off + 1 and the next. Those 2 * nq candidates are a
    count fixed by the shapes (no nonzero(), whose data-dependent size torch.compile cannot
    trace); the ones the edge does not cut change nothing. This gathers O(Q * 128) entries."""
    b, h, mq, mk = mask.shape
    nq, nk = -(-Q // BLOCK), -(-K // BLOCK)
    off = K - Q
    dev = mask.device
    qt = torch.arange(nq, device=dev)
    first = torch.div(qt * BLOCK + off + 1, BLOCK, rounding_mode="floor")
    ii, jj = torch.cat((qt, qt)), torch.cat((first, first + 1))  # (n,), n = 2 * nq
    q0, k0 = ii * BLOCK, jj * BLOCK
    q1, k1 = torch.clamp(q0 + BLOCK - 1, max=Q - 1), torch.clamp(k0 + BLOCK - 1, max=K - 1)
    cut = (jj >= 0) & (jj < nk) & (k0 <= q1 + off) & (k1 > q0 + off)  # (n,)
    jj = jj.clamp(0, nk - 1)
    r = torch.arange(BLOCK, device=dev)
    rows = ii[:, None] * BLOCK + r  # (n, 128) query index
    cols = jj[:, None] * BLOCK + r  # (n, 128) key index
    keep = (cols[:, None, :] <= rows[:, :, None] + off) & (rows[:, :, None] < Q) & (cols[:, None, :] < K)
    rows_c, cols_c = rows.clamp(max=Q - 1), cols.clamp(max=K - 1)
    if mq == 1:
        m = mask[:, :, 0][:, :, cols_c][:, :, :, None, :]  # (b, h, n, 1, 128)
    else:
        m = mask[:, :, rows_c[:, :, None], cols_c[:, None, :]]  # (b, h, n, 128, 128)
    drop = cut & ~(m & keep).flatten(-2).any(-1)  # (b, h, n): cut tiles with nothing kept
    # Scattered by addition: an uncut candidate adds 0 wherever its clamped index points.
    dropped = torch.zeros(nq, nk, b * h, dtype=torch.int32, device=dev)
    dropped.index_put_((ii, jj), drop.reshape(b * h, -1).t().to(torch.int32), accumulate=True)
    return any_ & (dropped == 0).permute(2, 0, 1).reshape(b, h, nq, nk)


def _tile_flags_torch(mask: Optional[torch.Tensor], Q: int, K: int, is_causal: bool, device):
    """(partial, full) per tile with torch ops (CPU, or CUDA without triton); shapes broadcast
    to (b|1, h|1, nq, nk)."""
    nq, nk = -(-Q // BLOCK), -(-K // BLOCK)
    if mask is None:
        any_ = torch.ones(1, 1, nq, nk, dtype=torch.bool, device=device)
        full = any_.clone()
    else:
        any_, full = _tile_any_all(mask, Q, K)
    if is_causal:
        c_any, c_all = _causal_tiles(Q, K, device)
        any_ = any_ & c_any
        full = full & c_all
        if mask is not None:
            # Tiles the causal edge cuts: recount them exactly (mask & causal), or a tile whose
            # kept entries all lie above the diagonal would be visited for nothing.
            any_ = _recount_diagonal(mask, any_, Q, K)
    # Tiles cut by the sequence end stay partial: flex masks the tail, the mask_mod decides.
    q_in = torch.arange(nq, device=device)[:, None] < Q // BLOCK
    k_in = torch.arange(nk, device=device)[None, :] < K // BLOCK
    full = full & q_in & k_in
    return any_ & ~full, full


def _ordered(blocks: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(num, indices) of the True entries along the last dim, as BlockMask wants them."""
    num = blocks.sum(-1, dtype=torch.int32)
    # Stable sort puts the selected tiles first, in index order.
    idx = torch.sort((~blocks).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return num.contiguous(), idx.contiguous()


def _block_tensors(
    mask: Optional[torch.Tensor],
    Q: int,
    K: int,
    num_heads: int,
    is_causal: bool,
    need_q: bool = True,
    device=None,
    no_full: bool = False,
) -> tuple:
    """BlockMask tensors (kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx, full_q_num,
    full_q_idx) for a dense (b, h, q|1, K) bool mask (None = all True), causal folded in; the q
    side (only the backward reads it) is None unless need_q."""
    device = mask.device if mask is not None else (torch.device(device) if device is not None else torch.device("cpu"))
    triton_tiles = device.type == "cuda" and _block_tiles is not None
    if triton_tiles:
        partial, full = _block_tiles.tile_flags(mask, Q, K, is_causal, device=device, block=BLOCK)
    else:
        partial, full = _tile_flags_torch(mask, Q, K, is_causal, device)
    if no_full:
        # The mask_mod holds a keep rule the tiles cannot see (the per-key selection): every
        # visited tile must run it.
        partial, full = partial | full, torch.zeros_like(full)
    if mask is not None and mask.shape[1] not in (1, num_heads):
        g = num_heads // mask.shape[1]
        partial, full = partial.repeat_interleave(g, 1), full.repeat_interleave(g, 1)
    # On CUDA one small kernel per index pair instead of the sort and its casts.
    order = _block_tiles.ordered if triton_tiles else _ordered
    kv = order(partial) + order(full)
    if not need_q:
        return kv + (None, None, None, None)
    return kv + order(partial.transpose(-1, -2)) + order(full.transpose(-1, -2))


def _make_block_mask(tensors: tuple, Q: int, K: int, mask_mod) -> BlockMask:
    # The plain constructor (not from_kv_blocks, which would recompute the q side inside the
    # compiled graph). Keyword arguments only: used with torch 2.11 and 2.13.
    kv_num, kv_idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx = tensors
    return BlockMask(
        seq_lengths=(Q, K),
        kv_num_blocks=kv_num,
        kv_indices=kv_idx,
        full_kv_num_blocks=full_num,
        full_kv_indices=full_idx,
        q_num_blocks=q_num,
        q_indices=q_idx,
        full_q_num_blocks=full_q_num,
        full_q_indices=full_q_idx,
        BLOCK_SIZE=(BLOCK, BLOCK),
        mask_mod=mask_mod if mask_mod is not None else noop_mask,
    )


def block_mask_from_dense(
    mask: Optional[torch.Tensor], Q: int, K: int, num_heads: int, is_causal: bool, mask_mod, device=None
) -> BlockMask:
    """A BlockMask (kv and q side) for a dense (b, h, q|1, K) bool mask (None = all True, on
    `device`), causal folded in."""
    return _make_block_mask(_block_tensors(mask, Q, K, num_heads, is_causal, True, device), Q, K, mask_mod)


def _index_fn(t: torch.Tensor, num_heads: int):
    """Index a ({1|B}, {1|KVH|H}, {1|Q}, {1|K}) tensor by (b, h, q, k), broadcast dims mapped to 0."""
    B_, H_, Q_, K_ = t.shape
    g = num_heads // H_

    def at(b, h, q, k):
        return t[b if B_ > 1 else 0, (h // g if g > 1 else h) if H_ > 1 else 0, q if Q_ > 1 else 0, k if K_ > 1 else 0]

    return at


def _scored(score, softcap: float, bias_value):
    """A score_mod's score: softcap, then the bias (None: none)."""
    if softcap > 0:
        score = softcap * torch.tanh(score / softcap)
    if bias_value is not None:
        score = score + bias_value.to(score.dtype)
    # Inductor's CPU kernel takes the row max over non-NaN scores only, so a row of NaN scores (a
    # NaN query) would read as empty and give 0. As +inf it makes the row's output and LSE NaN, as
    # in the reference. Masked keys are set to -inf after this, so they stay masked.
    return torch.where(torch.isnan(score), float("inf"), score)


def _attend(
    q, k, v, mask, bias, block_mask_tensors, Q, K, is_causal, scale, softcap, kernel_options, need_lse, keep=None
):
    """Runs FlexAttention on (B, H, S, D) inputs; compiled as a whole so the closures built here
    are part of the graph (no guard on their identity, so no recompiles for new contents)."""
    H = q.shape[1]
    bias_at = _index_fn(bias, H) if bias is not None else None
    mask_at = _index_fn(mask, H) if mask is not None else None
    # keep = (key_rank (P1, P2, 1, K), row_thr (P1, P2, Q, 1)) of a per-key top-W selection.
    rank_at = _index_fn(keep[0], H) if keep is not None else None
    thr_at = _index_fn(keep[1], H) if keep is not None else None
    off = K - Q

    def score_mod(score, b, h, q_idx, kv_idx):
        return _scored(score, softcap, bias_at(b, h, q_idx, kv_idx) if bias_at is not None else None)

    # Bounds checks and clamps only where a tile can reach past the sequence end (Q, K are static
    # here). A clamped index hides the contiguity of kv_idx from Triton, so the mask loads lose
    # their vectorization: at 32K with a top-1024 mask the forward took 9.0 ms clamped vs 2.6 ms
    # unclamped (H100). Past the end, flex's kernels bound the indices themselves.
    q_tail, k_tail = Q % BLOCK != 0, K % BLOCK != 0

    def mask_mod(b, h, q_idx, kv_idx):
        conds = []
        if q_tail:
            conds.append(q_idx < Q)
        if k_tail:
            conds.append(kv_idx < K)
        if is_causal:
            conds.append(kv_idx <= q_idx + off)
        if mask_at is not None:
            qi = torch.clamp(q_idx, max=Q - 1) if q_tail else q_idx
            ki = torch.clamp(kv_idx, max=K - 1) if k_tail else kv_idx
            conds.append(mask_at(b, h, qi, ki))
        if rank_at is not None:
            qi = torch.clamp(q_idx, max=Q - 1) if q_tail else q_idx
            ki = torch.clamp(kv_idx, max=K - 1) if k_tail else kv_idx
            conds.append(rank_at(b, h, qi, ki) <= thr_at(b, h, qi, ki))
        return functools.reduce(operator.and_, conds) if conds else q_idx >= 0

    bm = _make_block_mask(block_mask_tensors, Q, K, mask_mod)
    gqa = q.shape[1] != k.shape[1]
    if need_lse:
        out, aux = flex_attention(
            q,
            k,
            v,
            score_mod=score_mod,
            block_mask=bm,
            scale=scale,
            enable_gqa=gqa,
            kernel_options=kernel_options,
            return_aux=AuxRequest(lse=True),
        )
        return out, aux.lse
    return flex_attention(
        q, k, v, score_mod=score_mod, block_mask=bm, scale=scale, enable_gqa=gqa, kernel_options=kernel_options
    ), None


_RECOMPILE_LIMIT = 128
# Where _attend takes its kernel options.
_OPTIONS_ARG = list(inspect.signature(_attend).parameters).index("kernel_options")


@functools.lru_cache(None)
def _compiled(fn=_attend):
    return torch.compile(fn, dynamic=False, fullgraph=True)


@functools.lru_cache(None)
def _traced_unfused(fn=_attend):
    # Inductor's CPU FlexAttention has no LSE and no backward, so those calls run flex_attention
    # unfused. Traced by dynamo with the eager backend, that is the computation flex_attention
    # runs when called eagerly, minus its warning that asks for torch.compile.
    return torch.compile(fn, backend="eager", dynamic=False, fullgraph=True)


def forward(q, k, v, mask, bias, is_causal, scale, softcap, training, need_lse=True, keep=None):
    """(out, lse or None) of one FlexAttention call on (B, Q, H, D) inputs: the dense path's mask, or
    the per-key path's selection as `keep` (key_rank, row_thr views the mask_mod reads)."""
    B, Q, H, D = q.shape
    K = k.shape[1]
    row_bias = None
    if bias is not None and bias.shape[3] == 1 and K > 1 and training and bias.requires_grad:
        # A bias constant along keys shifts a whole row's scores: the softmax (and out) ignore it,
        # only the LSE moves. Routing it through the score_mod makes FlexAttention sum dS over the
        # row in low precision, a cancellation that leaves O(1e-2) noise in dbias; adding it to
        # the LSE instead gives the exact gradient (d lse / d bias = 1 on rows with any key).
        # The LSE is then needed to tell rows with visible keys from empty ones.
        row_bias, bias, need_lse = bias, None, True
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    # Built outside the compiled region, so that the graph holds flex_attention alone; the q side
    # is only read by the backward.
    tensors = _block_tensors(mask, Q, K, H, is_causal, need_q=training, device=q.device, no_full=keep is not None)
    opts = kernel_options(q.device, D, q.dtype, training)
    # Inductor's CPU FlexAttention is inference-only and returns no LSE: on CPU, compile only
    # when no LSE is needed, else run FlexAttention unfused (_traced_unfused).
    compile_ok = q.device.type == "cuda" or not need_lse
    args = (qt, kt, vt, mask, bias, tensors, Q, K, is_causal, scale, softcap, opts, need_lse, keep)
    if torch.compiler.is_compiling():
        out, lse = _attend(*args)
    else:
        # One compiled graph per shape family, all of them code of _attend: dynamo's default
        # limit of 8 would make the 9th shape a hard error under fullgraph.
        run = _compiled() if compile_ok else _traced_unfused()
        with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
            try:
                out, lse = run(*args)
            except Exception as e:
                if opts is not None or not _is_resource_error(e):
                    raise
                # FlexAttention's defaults do not fit this device at this head dim / dtype: remembered,
                # and this call (and every later one) runs with options that do.
                _DEFAULTS_FAILED.add(_options_key(q.device, D, q.dtype, training))
                warn_once(f"FlexAttention's default kernel options do not fit this GPU at head_dim {D}, {q.dtype}")
                opts = kernel_options(q.device, D, q.dtype, training)
                out, lse = run(*args[:_OPTIONS_ARG], opts, *args[_OPTIONS_ARG + 1 :])
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = out.transpose(1, 2)
    if lse is None:
        return out, None
    lse = lse.to(acc)
    if row_bias is not None:
        out, lse = _add_row_bias(out, lse, row_bias, H)
    # FlexAttention leaves rows with nothing visible at out 0 / lse -inf, the flexdma convention.
    return out, lse


def _add_row_bias(out, lse, row_bias, H):
    """Apply a bias constant along keys, ({1|B}, {1|KVH|H}, {1|Q}, 1), after the attention: it
    moves the LSE of rows with visible keys; as in the reference a NaN / +inf one makes the row
    NaN and a -inf one empties it."""
    rb = expand_heads(row_bias, H)[..., 0].to(lse.dtype)  # ({1|B}, {1|H}, {1|Q})
    visible = lse != float("-inf")
    # Rows with nothing visible stay -inf; they contribute no gradient: torch.where.
    lse = torch.where(visible, lse + rb, lse)
    poisoned = (visible & (torch.isnan(rb) | (rb == float("inf")))).transpose(1, 2).unsqueeze(-1)
    emptied = (visible & (rb == float("-inf"))).transpose(1, 2).unsqueeze(-1)
    out = out.masked_fill(poisoned, float("nan")).masked_fill(emptied, 0.0)
    # Keep the bias in out's graph with a zero gradient, as in the reference, so that
    # autograd.grad(out, bias) works without allow_unused. A where, not a product with 0, so
    # that a NaN in the bias does not reach every row.
    zero = torch.where(torch.zeros((), dtype=torch.bool, device=out.device), row_bias.sum(), 0.0)
    return out + zero.to(out.dtype), lse


class _FlexFwdOpBwd(torch.autograd.Function):
    """CPU training: FlexAttention forward, the flexdma C++ op's backward."""

    @staticmethod
    def forward(ctx, q, k, v, mask, bias, is_causal, scale, softcap):
        # FlexAttention refuses CPU inputs that require grad, even in no-grad mode.
        out, lse = forward(
            q.detach(),
            k.detach(),
            v.detach(),
            mask,
            bias.detach() if bias is not None else None,
            is_causal,
            scale,
            softcap,
            training=False,
        )
        out = out.contiguous()
        ctx.save_for_backward(q, k, v, mask, bias, out, lse)
        ctx.cfg = (is_causal, scale, softcap)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, mask, bias, out, lse = ctx.saved_tensors
        is_causal, scale, softcap = ctx.cfg
        bias_grad = bias is not None and ctx.needs_input_grad[4]
        dq, dk, dv, dbias = torch.ops.flexdma.bwd(
            dout.contiguous(), q, k, v, mask, bias, out, lse, scale, is_causal, softcap, bias_grad, True
        )
        return dq, dk, dv, None, (dbias if bias_grad else None), None, None, None


def flex_dma_attention(
    query,
    key,
    value,
    attn_mask,
    attn_bias,
    *,
    is_causal: bool,
    softmax_scale: float,
    softcap: float,
    need_lse: bool = True,
    training: Optional[bool] = None,
):
    """(out (B, Q, H, D), lse (B, H, Q) or None if not need_lse) through FlexAttention; inputs
    validated by flexdma.api. training: a backward will follow (flexdma's dispatcher knows; None:
    worked out here)."""
    if training is None:
        training = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (query, key, value, attn_bias)
        )
    if training and query.device.type == "cpu":
        return _FlexFwdOpBwd.apply(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale, softcap)
    return forward(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale, softcap, training, need_lse)


# ---- packed sequences (flexdma.flash_dma_attention_varlen): one call with a document mask ----


def _documents(cu: torch.Tensor, total: int) -> torch.Tensor:
    """Each packed row's document index, from the offsets on their device."""
    return torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device), cu.diff(), output_size=total)


def _varlen_tiles(
    cu_q: torch.Tensor, cu_k: torch.Tensor, Tq: int, Tk: int, is_causal: bool, doc_q: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """(1, 1, NQ, NK) bool: the 128 x 128 tiles of the packed rows that some row's document (and
    causality) reaches, from the offsets on their device (no host read). A tile's rows span the
    documents d0..d1 of its first and last row, whose keys are one range [cu_k[d0], cu_k[d1 + 1]);
    under causality the last row of d1 ends it (an earlier document's keys all lie before d1's).
    A superset where a document sees fewer keys than it has: the mask_mod is exact. doc_q: the rows'
    documents (_documents), where the caller has them."""
    dev = cu_q.device
    NQ, NK = -(-Tq // BLOCK), -(-Tk // BLOCK)
    if NQ == 0 or NK == 0:
        return torch.zeros(1, 1, NQ, NK, dtype=torch.bool, device=dev)
    lq, lk = cu_q.diff(), cu_k.diff()
    if doc_q is None:
        doc_q = _documents(cu_q, Tq)
    r0 = torch.arange(NQ, device=dev) * BLOCK
    r1 = torch.clamp(r0 + BLOCK - 1, max=Tq - 1)
    d0, d1 = doc_q[r0], doc_q[r1]
    lo, hi = cu_k[d0].long(), cu_k[d1 + 1].long()
    if is_causal:
        # Keys of d1 its last row r1 sees: up to (r1 - q0) + (nk - nq) of the document's own.
        last = cu_k[d1] + (r1 - cu_q[d1]) + (lk[d1] - lq[d1]) + 1
        hi = torch.minimum(hi, torch.maximum(cu_k[d1].long(), last.long()))
    k0 = torch.arange(NK, device=dev) * BLOCK
    return ((k0[None, :] < hi[:, None]) & (k0[None, :] + BLOCK > lo[:, None]))[None, None]


def _attend_varlen(q, k, v, bias, tensors, cu_q, cu_k, doc_q, doc_k, Tq, Tk, is_causal, scale, softcap, opts):
    """FlexAttention over the packed rows as one sequence (q (1, H, Tq, D)), a key visible where it
    is in the query's document (and, causal, at or before the query's bottom-right aligned limit
    there); bias (heads, Tk) per key."""
    H = q.shape[1]
    g_bias = H // bias.shape[0] if bias is not None else 1
    lq, lk = cu_q.diff(), cu_k.diff()

    def score_mod(score, b, h, q_idx, kv_idx):
        return _scored(score, softcap, bias[h // g_bias, kv_idx] if bias is not None else None)

    def mask_mod(b, h, q_idx, kv_idx):
        qi, ki = torch.clamp(q_idx, max=Tq - 1), torch.clamp(kv_idx, max=Tk - 1)
        dq, dk = doc_q[qi], doc_k[ki]
        ok = (q_idx < Tq) & (kv_idx < Tk) & (dq == dk)
        if is_causal:
            ok = ok & (ki - cu_k[dk] <= qi - cu_q[dq] + lk[dq] - lq[dq])
        return ok

    bm = _make_block_mask(tensors, Tq, Tk, mask_mod)
    out, aux = flex_attention(
        q,
        k,
        v,
        score_mod=score_mod,
        block_mask=bm,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
        kernel_options=opts,
        return_aux=AuxRequest(lse=True),
    )
    return out, aux.lse


def _varlen_forward(q, k, v, cu_q, cu_k, bias, is_causal, scale, softcap, training):
    Tq, H, D = q.shape
    Tk = k.shape[0]
    doc_q, doc_k = _documents(cu_q, Tq), _documents(cu_k, Tk)
    partial = _varlen_tiles(cu_q, cu_k, Tq, Tk, is_causal, doc_q)
    kv = _ordered(partial) + _ordered(torch.zeros_like(partial))
    qs = _ordered(partial.transpose(-1, -2)) + _ordered(torch.zeros_like(partial.transpose(-1, -2)))
    tensors = kv + (qs if training else (None, None, None, None))
    dev = q.device
    qt, kt, vt = (t[None].transpose(1, 2) for t in (q, k, v))
    opts = sparse_mask_kernel_options(dev, D, q.dtype, training)
    args = (qt, kt, vt, bias, tensors, cu_q, cu_k, doc_q, doc_k, Tq, Tk, is_causal, scale, softcap, opts)
    if torch.compiler.is_compiling():
        out, lse = _attend_varlen(*args)
    else:
        # Inductor's CPU FlexAttention returns no LSE: unfused there (as _forward does).
        run = _compiled(_attend_varlen) if dev.type == "cuda" else _traced_unfused(_attend_varlen)
        with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
            out, lse = run(*args)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out[0].transpose(0, 1), lse[0].to(acc)


class _FlexVarlenFwdOpBwd(torch.autograd.Function):
    """CPU training of a packed call: FlexAttention forward, the flexdma bwd op's (packed form) backward."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, bias, is_causal, scale, softcap):
        out, lse = _varlen_forward(
            q.detach(), k.detach(), v.detach(), cu_q, cu_k, None if bias is None else bias.detach(), is_causal,
            scale, softcap, training=False,
        )  # fmt: skip
        out = out.contiguous()
        ctx.save_for_backward(q, k, v, cu_q, cu_k, bias, out, lse)
        ctx.cfg = (max_q, max_k, is_causal, scale, softcap)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, cu_q, cu_k, bias, out, lse = ctx.saved_tensors
        max_q, max_k, is_causal, scale, softcap = ctx.cfg
        want = bias is not None and ctx.needs_input_grad[7]
        dq, dk, dv, dbias = torch.ops.flexdma.bwd(
            dout.contiguous(), q, k, v, None, bias, out, lse, scale, is_causal, softcap, want, True, None, None,
            cu_q, cu_k, max_q, max_k,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None, (dbias if want else None), None, None, None


def flex_varlen_attention(
    query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, attn_bias, *, is_causal: bool,
    softmax_scale: float, softcap: float, training: Optional[bool] = None,
):  # fmt: skip
    """(out (Tq, H, D), lse (H, Tq)) of packed sequences through one FlexAttention call with a
    document mask built from the offsets on their device; inputs validated by flexdma.varlen."""
    if training is None:
        training = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (query, key, value, attn_bias)
        )
    if training and query.device.type == "cpu":
        return _FlexVarlenFwdOpBwd.apply(
            query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, attn_bias, is_causal,
            softmax_scale, softcap,
        )  # fmt: skip
    return _varlen_forward(
        query, key, value, cu_seqlens_q, cu_seqlens_k, attn_bias, is_causal, softmax_scale, softcap, training
    )
