"""Train transformers' DogeForCausalLM with its sequence sharded over the ranks (context parallel),
optionally with FSDP2 over a 2-D (data x context) mesh.

    torchrun --nproc-per-node=4 -m flexdma.examples.doge_cp [--cp 4] [--seq-len 8192] [--steps 5]
        [--fsdp] [--check] [--dtype float32|float64|bfloat16] [--layers 2] [--hidden 64]

The recipe, per step:
- every rank of a context-parallel group holds the same batch rows (each data-parallel group its
  own rows); `input_ids`, `position_ids` (global positions) and the labels, shifted by one before
  sharding, are cut with `flexdma.distributed.shard_sequence` (head-tail layout);
- `patch_doge(model, cp_group=mesh["cp"])` makes every attention layer attend over the whole
  sequence (flexdma.distributed.context_parallel_attention); everything else runs on local tokens;
- the loss is the sum of the token losses over every rank divided by the number of labelled
  tokens in the global batch (`shift_labels`, so no rank needs its neighbour's first token), so the
  parameter gradient is the sum of the ranks' gradients: an all-reduce (SUM) over the world, or
  FSDP2's reduce-scatter with its divide factor set to 1.

`--check` (on a fresh seed) compares the first step's loss and every parameter's gradient with the
one-process model on the whole batch, on every rank, and exits non-zero on a mismatch: float64
agrees to 1e-10, float32 to 1e-4, bfloat16 is reported only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..distributed import shard_sequence
from ..integrations.transformers import patch_doge

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=None, help="context-parallel ranks (default: all)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (a multiple of 2 x cp)")
    p.add_argument("--batch", type=int, default=1, help="sequences per data-parallel rank")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--window", type=int, default=256, help="keep_window_size")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) over the data x context mesh")
    p.add_argument("--check", action="store_true", help="compare step 1 with the one-process model")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_model(args, dtype, device):
    import transformers

    torch.manual_seed(args.seed)
    cfg = transformers.DogeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        keep_window_size=args.window,
        is_moe=False,
        max_position_embeddings=args.seq_len,
    )
    model = transformers.DogeForCausalLM(cfg).to(device=device, dtype=dtype)
    with torch.no_grad():
        # Doge's init A = 0 scores every key alike (all ties); a trained model's scores differ.
        for layer in model.model.layers:
            layer.self_attn.A.uniform_(0.5, 1.5)
    return model


def batch_rows(args, step: int, rows: int, device):
    """(input_ids, shift_labels) of `rows` sequences, the same on every rank for a step."""
    g = torch.Generator().manual_seed(args.seed * 1000 + step)
    ids = torch.randint(0, args.vocab, (rows, args.seq_len + 1), generator=g)
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


def token_loss_sum(model, input_ids, position_ids, labels):
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    logits = logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, labels.flatten(), ignore_index=-100, reduction="sum")


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    cp = args.cp or world
    if world % cp:
        raise ValueError(f"--cp {cp} must divide the world size {world}")
    if args.seq_len % (2 * cp):
        raise ValueError(f"--seq-len {args.seq_len} must be a multiple of 2 x cp = {2 * cp}")
    mesh = init_device_mesh(device.type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
    dp_rank = mesh["dp"].get_local_rank()
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if cuda else torch.float32)

    model = build_model(args, dtype, device)
    # The reference is the one-process patched model: eager Doge breaks score ties its own way.
    reference = patch_doge(build_model(args, dtype, device)) if args.check else None
    patch_doge(model, cp_group=mesh["cp"])
    if args.fsdp:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        data_context = mesh["dp", "cp"]._flatten()
        for layer in model.model.layers:
            fully_shard(layer, mesh=data_context)
        fully_shard(model, mesh=data_context)
        # The loss below is already the global mean: the ranks' gradients add up, not average
        # (the factor is per FSDP module).
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    ok = True
    for step in range(args.steps):
        t0 = time.perf_counter()
        ids, labels = batch_rows(args, step, args.batch * mesh["dp"].size(), device)
        rows = slice(dp_rank * args.batch, (dp_rank + 1) * args.batch)
        positions = torch.arange(args.seq_len, device=device).expand(args.batch, -1)
        local = [shard_sequence(t, 1, group=mesh["cp"]) for t in (ids[rows], positions, labels[rows])]
        total = torch.tensor(float(labels.numel()), device=device)  # every label counts here
        loss_sum = token_loss_sum(model, *local)
        loss = loss_sum / total
        loss.backward()
        if not args.fsdp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        if args.check and step == 0:
            ok = check(model, reference, ids, labels, reported, dtype, rank) and ok
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if rank == 0:
            print(f"step {step}: loss {reported.item():.4f} ({(time.perf_counter() - t0) * 1e3:.1f} ms)", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


def check(model, reference, ids, labels, loss, dtype, rank) -> bool:
    """The one-process model's loss and gradients on the whole batch against the CP step's."""
    positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
    ref_loss = token_loss_sum(reference, ids, positions, labels) / labels.numel()
    ref_loss.backward()
    tol = {torch.float64: 1e-10, torch.float32: 1e-4}.get(dtype)
    worst, name = abs(loss.item() - ref_loss.item()) / max(1.0, abs(ref_loss.item())), "loss"
    for (n, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        err = (g.double() - r.grad.double()).abs().max().item() / max(1.0, r.grad.abs().max().item())
        if err > worst:
            worst, name = err, n
    good = tol is None or worst <= tol
    print(
        f"rank {rank} check: largest relative difference {worst:.2e} ({name}); {'ok' if good else 'MISMATCH'}",
        flush=True,
    )
    return good


if __name__ == "__main__":
    sys.exit(main())
