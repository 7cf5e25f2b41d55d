"""flexdma.compat runs the seed project's (flash-dmattn) calls: its create_mask with every mask
form the seed and transformers pass, its mask types, and its flash_dmattn_func call forms."""

import pytest
import torch

import flexdma
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
    assert torch.equal(m, (bias > 0) & flexdma.reference.causal_mask(Q, K))


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
