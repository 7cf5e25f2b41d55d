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
    return tuple(torch.randn(*s, generator=g).requires_grad_(requires_grad)
                 for s in ((B, Q, H, D), (B, K, KVH, D), (B, K, KVH, D)))


# ---------------------------------------------------------------- compiler and FlexAttention warnings
def test_compile_traces_the_api_without_dynamo_warnings(monkeypatch):
    # dynamo warns once per process: forget what it warned before this test
    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())
    torch._dynamo.reset()
    q, k, v = _qkv()
    f = torch.compile(lambda q, k, v: flexdma.flash_dma_attention(q, k, v, is_causal=True), backend="eager",
                      fullgraph=True)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        f(q, k, v)
    assert not [str(w.message) for w in rec if "lru_cache" in str(w.message)]
