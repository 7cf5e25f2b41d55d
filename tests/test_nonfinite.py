"""NaN / Inf inputs reach exactly the rows that use them, on every backend: a diverging training
run must look diverged, and a clean row must not be disturbed by a bad one."""

import pytest
import torch

import flexdma

# causal: row i sees keys j <= i + 2; K >= 16 and D = 32 so that every backend takes the call
B, Q, K, H, KVH, D = 2, 18, 20, 4, 2, 32
NAN, INF = float("nan"), float("inf")


def _inputs(device, dtype, d=D):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Q, H, d, generator=g)
    k = torch.randn(B, K, KVH, d, generator=g)
    v = torch.randn(B, K, KVH, d, generator=g)
    bias = torch.randn(B, H, Q, K, generator=g)
    mask = torch.ones(B, 1, Q, K, dtype=torch.bool)
    mask[..., 1] = False  # key 1 is never attended to
    mask[1, :, 0] = False  # row (b=1, i=0) attends to nothing
    return [t.to(device, dtype) for t in (q, k, v, bias)] + [mask.to(device)]


def _rows(*idx):
    """Expected bad rows as a (B, Q, H) bool tensor; idx are (b, i or slice, h or slice)."""
    out = torch.zeros(B, Q, H, dtype=torch.bool)
    for b, i, h in idx:
        out[b, i, h] = True
    return out


def _set(t, idx, value):
    t[idx] = value


def _q_plus_inf(q, k, v, bias):
    _set(q, (0, 2, 0, 0), INF)
    k[0, :, 0, 0] = k[0, :, 0, 0].abs() + 0.1  # every score of the row is +inf


ALL = slice(None)
# name -> (function that poisons the inputs in place, rows expected non-finite)
CASES = {
    "q nan": (lambda q, k, v, bias: _set(q, (0, 3, 1, 5), NAN), _rows((0, 3, 1))),
    "q nan in a row that attends to nothing": (lambda q, k, v, bias: _set(q, (1, 0, 2, 0), NAN), _rows()),
    "q +inf": (_q_plus_inf, _rows((0, 2, 0))),
    "k nan at a key only the last row sees": (
        lambda q, k, v, bias: _set(k, (0, K - 1, 1, 3), NAN),
        _rows((0, Q - 1, 2), (0, Q - 1, 3)),
    ),
    "k nan at a key every row sees": (
        lambda q, k, v, bias: _set(k, (0, 0, 0, 0), NAN),
        _rows((0, ALL, 0), (0, ALL, 1)),
    ),
    "k nan at a masked key": (lambda q, k, v, bias: _set(k, (0, 1, 0, 0), NAN), _rows()),
    "v nan at a key every row sees": (
        lambda q, k, v, bias: _set(v, (0, 0, 1, 0), NAN),
        _rows((0, ALL, 2), (0, ALL, 3)),
    ),
    "v +inf at a key every row sees": (
        lambda q, k, v, bias: _set(v, (0, 0, 0, 7), INF),
        _rows((0, ALL, 0), (0, ALL, 1)),
    ),
    "bias nan at a visible key": (lambda q, k, v, bias: _set(bias, (0, 1, 2, 3), NAN), _rows((0, 2, 1))),
    "bias +inf at a visible key": (lambda q, k, v, bias: _set(bias, (1, 3, 4, 0), INF), _rows((1, 4, 3))),
    "bias nan at masked and causally hidden keys": (
        lambda q, k, v, bias: (_set(bias, (0, 0, 0, 1), NAN), _set(bias, (0, 0, 0, 5), NAN)),
        _rows(),
    ),
    # a -inf bias masks: the row is empty (out 0, LSE -inf), not broken
    "bias -inf at every key of a row": (lambda q, k, v, bias: _set(bias, (0, 0, 1, ALL), -INF), _rows()),
}


def _check_backend(backend, device, dtype, return_lse, d=D):
    q0, k0, v0, bias0, mask = _inputs(device, dtype, d)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    failures = []
    for name, (poison, expected) in CASES.items():
        q, k, v, bias = q0.clone(), k0.clone(), v0.clone(), bias0.clone()
        poison(q, k, v, bias)
        # The same inputs with the bad values replaced by 0 (a -inf bias is a mask: it stays), in float32.
        clean, _ = flexdma.attention_ref(
            *(t.float().nan_to_num(0.0, 0.0, 0.0) for t in (q, k, v)),
            mask,
            bias.float().nan_to_num(0.0, 0.0, -INF),
            is_causal=True,
        )
        res = flexdma.flash_dma_attention(q, k, v, mask, bias, is_causal=True, backend=backend, return_lse=return_lse)
        out, lse = res if return_lse else (res, None)
        out, clean = out.float().cpu(), clean.cpu()
        bad = ~torch.isfinite(out).all(-1)
        if not torch.equal(bad, expected):
            failures.append(f"{name}: non-finite rows {bad.nonzero().tolist()}, expected {expected.nonzero().tolist()}")
            continue
        if not torch.allclose(out[~bad], clean[~bad], **tol):
            failures.append(f"{name}: rows that do not use the bad value changed")
        if lse is not None:
            lse = lse.cpu()
            bad_lse = (torch.isnan(lse) | (lse == INF)).transpose(1, 2)
            # The LSE depends on the scores only: a bad value of a key does not reach it.
            if not torch.equal(bad_lse, torch.zeros_like(expected) if name.startswith("v ") else expected):
                failures.append(f"{name}: NaN/+inf LSE at {bad_lse.nonzero().tolist()}")
            empty = (lse == -INF).transpose(1, 2)
            want_empty = torch.zeros_like(empty)
            want_empty[1, 0] = True
            if name == "bias -inf at every key of a row":
                want_empty[0, 1, 0] = True
            if not torch.equal(empty, want_empty):
                failures.append(f"{name}: -inf LSE at {empty.nonzero().tolist()}")
    assert not failures, "\n".join(failures)


def _skip_unbuilt(backend, d):
    # A dev build (FLEXDMA_HEAD_DIMS=64,128) lacks some head dims: backend="cuda" rejects them.
    from flexdma import _ext

    if backend == "cuda" and (_ext.BUILD_INFO is None or d not in _ext.BUILD_INFO.CUDA_HEAD_DIMS):
        pytest.skip(f"head_dim {d} is not in this build's CUDA head dims")


_CASES = [
    ("reference", "cpu", torch.float32),
    ("flex", "cpu", torch.float32),
    ("cpu", "cpu", torch.float32),
    ("cpu", "cpu", torch.bfloat16),
    pytest.param("reference", "cuda", torch.bfloat16, marks=pytest.mark.gpu),
    pytest.param("flex", "cuda", torch.bfloat16, marks=pytest.mark.gpu),
    pytest.param("cuda", "cuda", torch.bfloat16, marks=pytest.mark.gpu),
]


@pytest.mark.gpu
@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "out+lse"])
def test_nonfinite_inputs_cuda_wgmma_head_dim(return_lse):
    # D = 32 above runs the CUDA kernel's mma.sync path; D = 64 its wgmma one (sm_90a builds).
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _skip_unbuilt("cuda", 64)
    _check_backend("cuda", "cuda", torch.bfloat16, return_lse, d=64)


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "out+lse"])
@pytest.mark.parametrize("backend, device, dtype", _CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_nonfinite_inputs_reach_the_rows_that_use_them(backend, device, dtype, return_lse):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if backend not in flexdma.available_backends():
        pytest.skip(f"backend {backend} is not available")
    _skip_unbuilt(backend, D)
    _check_backend(backend, device, dtype, return_lse)


def test_flex_row_bias_nonfinite_like_the_reference():
    # The flex path applies a bias constant along keys to the LSE instead of the scores when it
    # needs a gradient (training); NaN / +inf / -inf entries must act as they do in the scores.
    if "flex" not in flexdma.available_backends():
        pytest.skip("FlexAttention is unavailable")
    from flexdma.dense import flex

    q, k, v, _, mask = _inputs("cpu", torch.float32)
    rb = torch.randn(B, H, Q, 1)
    rb[0, 1, 2] = NAN
    rb[0, 2, 3] = INF
    rb[1, 0, 4] = -INF
    rb[1, 3, 0] = NAN  # an empty row stays empty
    ref, ref_lse = flexdma.attention_ref(q, k, v, mask, rb, is_causal=True, softmax_scale=0.25)
    out, lse = flex.forward(q, k, v, mask, rb.requires_grad_(), True, 0.25, 0.0, training=True, need_lse=False)
    torch.testing.assert_close(out, ref, equal_nan=True)
    torch.testing.assert_close(lse, ref_lse, equal_nan=True)
