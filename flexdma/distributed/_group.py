"""The context-parallel group: which process group a call runs on, whether its backend carries the
tensors' device, the ranks' agreement on a call before any data moves, and the byte counters.

Every collective of the context-parallel path goes through this module, so what a rank sends is
counted in one place (`exchange_stats`).
"""

from __future__ import annotations

import math
import struct
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

try:  # DeviceMesh lives in torch.distributed; a build without distributed support has no mesh.
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # pragma: no cover - torch built without distributed
    DeviceMesh = ()

# Which device types a backend carries the collectives of this path for. gloo's all-to-all is
# CPU-only; NCCL is CUDA-only. A backend not listed here is trusted (its own error is the message).
_BACKEND_DEVICES = {"gloo": ("cpu",), "nccl": ("cuda",), "mpi": ("cpu",), "xccl": ("xpu",)}

_COUNTERS = (
    "calls",
    "forward_sent_bytes",
    "forward_received_bytes",
    "backward_sent_bytes",
    "backward_received_bytes",
)
_stats = dict.fromkeys(_COUNTERS, 0)


def exchange_stats(reset: bool = False) -> dict:
    """This rank's counters since the last reset: `calls` (context-parallel attention calls) and
    the bytes it sent to and received from other ranks in forward and backward passes (metadata,
    top-W lists and rows alike; an all-gather counts its piece once per other rank). With
    `reset=True` the counters are returned and then zeroed."""
    out = dict(_stats)
    if reset:
        _stats.update(dict.fromkeys(_COUNTERS, 0))
    return out


def _count(direction: str, sent: int, received: int) -> None:
    _stats[f"{direction}_sent_bytes"] += int(sent)
    _stats[f"{direction}_received_bytes"] += int(received)


def count_call() -> None:
    _stats["calls"] += 1


def resolve(group) -> dist.ProcessGroup:
    """The process group of a call: None (the default group), a ProcessGroup or a 1-D DeviceMesh."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "flexdma.distributed needs an initialized default process group: call "
            "torch.distributed.init_process_group (torchrun sets its environment) first"
        )
    if group is None:
        return dist.group.WORLD
    if DeviceMesh and isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"group must be a 1-D DeviceMesh (the context-parallel dim), got a {group.ndim}-D mesh "
                f"{tuple(group.mesh_dim_names or ())}; pass mesh['<context dim name>']"
            )
        return group.get_group()
    if isinstance(group, dist.ProcessGroup):
        return group
    raise TypeError(f"group must be None, a ProcessGroup or a 1-D DeviceMesh, got {type(group).__name__}")


def backend_devices(group: dist.ProcessGroup) -> Optional[Sequence[str]]:
    """Device types the group's backend carries, or None when the backend is not one we know."""
    name = str(dist.get_backend(group))
    if ":" in name:  # "cpu:gloo,cuda:nccl": one backend per device type
        return tuple(part.split(":")[0] for part in name.split(","))
    return _BACKEND_DEVICES.get(name)


def check_device(group: dist.ProcessGroup, device: torch.device, what: str) -> None:
    devices = backend_devices(group)
    if devices is not None and device.type not in devices:
        raise ValueError(
            f"{what} is on {device.type}, but the group's backend {dist.get_backend(group)!r} carries "
            f"{' / '.join(devices)} tensors only: use a {'NCCL' if device.type == 'cuda' else 'gloo'} group "
            f"for {device.type} tensors"
        )


def comm_device(group: dist.ProcessGroup, preferred: torch.device) -> torch.device:
    """A device the group's backend carries, the tensors' own where it can."""
    devices = backend_devices(group)
    if devices is None or preferred.type in devices:
        return preferred
    if "cuda" in devices and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(devices[0])


def float_bits(x: float) -> int:
    """A float as the int64 of its bits, so a signature compares it exactly."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


class agreement:
    """`with agreement(group, device, fields):` around a call's local checks, which fill `fields`
    (its call signature). On leaving, one small all-gather of each rank's signature before any data
    moves, and every rank raises the same way: its own TypeError / ValueError if its checks raised
    one, a ValueError naming a rank that did, or one naming the first field whose value differs
    between ranks (with every rank's value). Without it, ranks that disagree on a size would hang or
    corrupt one another's data.

    A context manager rather than an exception kept in a local and raised later: a frame holding
    the exception it raises is a cycle with the exception's traceback, which keeps the frame's
    group (and tensors) alive until the garbage collector runs; at exit that can be after the group
    was destroyed, and gloo's threads then abort the process."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, fields: dict):
        self.group, self.device, self.fields = group, device, fields

    def __enter__(self) -> "agreement":
        return self

    def __exit__(self, kind, problem, tb) -> bool:
        if kind is not None and not issubclass(kind, (TypeError, ValueError)):
            return False  # not an input error: it propagates on this rank alone, as raised
        names = list(self.fields)
        mine = torch.tensor([int(kind is not None)] + [int(self.fields[n]) for n in names], dtype=torch.int64)
        rows: List[List[int]] = all_gather(self.group, mine.to(self.device), "forward").tolist()  # the one host read
        if kind is not None:
            return False  # this rank's own error propagates
        failed = [r for r, row in enumerate(rows) if row[0]]
        if failed:
            raise ValueError(
                f"rank(s) {failed} of the context-parallel group rejected their input (their error names it); "
                "no data was exchanged"
            )
        for i, name in enumerate(names, start=1):
            values = [row[i] for row in rows]
            if len(set(values)) > 1:
                raise ValueError(
                    f"context-parallel ranks disagree on {name}: {values} (rank 0, 1, ...); every rank must pass "
                    "tensors of the same shapes and dtype and the same arguments"
                )
        return False


# torch renamed all_gather_into_tensor to all_gather_single; both take (output, input, group).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather(group: dist.ProcessGroup, t: torch.Tensor, direction: str) -> torch.Tensor:
    """Every rank's `t` (the same shape on each), stacked: (world, *t.shape)."""
    world = dist.get_world_size(group)
    out = t.new_empty(world * t.numel())
    _all_gather_single(out, t.reshape(-1), group=group)
    nbytes = t.numel() * t.element_size() * (world - 1)
    _count(direction, nbytes, nbytes)
    return out.view((world,) + tuple(t.shape))


def all_to_all_rows(
    group: dist.ProcessGroup,
    send: torch.Tensor,
    send_counts: List[int],
    recv_counts: List[int],
    direction: str,
) -> torch.Tensor:
    """Rows of `send` (grouped by destination rank, `send_counts` each) to their ranks; returns the
    rows received, grouped by source rank (`recv_counts` each). A rank's rows to itself are not
    sent: callers pass 0 for their own rank."""
    recv = send.new_empty((sum(recv_counts),) + tuple(send.shape[1:]))
    dist.all_to_all_single(recv, send, recv_counts, send_counts, group=group)
    row_bytes = math.prod(send.shape[1:]) * send.element_size()
    _count(direction, sum(send_counts) * row_bytes, sum(recv_counts) * row_bytes)
    return recv
