"""Multi-process harness of the context-parallel tests: `spawn(world, fn, *args)` runs
fn(rank, world, *args) in `world` processes on a gloo group (NCCL with backend="nccl", rank r on
GPU r) over a free local port and re-raises the
first failure in the parent. Each case builds the whole sequence from one seed on every rank, so a
rank checks its shard against the one-process call without exchanging the reference."""

from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, errdir, backend, fn, args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    kw = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kw["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **kw)
    try:
        fn(rank, world, *args)
    except BaseException:
        with open(os.path.join(errdir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def spawn(world: int, fn, *args, backend: str = "gloo") -> None:
    with tempfile.TemporaryDirectory() as errdir:
        try:
            mp.spawn(_entry, args=(world, free_port(), errdir, backend, fn, args), nprocs=world, join=True)
        except Exception as e:
            reports = [open(os.path.join(errdir, f)).read() for f in sorted(os.listdir(errdir))]
            raise AssertionError("\n".join(reports) or str(e)) from None
