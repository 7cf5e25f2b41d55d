"""dynamic_mask_attention and the flexdma.nn layers against independent eager implementations."""

import pytest
import torch
import torch.nn.functional as F
from utils import FP32_RTOL

import flexdma
from flexdma.dense.naive import attention_ref
from flexdma.dynamic import dynamic_mask_attention
from flexdma.nn import DynamicMaskAttention, MultiheadDynamicMaskAttention, apply_rotary, rotary_cos_sin

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _backends(device):
    if device == "cuda":
        return ["auto"]
    return [b for b in ("cpu", "reference") if b in flexdma.available_backends()]


CASES = [(d, b) for d in DEVICES for b in _backends(d)]


def naive_dynamic_mask(bias, window, *, Q, padding=None, is_causal=True):
    """Loop version of the top-k selection: per (b, h, query row) the `window` highest-bias visible
    keys, ties to the lower key index."""
    B, H, _, K = bias.shape
    mask = torch.zeros(B, H, Q, K, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for i in range(Q):
                vis = [
                    j
                    for j in range(K)
                    if (not is_causal or j <= i + K - Q) and (padding is None or bool(padding[b, j]))
                ]
                vis.sort(key=lambda j: (-float(bias[b, h, 0, j]), j))
                mask[b, h, i, vis[:window]] = True
    return mask


def eager_dma(q, k, v, dt_proj, A, window, *, padding=None, is_causal=True, dtype=torch.float64):
    """Explicit bias formula, loop mask, reference attention, computed in `dtype` (float64: the
    truth; the inputs' own dtype: the eager error a kernel is allowed twice of)."""
    B, K, KVH, D = v.shape
    q, k, v, dt_proj, A = (t.to(dtype) for t in (q, k, v, dt_proj, A))
    bias = torch.exp(A * F.softplus(v.reshape(B, K, KVH * D) @ dt_proj.T)).transpose(1, 2)[:, :, None, :]
    mask = naive_dynamic_mask(bias.detach().cpu(), window, Q=q.shape[1], padding=padding, is_causal=is_causal)
    return attention_ref(q, k, v, mask.to(q.device), bias, is_causal=False)[0]


def saturation_bound(q, k, v, dt_proj, A, window, grad_out, out, *, padding=None):
    """What the CUDA backward's row term may add to the gradients that reach dt_proj, A and v
    through the bias (docs/kernels.md, "Where a huge bias amplifies rounding"): its delta =
    rowsum(dO out) is summed in another order than the dP it is subtracted from, so a saturated
    row's dS = P (dP - delta), exactly 0, keeps float32 rounding of that sum, which the bias's
    gradient multiplies by the bias (exp(A softplus(x)), thousands and more once A > 1). Bound per
    row: 2 D eps |dO| . |out|, times P for each key it keeps, through the chain's derivatives in
    absolute value. Returns {name: max bound} for dv, ddt_proj and dA (float64)."""
    B, Q, H, D = q.shape
    K, KVH = v.shape[1], v.shape[2]
    q, k, v, dt_proj, A, grad_out, out = (t.detach().double().cpu() for t in (q, k, v, dt_proj, A, grad_out, out))
    x = v.reshape(B, K, KVH * D) @ dt_proj.T  # (B, K, KVH)
    bias = torch.exp(A * F.softplus(x)).transpose(1, 2)  # (B, KVH, K)
    mask = naive_dynamic_mask(bias[:, :, None, :], window, Q=Q, padding=padding)  # (B, KVH, Q, K)
    kv = torch.arange(H) // (H // KVH)
    s = torch.einsum("bihd,bjhd->bhij", q, k[:, :, kv]) / D**0.5 + bias[:, kv, None, :]
    p = torch.softmax(s.masked_fill(~mask[:, kv], float("-inf")), -1).nan_to_num(0.0)  # (B, H, Q, K)
    row = 2 * D * torch.finfo(torch.float32).eps * (grad_out.abs() * out.abs()).sum(-1)  # (B, Q, H)
    e = torch.einsum("bhij,bih->bhj", p, row).reshape(B, KVH, H // KVH, K).sum(2)  # (B, KVH, K)
    chain = e * bias * A.abs()[:, None] * torch.sigmoid(x.transpose(1, 2))  # |d bias / d x| e
    return {
        "dA": (e * bias * F.softplus(x.transpose(1, 2))).sum((0, 2)).max().item(),
        "ddt_proj": torch.einsum("bhj,bjc->hc", chain, v.reshape(B, K, KVH * D).abs()).max().item(),
        "dv": torch.einsum("bhj,hc->bjc", chain, dt_proj.abs()).max().item(),
    }


@pytest.mark.parametrize("device,backend", CASES)
@pytest.mark.parametrize(
    "Q,K,window,padded", [(16, 16, 5, False), (16, 16, 64, True), (3, 20, 7, True), (1, 9, 4, False)]
)
def test_dynamic_mask_attention_matches_eager(device, backend, Q, K, window, padded):
    B, H, KVH, D = 2, 4, 2, 16
    q = torch.randn(B, Q, H, D, device=device, requires_grad=True)
    k = torch.randn(B, K, KVH, D, device=device, requires_grad=True)
    v = torch.randn(B, K, KVH, D, device=device, requires_grad=True)
    dt = (0.3 * torch.randn(KVH, KVH * D, device=device)).requires_grad_()
    A = torch.randn(KVH, device=device).requires_grad_()
    padding = None
    if padded:
        padding = torch.ones(B, K, dtype=torch.bool, device=device)
        padding[1, :2] = False
    out = dynamic_mask_attention(q, k, v, dt, A, keep_window_size=window, attn_mask=padding, backend=backend)
    pad = None if padding is None else padding.cpu()
    ref = eager_dma(q, k, v, dt, A, window, padding=pad)
    ref32 = eager_dma(q, k, v, dt, A, window, padding=pad, dtype=torch.float32)
    g = torch.randn_like(out)
    leaves = (q, k, v, dt, A)
    results = zip(
        "out dq dk dv ddt_proj dA".split(),
        (out, *torch.autograd.grad(out, leaves, g)),
        (ref, *torch.autograd.grad(ref, leaves, g.double())),
        (ref32, *torch.autograd.grad(ref32, leaves, g)),
    )
    # FlashAttention's rule in float32: at most twice the float32 eager computation's error against
    # the float64 truth, plus the suite's float32 floor (tests/utils.py's FP32_RTOL of the result's
    # magnitude); 10x that for dt_proj's and A's gradients, each a sum over every key and row of
    # bias-gradient terms that cancel (a row's softmax gradient sums to zero), so their rounding
    # scales with the terms, not with the small result. On CUDA the gradients that pass through the
    # bias also get saturation_bound: the backward's row term there is dO . out, not the CPU
    # kernel's sum of P dP, which is exact on a saturated row (tests/dense/test_cpu_precision.py).
    bound = saturation_bound(q, k, v, dt, A, window, g, out, padding=pad) if device == "cuda" else {}
    for name, got, truth, eager in results:
        err = (got.double() - truth).abs().max().item()
        eager_err = (eager.double() - truth).abs().max().item()
        floor = FP32_RTOL * (10 if name in ("ddt_proj", "dA") else 1) * (1 + truth.abs().max().item())
        floor += bound.get(name, 0.0)
        assert err <= 2 * eager_err + floor, (
            f"{name}: error {err:.3e} > 2 x float32 eager {eager_err:.3e} + {floor:.1e}"
        )


def test_dynamic_mask_attention_window_prunes_keys():
    # A window of 1 over per-key scores: every query sees exactly its best visible key.
    B, S, H, D = 1, 8, 1, 4
    q, k, v = torch.randn(B, S, H, D), torch.randn(B, S, H, D), torch.randn(B, S, H, D)
    dt, A = torch.randn(1, D), torch.tensor([1.0])
    out = dynamic_mask_attention(q, k, v, dt, A, keep_window_size=1, backend="reference")
    score = F.softplus(v.reshape(S, D) @ dt.T).squeeze(-1)
    for i in range(S):
        best = int(torch.argmax(score[: i + 1]))
        torch.testing.assert_close(out[0, i, 0], v[0, best, 0])


def test_dynamic_mask_attention_bad_args():
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="dt_proj"):
        dynamic_mask_attention(q, k, v, torch.randn(2, 8), torch.randn(2))
    with pytest.raises(ValueError, match="A must"):
        dynamic_mask_attention(q, k, v, torch.randn(2, 16), torch.randn(3))
    with pytest.raises(TypeError, match="attn_mask"):
        dynamic_mask_attention(q, k, v, torch.randn(2, 16), torch.randn(2), attn_mask=torch.ones(1, 4))


def layer_eager(layer, x, cos, sin, padding):
    """DynamicMaskAttention written out with plain tensor ops and the float64 truth."""
    B, S, _ = x.shape
    q = layer.q_proj(x).view(B, S, layer.num_heads, layer.head_dim)
    k = layer.k_proj(x).view(B, S, layer.num_kv_heads, layer.head_dim)
    v = layer.v_proj(x).view(B, S, layer.num_kv_heads, layer.head_dim)
    c, s = cos[:, :, None], sin[:, :, None]
    half = layer.head_dim // 2
    rot = lambda t: t * c + torch.cat((-t[..., half:], t[..., :half]), -1) * s  # noqa: E731
    o = eager_dma(rot(q), rot(k), v, layer.dt_proj, layer.A, layer.keep_window_size, padding=padding)
    return layer.o_proj(o.float().reshape(B, S, -1))


@pytest.mark.parametrize("device,backend", CASES)
def test_dynamic_mask_attention_layer(device, backend):
    B, S = 2, 12
    layer = DynamicMaskAttention(32, 4, 2, 16, keep_window_size=6, backend=backend).to(device)
    with torch.no_grad():
        layer.A.normal_()
    x = torch.randn(B, S, 32, device=device)
    cos, sin = rotary_cos_sin(torch.arange(S, device=device).expand(B, S), 16)
    padding = torch.ones(B, S, dtype=torch.bool, device=device)
    padding[0, :3] = False
    out = layer(x, (cos, sin), attention_mask=padding)
    ref = layer_eager(layer, x, cos, sin, padding.cpu())
    real = padding[:, :, None].expand_as(out)  # fully padded query rows are 0 by convention
    torch.testing.assert_close(out[real], ref[real], atol=2e-5, rtol=1e-4)
    out.square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("device,backend", CASES)
def test_kv_cache_decoding_matches_full_forward(device, backend):
    B, S, P = 2, 10, 4
    layer = DynamicMaskAttention(32, 4, 1, keep_window_size=5, backend=backend).to(device)
    with torch.no_grad():
        layer.A.normal_()
    x = torch.randn(B, S, 32, device=device)
    rope = lambda a, b: rotary_cos_sin(torch.arange(a, b, device=device), 8)  # noqa: E731
    full = layer(x, rope(0, S))
    # Prefill P tokens, then decode one token at a time.
    out, cache = layer(x[:, :P], rope(0, P), use_cache=True)
    outs = [out]
    for t in range(P, S):
        out, cache = layer(x[:, t : t + 1], rope(t, t + 1), past_key_value=cache, use_cache=True)
        outs.append(out)
    assert cache[0].shape == (B, S, 1, 8)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)


def test_apply_rotary_matches_complex_rotation():
    x = torch.randn(1, 5, 2, 8)
    cos, sin = rotary_cos_sin(torch.arange(5), 8)
    y = apply_rotary(x, cos, sin)
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2) / 8))
    ang = torch.arange(5)[:, None] * inv
    z = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones_like(ang), ang)[None, :, None]
    torch.testing.assert_close(y, torch.cat((z.real, z.imag), -1), atol=1e-5, rtol=1e-5)


def test_layer_bad_args():
    with pytest.raises(ValueError, match="num_kv_heads"):
        DynamicMaskAttention(32, 4, 3)
    with pytest.raises(ValueError, match="keep_window_size"):
        DynamicMaskAttention(32, 4, keep_window_size=0)
    layer = DynamicMaskAttention(32, 4)
    with pytest.raises(ValueError, match="attention_mask"):
        layer(torch.randn(1, 4, 32), attention_mask=torch.ones(1, 4))


@pytest.mark.parametrize("device,backend", CASES)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masking", ["none", "padding", "attn_mask", "causal", "cross"])
def test_multihead_matches_torch(device, backend, batch_first, masking):
    E, H, B, L = 32, 4, 2, 9
    S = 13 if masking == "cross" else L
    ours = MultiheadDynamicMaskAttention(E, H, batch_first=batch_first, keep_window_size=10_000, backend=backend).to(
        device
    )
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=batch_first).to(device)
    with torch.no_grad():
        theirs.in_proj_weight.copy_(ours.in_proj_weight)
        theirs.in_proj_bias.copy_(torch.randn(3 * E))
        ours.in_proj_bias.copy_(theirs.in_proj_bias)
        ours.out_proj.weight.copy_(theirs.out_proj.weight)
        ours.out_proj.bias.copy_(torch.randn(E))
        theirs.out_proj.bias.copy_(ours.out_proj.bias)
    shape = (lambda n: (B, n, E)) if batch_first else (lambda n: (n, B, E))
    query = torch.randn(shape(L), device=device)
    key = query if masking != "cross" else torch.randn(shape(S), device=device)
    kw = {}
    ours_kw = {}
    if masking == "padding":
        kpm = torch.zeros(B, S, dtype=torch.bool, device=device)
        kpm[1, -3:] = True
        kw["key_padding_mask"] = kpm
    elif masking == "attn_mask":
        kw["attn_mask"] = torch.rand(L, S, device=device) < 0.3
        kw["attn_mask"][:, 0] = False  # no fully masked rows (torch gives NaN there)
    elif masking == "causal":
        kw["attn_mask"] = torch.ones(L, S, dtype=torch.bool, device=device).triu(1)
        ours_kw = {"is_causal": True}
    out, w = ours(query, key, key, **(kw if masking != "causal" else ours_kw))
    assert w is None
    ref, _ = theirs(query, key, key, need_weights=False, **kw)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_multihead_rejects_unsupported():
    with pytest.raises(ValueError, match="dropout"):
        MultiheadDynamicMaskAttention(16, 2, dropout=0.1)
    with pytest.raises(ValueError, match="kdim"):
        MultiheadDynamicMaskAttention(16, 2, kdim=8)
    m = MultiheadDynamicMaskAttention(16, 2, batch_first=True)
    x = torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match="need_weights"):
        m(x, x, x, need_weights=True)
    with pytest.raises(TypeError, match="attn_mask"):
        m(x, x, x, attn_mask=torch.zeros(3, 3))


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("kvh,window", [(2, 5), (1, 9), (2, 64)])
@pytest.mark.parametrize("per_step", [1, 4])
def test_selection_cache_decoding_matches_full_forward(grad, padded, kvh, window, per_step, monkeypatch):
    # float64: a sequence decoded token by token (or a few tokens a step, each row with its own
    # kept set) through the cache's O(W) kept-set update equals the whole sequence at once (W below
    # and above the length, GQA, left padding); without autograd the cache appends into buffers
    # with spare room, with it by concatenation.
    B, S, P = 2, 40, 6
    layer = DynamicMaskAttention(32, 4, kvh, keep_window_size=window, dtype=torch.float64)
    with torch.no_grad():
        layer.A.normal_()
    x = torch.randn(B, S, 32, dtype=torch.float64)
    x[:, 20:23] = x[:, 3:4]  # repeated tokens: equal scores, the older key wins the tie
    rope = lambda a, b: rotary_cos_sin(torch.arange(a, b), 8, dtype=torch.float64)  # noqa: E731
    pad = None
    if padded:
        pad = torch.ones(B, S, dtype=torch.bool)
        pad[1, :4] = False
        pad[0, 10] = False  # a padded token in the middle (decoded without a padding change later)
    full = layer(x, rope(0, S), attention_mask=pad)
    out, cache = layer(x[:, :P], rope(0, P), attention_mask=None if pad is None else pad[:, :P], use_cache=True)
    assert isinstance(cache, flexdma.nn.DMACache)
    outs = [out]

    def no_selection(*a, **k):
        raise AssertionError("a decode step ran the selection over all keys")

    monkeypatch.setattr(flexdma.perkey.contract, "select", no_selection)
    with torch.set_grad_enabled(grad):
        for t in range(P, S, per_step):
            e = min(t + per_step, S)
            out, cache = layer(
                x[:, t:e],
                rope(t, e),
                attention_mask=None if pad is None else pad[:, :e],
                past_key_value=cache,
                use_cache=True,
            )
            outs.append(out)
    if grad:  # gradients flow through the gathered keys and the cached biases
        torch.cat(outs, 1).sum().backward()
        assert layer.dt_proj.grad is not None and layer.A.grad.abs().sum() > 0
    k, v = cache  # still unpacks as the (key, value) pair
    assert k.shape == (B, S, kvh, 8) and cache.sel_idx.shape == (B, kvh, window)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-12, rtol=1e-10)


@torch.no_grad()
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_one_op_decode_steps(monkeypatch, device):
    # bf16: one-token steps take the one-op step (flexdma::decode_append: the new key written into
    # the cache's buffers, the kept set updated in place, the row attended); the same kept sets as
    # the gathered path, outputs within FlashAttention's rule of float64.
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from flexdma.perkey import decode

    B, S, P = 2, 60, 5
    layer = DynamicMaskAttention(128, 8, 2, keep_window_size=9).to(device)
    layer.A.normal_()
    wide = DynamicMaskAttention(128, 8, 2, keep_window_size=9, dtype=torch.float64, backend="reference").to(device)
    wide.load_state_dict(layer.state_dict())
    layer = layer.bfloat16()
    x = torch.randn(B, S, 128, device=device).bfloat16()
    pad = torch.ones(B, S, dtype=torch.bool, device=device)
    pad[1, :3] = False
    rope = lambda a, b, dt: rotary_cos_sin(torch.arange(a, b, device=device), 16, dtype=dt)  # noqa: E731
    full = wide(x.double(), rope(0, S, torch.float64), attention_mask=pad)
    calls = []
    append_one = decode.append_one
    monkeypatch.setattr(decode, "append_one", lambda *a, **k: calls.append(1) or append_one(*a, **k))
    got = {}
    for path in ("one op", "gathered"):
        if path == "gathered":
            monkeypatch.setattr(decode, "one_kernel_reason", lambda *a: "forced")
        out, cache = layer(x[:, :P], rope(0, P, torch.bfloat16), attention_mask=pad[:, :P], use_cache=True)
        outs, kept = [], []
        for t in range(P, S):
            out, cache = layer(
                x[:, t : t + 1],
                rope(t, t + 1, torch.bfloat16),
                attention_mask=pad[:, : t + 1],
                past_key_value=cache,
                use_cache=True,
            )
            outs.append(out.double())
            kept.append((cache.sel_idx.clone(), cache.sel_valid.clone()))
        got[path] = (torch.cat(outs, 1), kept)
    assert len(calls) == S - P
    for (i1, v1), (i2, v2) in zip(got["one op"][1], got["gathered"][1]):
        assert torch.equal(v1, v2) and torch.equal(i1[v1], i2[v2])
    err = (got["one op"][0] - full[:, P:]).abs().max().item()
    base = (got["gathered"][0] - full[:, P:]).abs().max().item()
    assert err <= 2 * base + 1e-2, (err, base)


def test_selection_cache_is_the_last_row_of_the_full_selection():
    B, S, W = 2, 30, 6
    layer = DynamicMaskAttention(32, 4, 2, keep_window_size=W, dtype=torch.float64)
    with torch.no_grad():
        layer.A.normal_()
    x = torch.randn(B, S, 32, dtype=torch.float64)
    _, cache = layer(x[:, :10], use_cache=True)
    for t in range(10, S):
        _, cache = layer(x[:, t : t + 1], past_key_value=cache, use_cache=True)
    _, full = layer(x, use_cache=True)
    bias = full.bias[:, :, None, :]
    want = flexdma.create_mask(bias, W, is_causal=True, query_len=S)[:, :, -1]  # (B, KVH, K)
    got = torch.zeros(want.shape, dtype=torch.int32).scatter_add_(-1, cache.sel_idx, cache.sel_valid.int())
    assert torch.equal(got > 0, want)
    # The old tuple form still works as past_key_value (full path) and gives the same step.
    o1, _ = layer(x[:, -1:], past_key_value=(cache[0][:, :-1], cache[1][:, :-1]), use_cache=True)
    o2 = layer(x)[:, -1:]
    torch.testing.assert_close(o1, o2)


def test_packed_sequences_equal_one_by_one():
    # cu_seqlens: one packed row of documents (lengths around W = 4, one of a single token, one
    # empty), each attending and selecting within itself; positions restart per document.
    torch.manual_seed(0)
    layer = DynamicMaskAttention(32, 4, 2, keep_window_size=4, dtype=torch.float64)
    with torch.no_grad():
        layer.A.normal_()
    lens = [6, 1, 0, 9]
    x = torch.randn(1, sum(lens), 32, dtype=torch.float64, requires_grad=True)
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    packed = layer(x, rotary_cos_sin(pos, 8, dtype=torch.float64), cu_seqlens=cu, max_seqlen=max(lens))
    parts, start = [], 0
    for n in lens:
        if n:
            parts.append(layer(x[:, start : start + n], rotary_cos_sin(torch.arange(n), 8, dtype=torch.float64)))
        start += n
    want = torch.cat(parts, 1)
    torch.testing.assert_close(packed, want, atol=1e-12, rtol=1e-10)
    g = torch.randn_like(want)
    a = torch.autograd.grad(packed, (x, layer.dt_proj, layer.A), g)
    b = torch.autograd.grad(want, (x, layer.dt_proj, layer.A), g)
    for u, w in zip(a, b):
        torch.testing.assert_close(u, w, atol=1e-10, rtol=1e-9)
    with pytest.raises(ValueError, match="no attention_mask"):
        layer(x, cu_seqlens=cu, max_seqlen=9, use_cache=True)
    with pytest.raises(TypeError, match="max_seqlen"):
        layer(x, cu_seqlens=cu)


@pytest.mark.parametrize("per_step", [1, 3])
@pytest.mark.parametrize("seed", range(3))
def test_kept_set_updates_equal_the_selection_of_every_prefix(seed, per_step):
    # flexdma.perkey.decode: appending keys one at a time (or a few a step, each new row with its
    # own kept set) keeps exactly the top-W of every prefix in the selection's order: NaN first,
    # -0.0 tied with +0.0, -inf and padding never kept, ties to the older key.
    from flexdma.perkey import decode

    g = torch.Generator().manual_seed(seed)
    B, P, K, W, K0 = 2, 3, 40, 6, 3
    s = (torch.randn(B, P, K, generator=g) * 2).round()  # many ties
    s[0, 0, 5], s[0, 1, 7], s[1, 2, 9] = float("nan"), -0.0, 0.0
    s[1, 0, 11:14] = float("-inf")
    eligible = (torch.rand(B, 1, K, generator=g) < 0.85).expand(B, P, K)
    masked = s.masked_fill(~eligible, float("-inf"))

    def members(idx, keep):  # key membership (free slots repeat key indices: added, not written)
        return torch.zeros(B, P, K, dtype=torch.int64).scatter_add_(-1, idx, keep.long()) > 0

    def want(n):  # the top-W of the first n keys
        kept = decode.last_row(masked[..., :n], W)
        return members(kept.idx, kept.valid)

    kept = decode.last_row(masked[..., :K0], W)
    for n0 in range(K0, K, per_step):
        T = min(per_step, K - n0)
        rows = decode.append_rows(kept, s[..., n0 : n0 + T], n0, eligible[..., n0 : n0 + T])
        for t in range(T):
            assert torch.equal(members(rows.idx, rows.keep[:, :, t]), want(n0 + t + 1)), (n0, t)
        kept = rows.kept


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_step", [1, 3])
def test_float64_kept_set_updates_rank_in_float64(per_step, device):
    # flexdma.perkey.decode on float64 scores ranks them in float64, as the selection does: keys
    # whose scores differ below float32's resolution are not ties (the newer, higher one wins),
    # positive and negative ones alike, beside NaN, -0.0 / +0.0, -inf and padding. On CUDA the
    # float64 steps take the torch ops, not the float32 kernel.
    from flexdma.perkey import decode

    g = torch.Generator().manual_seed(3)
    B, P, K, W, K0 = 2, 3, 40, 6, 3
    s = torch.randn(B, P, K, generator=g, dtype=torch.float64)
    steps = torch.rand(B, P, 9, generator=g, dtype=torch.float64).add(0.5).cumsum(-1)
    s[..., 4:13] = 3.0 + 1e-12 * steps  # rising with the index, above every other score
    s[0, 1, 20:26] = -0.5 - 1e-12 * torch.arange(6, 0, -1, dtype=torch.float64)
    s[0, 1, 14:20] = -10.0  # so the negative group competes for the last slots of its plane
    s[0, 0, 30], s[1, 1, 31], s[1, 2, 32] = float("nan"), -0.0, 0.0
    s[1, 0, 33:35] = float("-inf")
    assert (s[..., 4:13].float() == 3.0).all() and (s[0, 1, 20:26].float() == -0.5).all()
    eligible = (torch.rand(B, 1, K, generator=g) < 0.9).expand(B, P, K)
    s, eligible = s.to(device), eligible.to(device)
    masked = s.masked_fill(~eligible, float("-inf"))

    def members(idx, keep):  # key membership (free slots repeat key indices: added, not written)
        return torch.zeros(B, P, K, dtype=torch.int64, device=device).scatter_add_(-1, idx, keep.long()) > 0

    def want(scores, n):  # the top-W of the first n keys (a stable float64 sort)
        kept = decode.last_row(scores[..., :n], W)
        return members(kept.idx, kept.valid)

    kept = decode.last_row(masked[..., :K0], W)
    differs = 0  # prefixes whose float32 rule keeps other keys: the near ties decide
    for n0 in range(K0, K, per_step):
        T = min(per_step, K - n0)
        rows = decode.append_rows(kept, s[..., n0 : n0 + T], n0, eligible[..., n0 : n0 + T])
        for t in range(T):
            assert torch.equal(members(rows.idx, rows.keep[:, :, t]), want(masked, n0 + t + 1)), (n0, t)
            differs += not torch.equal(want(masked, n0 + t + 1), want(masked.float(), n0 + t + 1))
        kept = rows.kept
    assert differs > 10


@pytest.mark.parametrize("per_step", [1, 4])
def test_float64_cache_steps_rank_in_float64(per_step):
    # A float64 DynamicMaskAttention decoded through its cache's O(W) kept-set update equals the
    # whole sequence at once when scores tie only in float32: a group of tokens whose importance
    # scores rise by ~1e-9 relative (one float32 value), above every other key, with unrelated
    # keys and values. The float64 order keeps the group's newest W, the float32 rule its oldest.
    torch.manual_seed(0)
    B, S, P, W, hidden = 2, 40, 6, 5, 32
    group = range(10, 10 + W + 4)
    layer = DynamicMaskAttention(hidden, 4, 2, keep_window_size=W, dtype=torch.float64)
    with torch.no_grad():
        layer.A.uniform_(0.5, 1.0)
    # z(x) = G x: the pre-softplus scores of every kv head (v_proj has no bias). Group token i is
    # random with its component in G's row space replaced: z = c + 1e-9 * i in every head.
    G = layer.dt_proj.detach() @ layer.v_proj.weight.detach()
    pinv = torch.linalg.pinv(G)  # (hidden, KVH): G @ pinv = I
    x = torch.randn(B, S, hidden, dtype=torch.float64)
    c = (x @ G.T).max().item() + 3.0
    for i, t in enumerate(group):
        r = x[:, t] - x[:, t] @ G.T @ pinv.T
        x[:, t] = r + (c + 1e-9 * i) * pinv.sum(-1)
    rope = lambda a, b: rotary_cos_sin(torch.arange(a, b), 8, dtype=torch.float64)  # noqa: E731
    full, full_cache = layer(x, rope(0, S), use_cache=True)
    bias = full_cache.bias[:, :, None, :]  # (B, KVH, 1, S)
    g = bias[..., list(group)]
    assert (g.float() == g[..., :1].float()).all() and (g.diff(dim=-1) > 0).all()
    assert (bias[..., list(group)].amin(-1) > bias[..., [t for t in range(S) if t not in group]].amax(-1)).all()
    out, cache = layer(x[:, :P], rope(0, P), use_cache=True)
    outs = [out]
    with torch.no_grad():
        for t in range(P, S, per_step):
            e = min(t + per_step, S)
            out, cache = layer(x[:, t:e], rope(t, e), past_key_value=cache, use_cache=True)
            outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-12, rtol=1e-10)
    want = flexdma.create_mask(bias, W, is_causal=True, query_len=S)[:, :, -1]
    got = torch.zeros(want.shape, dtype=torch.int32).scatter_add_(-1, cache.sel_idx, cache.sel_valid.int())
    assert torch.equal(got > 0, want)
    assert want[..., group[-W] : group[-1] + 1].all() and want.sum(-1).eq(W).all()  # the group's newest W
    assert not torch.equal(flexdma.create_mask(bias.float(), W, is_causal=True, query_len=S)[:, :, -1], want)
