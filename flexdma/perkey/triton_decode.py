"""One decode step of the per-key path on CUDA (one new token): the kept set's O(W) update, in place
and bit for bit flexdma.perkey.decode.append's, and the new row's attention over the updated set,
in one kernel launch (its counters: a zeroed buffer it leaves zero): no host synchronisation, so a
CUDA graph can hold it. Imports triton: loaded by decode.kernels, not by `import flexdma`. Under
torch.compile the launch is a triton_op (flexdma::decode_step), which Inductor inlines into its
graph: transformers' compiled generation replays the one kernel from its CUDA graph.

The grid is (batch x kv head, NSPLIT): a plane's W slots are split over NSPLIT programs, so that a
step with few planes still fills the GPU. Every program reads all W scores of its plane and takes
the update decision itself (W scores are little next to the K / V rows), so no program waits for
another. It attends over its slice of the NEW kept set (the replaced slot substituted), the query
heads of its kv group the rows of one tile, and stores its partial softmax (max, sum, unnormalised
output) in float32. A per-plane counter elects the program that finishes last: it merges the
partials, writes the output and the kept set's one changed slot (every program of the plane has
read the old set by then), and sets the counter back to 0.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from .kept import KeptSet
from .triton import _LOG2E, _tanh, _within

# Slots per attention block: at most BLOCK_BUDGET / (query rows x padded head dim). Triton lays
# chained dots out with every warp along the rows, so with 16 rows each warp holds whole K / V
# blocks and the whole output block: 64 slots at head dim 64, 16 at 256 stay in registers. BW:
# slots per block of the update decision.
BLOCK_BUDGET, BW = 1 << 16, 1024
CONFIG = dict(num_warps=4, num_stages=2)  # module level, so a benchmark can sweep it
# Above every packed (order key, index) of a kept key: a free slot's in the search for the worst.
_NOT_KEPT = tl.constexpr(2**63 - 1)


@triton.jit
def _order(s):
    """The selection's order of float32 scores as int32 (flexdma.perkey.kept.order_key): the
    float's order-preserving integer, -0.0 equal to +0.0, every NaN above +inf."""
    bits = s.to(tl.int32, bitcast=True)
    # Negative floats order backwards as integers: flip their magnitude bits.
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where(s == 0.0, 0, key)
    return tl.where(s != s, 0x7FFFFFFF, key)


@triton.jit
def _decide(idx_b, val_b, sc_b, siw, saw, ssw, W, sn, eligible, BW: tl.constexpr):
    """decode.append's decision for a new key of float32 score sn: (whether it enters, its slot).
    The slot is the first free one, else the worst kept key's (the lowest order key, among equal
    ones the highest index, then the first such slot), found as the smallest (order key, index)
    packed into one int64; the key enters where eligible, not -inf, and a slot is free or it
    outranks the worst. The slots' validity, scores and indices are loaded side by side (a free
    slot's are read and ignored): one memory round trip a block, not a load waiting on another."""
    worst = tl.full([], _NOT_KEPT, tl.int64)
    worst_slot = tl.zeros([], tl.int32)
    first_free = tl.zeros([], tl.int32) + W
    for w0 in range(0, W, BW):
        j = w0 + tl.arange(0, BW)
        inw = j < W
        ok = tl.load(val_b + j * saw, mask=inw, other=0) != 0
        s = tl.load(sc_b + j * ssw, mask=inw, other=0.0).to(tl.float32)
        ix = tl.load(idx_b + j * siw, mask=inw, other=0)
        packed = tl.where(ok, (_order(s).to(tl.int64) << 32) | (0x7FFFFFFF - ix), _NOT_KEPT)
        low = tl.min(packed, 0)
        worst_slot = tl.where(low < worst, tl.min(tl.where(packed == low, j, W), 0), worst_slot)
        worst = tl.minimum(worst, low)
        first_free = tl.minimum(first_free, tl.min(tl.where(inw & ~ok, j, W), 0))
    free = first_free < W
    enter = eligible & (sn != float("-inf")) & (free | (_order(sn) > (worst >> 32).to(tl.int32)))
    return enter, tl.where(free, first_free, worst_slot)


@triton.jit
def _slots(idx_b, val_b, sc_b, siw, saw, ssw, kb, vb, skn, skd, svn, svd, j, hi, d, D: tl.constexpr, DP: tl.constexpr):
    """Slots j (< hi) of the kept set as it was: validity, scores, and the K / V rows of the valid
    ones (gathered as soon as the indices arrive; the update decision is not waited for)."""
    inb = j < hi
    ok = tl.load(val_b + j * saw, mask=inb, other=0) != 0
    sc = tl.load(sc_b + j * ssw, mask=inb, other=0.0)
    kix = tl.load(idx_b + j * siw, mask=inb, other=0)
    cols = _within(ok[:, None], d, D, DP)
    k = tl.load(kb + kix[:, None] * skn + d[None, :] * skd, mask=cols, other=0.0)
    v = tl.load(vb + kix[:, None] * svn + d[None, :] * svd, mask=cols, other=0.0)
    return ok, sc, k, v


@triton.jit(do_not_specialize=["position"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, valid_ptr, score_ptr, snew_ptr, elig_ptr, position, out_ptr, part_ptr, count_ptr,
    sqb, sqh, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sib, sih, siw, sab, sah, saw, ssb, ssh, ssw,
    snb, snh, seb, seh, sob, soh, sod, KVH, W, CH, scale_log2, softcap,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr,
    NSPLIT: tl.constexpr, POS_TENSOR: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    # Float arguments in float32 however the launcher types them (Inductor's, float64).
    scale_log2 = tl.cast(scale_log2, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    plane = tl.program_id(0)
    b = (plane // KVH).to(tl.int64)
    g = (plane % KVH).to(tl.int64)
    idx_b, val_b, sc_b = idx_ptr + b * sib + g * sih, valid_ptr + b * sab + g * sah, score_ptr + b * ssb + g * ssh
    if POS_TENSOR:  # a static cache's step under a CUDA graph: the position lives on the device
        pos = tl.load(position).to(tl.int64)
    else:
        pos = position.to(tl.int64)

    # The kv group's query heads, padded to GP rows (tl.dot's minimum of 16).
    r = tl.arange(0, GP)
    d = tl.arange(0, DP)
    rows = _within((r < G)[:, None], d, D, DP)
    h = g * G + r
    kb, vb = k_ptr + b * skb + g * skh, v_ptr + b * svb + g * svh
    lo = tl.program_id(1) * CH
    hi = tl.minimum(lo + CH, W)
    # Issued first, so that they travel together: this program's first block of the old kept set
    # with its K / V rows, the new key's K / V row (the key may take a slot of the block), q, and
    # then the decision's loads. Each later block is fetched while the one before is computed.
    ok, sc, k, v = _slots(idx_b, val_b, sc_b, siw, saw, ssw, kb, vb, skn, skd, svn, svd, lo + tl.arange(0, BN), hi, d, D, DP)  # fmt: skip
    s_new = tl.load(snew_ptr + b * snb + g * snh).to(score_ptr.dtype.element_ty)  # stored as the scores are
    sn = s_new.to(tl.float32)
    eligible = tl.load(elig_ptr + b * seb + g * seh) != 0
    dn = d < D
    # The real head dims where the key is eligible, as one compare (Triton's interpreter makes a
    # scalar-and-tensor mask uint8, which its loads reject).
    row_new = d < tl.where(eligible, D, 0)
    k_new = tl.load(kb + pos * skn + d * skd, mask=row_new, other=0.0)
    v_new = tl.load(vb + pos * svn + d * svd, mask=row_new, other=0.0)
    q = tl.load(q_ptr + b * sqb + h[:, None] * sqh + d[None, :] * sqd, mask=rows, other=0.0)
    # Every program of the plane reaches the same decision.
    enter, slot = _decide(idx_b, val_b, sc_b, siw, saw, ssw, W, sn, eligible, BW)
    taken = tl.where(enter, slot, -1)  # the slot the new key takes; none: -1, below every slot

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    for n0 in range(lo, hi, BN):
        j = n0 + tl.arange(0, BN)
        new = j == taken
        keep = (j < hi) & (ok | new)
        kk = tl.where(new[:, None], k_new[None, :], k)
        vv = tl.where(new[:, None], v_new[None, :], v)
        bias = tl.where(new, sn, sc.to(tl.float32))
        # The reference's order: scale, softcap, then the bias (in log2 units here).
        s = tl.dot(q, tl.trans(kk))
        if SOFTCAP:
            s = _tanh(s * (scale_log2 / _LOG2E / softcap)) * (softcap * _LOG2E)
        else:
            s = s * scale_log2
        s += bias[None, :] * _LOG2E
        # A NaN becomes +inf, so the max and the sum turn NaN and the row comes out NaN (as in the
        # reference) instead of the max skipping it.
        s = tl.where(keep[None, :], tl.where(s != s, float("inf"), s), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)
        m_i = m_new
        # The next block (none past hi: its loads are masked off).
        ok, sc, k, v = _slots(idx_b, val_b, sc_b, siw, saw, ssw, kb, vb, skn, skd, svn, svd, j + BN, hi, d, D, DP)  # fmt: skip

    if NSPLIT > 1:
        # A partial: G maxima, G sums, G x D outputs.
        UNIT: tl.constexpr = G * (D + 2)
        part = part_ptr + (plane * NSPLIT + tl.program_id(1)).to(tl.int64) * UNIT
        tl.store(part + r, m_i, mask=r < G)
        tl.store(part + G + r, l_i, mask=r < G)
        tl.store(part + 2 * G + r[:, None] * D + d[None, :], acc, mask=rows)
        # Every thread's stores (and reads of the kept set) before the release; the last program's
        # acquire then sees every partial, and no program reads the kept set after its update.
        tl.debug_barrier()
        last = tl.atomic_add(count_ptr + plane, 1, sem="acq_rel") == NSPLIT - 1
    else:
        tl.debug_barrier()  # every thread's reads of the kept set before its update
        last = True
    if last:
        if NSPLIT > 1:
            # The log-sum-exp merge, every split's partial of a row in one load (the rows unrolled,
            # their loads in flight together); .cg reads past L1, which may hold none of the other
            # programs' stores.
            base = part_ptr + plane.to(tl.int64) * NSPLIT * UNIT
            u = tl.arange(0, NSPLIT)
            at = base + u[:, None] * UNIT + r[None, :]
            ms = tl.load(at, mask=(r < G)[None, :], other=float("-inf"), cache_modifier=".cg")
            ls = tl.load(at + G, mask=(r < G)[None, :], other=0.0, cache_modifier=".cg")
            top = tl.max(ms, 0)
            w = tl.exp2(ms - tl.where(top == float("-inf"), 0.0, top)[None, :])  # (NSPLIT, GP)
            l_i = tl.sum(w * ls, 0)
            acc = tl.zeros([GP, DP], tl.float32)
            for gi in tl.static_range(G):
                a = tl.load(base + u[:, None] * UNIT + 2 * G + gi * D + d[None, :], mask=dn[None, :], other=0.0, cache_modifier=".cg")  # fmt: skip
                wg = tl.sum(tl.where(r[None, :] == gi, w, 0.0), 1)  # (NSPLIT,)
                acc += tl.where(r[:, None] == gi, tl.sum(wg[:, None] * a, 0)[None, :], 0.0)
            tl.store(count_ptr + plane, 0)  # ready for the next step
        # A row that keeps no key: output 0.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + b * sob + h[:, None] * soh + d[None, :] * sod, out.to(out_ptr.dtype.element_ty), mask=rows)
        tl.store(idx_b + slot * siw, pos, mask=enter)
        tl.store(val_b + slot * saw, 1, mask=enter)
        tl.store(sc_b + slot * ssw, s_new, mask=enter)


_SM_COUNTS: dict = {}


# Traced by torch.compile (transformers' compiled generation) as a constant of the device, as the
# dispatcher's kernel check is (flexdma/_dispatch.py): the device query is not traceable.
@torch.compiler.assume_constant_result
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # the interpreter: an H100's, so that tests split the slots too
        return 132
    if device not in _SM_COUNTS:
        _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNTS[device]


def splits(window: int, planes: int, block: int, device: torch.device) -> int:
    """NSPLIT: programs per plane, a power of two, so that planes x NSPLIT about fills the SMs with
    at least one block of slots each."""
    n = max(1, min(_sm_count(device) // max(planes, 1), -(-window // block)))
    return 1 << (n.bit_length() - 1)


# The kernel's per-plane counters, one zeroed buffer per (device, stream): the kernel leaves them
# zero, so a step needs no fill launch. Kernels on one stream run in order; another stream gets its
# own buffer.
_COUNTERS: dict = {}


def _counter(device: torch.device, n: int) -> torch.Tensor:
    # The raw stream handle: no Stream object built a step.
    key = (device, torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 256), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def geometry(window: int, rows: int, head_dim: int, planes: int, device: torch.device) -> tuple:
    """(slots per attention block, programs per plane) for `rows` padded query rows and a padded
    head dim (module level, so a benchmark can sweep it)."""
    block = max(16, min(64, BLOCK_BUDGET // (rows * head_dim), triton.next_power_of_2(window)))
    return block, splits(window, planes, block, device)


def decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kept: KeptSet,
    s_new: torch.Tensor,
    position: Union[int, torch.Tensor],
    eligible: torch.Tensor,
    softmax_scale: float,
    softcap: float = 0.0,
    *,
    out: Optional[torch.Tensor] = None,
    counter: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One new token against a cache: updates `kept` in place to decode.append(kept, s_new,
    position, eligible) and returns the new row's attention over it.

    q (B, H, D) the new query rows; k, v (B, KVH, Kcap, D) the cache, the new key already at
    `position` (any strides: (B, K, KVH, D) caches pass a transposed view); kept: KeptSet of
    (B, KVH, W); s_new (B, KVH) the new key's score; position an int or a one-element integer tensor
    on the device (read there: no host synchronisation); eligible (B, KVH) bool. Query head h uses kv
    head h // (H // KVH); its logits are softcap(softmax_scale * q.k) + score over the valid slots;
    no valid slot gives output 0. Returns (B, H, D) in q's dtype, written into `out` where given.
    `counter`: B * KVH int32 zeros that the kernel leaves zero (calls that may run at once on one
    stream need one each); by default a buffer kept per device and stream. The position is not checked
    against the cache's length (that would read it on the host)."""
    B, H, D = q.shape
    KVH, W = k.shape[1], kept.idx.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"decode_step takes float16 or bfloat16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if D % 16 or not 16 <= D <= 256 or k.dim() != 4 or (k.shape[0], k.shape[3]) != (B, D) or v.shape != k.shape:
        raise ValueError(f"decode_step: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (head dim 16..256)")
    if KVH < 1 or H % KVH:
        raise ValueError(f"decode_step: {H} query heads do not group onto {KVH} kv heads")
    if (
        W < 1
        or kept.idx.shape != (B, KVH, W)
        or kept.valid.shape != kept.idx.shape
        or kept.score.shape != kept.idx.shape
        or kept.idx.dtype != torch.int64
        or kept.valid.dtype != torch.bool
    ):
        raise ValueError(
            f"decode_step: the kept set is not int64 / bool / scores of (B, KVH, W) = ({B}, {KVH}, W >= 1)"
        )
    if s_new.shape != (B, KVH) or eligible.shape != (B, KVH) or eligible.dtype != torch.bool:
        raise ValueError(f"decode_step: s_new and eligible (bool) must be ({B}, {KVH})")
    pos_tensor = isinstance(position, torch.Tensor)
    if pos_tensor and (position.numel() != 1 or position.is_floating_point() or position.device != q.device):
        raise ValueError("decode_step: a tensor position is one integer on q's device")
    if out is None:
        out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"decode_step: out must be {tuple(q.shape)} {q.dtype}")
    if counter is not None and (
        counter.dtype != torch.int32 or counter.numel() < B * KVH or not counter.is_contiguous()
    ):
        raise ValueError(f"decode_step: counter must be {B * KVH} contiguous int32 zeros")
    if B == 0:
        return out
    if torch.compiler.is_compiling():
        # Traced (transformers' compiled generation): the launch as a custom op that Inductor
        # inlines and a CUDA graph holds. Its counters are zeroed in the graph (a memset).
        if not pos_tensor:
            position = torch.full((1,), position, dtype=torch.int64, device=q.device)
        got = torch.ops.flexdma.decode_step(
            q, k, v, kept.idx, kept.valid, kept.score, s_new, eligible, position.reshape(1), softmax_scale, softcap
        )
        return got if out is None else out.copy_(got)
    # The launch's geometry, computed once a step: its host time is most of what a step costs.
    geom = _step_geometry(q, KVH, W)
    count = (_counter(q.device, B * KVH) if counter is None else counter) if geom[-1] > 1 else out
    _launch(_decode_kernel, q, k, v, kept.idx, kept.valid.view(torch.uint8), kept.score, s_new,
            eligible.view(torch.uint8), position, out, count, softmax_scale, softcap, geom)  # fmt: skip
    return out


def _step_geometry(q: torch.Tensor, KVH: int, W: int) -> tuple:
    """(GP, DP, slots per attention block, programs per plane) of a step's launch."""
    B, H, D = q.shape
    GP, DP = max(16, triton.next_power_of_2(H // KVH)), triton.next_power_of_2(D)
    return (GP, DP) + geometry(W, GP, DP, B * KVH, q.device)


def _launch(kernel, q, k, v, idx, valid, score, s_new, eligible, position, out, count, softmax_scale, softcap, geom):
    """The kernel's launch (eager: the kernel; traced: wrap_triton's), valid / eligible as uint8,
    at the geometry `geom` (_step_geometry)."""
    B, H, D = q.shape
    KVH, W = k.shape[1], idx.shape[-1]
    G = H // KVH
    GP, DP, block, nsplit = geom
    part = out  # unused with one program a plane
    if nsplit > 1:
        part = torch.empty(B * KVH * nsplit * G * (D + 2), dtype=torch.float32, device=q.device)
    kernel[(B * KVH, nsplit)](
        q, k, v, idx, valid, score, s_new, eligible, position, out, part, count,
        *q.stride(), *k.stride(), *v.stride(), *idx.stride(), *valid.stride(), *score.stride(),
        *s_new.stride(), *eligible.stride(), *out.stride(),
        KVH, W, -(-W // (nsplit * block)) * block, softmax_scale * _LOG2E.value, softcap,
        G=G, GP=GP, D=D, DP=DP, BN=block, BW=max(16, min(BW, triton.next_power_of_2(W))),
        NSPLIT=nsplit, POS_TENSOR=isinstance(position, torch.Tensor), SOFTCAP=softcap > 0, **CONFIG,
    )  # fmt: skip


@torch.library.triton_op("flexdma::decode_step", mutates_args={"idx", "valid", "score"})
def _decode_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, score: torch.Tensor,
    s_new: torch.Tensor, eligible: torch.Tensor, position: torch.Tensor, softmax_scale: float, softcap: float,
) -> torch.Tensor:  # fmt: skip
    """decode_step's launch as an op torch.compile traces (the position a one-element device
    tensor); the checks are decode_step's. The kernel reads and writes bytes where torch keeps
    bools: Inductor cannot lower a bool tensor's uint8 view, so valid and eligible pass as uint8
    copies (W bytes a plane), and valid is copied back."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    count = torch.zeros(q.shape[0] * k.shape[1], dtype=torch.int32, device=q.device)
    valid8 = valid.to(torch.uint8)
    _launch(torch.library.wrap_triton(_decode_kernel), q, k, v, idx, valid8, score, s_new, eligible.to(torch.uint8),
            position, out, count, softmax_scale, softcap, _step_geometry(q, k.shape[1], idx.shape[-1]))  # fmt: skip
    valid.copy_(valid8 != 0)
    return out
