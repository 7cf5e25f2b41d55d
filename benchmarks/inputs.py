"""Inputs of one case, built outside any timed region, and the work/bytes figures derived from them.

q/k/v/dout: random normal. bias: random normal in the case's shape. mask: the top-W keys per
query row of the causally visible bias (per-key bias: of the visible keys' scores), as a
(1,1,Q,K) bool tensor. flexdma.create_mask does the top-W chunked over rows, so 32K x 32K fits.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from flexdma import create_mask

from .configs import KVH, B, Case, H


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    bias: torch.Tensor
    mask: torch.Tensor
    pairs: int  # kept (q, k) pairs of one head: mask.sum()

    @property
    def density(self) -> float:
        return self.pairs / float(self.mask.shape[-2] * self.mask.shape[-1])


def _top_w_mask(bias: torch.Tensor, Q: int, K: int, W: int) -> torch.Tensor:
    mask = create_mask(bias, W, is_causal=True, query_len=Q)
    return mask.expand(1, 1, Q, K) if mask.shape[2] == 1 else mask


def make_inputs(case: Case, device, dtype=torch.bfloat16, seed: int = 0) -> Inputs:
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=g)

    q = randn(B, case.Q, H, case.D)
    k = randn(B, case.K, KVH, case.D)
    v = randn(B, case.K, KVH, case.D)
    dout = randn(B, case.Q, H, case.D)
    bias = randn(*case.bias_shape)
    mask = _top_w_mask(bias, case.Q, case.K, case.W)
    if mask.shape != (1, 1, case.Q, case.K):
        mask = mask.expand(1, 1, case.Q, case.K).contiguous()
    pairs = int(mask.sum().item())
    return Inputs(q, k, v, dout, bias, mask, pairs)


def flops(case: Case, pairs: int, direction: str) -> float:
    """4*D per kept pair and head forward (QK^T and PV); backward 2.5x that."""
    f = 4.0 * case.D * pairs * H * B
    return f * 2.5 if direction == "bwd" else f


def bytes_moved(case: Case, direction: str, elt: int = 2, mask_numel: Optional[int] = None) -> float:
    """The bytes that must cross device memory: each input read once, each output written once.

    fwd: q, k, v, out, the mask (1 byte per element) and the bias.
    bwd: q, k, v, out, dout, mask, bias read; dq, dk, dv, dbias written.
    """
    q = B * case.Q * H * case.D * elt
    kv = B * case.K * KVH * case.D * elt
    mask = mask_numel if mask_numel is not None else case.Q * case.K
    bias = case.bias_shape[2] * case.bias_shape[3] * elt
    fwd = 2 * q + 2 * kv + mask + bias
    if direction == "fwd":
        return float(fwd)
    return float(fwd + q + (q + 2 * kv + bias))
