"""`python -m benchmarks cp`, under `torchrun --nproc-per-node=P`: context parallel (CP) on the
per-key path, flexdma.distributed.context_parallel_attention over P ranks, against one GPU and
against PyTorch's context parallel over dense SDPA, in one run.

Rows (bf16, causal, B=1, H=16, KVH=4, D=128, W=2048, bias per kv head): the per-key forward and
training call (forward + backward) at 512K, 1M, 2M and 4M tokens over the P ranks (--quick: 512K
and 1M; --lengths overrides). The scores are exp(randn) drawn in float32 and cast to bf16, one
draw for the whole sequence (same seed on every rank, each rank takes its shard with
shard_sequence): bf16 has fewer distinct values than these lengths have keys, so some scores
repeat (each row records how many are distinct); ties go to the lower index, a strict order the
CP path and the one-GPU call share, and the kept sets stay scattered over the sequence (unlike
all-equal scores, whose kept sets are every row's first W keys). Beside each row:
- the one-GPU call (flash_dma_attention over the whole sequence, rank 0 alone while the other
  ranks wait at a barrier) at L where it fits, and at L/P: the scaling bar, CP over P GPUs at P·L
  tokens against one GPU at L;
- PyTorch's context parallel (torch.distributed.tensor.experimental.context_parallel on a 1-D
  DeviceMesh, head-tail load balancing) over causal dense SDPA with GQA, at the lengths up to
  512K, with each rotate method ("allgather", "alltoall") and each of the flash and cuDNN
  backends; every option's time or error is kept, the table shows the fastest;
- bytes each rank sent and received per call (flexdma.distributed.exchange_stats: every
  collective of the CP attention, metadata and top-W lists included), forward and training call,
  with the bound on what a rank fetches: K and V of at most 2·W·B·KVH rows (W keys per (batch, KV
  head) for each of its two chunks), their scores, plus the published top-W lists;
- the peak memory of each rank (above what was allocated before the call, and absolute);
- transformers' DogeForCausalLM train step (4 layers, hidden 1024, H=8, KVH=4,
  keep_window_size=2048, bf16, each layer's A drawn from U[0.5, 1.5]: at Doge's init A = 0 every
  score ties) with patch_doge(model, cp_group=...) at 512K tokens over the P ranks: each rank
  passes its shard of input_ids, position_ids (global) and the labels shifted before sharding;
  loss = the sum of the token losses over all ranks / the number of tokens, gradients all-reduced
  over the group (one flat all-reduce); beside it the one-GPU step at 128K and at 512K/P.

Timing across ranks: do_bench sizes its repetitions from each process's own estimate, and ranks
whose counts differ would wait forever in each other's collectives, so the multi-rank rows are
timed call by call. Before each call every rank synchronizes its GPU and passes a barrier (then
synchronizes again); each rank times the call on the host until its GPU is done; the call's time
is the maximum over ranks (the step waits for the slowest rank). The first call warms up (and
sets the counts: about WARMUP_MS of warm-up calls and REP_MS of timed calls, at least MIN_REPS,
the same on every rank since the estimate is that maximum); the row reports the median. The
one-GPU calls are timed the same way (the scaling ratio compares like with like) and also with
triton's do_bench (do_bench_* in the JSON: the perkey benchmark's convention).

Without CUDA (gloo) the same script runs at a toy size (H=4, KVH=2, D=32, W=32, float32,
lengths 256 and 512, a 2-layer Doge of hidden 64): a smoke test of the plumbing, not a timing.
Only rank 0 writes the JSON (after every row) and prints.
"""

from __future__ import annotations

import datetime
import gc
import os
import statistics
import sys
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flexdma
import flexdma.distributed as fdist
from flexdma.integrations.transformers import patch_doge

from .common import Saving, peak_memory, public_argv, run_section, runs_of, table
from .perkey import DOGE, _pair, _time

SCHEMA = "flexdma-cp-bench/1"
SECTIONS = ("cp", "single", "dense", "doge")
WARMUP_MS, REP_MS, MIN_REPS = 25, 100, 5
# Each part of the run: the model shape on GPUs, a toy on the CPU (gloo).
GPU = dict(
    shape=dict(B=1, H=16, KVH=4, D=128, W=2048),
    lengths=(524288, 1048576, 2097152, 4194304),
    quick_lengths=(524288, 1048576),
    dense_max=524288,
    doge=dict(config=DOGE, cp_length=524288, single_lengths=(131072,)),
)
# The CPU's Doge: the GPU's configuration, scaled down (GQA kept: 4 heads over 2 KV heads).
TOY_DOGE = dict(DOGE, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
TOY_DOGE.update(num_attention_heads=4, num_key_value_heads=2, keep_window_size=32)
CPU = dict(
    shape=dict(B=1, H=4, KVH=2, D=32, W=32),
    lengths=(256, 512),
    quick_lengths=(256, 512),
    dense_max=0,
    doge=dict(config=TOY_DOGE, cp_length=512, single_lengths=(128,)),
)
DENSE_OPTIONS = (("allgather", "flash"), ("alltoall", "flash"), ("allgather", "cudnn"), ("alltoall", "cudnn"))
A_RANGE = (0.5, 1.5)


def size(n: int) -> str:
    """524288 -> '512K', 1048576 -> '1M', 300 -> '300'."""
    for unit, name in ((2**20, "M"), (2**10, "K")):
        if n >= unit and n % unit == 0:
            return f"{n // unit}{name}"
    return str(n)


def exchange_bound(shape: dict, P: int, elem: int) -> dict:
    """What one rank fetches at most per call: the K and V rows (and scores) of W keys per (batch,
    KV head) for each of its two chunks, whatever L is, and the top-W lists every chunk publishes
    (2P·W entries per (batch, KV head)). The backward sends the gradients of the same rows back."""
    rows = 2 * shape["W"] * shape["B"] * shape["KVH"]
    return dict(
        kv_rows=rows,
        kv_bytes=rows * 2 * shape["D"] * elem,
        score_bytes=rows * elem,
        topw_entries=2 * P * shape["W"] * shape["B"] * shape["KVH"],
    )


def dense_ring_bytes(shape: dict, L: int, P: int, elem: int) -> int:
    """K and V bytes a rank receives in a dense ring or all-gather forward: every other rank's keys."""
    return (P - 1) * (L // P) * shape["B"] * shape["KVH"] * 2 * shape["D"] * elem


class Ranks:
    """The process group of the run and what its ranks agree on."""

    def __init__(self):
        if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) < 2:
            raise SystemExit(
                "`cp` runs under torchrun with 2 or more processes: torchrun --nproc-per-node=P -m benchmarks cp"
            )
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            if local >= torch.cuda.device_count():
                raise SystemExit(f"`cp`: local rank {local} has no GPU ({torch.cuda.device_count()} visible)")
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")
        if not dist.is_initialized():
            # The one-GPU rows keep the other ranks at a barrier for minutes: a long timeout.
            kw = dict(device_id=self.device) if self.cuda else {}
            dist.init_process_group("nccl" if self.cuda else "gloo", timeout=datetime.timedelta(minutes=30), **kw)
        self.group = dist.group.WORLD
        self.rank, self.P = dist.get_rank(), dist.get_world_size()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def barrier(self):
        self.sync()
        dist.barrier(group=self.group)
        self.sync()

    def max(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def gather(self, obj) -> list:
        out = [None] * self.P
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def rank0(self, obj):
        """Rank 0's value on every rank (a decision all ranks must take alike)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def _one(fn, ranks: Optional[Ranks], cuda: bool) -> float:
    """One call's milliseconds: from a common start (barrier) until this rank's GPU is done, the
    maximum over ranks; ranks=None: this process alone."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if ranks is not None:
        ranks.barrier()
    else:
        sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    ms = (time.perf_counter() - t0) * 1e3
    del out
    return ranks.max(ms) if ranks is not None else ms


def time_calls(fn, ranks: Optional[Ranks], cuda: bool, min_reps: int = MIN_REPS) -> dict:
    """The median of per-call times (see the module's docstring), with the repetitions' count."""
    _one(fn, ranks, cuda)  # the first call: compiles, fills the allocator's cache
    est = max(_one(fn, ranks, cuda), 1e-3)
    for _ in range(max(1, int(WARMUP_MS / est))):
        _one(fn, ranks, cuda)
    times = [_one(fn, ranks, cuda) for _ in range(max(min_reps, int(REP_MS / est)))]
    return dict(ms=statistics.median(times), reps=len(times), min_ms=min(times), max_ms=max(times))


def _peak(fn, cuda: bool) -> Optional[dict]:
    """Peak allocated memory during one call: absolute, and above what was allocated before it."""
    if not cuda:
        return None
    gc.collect()
    return peak_memory(fn)


def _exchanged(fn, cuda: bool) -> dict:
    """This rank's exchange counters over one call of fn."""
    fdist.exchange_stats(reset=True)
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    del out
    return fdist.exchange_stats(reset=True)


def _free(cuda: bool):
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def _error(e: BaseException) -> str:
    if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
        return "out of memory"
    return f"{type(e).__name__}: {str(e)[:300]}"


def _scores(shape: dict, L: int, device, dtype, seed: int) -> torch.Tensor:
    """The per-key scores of the whole sequence (B, KVH, 1, L): exp(randn) in float32, then cast;
    the same on every rank that draws it with the same seed."""
    g = torch.Generator(device=device).manual_seed(seed)
    s = torch.randn(shape["B"], shape["KVH"], 1, L, device=device, generator=g)
    return torch.exp(s).to(dtype)


def _qkv(shape: dict, L: int, device, dtype, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    B, H, KVH, D = shape["B"], shape["H"], shape["KVH"], shape["D"]
    q = torch.randn(B, L, H, D, device=device, generator=g).to(dtype)
    k = torch.randn(B, L, KVH, D, device=device, generator=g).to(dtype)
    v = torch.randn(B, L, KVH, D, device=device, generator=g).to(dtype)
    return q, k, v


def _fwd_and_train(call, leaves: list, dout: torch.Tensor):
    """(forward without autograd, forward + backward to the leaves) of call(*inputs)."""

    def fwd():
        with torch.no_grad():
            return call(*[t.detach() for t in leaves])

    def train():
        out = call(*leaves)
        return torch.autograd.grad(out, leaves, dout)

    return fwd, train


# ---------------------------------------------------------------------------------------------
# The rows


def cp_row(ranks: Ranks, shape: dict, L: int, dtype, seed: int) -> dict:
    """The per-key CP call at L tokens over the ranks: times, bytes, peaks (every rank calls this)."""
    P, dev, cuda = ranks.P, ranks.device, ranks.cuda
    case = dict(name=f"L={size(L)} P={P}", L=L, P=P, L_local=L // P, bias_heads=shape["KVH"], **shape)
    case["dtype"] = str(dtype).replace("torch.", "")
    row: dict = dict(case=case)
    scores = _scores(shape, L, dev, dtype, seed)
    row["distinct_scores"] = int(torch.unique(scores).numel())
    bias = fdist.shard_sequence(scores, 3, group=ranks.group).contiguous()
    del scores
    q, k, v = _qkv(shape, L // P, dev, dtype, seed + 1 + ranks.rank)
    dout = torch.randn_like(q)
    W = shape["W"]

    def call(q, k, v, b):
        return fdist.context_parallel_attention(q, k, v, b, keep_window_size=W, group=ranks.group)

    fwd, train = _fwd_and_train(call, [t.requires_grad_() for t in (q, k, v, bias)], dout)
    f, t = time_calls(fwd, ranks, cuda), time_calls(train, ranks, cuda)
    row.update(fwd_ms=f["ms"], fwd_reps=f["reps"], fwd_bwd_ms=t["ms"], fwd_bwd_reps=t["reps"])
    row["bwd_ms"] = t["ms"] - f["ms"]
    row["bytes"] = dict(fwd=ranks.gather(_exchanged(fwd, cuda)), train=ranks.gather(_exchanged(train, cuda)))
    row["peak"] = dict(fwd=ranks.gather(_peak(fwd, cuda)), train=ranks.gather(_peak(train, cuda)))
    row["bound"] = exchange_bound(shape, P, q.element_size())
    row["dense_ring_kv_bytes"] = dense_ring_bytes(shape, L, P, q.element_size())
    return row


def single_row(shape: dict, L: int, dtype, device, cuda: bool, seed: int) -> dict:
    """flash_dma_attention over the whole sequence on this process's device alone."""
    row: dict = dict(case=dict(name=f"one GPU L={size(L)}", L=L, P=1, **shape))
    try:
        q, k, v = _qkv(shape, L, device, dtype, seed + 1)
        bias = _scores(shape, L, device, dtype, seed)
        dout = torch.randn_like(q)
        W = shape["W"]

        def call(q, k, v, b):
            return flexdma.flash_dma_attention(q, k, v, None, b, is_causal=True, keep_window_size=W)

        fwd, train = _fwd_and_train(call, [t.requires_grad_() for t in (q, k, v, bias)], dout)
        for key, fn in (("fwd", fwd), ("fwd_bwd", train)):
            r = time_calls(fn, None, cuda)
            row[f"{key}_ms"], row[f"{key}_reps"] = r["ms"], r["reps"]
            if cuda:
                row[f"do_bench_{key}_ms"] = _time(fn)
            row[f"{key}_peak"] = _peak(fn, cuda)
        row["bwd_ms"] = row["fwd_bwd_ms"] - row["fwd_ms"]
    except Exception as e:  # out of memory at the longest lengths is a result
        row["error"] = _error(e)
    return row


def dense_row(ranks: Ranks, shape: dict, L: int, dtype, seed: int, options=DENSE_OPTIONS) -> dict:
    """PyTorch's context parallel over causal dense SDPA (GQA) at L tokens, each option timed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = dict(flash=SDPBackend.FLASH_ATTENTION, cudnn=SDPBackend.CUDNN_ATTENTION)
    row: dict = dict(case=dict(name=f"dense CP L={size(L)} P={ranks.P}", L=L, P=ranks.P, **shape), options={})
    mesh = init_device_mesh("cuda", (ranks.P,), mesh_dim_names=("cp",))
    # The whole sequence on every rank (the same seed), SDPA's (B, heads, L, D) layout: the context
    # shards q, k, v in place along dim 2, head-tail.
    q, k, v = (t.transpose(1, 2).contiguous() for t in _qkv(shape, L, ranks.device, dtype, seed))
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}):
        dout = torch.randn_like(q)

        def call(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        fwd, train = _fwd_and_train(call, [t.requires_grad_() for t in (q, k, v)], dout)
        for rotate, backend in options:
            name = f"{rotate}/{backend}"
            rec: dict = {}
            try:
                set_rotate_method(rotate)
                with sdpa_kernel(backends[backend]):
                    f = time_calls(fwd, ranks, True, min_reps=3)
                    t = time_calls(train, ranks, True, min_reps=3)
                rec.update(fwd_ms=f["ms"], fwd_bwd_ms=t["ms"], fwd_reps=f["reps"], fwd_bwd_reps=t["reps"])
            except Exception as e:  # an option the backend does not take (GQA, head dim) is a result
                rec["error"] = _error(e)
            errors = [e for e in ranks.gather(rec.get("error")) if e]
            row["options"][name] = dict(error=errors[0]) if errors else rec
            _free(True)
        ok = {n: r for n, r in row["options"].items() if "error" not in r}
        if ok:
            best = min(ok, key=lambda n: ok[n]["fwd_bwd_ms"])
            row.update(best=best, fwd_ms=ok[best]["fwd_ms"], fwd_bwd_ms=ok[best]["fwd_bwd_ms"])
            rotate, backend = best.split("/")
            set_rotate_method(rotate)
            with sdpa_kernel(backends[backend]):
                row["peak"] = dict(train=ranks.gather(_peak(train, True)))
        set_rotate_method("allgather")  # PyTorch's default, for whatever runs next in the process
    return row


def _doge_model(config: dict, L: int, device, dtype, group=None):
    from transformers import DogeConfig, DogeForCausalLM

    torch.manual_seed(0)  # the same weights on every rank
    cfg = DogeConfig(max_position_embeddings=L, **config)
    model = DogeForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.A.uniform_(*A_RANGE)
    model.to(device=device, dtype=dtype)
    if group is None:
        patch_doge(model)
    else:
        patch_doge(model, cp_group=group)
    return model


def _doge_batch(config: dict, L: int, device):
    """input_ids, global position_ids and labels shifted (the last token has none: -100) of one sequence."""
    g = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(config["vocab_size"], (1, L), device=device, generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100, device=device, dtype=ids.dtype)], dim=1)
    pos = torch.arange(L, device=device).unsqueeze(0)
    return ids, pos, labels


def _doge_step(model, ids, pos, labels, total: int, group=None) -> Callable:
    """Forward + backward of sum(token losses) / total; over a group, the gradients all-reduced."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        loss = loss / total
        loss.backward()
        if group is not None:
            grads = [p.grad for p in params]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=group)
            for g, s in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(s)
        return loss.detach()

    return step


def doge_cp_row(ranks: Ranks, config: dict, L: int, dtype) -> dict:
    P, cuda = ranks.P, ranks.cuda
    row: dict = dict(case=dict(name=f"Doge CP L={size(L)} P={P}", L=L, P=P, A=f"U{list(A_RANGE)}", **config))
    model = _doge_model(config, L, ranks.device, dtype, ranks.group)
    ids, pos, labels = _doge_batch(config, L, ranks.device)
    total = int((labels != -100).sum())
    ids, pos, labels = (fdist.shard_sequence(t, 1, group=ranks.group) for t in (ids, pos, labels))
    step = _doge_step(model, ids, pos, labels, total, ranks.group)
    loss = step()
    dist.all_reduce(loss, group=ranks.group)  # each rank's share of the sum / total
    row["loss"] = float(loss)
    r = time_calls(step, ranks, cuda)
    row.update(ms=r["ms"], reps=r["reps"])
    row["bytes"] = ranks.gather(_exchanged(step, cuda))
    row["peak"] = ranks.gather(_peak(step, cuda))
    return row


def doge_single_row(config: dict, L: int, dtype, device, cuda: bool) -> dict:
    row: dict = dict(case=dict(name=f"Doge one GPU L={size(L)}", L=L, P=1, A=f"U{list(A_RANGE)}", **config))
    try:
        model = _doge_model(config, L, device, dtype)
        ids, pos, labels = _doge_batch(config, L, device)
        step = _doge_step(model, ids, pos, labels, int((labels != -100).sum()))
        row["loss"] = float(step())
        r = time_calls(step, None, cuda)
        row.update(ms=r["ms"], reps=r["reps"], peak=_peak(step, cuda))
    except Exception as e:  # out of memory is a result
        row["error"] = _error(e)
    return row


# ---------------------------------------------------------------------------------------------


def _lengths(args, part: dict, P: int) -> List[int]:
    if args.lengths:
        lengths = [int(x) for x in args.lengths.split(",")]
    else:
        lengths = list(part["quick_lengths"] if args.quick else part["lengths"])
    bad = [n for n in lengths if n <= 0 or n % (2 * P)]
    if bad:
        raise SystemExit(
            f"--lengths: each length must be a positive multiple of 2P = {2 * P} (head-tail chunks), got {bad}"
        )
    return lengths


def _sections(arg: Optional[str]) -> tuple:
    if not arg:
        return SECTIONS
    names = tuple(arg.split(","))
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise SystemExit(f"--peers: cp knows the parts {', '.join(SECTIONS)}, got {unknown}")
    return names


def _on_all_ranks(ranks: Ranks, case: dict, make: Callable[[], dict]) -> dict:
    """make() on every rank; where a rank failed, the case and the first error. A failure every rank
    meets alike (out of memory at the same size) ends the row, not the run; one rank failing alone
    inside a collective leaves the others waiting there (the run's timeout ends it; the JSON keeps
    the rows before)."""
    try:
        row = make()
    except Exception as e:
        row = dict(case=case, error=_error(e))
    errors = [r for r in ranks.gather(row.get("error")) if r]
    return dict(case=case, error=errors[0]) if errors else row


def run(args, ranks: Ranks, doc: dict, save: Callable) -> None:
    """Every part, in an order that keeps the targets' rows first in a run cut short: the CP rows,
    the one-GPU bars, the Doge steps, dense context parallel. Rows land in doc (rank 0) as they finish."""
    part = GPU if ranks.cuda else CPU
    dtype = torch.bfloat16 if ranks.cuda else torch.float32
    shape, P, cuda, main = part["shape"], ranks.P, ranks.cuda, ranks.rank == 0
    lengths, sections = _lengths(args, part, P), _sections(args.peers)
    t0 = time.perf_counter()

    def out_of_time() -> bool:
        return bool(ranks.rank0(bool(args.budget) and time.perf_counter() - t0 > args.budget))

    def land(key: str, row: dict):
        if main:
            doc[key].append(row)
            shown = {k: v for k, v in row.items() if k not in ("case", "bytes", "peak", "options")}
            print(row["case"]["name"], shown, flush=True)
            save()

    for L in lengths if "cp" in sections else ():
        if out_of_time():
            land("rows", dict(case=dict(name=f"L={size(L)} P={P}", L=L, P=P), not_run="time budget"))
            continue
        case = dict(name=f"L={size(L)} P={P}", L=L, P=P)
        land("rows", _on_all_ranks(ranks, case, lambda: cp_row(ranks, shape, L, dtype, args.seed)))
        _free(cuda)

    if "single" in sections:
        singles = sorted({n for L in lengths for n in (L, L // P)})
        if main:
            for L in singles:
                if args.budget and time.perf_counter() - t0 > args.budget:
                    land("single", dict(case=dict(name=f"one GPU L={size(L)}", L=L, P=1), not_run="time budget"))
                    continue
                land("single", single_row(shape, L, dtype, ranks.device, cuda, args.seed))
                _free(cuda)
        ranks.barrier()  # the other ranks wait here while rank 0 runs alone

    if "doge" in sections:
        dg = part["doge"]
        L = dg["cp_length"]
        if out_of_time():
            land("doge", dict(case=dict(name=f"Doge CP L={size(L)} P={P}", L=L, P=P), not_run="time budget"))
        else:
            case = dict(name=f"Doge CP L={size(L)} P={P}", L=L, P=P)
            land("doge", _on_all_ranks(ranks, case, lambda: doge_cp_row(ranks, dg["config"], L, dtype)))
        _free(cuda)
        if main:
            for n in sorted(set(dg["single_lengths"]) | {L // P}):
                land("doge", doge_single_row(dg["config"], n, dtype, ranks.device, cuda))
                _free(cuda)
        ranks.barrier()

    if "dense" in sections:
        for L in lengths:
            name = f"dense CP L={size(L)} P={P}"
            if not cuda:
                land(
                    "dense",
                    dict(
                        case=dict(name=name, L=L, P=P),
                        skipped="needs CUDA: PyTorch's ring attention handles the CUDA SDPA kernels only",
                    ),
                )
                continue
            if L > part["dense_max"]:
                continue
            if out_of_time():
                land("dense", dict(case=dict(name=name, L=L, P=P), not_run="time budget"))
                continue
            case = dict(name=name, L=L, P=P)
            land("dense", _on_all_ranks(ranks, case, lambda: dense_row(ranks, shape, L, dtype, args.seed)))
            _free(cuda)


def main(args, environment: Callable) -> Optional[str]:
    """`environment(commit)`: the run's environment record, taken once this rank holds its GPU."""
    ranks = Ranks()
    env = environment(args.commit)
    part = GPU if ranks.cuda else CPU
    doc = dict(
        schema=SCHEMA,
        subcommand="cp",
        argv=public_argv(sys.argv[1:]),
        world_size=ranks.P,
        backend=dist.get_backend(ranks.group),
        shape=part["shape"],
        dtype="bfloat16" if ranks.cuda else "float32",
        timing=dict(
            warmup_ms=WARMUP_MS,
            rep_ms=REP_MS,
            min_reps=MIN_REPS,
            stat="median over calls of the max over ranks",
            tool="barrier + host timer per call (one-GPU rows also triton.testing.do_bench)",
        ),
        unfinished=True,
    )
    saving = Saving(doc, args.out, env, f"cp_p{ranks.P}")
    for key in ("rows", "single", "doge", "dense"):
        if ranks.rank == 0:
            saving.list(key)
        else:
            doc[key] = []
    path = None
    try:
        run(args, ranks, doc, saving.save)
        if ranks.rank == 0:
            del doc["unfinished"]
            path = saving.save()
            print(f"wrote {path}\n" + markdown(doc), flush=True)
        ranks.barrier()
    finally:
        dist.destroy_process_group()
    return path


# ---------------------------------------------------------------------------------------------
# Tables


def _mib(x) -> str:
    return "–" if x is None else f"{x / 2**20:.2f}"


def _per_rank_max(recs: Optional[list], key: str):
    vals = [r[key] for r in recs or [] if r and r.get(key) is not None]
    return max(vals) if vals else None


def _times(r: Optional[dict]) -> str:
    if not r:
        return "not run"
    for why in ("not_run", "skipped", "error"):
        if why in r:
            return f"– ({str(r[why])[:60]})"
    return _pair(r.get("fwd_ms"), r.get("fwd_bwd_ms"), fmt="{:.1f}")


def _ratio(a: Optional[dict], b: Optional[dict], key: str = "fwd_bwd_ms") -> str:
    if a and b and a.get(key) and b.get(key):
        return f"{a[key] / b[key]:.2f}x"
    return "–"


def markdown(doc: dict) -> str:
    P = doc.get("world_size")
    single = {r["case"]["L"]: r for r in doc.get("single", [])}
    dense = {r["case"]["L"]: r for r in doc.get("dense", [])}
    head = [
        "tokens",
        f"flexdma CP over {P} GPUs fwd / train ms",
        "one GPU at L fwd / train ms",
        "one GPU at L/P fwd / train ms",
        "CP train / one GPU at L/P",
        "PyTorch CP, dense SDPA fwd / train ms (best option)",
        "dense CP / flexdma CP train",
        "MiB received per rank fwd / train (max over ranks)",
        "MiB sent per rank fwd / train (max)",
        "bound: K,V rows per rank (2·W·B·KVH) / MiB",
        "peak MiB per rank fwd / train (max)",
        "distinct scores",
    ]

    def moved(row, direction):
        out = []
        for part in ("fwd", "train"):
            recs = row["bytes"][part]
            if part == "fwd":
                out.append(_per_rank_max(recs, f"forward_{direction}_bytes"))
            else:
                tot = [r[f"forward_{direction}_bytes"] + r[f"backward_{direction}_bytes"] for r in recs if r]
                out.append(max(tot) if tot else None)
        return " / ".join(_mib(x) for x in out)

    def cells(row):
        c = row["case"]
        L = c["L"]
        if "error" in row:
            return [size(L), f"error: {row['error'][:80]}"] + ["–"] * (len(head) - 2)
        d = dense.get(L)
        dense_cell = (_times(d) + (f" ({d['best']})" if d.get("best") else "")) if d else "–"
        if d and d.get("options") and not d.get("best"):
            dense_cell = "– (every option failed: notes below)"
        peaks = [_per_rank_max(row["peak"][p], "extra_mib") for p in ("fwd", "train")]
        b = row["bound"]
        return [
            size(L),
            _times(row),
            _times(single.get(L)),
            _times(single.get(L // P)),
            _ratio(row, single.get(L // P)),
            dense_cell,
            _ratio(d, row),
            moved(row, "received"),
            moved(row, "sent"),
            f"{b['kv_rows']} / {_mib(b['kv_bytes'] + b['score_bytes'])}",
            _pair(*peaks, fmt="{:.0f}"),
            str(row.get("distinct_scores", "–")),
        ]

    lines = table(head, doc.get("rows", []), cells)
    notes = []
    for d in doc.get("dense", []):
        if d.get("options"):
            opts = ", ".join(
                f"{n} {_pair(r.get('fwd_ms'), r.get('fwd_bwd_ms'), fmt='{:.0f}')} ms"
                if "error" not in r
                else f"{n}: {r['error'][:80]}"
                for n, r in d["options"].items()
            )
            notes.append(f"- PyTorch CP at {size(d['case']['L'])}, fwd / train per option: {opts}")
    if notes:
        lines += [""] + notes
    doge = doc.get("doge", [])
    if doge:
        ones = {r["case"]["L"]: r for r in doge if r["case"].get("P") == 1}
        c0 = next((r["case"] for r in doge if "hidden_size" in r["case"]), {})
        model = (
            f"{c0['num_hidden_layers']} layers, hidden {c0['hidden_size']}, H={c0['num_attention_heads']}, "
            f"KVH={c0['num_key_value_heads']}, W={c0['keep_window_size']}, A ~ {c0['A']}"
            if c0
            else "no step ran"
        )
        dhead = [
            f"Doge train step (B=1, {model})",
            "ms",
            "peak MiB per rank (max)",
            "MiB sent / received per rank per step (max)",
            "vs one GPU at L/P",
            "loss",
        ]

        def doge_cells(row):
            c = row["case"]
            if "error" in row:
                return [c["name"], f"error: {row['error'][:80]}", "–", "–", "–", "–"]
            peak = row.get("peak")
            peak = _per_rank_max(peak, "peak_mib") if isinstance(peak, list) else (peak or {}).get("peak_mib")
            moved_ = "–"
            if row.get("bytes"):
                moved_ = " / ".join(
                    _mib(max(r[f"forward_{d}_bytes"] + r[f"backward_{d}_bytes"] for r in row["bytes"]))
                    for d in ("sent", "received")
                )
            bar = ones.get(c["L"] // c["P"]) if c["P"] > 1 else None
            return [
                c["name"],
                f"{row['ms']:.1f}",
                "–" if peak is None else f"{peak:.0f}",
                moved_,
                f"{row['ms'] / bar['ms']:.2f}x" if bar and bar.get("ms") else "–",
                f"{row['loss']:.4f}",
            ]

        lines += [""] + table(dhead, doge, doge_cells)
    return "\n".join(lines)


def section(results_dir: str) -> List[str]:
    """The newest run for each number of ranks."""
    out, seen = [], set()
    for doc in runs_of(results_dir, SCHEMA):
        P = doc.get("world_size")
        if P in seen:
            continue
        seen.add(P)
        s = doc.get("shape", {})
        note = (
            f"`torchrun --nproc-per-node={P} -m benchmarks cp`: per-key path, {doc.get('dtype')}, causal, B={s.get('B')}, "
            f"H={s.get('H')}, KVH={s.get('KVH')}, D={s.get('D')}, W={s.get('W')}, bias per kv head; times = median over calls "
            "of the slowest rank (a barrier before each call); train = forward + backward; bytes = every collective of "
            "the CP attention (exchange_stats); the bound counts the K, V and score rows a rank fetches (2·W·B·KVH "
            "rows, whatever L is), the top-W lists come on top; peak = above what was allocated before the call."
        )
        out += run_section(doc, f"context parallel, {P} ranks", note, markdown(doc))
    return out
