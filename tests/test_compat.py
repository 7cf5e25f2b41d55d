"""flexdma.compat runs the seed project's (flash-dmattn) calls: its create_mask with every mask
form the seed and transformers pass, its mask types, and its flash_dmattn_func call forms."""

import pytest
import seed_reference
import torch

import flexdma
from flexdma import compat
from flexdma.compat import create_mask, flash_dmattn_func, flash_dmattn_func_auto

B, Q, K, H, KVH, D = 2, 6, 40, 4, 2, 16


def _padding():
    keep = torch.ones(B, K, dtype=torch.bool)
    keep[1, :13] = False  # left padding of the second sequence
    return keep


def _mask_forms():
    keep = _padding()
    yield "bool", keep
    for dt in (torch.int64, torch.int32, torch.uint8):
        yield f"{dt} 0/1", keep.to(dt)
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        yield f"{dt} 0/1", keep.to(dt)
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        yield f"{dt} additive finfo.min", torch.zeros(B, K, dtype=dt).masked_fill(~keep, torch.finfo(dt).min)
    # the seed's Hugging Face glue fills with -1e30 in bfloat16 and -1e4 in float16
    yield "bfloat16 additive -1e30", torch.zeros(B, K, dtype=torch.bfloat16).masked_fill(~keep, -1e30)
    yield "float16 additive -1e4", torch.zeros(B, K, dtype=torch.float16).masked_fill(~keep, -1e4)
    yield "float32 additive -inf", torch.zeros(B, K).masked_fill(~keep, float("-inf"))
    # transformers' 4-D additive mask (padding folded into (B, 1, Q, K))
    yield "4-D additive", torch.zeros(B, 1, Q, K).masked_fill(~keep[:, None, None, :], torch.finfo(torch.float32).min)


MIN_DTYPES = [None, torch.finfo(torch.float32).min, torch.finfo(torch.bfloat16).min, -1e30, -1e4]


@pytest.mark.parametrize("min_dtype", MIN_DTYPES, ids=lambda m: f"min_dtype={m}")
@pytest.mark.parametrize("form", list(_mask_forms()), ids=lambda f: f[0])
def test_create_mask_reads_every_padding_mask_form(form, min_dtype):
    _, mask = form
    keep = _padding()
    bias = torch.randn(B, KVH, Q, K)
    full = create_mask(bias, mask, B, Q, K, window_size=K, min_dtype=min_dtype)
    assert full.dtype == torch.bool
    assert torch.equal(full.expand(B, KVH, Q, K), keep[:, None, None, :].expand(B, KVH, Q, K))
    topk = create_mask(bias, mask, B, Q, K, window_size=8, min_dtype=min_dtype)
    assert not (topk & ~keep[:, None, None, :]).any(), "a padded key was selected"
    assert (topk.sum(-1) == 8).all()


def test_create_mask_padding_mask_end_to_end():
    # The seed's flow with a Hugging Face tokenizer mask (int64): padded keys must not be attended.
    q, k, v = torch.randn(B, Q, H, D), torch.randn(B, K, KVH, D), torch.randn(B, K, KVH, D)
    bias = torch.randn(B, KVH, Q, K)
    hf_mask = _padding().long()
    mask = create_mask(bias, hf_mask, B, Q, K, window_size=K, min_dtype=torch.finfo(torch.float32).min)
    out = flash_dmattn_func(q, k, v, mask, bias, backend="reference")
    ref, _ = flexdma.attention_ref(q, k, v, _padding()[:, None, None, :], bias)
    torch.testing.assert_close(out, ref)


def test_create_mask_all_zero_float_mask_keeps_every_key():
    # 0 is "attend" in an additive mask; an all-zero mask of keep flags would attend to nothing.
    m = create_mask(torch.randn(B, 1, 1, K), torch.zeros(B, K), B, 1, K, window_size=K)
    assert m.all()


def test_create_mask_query_len_padding_mask_keeps_the_cache():
    keep = torch.ones(B, Q, dtype=torch.long)
    keep[1, :2] = 0
    m = create_mask(torch.randn(B, 1, Q, K), keep, B, Q, K, window_size=K)
    assert m[:, :, :, : K - Q].all()
    assert torch.equal(m[:, 0, 0, K - Q :], keep.bool())


@pytest.mark.parametrize(
    "mask, exc, pattern",
    [
        (
            torch.full((B, K), 0.5),
            ValueError,
            r"must hold keep flags \(1 = attend, 0 = masked\) or be additive \(0 = attend, <= -10000 or -inf = masked\); "
            r"got torch.float32 values 0.5",
        ),
        (torch.full((B, K), -3.0), ValueError, "got torch.float32 values -3"),
        (torch.full((B, K), float("nan")), ValueError, "got torch.float32 values nan"),
        (
            torch.full((B, K), 2, dtype=torch.long),
            ValueError,
            "an integer attention_mask must hold keep flags, 1 = attend and 0 = masked .*; got torch.int64 values 2",
        ),
        (torch.ones(B, K, dtype=torch.complex64), TypeError, "attention_mask must be bool, integer or floating point"),
        (
            torch.ones(B, K + 1, dtype=torch.bool),
            ValueError,
            r"a 2-D attention_mask must be \(batch_size, key_len\) = \(2, 40\) .* got \(2, 41\)",
        ),
        ([[1] * K] * B, TypeError, "attention_mask must be a torch.Tensor or None, got list"),
    ],
    ids=["float 0.5", "float -3", "nan", "long 2", "complex", "2-D shape", "list"],
)
def test_create_mask_bad_attention_mask(mask, exc, pattern):
    with pytest.raises(exc, match=pattern):
        create_mask(torch.randn(B, 1, Q, K), mask, B, Q, K, window_size=4)


def test_create_mask_bad_min_dtype():
    with pytest.raises(ValueError, match=r"min_dtype must be a negative number .* got 5"):
        create_mask(torch.randn(B, 1, Q, K), None, B, Q, K, window_size=4, min_dtype=5)


# ------------------------------------------------------------------ mask types
def test_create_mask_relu_type():
    bias = torch.randn(B, KVH, Q, K)
    keep = _padding()
    m = create_mask(bias, keep.long(), B, Q, K, window_size=4, type="relu")
    assert torch.equal(m, (bias > 0) & keep[:, None, None, :])
    m = create_mask(bias, None, B, Q, K, window_size=4, type="relu", is_causal=True)
    assert torch.equal(m, (bias > 0) & flexdma.dense.naive.causal_mask(Q, K))


def test_create_mask_relu_block_size_smooths_but_keeps_masked_keys_out():
    bias = torch.tensor([[[[1.0, 1.0, -1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 1.0, 1.0]]]])
    m = create_mask(bias, None, 1, 1, 10, window_size=4, block_size=4, type="relu")
    # blocks [0:4] 3 of 4 kept -> whole, [4:8] 1 of 4 -> none, tail [8:10] 2 of 2 -> whole
    assert m[0, 0, 0].tolist() == [True] * 4 + [False] * 4 + [True] * 2
    pad = torch.ones(1, 10, dtype=torch.bool)
    pad[0, 2] = False
    m = create_mask(bias.abs(), pad, 1, 1, 10, window_size=4, block_size=4, type="relu")
    assert not m[0, 0, 0, 2] and m[0, 0, 0, :2].all() and m[0, 0, 0, 3:].all()


def test_create_mask_unknown_type_names_the_supported_ones():
    with pytest.raises(
        ValueError, match=r"type must be one of 'topk', 'relu' \(the seed's mask types\), got 'sigmoid'"
    ):
        create_mask(torch.randn(B, 1, Q, K), None, B, Q, K, window_size=4, type="sigmoid")


# ------------------------------------------------------------------ flash_dmattn_func call forms
def _qkv(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*s, generator=g).to(dtype) for s in ((B, Q, H, D), (B, K, KVH, D), (B, K, KVH, D)))


def test_flash_dmattn_func_q_k_v_keywords():
    q, k, v = _qkv()
    out = flash_dmattn_func(q=q, k=k, v=v, is_causal=True, backend="reference")
    torch.testing.assert_close(out, flexdma.flash_dma_attention(q, k, v, is_causal=True, backend="reference"))
    with pytest.raises(TypeError, match="flash_dmattn_func got both query= and q=; pass one of them"):
        flash_dmattn_func(q, k, v, q=q)
    with pytest.raises(TypeError, match=r"flash_dmattn_func is missing value \(or v=\)"):
        flash_dmattn_func(q=q, k=k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_dmattn_func_float32_bias_with_low_precision_query(dtype):
    backend = "cpu" if "cpu" in flexdma.available_backends() else "reference"
    q, k, v = _qkv(dtype)
    bias = torch.randn(B, KVH, 1, K, requires_grad=True)
    out = flash_dmattn_func(q, k, v, attn_bias=bias, is_causal=True, backend=backend)
    assert out.dtype == dtype
    ref = flexdma.flash_dma_attention(q, k, v, None, bias.detach().to(dtype), is_causal=True, backend=backend)
    torch.testing.assert_close(out, ref)
    out.float().square().sum().backward()
    assert bias.grad.dtype == torch.float32 and bias.grad.shape == bias.shape


def test_flash_dmattn_func_returns_lse_like_the_seed():
    q, k, v = _qkv()
    bias = torch.randn(B, KVH, Q, K)
    out, lse, probs = flash_dmattn_func(
        q, k, v, None, bias, is_causal=True, return_attn_probs=True, backend="reference"
    )
    ref, ref_lse = flexdma.attention_ref(q, k, v, None, bias, is_causal=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    assert lse.shape == (B, H, Q) and lse.dtype == torch.float32 and probs is None
    out2, lse2, _ = flash_dmattn_func_auto(backend="reference")(
        query=q, key=k, value=v, attn_bias=bias, is_causal=True, return_attn_probs=True
    )
    torch.testing.assert_close(lse2, ref_lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_flash_dmattn_func_float_attn_mask_is_keep_flags(dtype):
    # The seed's flash_dmattn_func took its mask in a float dtype before masks became bool:
    # 1.0 = attend, 0.0 = masked.
    q, k, v = _qkv()
    bias = torch.randn(B, KVH, Q, K)
    keep = torch.rand(B, KVH, Q, K, generator=torch.Generator().manual_seed(1)) < 0.6
    keep[0, 0, 2] = False  # a row that attends to nothing
    want = flash_dmattn_func(q, k, v, keep, bias, is_causal=True, backend="reference")
    got = flash_dmattn_func(q, k, v, keep.to(dtype), bias, is_causal=True, backend="reference")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (got[0, 2, : H // KVH] == 0).all()
    pad = _padding()  # (B, K) float padding, as the seed's 2-D form
    torch.testing.assert_close(
        flash_dmattn_func(q, k, v, pad.to(dtype), bias, backend="reference"),
        flash_dmattn_func(q, k, v, pad, bias, backend="reference"),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize(
    "values, shown", [(0.5, "0.5"), (float("-inf"), "-inf"), (-1e4, "-10000")], ids=["0.5", "-inf", "additive"]
)
def test_flash_dmattn_func_float_attn_mask_other_values(values, shown):
    # An additive float mask (0 = attend) would mean the opposite: it is an error, not a guess.
    q, k, v = _qkv()
    mask = torch.ones(B, K)
    mask[:, 3] = values
    with pytest.raises(
        ValueError,
        match=rf"a floating-point attn_mask must hold keep flags, 1.0 = attend .* got torch.float32 values {shown}",
    ):
        flash_dmattn_func(q, k, v, mask, backend="reference")


# ------------------------------------------------------------------ create_mask's block_size
def test_create_mask_topk_block_size_is_the_seeds_majority():
    # The seed: the top-k keys first, then each aligned block (and the shorter tail) kept whole
    # where more than half of it is kept. The 8 best keys are 0, 5-7, 9-10 and 12-13: block [4:8]
    # has 3 of 4 and the tail 2 of 2 (kept), [0:4] 1 of 4 and [8:12] 2 of 4 (dropped). Keeping the
    # ceil(8 / 4) blocks with the best scores would give [0:4] and [4:8].
    bias = torch.full((1, 1, 1, 14), -1.0)
    bias[..., [0, 5, 6, 7, 9, 10, 12, 13]] = torch.tensor([9.0, 5, 5, 5, 4, 4, 3.5, 3.5])
    m = create_mask(bias, None, 1, 1, 14, window_size=8, block_size=4)
    assert m[0, 0, 0].tolist() == [False] * 4 + [True] * 4 + [False] * 4 + [True] * 2
    assert flexdma.create_mask(bias, 8, block_size=4)[0, 0, 0].tolist() == [True] * 8 + [False] * 6


@pytest.mark.parametrize("seed", range(4))
def test_create_mask_topk_block_size_against_the_seed(seed):
    g = torch.Generator().manual_seed(seed)
    Bq, Hb, Lq, Lk, W, bs = 2, 2, 24, 61, 20, 8
    bias = torch.randn(Bq, Hb, 1, Lk, generator=g, dtype=torch.float64)
    pad = torch.rand(Bq, Lk, generator=g) < 0.8
    fill = seed_reference.fill_value(torch.float64)
    for causal in (False, True):
        allowed = pad[:, None, None, :] & (flexdma.dense.naive.causal_mask(Lq, Lk) if causal else True)
        rows = bias.expand(Bq, Hb, Lq, Lk).masked_fill(~allowed, fill)
        top = torch.topk(rows, W, dim=-1)
        seed_sel = torch.zeros_like(rows, dtype=torch.bool).scatter(-1, top.indices, top.values != fill)
        want = seed_reference.block_smooth(seed_sel, bs) & allowed  # flexdma never keeps a masked key
        got = create_mask(bias, pad.long(), Bq, Lq, Lk, window_size=W, block_size=bs, is_causal=causal)
        assert torch.equal(got.expand_as(want), want), causal


def test_create_mask_bad_block_size():
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match=rf"block_size must be a positive int or None, got {bad!r}"):
            create_mask(torch.randn(B, 1, Q, K), None, B, Q, K, window_size=4, block_size=bad)


# ------------------------------------------------------------------ fwd: the seed's first low-level call
def _fwd_inputs():
    g = torch.Generator().manual_seed(3)
    shapes = ((B, Q, H, D), (B, K, KVH, D), (B, K, KVH, D), (B, KVH, Q, K))
    q, k, v, zoh = (torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes)
    active = (torch.rand(B, KVH, Q, K, generator=g) < 0.5).double()
    return q, k, v, zoh, active


def test_fwd_readme_call():
    # The seed's README: keywords, an all-ones active mask, [0] for the output.
    q, k, v, zoh, _ = _fwd_inputs()
    res = compat.fwd(
        q=q, k=k, v=v, zoh=zoh, active_mask=torch.ones_like(zoh), softmax_scale=0.25, keep_window_size=16,
        is_causal=True,
    )  # fmt: skip
    assert isinstance(res, list) and len(res) == 4
    want, want_lse = flexdma.attention_ref(q, k, v, None, zoh, is_causal=True, softmax_scale=0.25)
    torch.testing.assert_close(res[0], want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(res[1], want_lse, rtol=1e-12, atol=1e-12)
    assert res[1].shape == (B, H, Q) and res[1].dtype == torch.float64
    assert res[2].numel() == 0 and res[3].dtype == torch.int64 and res[3].shape == (2,)


@pytest.mark.parametrize("mask_dtype", [torch.float64, torch.bool])
def test_fwd_active_mask(mask_dtype):
    q, k, v, zoh, active = _fwd_inputs()
    active[0, 0, 1] = 0  # an empty row: output 0, LSE +inf as the seed's kernels wrote it
    keep = active.bool()
    out, lse, _, _ = compat.fwd(q, k, v, zoh, active.to(mask_dtype), None, 0.0, None, False, K - 1)
    want, want_lse = flexdma.attention_ref(q, k, v, keep, zoh)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert (out[0, 1, : H // KVH] == 0).all() and (lse[0, : H // KVH, 1] == float("inf")).all()
    torch.testing.assert_close(lse, want_lse.masked_fill(want_lse == float("-inf"), float("inf")))
    # As in the seed, with at most keep_window_size keys every key is active.
    out, _, _, _ = compat.fwd(q, k, v, zoh, active.to(mask_dtype), keep_window_size=K)
    torch.testing.assert_close(out, flexdma.attention_ref(q, k, v, None, zoh)[0], rtol=1e-12, atol=1e-12)


def test_fwd_writes_out_and_takes_query_heads():
    q, k, v, zoh, active = _fwd_inputs()
    out = torch.full_like(q, float("nan"))
    zoh_h, active_h = (t.repeat_interleave(H // KVH, 1) for t in (zoh, active))
    res = compat.fwd(q, k, v, zoh_h, active_h, out, keep_window_size=4)
    assert res[0] is out
    want, _ = flexdma.attention_ref(q, k, v, active.bool(), zoh)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def test_fwd_gradients_reach_zoh():
    q, k, v, zoh, active = _fwd_inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v, zoh)]
    out = compat.fwd(*leaves[:4], active, keep_window_size=4, is_causal=True)[0]
    ref = [t.clone().requires_grad_() for t in (q, k, v, zoh)]
    want, _ = flexdma.attention_ref(*ref[:3], active.bool(), ref[3], is_causal=True)
    g = torch.randn_like(want)
    for got_grad, want_grad in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(want, ref, g)):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "change, exc, pattern",
    [
        (dict(p_dropout=0.1), ValueError, "p_dropout must be 0: flexdma has no attention dropout, got 0.1"),
        (dict(return_softmax=True), ValueError, r"return_softmax=True needs dropout in the seed \(p_dropout > 0\)"),
        (dict(gen=3), TypeError, "gen must be a torch.Generator or None, got int"),
        (dict(keep_window_size=0), ValueError, "keep_window_size must be a positive int, got 0"),
        (dict(zoh="zoh"), TypeError, "zoh must be a torch.Tensor, got str"),
        (dict(zoh=torch.zeros(B, KVH, Q, K + 1)), ValueError, r"zoh must be \(batch, kv heads, seqlen_q, seqlen_k\) = \(2, 2, 6, 40\) .* got shape \(2, 2, 6, 41\)"),
        (dict(zoh=torch.zeros(B, KVH, Q, K)), TypeError, "zoh must have q's dtype torch.float64, got torch.float32"),
        (dict(active_mask=torch.ones(1, KVH, Q, K)), ValueError, r"active_mask must be \(batch, kv heads.* got shape \(1, 2, 6, 40\)"),
        (dict(active_mask=torch.ones(B, KVH, Q, K, dtype=torch.long)), TypeError, "active_mask must be floating point .* got torch.int64"),
        (dict(active_mask=torch.full((B, KVH, Q, K), 0.5, dtype=torch.float64)), ValueError, "a floating-point active_mask must hold keep flags"),
        (dict(out=torch.zeros(B, Q, H, D)), ValueError, r"out must be a tensor like q \(torch.float64 of shape \(2, 6, 4, 16\)\), got torch.float32"),
    ],
    ids=["dropout", "return_softmax", "gen", "window", "zoh type", "zoh shape", "zoh dtype", "mask shape", "mask int", "mask 0.5", "out"],
)  # fmt: skip
def test_fwd_bad_arguments(change, exc, pattern):
    q, k, v, zoh, active = _fwd_inputs()
    kw = dict(zoh=zoh, active_mask=active, keep_window_size=4)
    kw.update(change)
    with pytest.raises(exc, match=pattern):
        compat.fwd(q, k, v, **kw)
