"""The CPU kernels where rounding would show.

- float64 is computed in float64 throughout, the softmax scale and the softcap included: at head
  dims whose 1/sqrt(D) float32 cannot hold (32, 96, 128) and at a scale of no power of two, every
  kernel (dense, per-key, packed, decoding through the kept sets; forward and backward) agrees
  with the float64 reference to 1e-12.
- A saturated row (its kept probabilities one-hot) has dS = 0 exactly: its true gradient. Doge's
  bias exp(A * softplus(v @ dt_proj^T)) reaches 1e7 and more once A > 0, and multiplies whatever
  the kernel leaves in dS on its way to dt_proj, A and v.
"""

import pytest
import torch
import torch.nn.functional as F
from utils import assert_close_to_ref, make_qkv, reference_with_grads

import flexdma
from flexdma.nn import DynamicMaskAttention
from scripts.dev.saturated_grad import eager_doge

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


# ------------------------------------------------------------------------------ saturated rows
def test_one_hot_row_has_zero_bias_gradient():
    """Rows whose softmax is one-hot (one key's bias 1e4 above the rest) give dbias = 0 exactly
    on every key of that row, dense and per-key, float32 and float64."""
    torch.manual_seed(0)
    B, Q, K, H, D = 1, 70, 90, 2, 64
    for dtype in (torch.float32, torch.float64):
        q, k, v = make_qkv(B, Q, K, H, H, D, dtype=dtype, requires_grad=True)
        hot = torch.randint(0, K, (Q,))
        bias = torch.randn(1, H, Q, K, dtype=dtype)
        bias[0, :, torch.arange(Q), hot] += 1e4
        bias.requires_grad_()
        out = flexdma.flash_dma_attention(q, k, v, None, bias, backend="cpu")
        dbias, dq = torch.autograd.grad(out, (bias, q), torch.randn_like(out))
        assert (dbias == 0).all(), f"{dtype}: dbias of one-hot rows up to {dbias.abs().max().item():.2e}"
        assert (dq == 0).all(), f"{dtype}: dq of one-hot rows up to {dq.abs().max().item():.2e}"
        # Per-key: one key far above the others, every row that sees it is one-hot.
        pk = torch.randn(1, H, 1, K, dtype=dtype)
        pk[..., 5] += 1e4
        pk.requires_grad_()
        out = flexdma.flash_dma_attention(q, k, v, None, pk, keep_window_size=16, is_causal=True, backend="cpu")
        (dpk,) = torch.autograd.grad(out, (pk,), torch.randn_like(out))
        assert (dpk == 0).all(), f"{dtype}: per-key dbias of one-hot rows up to {dpk.abs().max().item():.2e}"


@pytest.mark.parametrize("seed,A", [(42, None), (2, 1.0)], ids=["seed42-randnA", "seed2-A1"])
def test_doge_gradient_benchmark_with_huge_bias(seed, A):
    """The seed's gradient benchmark (B = H = 1, L = D = 64, keep_window_size 32,
    inputs drawn in its order; A > 0, so the bias reaches 1e6 and more and many rows saturate):
    dq, dk, dv, d dt_proj and dA of flexdma.dynamic_mask_attention on the CPU kernel agree with
    the float32 eager computation to 1e-3 of each gradient's largest entry. A saturated row's dS
    left at the last bits of dP would be multiplied by the bias into errors of 1e3."""
    torch.manual_seed(seed)
    B, H, L, D, W = 1, 1, 64, 64, 32
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    dt_proj = torch.randn(H, H * D)
    A = torch.randn(H) if A is None else torch.full((H,), A)
    assert (A > 0).all()
    bias = torch.exp(A * F.softplus(v.transpose(1, 2).reshape(B, L, H * D) @ dt_proj.T))
    assert bias.max() > 1e6  # the regime the test is about

    ref_in = [t.clone().requires_grad_() for t in (q, k, v, dt_proj, A)]
    ref_out = eager_doge(*ref_in, scale=D**-0.5, window=W)
    ref = torch.autograd.grad(ref_out.sum(), ref_in)

    ins = [t.clone().requires_grad_() for t in (q, k, v, dt_proj, A)]
    qs, ks, vs = (t.transpose(1, 2) for t in ins[:3])
    out = flexdma.dynamic_mask_attention(
        qs, ks, vs, ins[3], ins[4], keep_window_size=W, is_causal=True, softmax_scale=D**-0.5, backend="cpu"
    ).transpose(1, 2)
    got = torch.autograd.grad(out.sum(), ins)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-5)
    for name, g, r in zip(("dq", "dk", "dv", "d dt_proj", "dA"), got, ref):
        assert torch.isfinite(r).all(), name
        err, size = (g - r).abs().max().item(), r.abs().max().item()
        assert err <= 1e-3 * size, f"{name}: max error {err:.3e} against a largest entry of {size:.3e}"


@pytest.mark.parametrize("softcap", [0.0, 4.7], ids=["nocap", "cap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_schedules_agree_past_the_kept_tiles(dtype, softcap):
    """Sweep 0 keeps the tiles of the first 16 key tiles for sweep 1 and forms later ones again;
    either way, and in the fused schedule (B * KVH = 2 on 1 thread) as in the split one (3
    threads), the backward gives the same bits."""
    B, Q, K, H, KVH, D = 1, 70, 16 * 64 + 100, 4, 2, 32
    q, k, v = make_qkv(B, Q, K, H, KVH, D, dtype=dtype)
    bias = torch.randn(1, KVH, 1, K).to(dtype)
    mask = torch.rand(B, 1, Q, K) < 0.8
    grad_out = torch.randn(B, Q, H, D).to(dtype)

    def backward():
        out, lse, resid = torch.ops.flexdma.fwd(q, k, v, mask, bias, 0.3, True, softcap, False)
        return torch.ops.flexdma.bwd(grad_out, q, k, v, mask, bias, out, lse, 0.3, True, softcap, True, True)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        fused = backward()
        torch.set_num_threads(3)
        split = backward()
    finally:
        torch.set_num_threads(threads)
    for a, b, name in zip(fused, split, ("dq", "dk", "dv", "dbias")):
        assert torch.equal(a, b), f"{name} differs between the fused and the split backward"
    kw = dict(bias_grad=True, is_causal=True, softmax_scale=0.3, softcap=softcap)
    ref = reference_with_grads(q, k, v, mask, bias, grad_out, dtype=torch.float64, **kw)
    low = None if dtype == torch.float32 else reference_with_grads(q, k, v, mask, bias, grad_out, dtype=dtype, **kw)
    for a, name in zip(fused, ("dq", "dk", "dv", "dbias")):
        assert_close_to_ref(a, ref[name], None if low is None else low[name], name, factor=3.0 if softcap else 2.0)
