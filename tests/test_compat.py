"""flexdma.compat runs the seed project's (flash-dmattn) calls: its create_mask with every mask
form the seed and transformers pass."""
import pytest
import torch

import flexdma
from flexdma.compat import create_mask, flash_dmattn_func

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
    assert m[:, :, :, :K - Q].all()
    assert torch.equal(m[:, 0, 0, K - Q:], keep.bool())


@pytest.mark.parametrize("mask, exc, pattern", [
    (torch.full((B, K), 0.5), ValueError,
     r"must hold keep flags \(1 = attend, 0 = masked\) or be additive \(0 = attend, <= -10000 or -inf = masked\); "
     r"got torch.float32 values 0.5"),
    (torch.full((B, K), -3.0), ValueError, "got torch.float32 values -3"),
    (torch.full((B, K), float("nan")), ValueError, "got torch.float32 values nan"),
    (torch.full((B, K), 2, dtype=torch.long), ValueError,
     "an integer attention_mask must hold keep flags, 1 = attend and 0 = masked .*; got torch.int64 values 2"),
    (torch.ones(B, K, dtype=torch.complex64), TypeError, "attention_mask must be bool, integer or floating point"),
    (torch.ones(B, K + 1, dtype=torch.bool), ValueError,
     r"a 2-D attention_mask must be \(batch_size, key_len\) = \(2, 40\) .* got \(2, 41\)"),
    ([[1] * K] * B, TypeError, "attention_mask must be a torch.Tensor or None, got list"),
], ids=["float 0.5", "float -3", "nan", "long 2", "complex", "2-D shape", "list"])
def test_create_mask_bad_attention_mask(mask, exc, pattern):
    with pytest.raises(exc, match=pattern):
        create_mask(torch.randn(B, 1, Q, K), mask, B, Q, K, window_size=4)


def test_create_mask_bad_min_dtype():
    with pytest.raises(ValueError, match=r"min_dtype must be a negative number .* got 5"):
        create_mask(torch.randn(B, 1, Q, K), None, B, Q, K, window_size=4, min_dtype=5)
