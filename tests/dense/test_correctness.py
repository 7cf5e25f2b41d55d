"""Every backend against the float64 reference, through the public API.

The matrix samples combinations (each factor cycles with its own stride, so pairs of factor
values meet across cases) instead of the full cross product: sequence lengths 1..300 with Q != K,
head dims 16..256, GQA ratios 1/2/4, every mask and bias broadcast pattern, causal on/off, softcap,
rows with no visible key, bias with and without a gradient. Forward out and lse, backward dq, dk, dv
and dbias, with FlashAttention's tolerance rule for low precision.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import pytest
import torch
from utils import (
    ALL_PATTERNS,
    assert_close_to_ref,
    assert_no_nan,
    make_mask_bias,
    make_qkv,
    pattern_id,
    poison_allocator,
    reference_with_grads,
)

import flexdma
from flexdma import _dispatch

HAS_CUDA = torch.cuda.is_available()


@dataclasses.dataclass(frozen=True)
class Case:
    B: int
    Q: int
    K: int
    H: int
    KVH: int
    D: int
    mask: Optional[Tuple[str, ...]]
    bias: Optional[Tuple[str, ...]]
    causal: bool
    bias_grad: bool
    empty_rows: bool
    softcap: float

    @property
    def id(self) -> str:
        return (
            f"B{self.B}-Q{self.Q}-K{self.K}-H{self.H}kv{self.KVH}-D{self.D}-m{pattern_id(self.mask)}"
            f"-b{pattern_id(self.bias)}{'-causal' if self.causal else ''}{'-dbias' if self.bias_grad else ''}"
            f"{'-empty' if self.empty_rows else ''}{f'-cap{self.softcap:g}' if self.softcap else ''}"
        )


SEQLENS = [
    (1, 1),
    (1, 37),
    (37, 1),
    (17, 130),
    (130, 17),
    (64, 64),
    (65, 129),
    (113, 203),
    (200, 77),
    (300, 300),
    (255, 256),
    (3, 300),
    (300, 5),
    (96, 161),
]
HEAD_DIM = [16, 32, 40, 64, 80, 96, 128, 160, 192, 256]
HEADS = [(1, 1), (2, 2), (4, 2), (4, 1), (8, 2), (3, 3)]  # GQA ratios 1, 2, 4
MASKS = [None] + list(ALL_PATTERNS)
BIASES = [None] + list(ALL_PATTERNS)


def _cases():
    cases = []
    n = 6 * len(MASKS)  # every mask and every bias pattern appears six times, with other factors
    for i in range(n):
        Q, K = SEQLENS[(i * 5) % len(SEQLENS)]
        H, KVH = HEADS[(i * 7) % len(HEADS)]
        D = HEAD_DIM[(i * 3) % len(HEAD_DIM)]
        # Keep big problems (long sequences x wide heads) few so the suite stays fast on CPU.
        if Q * K * H * D > 300 * 300 * 4 * 64:
            H, KVH = (2, 1) if i % 2 else (2, 2)
        mask = MASKS[i % len(MASKS)]
        bias = BIASES[(i * 11 + 3 + i // len(MASKS)) % len(BIASES)]
        cases.append(
            Case(
                B=1 + i % 2,
                Q=Q,
                K=K,
                H=H,
                KVH=KVH,
                D=D,
                mask=mask,
                bias=bias,
                causal=(i % 3 == 1) or (i % 5 == 0),
                bias_grad=bias is not None and i % 4 != 3,
                empty_rows=mask is not None and i % 4 == 2,
                softcap=(30.0 if i % 7 == 3 else (5.0 if i % 11 == 6 else 0.0)),
            )
        )
    return cases


CASES = _cases()


def _device_for(backend: str) -> str:
    if backend == "cuda":
        return "cuda"
    if backend == "flex":
        return "cuda" if HAS_CUDA else "cpu"
    return "cpu"


def _skip_unavailable(backend: str, device: str) -> None:
    if device == "cuda" and not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    if backend not in flexdma.available_backends():
        pytest.skip(f"backend {backend!r} is not available here")


def _params():
    for backend in ("cpu", "flex", "cuda"):
        device = _device_for(backend)
        for idx, case in enumerate(CASES):
            dtypes = [torch.float32, torch.bfloat16]
            # float16 on GPU everywhere; on CPU only a slice of the matrix (same kernel, other converter).
            if device == "cuda" or idx % 3 == 0:
                dtypes.append(torch.float16)
            if backend == "flex" and idx % (6 if device == "cpu" else 12):
                continue  # FlexAttention compiles per shape (seconds each): a slice of the matrix only
            for dtype in dtypes:
                marks = [pytest.mark.gpu] if device == "cuda" else []
                yield pytest.param(backend, dtype, case, id=f"{backend}-{str(dtype)[6:]}-{case.id}", marks=marks)


def _run_backend(backend, q, k, v, mask, bias, case):
    return flexdma.flash_dma_attention(
        q, k, v, mask, bias, is_causal=case.causal, softcap=case.softcap, return_lse=True, backend=backend
    )


@pytest.mark.parametrize("backend,dtype,case", list(_params()))
def test_matches_reference(backend, dtype, case):
    device = _device_for(backend)
    _skip_unavailable(backend, device)
    dims = dict(B=case.B, H=case.H, KVH=case.KVH, Q=case.Q, K=case.K)
    q, k, v = make_qkv(case.B, case.Q, case.K, case.H, case.KVH, case.D, dtype=dtype, device=device, requires_grad=True)
    mask, bias = make_mask_bias(
        case.mask,
        case.bias,
        **dims,
        dtype=dtype,
        device=device,
        empty_rows=case.empty_rows,
        bias_requires_grad=case.bias_grad,
    )
    call = _dispatch.Call.of(q, k, v, mask, bias, is_causal=case.causal, softcap=case.softcap, requires_grad=True)
    why = _dispatch.unsupported_reason("dense", backend, call)
    if why:
        pytest.skip(f"{backend} does not take this call: {why}")

    poison_allocator([q, q, k, v])
    out, lse = _run_backend(backend, q, k, v, mask, bias, case)
    grad_out = torch.randn_like(out)
    inputs = [q, k, v] + ([bias] if case.bias_grad else [])
    grads = torch.autograd.grad(out, inputs, grad_out)
    got = dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
    if case.bias_grad:
        got["dbias"] = grads[3]
        assert grads[3].shape == bias.shape and grads[3].dtype == bias.dtype
    for name, t in got.items():
        if name != "lse":
            assert_no_nan(name, t)
    assert lse.dtype == torch.float32 and lse.shape == (case.B, case.H, case.Q)

    kw = dict(
        is_causal=case.causal, softcap=case.softcap, softmax_scale=1.0 / math.sqrt(case.D), bias_grad=case.bias_grad
    )
    ref = reference_with_grads(q, k, v, mask, bias, grad_out, dtype=torch.float64, **kw)
    low = None if dtype == torch.float32 else reference_with_grads(q, k, v, mask, bias, grad_out, dtype=dtype, **kw)
    factor = 3.0 if case.softcap else 2.0  # FlashAttention-3's rule
    for name in got:
        assert_close_to_ref(got[name], ref[name], None if low is None else low[name], name, factor=factor)

    # Rows that see no key: out exactly 0, lse -inf, and (checked above) finite grads.
    empty = torch.isneginf(ref["lse"]).cpu()  # (B, H, Q)
    if empty.any():
        assert torch.isneginf(lse.cpu()[empty]).all()
        assert (out.detach().cpu().transpose(1, 2)[empty] == 0).all()


def test_matrix_covers_every_pattern_and_factor():
    assert {c.mask for c in CASES} == set(MASKS)
    assert {c.bias for c in CASES} == set(BIASES)
    assert {c.H // c.KVH for c in CASES} >= {1, 2, 4}
    assert any(c.Q != c.K for c in CASES) and {c.D for c in CASES} >= {16, 256}
    assert any(c.causal and c.Q > c.K for c in CASES)  # rows before the diagonal see nothing
    assert any(c.empty_rows for c in CASES) and any(c.softcap for c in CASES)
    assert any(c.bias is not None and not c.bias_grad for c in CASES)
    patterns_with_grad = {c.bias for c in CASES if c.bias_grad}
    assert len(patterns_with_grad) >= len(ALL_PATTERNS) - 4


# -------------------------------------------------------------------- targeted cases
def _devices():
    yield pytest.param("cpu")
    yield pytest.param("cuda", marks=pytest.mark.gpu)


@pytest.mark.parametrize("device", _devices())
def test_all_masked_rows_give_zero_out_and_zero_grads(device):
    B, Q, K, H, KVH, D = 2, 70, 90, 4, 2, 64
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = make_qkv(B, Q, K, H, KVH, D, dtype=dtype, device=device, requires_grad=True)
    mask = torch.rand(B, H, Q, K, device=device) < 0.5
    mask[0, 1, 3] = False
    mask[1, :, 40:] = False
    bias = torch.randn(1, KVH, Q, K, dtype=dtype, device=device, requires_grad=True)
    backend = "cpu" if device == "cpu" else "auto"
    out, lse = flexdma.flash_dma_attention(q, k, v, mask, bias, return_lse=True, backend=backend)
    grad_out = torch.randn_like(out)
    dq, dk, dv, dbias = torch.autograd.grad(out, (q, k, v, bias), grad_out)
    assert (out[0, 3, 1] == 0).all() and (out[1, 40:] == 0).all()
    assert torch.isneginf(lse[0, 1, 3]) and torch.isneginf(lse[1, :, 40:]).all()
    assert torch.isfinite(lse[0, 0]).all()
    for g in (dq, dk, dv, dbias):
        assert torch.isfinite(g).all()
    assert (dq[0, 3, 1] == 0).all() and (dq[1, 40:] == 0).all()
    # Batch 1 rows 40.. are empty in every head: they add nothing to dbias (summed over batch).
    ref = reference_with_grads(
        q, k, v, mask, bias, grad_out, dtype=torch.float64, bias_grad=True, is_causal=False, softmax_scale=D**-0.5
    )
    low = (
        None
        if dtype == torch.float32
        else reference_with_grads(
            q, k, v, mask, bias, grad_out, dtype=dtype, bias_grad=True, is_causal=False, softmax_scale=D**-0.5
        )
    )
    for name, t in dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, dbias=dbias).items():
        assert_close_to_ref(t, ref[name], None if low is None else low[name], name)


def test_everything_masked_and_no_keys():
    q, k, v = make_qkv(1, 5, 7, 2, 1, 16, requires_grad=True)
    mask = torch.zeros(1, 1, 1, 7, dtype=torch.bool)
    out, lse = flexdma.flash_dma_attention(q, k, v, mask, return_lse=True, backend="cpu")
    assert (out == 0).all() and torch.isneginf(lse).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()
    # Causal with more queries than keys: the first Q - K rows see nothing.
    q, k, v = make_qkv(1, 9, 4, 1, 1, 16)
    out, lse = flexdma.flash_dma_attention(q, k, v, is_causal=True, return_lse=True, backend="cpu")
    assert (out[0, :5] == 0).all() and torch.isneginf(lse[0, 0, :5]).all() and torch.isfinite(lse[0, 0, 5:]).all()


def test_zero_length_keys_through_op():
    q, k, v = make_qkv(1, 4, 0, 2, 1, 16)
    out, lse, _ = torch.ops.flexdma.fwd(q, k, v, None, None, 0.25, False, 0.0, False)
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_inputs_and_strided_mask_columns(dtype):
    # q/k/v as views with large row/head strides, bias and mask with a non-unit key stride
    # (allowed through the op directly; the public API makes the key dim contiguous first).
    B, Q, K, H, KVH, D = 2, 37, 83, 4, 2, 32
    big_q = torch.randn(B, Q, 2 * H, D + 8).to(dtype)
    big_kv = torch.randn(B, K, 3 * KVH, D).to(dtype)
    q, k, v = big_q[:, :, ::2, :D], big_kv[:, :, :KVH], big_kv[:, :, KVH : 2 * KVH]
    mask_full = torch.rand(B, 1, Q, 2 * K) < 0.7
    mask = mask_full[..., ::2]
    bias_full = torch.randn(1, H, 1, 3 * K).to(dtype)
    bias = bias_full[..., ::3]
    assert mask.stride(-1) == 2 and bias.stride(-1) == 3 and q.stride(2) == 2 * (D + 8)
    scale = D**-0.5
    out, lse, _ = torch.ops.flexdma.fwd(q, k, v, mask, bias, scale, True, 0.0, False)
    ref = reference_with_grads(
        q,
        k,
        v,
        mask,
        bias,
        torch.randn(B, Q, H, D),
        dtype=torch.float64,
        bias_grad=False,
        is_causal=True,
        softmax_scale=scale,
    )
    low = (
        None
        if dtype == torch.float32
        else reference_with_grads(
            q,
            k,
            v,
            mask,
            bias,
            torch.randn(B, Q, H, D),
            dtype=dtype,
            bias_grad=False,
            is_causal=True,
            softmax_scale=scale,
        )
    )
    assert_close_to_ref(out, ref["out"], None if low is None else low["out"], "out")
    assert_close_to_ref(lse, ref["lse"], None if low is None else low["lse"], "lse")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_conversions_are_exact(dtype):
    # One key: out = v exactly, so every finite 16-bit pattern must survive load + store.
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    vals = bits.view(dtype)
    vals = vals[torch.isfinite(vals.float())]
    D = 256
    n = vals.numel() // D
    v = vals[: n * D].reshape(1, 1, n, D)
    q = torch.ones(1, 1, n, D, dtype=dtype)
    out, _, _ = torch.ops.flexdma.fwd(q, torch.ones_like(v), v, None, None, 1e-3, False, 0.0, False)
    _assert_same_bits(out, v)
    # Two keys with equal scores: out = (v1 + v2) / 2 in float, rounded once to the dtype
    # (round to nearest even, subnormals and overflow to inf included).
    v2 = vals[torch.randperm(vals.numel())][: n * D].reshape(1, 1, n, D)
    vv = torch.cat([v, v2], dim=1)
    kk = torch.ones_like(vv)
    out, _, _ = torch.ops.flexdma.fwd(torch.ones(1, 1, n, D, dtype=dtype), kk, vv, None, None, 1e-3, False, 0.0, False)
    expected = ((v.float() + v2.float()) * 0.5).to(dtype)
    _assert_same_bits(out, expected)


def _assert_same_bits(x, y):
    # Bit-exact, except that the sign of zero is not kept (the accumulator starts at +0).
    nonzero = y != 0
    assert torch.equal(x.view(torch.int16)[nonzero], y.view(torch.int16)[nonzero])
    assert (x[~nonzero] == 0).all()


@pytest.mark.parametrize("softcap,is_causal", [(0.0, True), (4.0, False)])
def test_float64_is_exact_to_rounding(softcap, is_causal):
    # float64 runs the kernel in double: with a scale and softcap that are exact in float32 (the
    # kernel params carry them as float), it matches the float64 reference to ~1e-12.
    B, Q, K, H, KVH, D = 2, 70, 131, 4, 2, 64
    q, k, v = make_qkv(B, Q, K, H, KVH, D, dtype=torch.float64, requires_grad=True)
    mask, bias = make_mask_bias(
        ("B", "1", "Q", "K"),
        ("1", "KVH", "1", "K"),
        B=B,
        H=H,
        KVH=KVH,
        Q=Q,
        K=K,
        dtype=torch.float64,
        empty_rows=True,
        bias_requires_grad=True,
    )
    out, lse = flexdma.flash_dma_attention(
        q, k, v, mask, bias, is_causal=is_causal, softmax_scale=0.125, softcap=softcap, return_lse=True, backend="cpu"
    )
    assert lse.dtype == torch.float64
    grad_out = torch.randn_like(out)
    got = dict(zip(("dq", "dk", "dv", "dbias"), torch.autograd.grad(out, (q, k, v, bias), grad_out)))
    got.update(out=out, lse=lse)
    ref = reference_with_grads(
        q,
        k,
        v,
        mask,
        bias,
        grad_out,
        dtype=torch.float64,
        bias_grad=True,
        is_causal=is_causal,
        softmax_scale=0.125,
        softcap=softcap,
    )
    for name, t in got.items():
        check = torch.isfinite(ref[name])
        assert torch.equal(torch.isfinite(t), check), name
        torch.testing.assert_close(t[check], ref[name][check], rtol=1e-10, atol=1e-10, msg=name)
