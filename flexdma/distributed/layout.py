"""The head-tail sequence layout of causal context parallel.

The sequence is cut into 2P equal chunks and rank r holds chunks r and 2P-1-r, concatenated in that
order: every rank then owns the same number of causal (query, key) pairs. It is the layout
PyTorch's context parallel uses by default for causal attention (and Megatron's), so a model
sharded for one shards the same way for the other.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist

from . import _group


def chunk_of(rank: int, world: int) -> Tuple[int, int]:
    """The two chunk indices rank `rank` holds, in their local order."""
    return rank, 2 * world - 1 - rank


def owner_of(chunk: torch.Tensor, world: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(rank, local slot 0 / 1) holding each chunk index of `chunk`."""
    late = chunk >= world
    return torch.where(late, 2 * world - 1 - chunk, chunk), late.long()


def _check_dim(x, seq_dim: int, name: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or not -x.dim() <= seq_dim < x.dim():
        raise ValueError(f"seq_dim must be an int dim of {name} (shape {tuple(x.shape)}), got {seq_dim!r}")
    return seq_dim % x.dim()


def shard_sequence(x: torch.Tensor, seq_dim: int, group=None) -> torch.Tensor:
    """This rank's part of `x` (the whole sequence, the same on every rank) in the head-tail layout:
    chunks r and 2P-1-r of 2P equal chunks along `seq_dim`. Differentiable (a slice)."""
    seq_dim = _check_dim(x, seq_dim, "x")
    pg = _group.resolve(group)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    L = x.shape[seq_dim]
    if L % (2 * world):
        raise ValueError(
            f"x's length along seq_dim={seq_dim} is {L}; the head-tail layout cuts it into 2 x {world} equal "
            f"chunks, so it must be a multiple of {2 * world} (pad the sequence)"
        )
    C = L // (2 * world)
    first, second = chunk_of(rank, world)
    return torch.cat([x.narrow(seq_dim, first * C, C), x.narrow(seq_dim, second * C, C)], dim=seq_dim)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, seq_dim, pg):
        world, rank = dist.get_world_size(pg), dist.get_rank(pg)
        ctx.seq_dim, ctx.rank, ctx.world = seq_dim, rank, world
        parts = [torch.empty_like(x_local) for _ in range(world)]
        dist.all_gather(parts, x_local.contiguous(), group=pg)
        C = x_local.shape[seq_dim] // 2
        chunks = [None] * (2 * world)
        for r, part in enumerate(parts):
            a, b = chunk_of(r, world)
            chunks[a], chunks[b] = part.narrow(seq_dim, 0, C), part.narrow(seq_dim, C, C)
        return torch.cat(chunks, dim=seq_dim)

    @staticmethod
    def backward(ctx, grad):
        # Every rank holds the whole sequence after the gather; each takes back the gradient of
        # its own rows (the gather's adjoint when every rank computes the same function of it).
        C = grad.shape[ctx.seq_dim] // (2 * ctx.world)
        a, b = chunk_of(ctx.rank, ctx.world)
        local = torch.cat([grad.narrow(ctx.seq_dim, a * C, C), grad.narrow(ctx.seq_dim, b * C, C)], dim=ctx.seq_dim)
        return local, None, None


def unshard_sequence(x_local: torch.Tensor, seq_dim: int, group=None) -> torch.Tensor:
    """The whole sequence from every rank's head-tail part (an all-gather), on every rank.

    Differentiable: the backward gives each rank the gradient of its own rows (not a sum over
    ranks), so a loss every rank computes identically on the whole sequence backpropagates as it
    would in one process."""
    seq_dim = _check_dim(x_local, seq_dim, "x_local")
    pg = _group.resolve(group)
    if x_local.shape[seq_dim] % 2:
        raise ValueError(
            f"x_local's length along seq_dim={seq_dim} is {x_local.shape[seq_dim]}; a head-tail part holds two "
            "equal chunks, so it must be even"
        )
    _group.check_device(pg, x_local.device, "x_local")
    return _Unshard.apply(x_local, seq_dim, pg)
