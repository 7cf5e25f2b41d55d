"""Calls users make that used to fail or warn: a (batch, key) padding mask, zero queries with a
backward, the compiler's and FlexAttention's warnings, the command line, the README's claims."""

import pathlib
import re
import warnings

import pytest
import torch

import flexdma
from flexdma.__main__ import main as flexdma_main

BACKENDS = [b for b in ("cpu", "reference") if b in flexdma.available_backends()]
README = " ".join((pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text().split())


def _qkv(B=3, Q=5, K=7, H=4, KVH=2, D=16, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    return tuple(
        torch.randn(*s, generator=g).requires_grad_(requires_grad)
        for s in ((B, Q, H, D), (B, K, KVH, D), (B, K, KVH, D))
    )


# ---------------------------------------------------------------- (batch, key) padding mask
@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_mask_2d_is_a_batch_key_mask(backend):
    q, k, v = _qkv()
    pad = torch.ones(3, 7, dtype=torch.bool)
    pad[1, :3] = False
    out = flexdma.flash_dma_attention(q, k, v, pad, backend=backend)
    ref = flexdma.flash_dma_attention(q, k, v, pad[:, None, None, :], backend=backend)
    torch.testing.assert_close(out, ref)


def test_padding_mask_2d_ambiguous_or_not_bool():
    q, k, v = _qkv(B=5, Q=5)
    with pytest.raises(ValueError, match=r"attn_mask of shape \(5, 7\) is ambiguous: batch and seqlen_q are both 5"):
        flexdma.flash_dma_attention(q, k, v, torch.ones(5, 7, dtype=torch.bool))
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"got torch.int64; a 0/1 padding mask becomes one with attn_mask.bool\(\)"):
        flexdma.flash_dma_attention(q, k, v, torch.ones(3, 7, dtype=torch.long))


# ---------------------------------------------------------------- empty sequences
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Q, K", [(0, 7), (0, 0), (5, 0)])
def test_empty_sequences_backward(backend, Q, K):
    q, k, v = _qkv(Q=Q, K=K, requires_grad=True)
    bias = torch.randn(3, 2, Q, K, requires_grad=True)
    out = flexdma.flash_dma_attention(q, k, v, None, bias, backend=backend)
    out.sum().backward()  # grad_out is a broadcast scalar: strides 0
    for t in (q, k, v, bias):
        assert t.grad.shape == t.shape and not t.grad.any()


# ---------------------------------------------------------------- compiler and FlexAttention warnings
def test_compile_traces_the_api_without_dynamo_warnings(monkeypatch):
    # dynamo warns once per process: forget what it warned before this test
    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())
    torch._dynamo.reset()
    q, k, v = _qkv()
    f = torch.compile(
        lambda q, k, v: flexdma.flash_dma_attention(q, k, v, is_causal=True), backend="eager", fullgraph=True
    )
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        f(q, k, v)
    assert not [str(w.message) for w in rec if "lru_cache" in str(w.message)]


def test_flex_backend_uses_the_current_flex_attention_api(monkeypatch):
    if "flex" not in flexdma.available_backends():
        pytest.skip("FlexAttention is unavailable")
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_WARNINGS_SHOWN", set())  # FlexAttention warns once per process
    q, k, v = _qkv(Q=16, K=16)
    bias = torch.randn(3, 2, 16, 16)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with torch.no_grad():
            flexdma.flash_dma_attention(q, k, v, None, bias, backend="flex")  # compiled by flexdma
        flexdma.flash_dma_attention(q, k, v, None, bias, backend="flex", return_lse=True)  # LSE: unfused on CPU
        qg = q.clone().requires_grad_()
        flexdma.flash_dma_attention(qg, k, v, None, bias, backend="flex").sum().backward()
    msgs = [str(w.message) for w in rec]
    assert not [m for m in msgs if "return_lse is deprecated" in m or "called without torch.compile" in m], msgs


# ---------------------------------------------------------------- command line
def test_python_m_flexdma_help(capsys):
    with pytest.raises(SystemExit) as e:
        flexdma_main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m flexdma") and "self-check" in out and "max err" not in out


def test_python_m_flexdma_unknown_flag(capsys):
    with pytest.raises(SystemExit) as e:
        flexdma_main(["--fast"])
    assert e.value.code == 2
    assert "unrecognized arguments: --fast" in capsys.readouterr().err


# ---------------------------------------------------------------- README
def test_readme_states_what_attention_ref_returns():
    assert re.search(r"`flexdma\.attention_ref\(.*\)` .*returns `\(out, lse\)`", README)


def test_readme_says_register_comes_before_attn_implementation():
    assert (
        'Without `register()` transformers rejects the name ("Specified `attn_implementation="flexdma"` '
        'is not supported")' in README
    )
