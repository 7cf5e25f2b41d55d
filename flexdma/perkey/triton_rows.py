"""A step of T new tokens (2..cache.MAX_ROWS) against a kept set on CUDA, in one kernel launch:
the T O(W) updates of decode.append_rows, each new row's kept set among the union of the W old
slots and the T new keys, and the kept set after the last key, updated in place. Bit for bit
decode.append_rows's outputs (tests/perkey/interpret_rows.py). Imports triton: loaded by decode.rows_kernel.

One program per (batch, plane) runs the updates in order (each is a reduction over the W slots, so
T of them are T passes over W entries: microseconds, against a Python loop of ~10 launches a key).
It keeps, beside the slots, which union entry each slot holds, and after update t writes row t of
the keep matrix: the entries its slots hold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kept import KeptSet, Rows

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


# Entries a block of the kernel's loops holds (module level, so the tests can make several blocks).
MAX_BLOCK = 1024


@triton.jit(do_not_specialize=["start", "T"])
def _rows_kernel(
    idx_ptr, valid_ptr, score_ptr, snew_ptr, elig_ptr, entry_ptr, uidx_ptr, uscore_ptr, keep_ptr, start,
    sib, sip, siw, sab, sap, saw, ssb, ssp, ssw, snb, snp, snt, seb, sep, set_, P, W, T,
    BW: tl.constexpr, BE: tl.constexpr,
):  # fmt: skip
    plane = tl.program_id(0)
    b = (plane // P).to(tl.int64)
    p = (plane % P).to(tl.int64)
    idx_b, val_b, sc_b = idx_ptr + b * sib + p * sip, valid_ptr + b * sab + p * sap, score_ptr + b * ssb + p * ssp
    E = W + T
    # Scratch and outputs are contiguous per plane: entry (W), union idx / score (E), keep (T, E).
    ent = entry_ptr + plane.to(tl.int64) * W
    uidx, usc = uidx_ptr + plane.to(tl.int64) * E, uscore_ptr + plane.to(tl.int64) * E
    keep = keep_ptr + plane.to(tl.int64) * T * E
    # The union before any update: the old slots (entry s is slot s), then the new keys.
    for w0 in range(0, W, BW):
        j = w0 + tl.arange(0, BW)
        m = j < W
        tl.store(ent + j, j, mask=m)
        tl.store(uidx + j, tl.load(idx_b + j * siw, mask=m), mask=m)
        tl.store(usc + j, tl.load(sc_b + j * ssw, mask=m), mask=m)
    for u0 in range(0, T, BW):
        u = u0 + tl.arange(0, BW)
        m = u < T
        tl.store(uidx + W + u, start + u.to(tl.int64), mask=m)
        s_u = tl.load(snew_ptr + b * snb + p * snp + u * snt, mask=m)
        tl.store(usc + W + u, s_u.to(uscore_ptr.dtype.element_ty), mask=m)
    tl.debug_barrier()
    for t in range(0, T):
        # decode.append's decision, on the slots as they are.
        s_new = tl.load(snew_ptr + b * snb + p * snp + t * snt).to(score_ptr.dtype.element_ty)
        eligible = tl.load(elig_ptr + b * seb + p * sep + t * set_) != 0
        enter, slot = _decide(idx_b, val_b, sc_b, siw, saw, ssw, W, s_new.to(tl.float32), eligible, BW)
        tl.debug_barrier()  # every thread's reads of the slots before the update
        tl.store(idx_b + slot * siw, start + t, mask=enter)
        tl.store(val_b + slot * saw, 1, mask=enter)
        tl.store(sc_b + slot * ssw, s_new, mask=enter)
        tl.store(ent + slot, W + t, mask=enter)
        # Row t keeps the entries its slots hold: zeros, then the held entries set.
        for e0 in range(0, E, BE):
            e = e0 + tl.arange(0, BE)
            tl.store(keep + t * E + e, tl.zeros([BE], tl.int8), mask=e < E)
        tl.debug_barrier()
        for w0 in range(0, W, BW):
            j = w0 + tl.arange(0, BW)
            ok = tl.load(val_b + j * saw, mask=j < W, other=0) != 0
            held = tl.load(ent + j, mask=ok, other=0)
            tl.store(keep + t * E + held, tl.full([BW], 1, tl.int8), mask=ok)
        tl.debug_barrier()


def append_rows(kept: KeptSet, s_new: torch.Tensor, start: int, eligible: torch.Tensor) -> Rows:
    """decode.append_rows on CUDA in one launch; `kept` is updated in place (it is Rows.kept)."""
    B, P, W = kept.idx.shape
    T = s_new.shape[-1]
    dev = kept.idx.device
    if s_new.shape != (B, P, T) or eligible.shape != (B, P, T) or eligible.dtype != torch.bool:
        raise ValueError(f"append_rows: s_new and eligible (bool) must be ({B}, {P}, T)")
    E = W + T
    entry = torch.empty(B * P * W, dtype=torch.int32, device=dev)
    uidx = torch.empty(B, P, E, dtype=torch.int64, device=dev)
    uscore = torch.empty(B, P, E, dtype=kept.score.dtype, device=dev)
    keep = torch.empty(B, P, T, E, dtype=torch.bool, device=dev)
    if B * P and T:
        _rows_kernel[(B * P,)](
            kept.idx, kept.valid.view(torch.uint8), kept.score, s_new, eligible.view(torch.uint8), entry, uidx,
            uscore, keep.view(torch.int8), start,
            *kept.idx.stride(), *kept.valid.stride(), *kept.score.stride(), *s_new.stride(), *eligible.stride(),
            P, W, T, BW=max(16, min(MAX_BLOCK, triton.next_power_of_2(W))),
            BE=max(16, min(MAX_BLOCK, triton.next_power_of_2(E))),
            num_warps=4,
        )  # fmt: skip
    return Rows(uidx, uscore, keep, kept)
