"""The CPU kernels in float64 compute in float64 throughout, the softmax scale and the softcap
included: at head dims whose 1/sqrt(D) float32 cannot hold (32, 96, 128) and at a scale of no power
of two, every kernel (dense, per-key, packed, decoding through the kept sets; forward and backward)
agrees with the float64 reference to 1e-12."""

import pytest
import torch
from utils import make_qkv, reference_with_grads

import flexdma
from flexdma.nn import DynamicMaskAttention

EXACT = dict(rtol=1e-12, atol=1e-12)

# (head_dim, softmax_scale, softcap): None is 1/sqrt(D); 0.3 and 4.7 are no power of two and not
# float32 values either.
SCORE_CASES = [
    (32, None, 0.0),
    (96, None, 0.0),
    (128, None, 0.0),
    (64, 0.3, 0.0),
    (32, None, 4.7),
    (96, 0.3, 4.7),
]


def _case_id(c):
    D, scale, cap = c
    return f"D{D}-scale{'default' if scale is None else scale}-cap{cap}"


def _assert_exact(got, ref):
    for name, t in got.items():
        torch.testing.assert_close(t, ref[name], **EXACT, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", SCORE_CASES, ids=_case_id)
def test_dense_float64_is_exact(case, causal):
    D, scale, cap = case
    B, Q, K, H, KVH = 2, 70, 90, 4, 2  # partial query and key tiles, GQA
    q, k, v = make_qkv(B, Q, K, H, KVH, D, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(B, 1, Q, K) < 0.7
    mask[..., -1] = True  # no empty rows: those are tested elsewhere
    bias = torch.randn(1, H, Q, K, dtype=torch.float64).requires_grad_()
    kw = dict(is_causal=causal, softmax_scale=scale, softcap=cap)
    out, lse = flexdma.flash_dma_attention(q, k, v, mask, bias, return_lse=True, backend="cpu", **kw)
    grad_out = torch.randn_like(out)
    dq, dk, dv, dbias = torch.autograd.grad(out, (q, k, v, bias), grad_out)
    ref = reference_with_grads(q, k, v, mask, bias, grad_out, dtype=torch.float64, bias_grad=True, **kw)
    _assert_exact(dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, dbias=dbias), ref)


def _float32_values(*shape):
    """float64 scores that float32 holds exactly: their order is the same whether the selection
    ranks them in float32 or float64."""
    return torch.randn(*shape).to(torch.float64)


@pytest.mark.parametrize("case", SCORE_CASES, ids=_case_id)
def test_perkey_float64_is_exact(case):
    D, scale, cap = case
    B, Q, K, H, KVH, W = 2, 70, 130, 4, 2, 40
    q, k, v = make_qkv(B, Q, K, H, KVH, D, dtype=torch.float64, requires_grad=True)
    bias = (2 * _float32_values(B, KVH, 1, K)).requires_grad_()
    kw = dict(is_causal=True, softmax_scale=scale, softcap=cap)
    out, lse = flexdma.flash_dma_attention(
        q, k, v, None, bias, keep_window_size=W, return_lse=True, backend="cpu", **kw
    )
    grad_out = torch.randn_like(out)
    dq, dk, dv, dbias = torch.autograd.grad(out, (q, k, v, bias), grad_out)
    keep = flexdma.create_mask(bias.detach(), W, is_causal=True, query_len=Q)
    ref = reference_with_grads(q, k, v, keep, bias, grad_out, dtype=torch.float64, bias_grad=True, **kw)
    _assert_exact(dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, dbias=dbias), ref)


@pytest.mark.parametrize("window", [None, 24], ids=["dense", "window24"])
@pytest.mark.parametrize("case", SCORE_CASES, ids=_case_id)
def test_packed_float64_is_exact(case, window):
    D, scale, cap = case
    H, KVH = 4, 2
    lens = [37, 0, 1, 80, 66]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    T = int(cu[-1])
    q, k, v = make_qkv(1, T, T, H, KVH, D, dtype=torch.float64, requires_grad=True)
    q, k, v = (t.detach()[0].requires_grad_() for t in (q, k, v))
    bias = (2 * _float32_values(KVH, T)).requires_grad_()
    kw = dict(is_causal=True, softmax_scale=scale, softcap=cap)
    out, lse = flexdma.flash_dma_attention_varlen(
        q, k, v, cu, cu, max(lens), max(lens), bias, keep_window_size=window, return_lse=True, backend="cpu", **kw
    )
    grad_out = torch.randn_like(out)
    got = dict(
        zip(("out", "lse", "dq", "dk", "dv", "dbias"), (out, lse, *torch.autograd.grad(out, (q, k, v, bias), grad_out)))
    )
    # The float64 reference, one sequence at a time.
    ref = {name: torch.zeros_like(t) for name, t in got.items()}
    ref["lse"].fill_(float("-inf"))
    for s0, s1 in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if s1 == s0:
            continue
        rows = slice(s0, s1)
        b = bias.detach()[:, rows][None, :, None, :]
        keep = None if window is None else flexdma.create_mask(b, window, is_causal=True, query_len=s1 - s0)
        r = reference_with_grads(
            q[rows][None],
            k[rows][None],
            v[rows][None],
            keep,
            b,
            grad_out[rows][None],
            dtype=torch.float64,
            bias_grad=True,
            **kw,
        )
        for name in ("out", "dq", "dk", "dv"):
            ref[name][rows] = r[name][0]
        ref["lse"][:, rows] = r["lse"][0]
        ref["dbias"][:, rows] = r["dbias"][0, :, 0]
    _assert_exact(got, ref)


@pytest.mark.parametrize("D", [32, 96])
def test_decoding_float64_is_exact(D):
    """A cached step of a few new tokens (the kept sets' update, then the dense kernel over the
    gathered keys) equals the last rows of the whole sequence through the float64 reference."""
    hidden, H, KVH, W, S, new = 2 * D, 4, 2, 16, 40, 3
    layer = DynamicMaskAttention(hidden, H, KVH, D, keep_window_size=W, backend="cpu", dtype=torch.float64)
    with torch.no_grad():
        layer.A.fill_(0.5)
    x = torch.randn(2, S + new, hidden, dtype=torch.float64)
    _, cache = layer(x[:, :S], use_cache=True)
    step, _ = layer(x[:, S:], past_key_value=cache, use_cache=True)
    layer.backend = "reference"
    whole = layer(x)
    torch.testing.assert_close(step, whole[:, S:], **EXACT)
