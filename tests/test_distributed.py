"""Context parallel (flexdma.distributed) on gloo: 2, 3 and 4 CPU processes, float64, each rank's
output and gradients against the one-process call over the whole sequence (1e-12), and the bytes
each rank receives against the bound (at most 2 W rows per fetch plane, whatever L)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from cp_worker import free_port, spawn
from utils import assert_close_to_ref

import flexdma
from flexdma.distributed import context_parallel_attention, exchange_stats, shard_sequence, unshard_sequence
from flexdma.integrations.transformers import patch_doge
from flexdma.nn import DynamicMaskAttention, rotary_cos_sin

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")

TOL = 1e-12


def _inputs(case, seed):
    g = torch.Generator().manual_seed(seed)
    B, L, H, KVH, D = case["B"], case["L"], case["H"], case["KVH"], case["D"]
    dt = case.get("dtype", torch.float64)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dt)

    q, k, v = rnd(B, L, H, D), rnd(B, L, KVH, D), rnd(B, L, KVH, D)
    # Scores that do not tie: distinct by construction, shuffled per plane.
    Bb, Hb = case["Bb"], case["Hb"]
    bias = (torch.rand(Bb, Hb, 1, L, generator=g, dtype=torch.float64) * 4 - 2).to(dt)
    mask = None
    if case.get("pad"):
        mask = torch.rand(B, L, generator=g) > 0.3
        mask[0, : L // 3] = False  # a left-padded row
    go = rnd(B, L, H, D)
    return q, k, v, bias, mask, go


def _max_err(got, want):
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item()) if want.numel() else 0.0


def _run_case(rank, world, case, seed):
    q, k, v, bias, mask, go = _inputs(case, seed)
    W, causal = case["W"], case.get("causal", True)
    kw = dict(is_causal=causal, softmax_scale=case.get("scale"), softcap=case.get("softcap", 0.0))
    full = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    mask4 = None if mask is None else mask[:, None, None, :]
    out = flexdma.flash_dma_attention(*full[:3], mask4, full[3], keep_window_size=W, **kw)
    (out * go).sum().backward()

    local = [shard_sequence(t, 1).detach().requires_grad_() for t in (q, k, v)]
    local.append(shard_sequence(bias, 3).detach().requires_grad_())
    local_mask = None if mask is None else shard_sequence(mask, 1)
    exchange_stats(reset=True)
    out_l = context_parallel_attention(*local, keep_window_size=W, attn_mask=local_mask, **kw)
    (out_l * shard_sequence(go, 1)).sum().backward()
    stats = exchange_stats(reset=True)

    errs = {"out": _max_err(out_l, shard_sequence(out.detach(), 1))}
    for name, t, f, dim in zip(("dq", "dk", "dv", "dbias"), local, full, (1, 1, 1, 3)):
        errs[name] = _max_err(t.grad, shard_sequence(f.grad, dim))
    bad = {n: e for n, e in errs.items() if not e <= TOL}
    assert not bad, f"rank {rank}/{world} case {case}: errors {bad}"

    # The exchange: lists and signature, plus at most W rows per fetch plane per local chunk.
    B, L, H, KVH, D = case["B"], case["L"], case["H"], case["KVH"], case["D"]
    C = L // (2 * world)
    Hk = H if case["Hb"] == H and H != KVH else KVH
    Bs = B if (mask is not None or case["Bb"] == B) else 1
    n_targets = 2 if causal else 1
    lists = 2 * Bs * case["Hb"] * min(W, C) * (8 + 8) if C else 0
    rows = n_targets * min(W, L) * B * Hk * (2 * D + 1) * 8 if C else 0
    bound = (world - 1) * (15 * 8 + lists) + rows
    assert stats["calls"] == 1
    assert stats["forward_received_bytes"] <= bound, (stats, bound)
    # The backward sends back exactly the rows the forward received.
    fetched = stats["forward_received_bytes"] - (world - 1) * (15 * 8 + lists)
    assert stats["backward_sent_bytes"] == fetched, (stats, fetched)
    return stats


CASES = [
    # B, L, H, KVH, D; bias planes (Bb, Hb); W: shorter than a chunk, between, past L.
    dict(B=1, L=48, H=2, KVH=1, D=16, Bb=1, Hb=1, W=3),
    dict(B=1, L=48, H=2, KVH=1, D=16, Bb=1, Hb=1, W=1),
    dict(B=2, L=48, H=4, KVH=2, D=32, Bb=2, Hb=2, W=10),
    dict(B=2, L=48, H=4, KVH=2, D=16, Bb=1, Hb=4, W=7, pad=True),
    dict(B=2, L=48, H=4, KVH=2, D=16, Bb=2, Hb=1, W=5, pad=True, softcap=5.0, scale=0.3),
    dict(B=1, L=48, H=2, KVH=2, D=8, Bb=1, Hb=2, W=100),
    dict(B=1, L=48, H=2, KVH=1, D=16, Bb=1, Hb=1, W=6, causal=False),
    dict(B=2, L=48, H=4, KVH=2, D=16, Bb=2, Hb=2, W=9, causal=False, pad=True),
]


def _cases_worker(rank, world, cases):
    for i, case in enumerate(cases):
        case = dict(case, L=case["L"] // 12 * 2 * world)  # a multiple of 2P for every world size
        _run_case(rank, world, case, seed=1000 + i)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_matches_one_process(world):
    spawn(world, _cases_worker, CASES)


def _edge_worker(rank, world):
    base = dict(B=1, H=2, KVH=1, D=64, Bb=1, Hb=1)
    _run_case(rank, world, dict(base, L=2 * world, W=1), seed=1)  # one token per chunk
    _run_case(rank, world, dict(base, L=2 * world, W=4), seed=2)
    _run_case(rank, world, dict(base, L=0, W=4), seed=3)  # empty sequence
    _run_case(rank, world, dict(base, L=8 * world, D=128, W=5), seed=4)
    _run_case(rank, world, dict(base, L=8 * world, D=96, W=3, Hb=1, H=3, KVH=3), seed=5)


@pytest.mark.parametrize("world", [2, 3])
def test_edge_sizes(world):
    spawn(world, _edge_worker)


def _bytes_worker(rank, world):
    # With W fixed, what a rank fetches does not grow with the sequence: the row bytes at 4x the
    # length stay under the same bound (2 W rows per fetch plane), and the lists are W entries.
    base = dict(B=1, H=2, KVH=1, D=16, Bb=1, Hb=1, W=4)
    short = _run_case(rank, world, dict(base, L=16 * world), seed=7)
    long = _run_case(rank, world, dict(base, L=64 * world), seed=7)
    cap = (world - 1) * (15 * 8 + 2 * 4 * 16) + 2 * 4 * 1 * 1 * (2 * 16 + 1) * 8
    assert short["forward_received_bytes"] <= cap and long["forward_received_bytes"] <= cap


def test_exchange_does_not_grow_with_length():
    spawn(2, _bytes_worker)


def _layout_worker(rank, world):
    x = torch.arange(4 * world * 3, dtype=torch.float64).view(1, 4 * world, 3).requires_grad_()
    local = shard_sequence(x, 1)
    C = x.shape[1] // (2 * world)
    assert torch.equal(local[0, :C], x[0, rank * C : (rank + 1) * C])
    assert torch.equal(local[0, C:], x[0, (2 * world - 1 - rank) * C : (2 * world - rank) * C])
    leaf = local.detach().requires_grad_()
    whole = unshard_sequence(leaf, 1)
    assert torch.equal(whole, x.detach())
    (whole * torch.arange(whole.numel(), dtype=torch.float64).view_as(whole)).sum().backward()
    want = shard_sequence(torch.arange(whole.numel(), dtype=torch.float64).view_as(whole), 1)
    assert torch.equal(leaf.grad, want)


def test_shard_unshard_layout():
    spawn(2, _layout_worker)


def _errors_worker(rank, world):
    base = dict(B=1, L=8 * world, H=2, KVH=1, D=8, Bb=1, Hb=1)
    q, k, v, bias, _, _ = _inputs(base, 0)
    q, k, v = (shard_sequence(t, 1) for t in (q, k, v))
    bias = shard_sequence(bias, 3)

    def expect(exc, match, *args, **kw):
        kw.setdefault("keep_window_size", 4)
        with pytest.raises(exc, match=match):
            context_parallel_attention(*args, **kw)

    # Bad input on one rank raises on every rank, before any data moves.
    if rank == 0:
        expect(ValueError, "must be even", q[:, :-1], k[:, :-1], v[:, :-1], bias[..., :-1])
    else:
        expect(ValueError, r"rank\(s\) \[0\]", q, k, v, bias)
    # Local lengths that differ across ranks.
    n = 2 if rank == 1 else 0
    expect(ValueError, "disagree on local_length", q[:, n:], k[:, n:], v[:, n:], bias[..., n:])
    # Dtypes that differ across ranks.
    cast = (lambda t: t.float()) if rank == 0 else (lambda t: t)
    expect(ValueError, "disagree on dtype", cast(q), cast(k), cast(v), cast(bias))
    # Arguments that differ across ranks.
    expect(ValueError, "disagree on keep_window_size", q, k, v, bias, keep_window_size=3 + rank)
    # Bad arguments on every rank.
    expect(ValueError, "keep_window_size must be a positive int", q, k, v, bias, keep_window_size=0)
    expect(ValueError, "per-key attn_bias", q, k, v, None)
    expect(ValueError, "key padding mask", q, k, v, bias, attn_mask=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="keep_window_size"):
        context_parallel_attention(q, k, v, bias)
    with pytest.raises(TypeError, match="group must be"):
        context_parallel_attention(q, k, v, bias, keep_window_size=4, group="world")
    assert exchange_stats()["calls"] == 0
    # The group still works after every rejected call.
    context_parallel_attention(q, k, v, bias, keep_window_size=4)


def test_bad_input_raises_on_every_rank():
    spawn(2, _errors_worker)


def _rejected_call_worker(rank, world):
    # A rejected call's exception is not held by a frame it passed through: such a frame and the
    # exception's traceback are a cycle that keeps the group and the tensors alive until the garbage
    # collector runs; collected at exit after destroy_process_group, it made gloo abort the process.
    q, k, v, bias, _, _ = _inputs(dict(B=1, L=8 * world, H=2, KVH=1, D=8, Bb=1, Hb=1), 0)
    q, k, v = (shard_sequence(t, 1) for t in (q, k, v))
    bias = shard_sequence(bias, 3)
    own = torch.arange(k.shape[1]) + rank * k.shape[1]
    calls = (
        lambda: context_parallel_attention(q, k, v, bias, keep_window_size=0),  # every rank's own error
        lambda: context_parallel_attention(q, k, v, bias, keep_window_size=4 if rank else 0),  # rank 0's
        lambda: flexdma.distributed.context_parallel_decode(
            q[:, :1], k, v, bias, keep_window_size=3 + rank, key_index=own
        ),
    )
    for call in calls:
        with pytest.raises(ValueError) as info:
            call()
        tb, holders = info.value.__traceback__.tb_next, []  # the frames below this one
        while tb is not None:
            frame = tb.tb_frame
            holders += [f"{frame.f_code.co_name}:{n}" for n, x in frame.f_locals.items() if x is info.value]
            tb = tb.tb_next
        assert not holders, (rank, holders)


def test_a_rejected_call_leaves_no_reference_cycle():
    spawn(2, _rejected_call_worker)


def test_needs_an_initialized_group():
    q, kv, bias = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 8), torch.randn(1, 1, 1, 4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        context_parallel_attention(q, kv, kv, bias, keep_window_size=2)


def _layer_worker(rank, world):
    torch.manual_seed(0)
    B, L, hidden = 2, 8 * world, 32
    layer = DynamicMaskAttention(hidden, 4, 2, keep_window_size=5, dtype=torch.float64)
    with torch.no_grad():
        layer.A.uniform_(0.5, 1.5)  # scores away from Doge's init, where every key ties
    cp_layer = DynamicMaskAttention(hidden, 4, 2, keep_window_size=5, cp_group=dist.group.WORLD, dtype=torch.float64)
    cp_layer.load_state_dict(layer.state_dict())
    x = torch.randn(B, L, hidden, dtype=torch.float64)
    pad = torch.ones(B, L, dtype=torch.bool)
    pad[1, :3] = False
    cos, sin = rotary_cos_sin(torch.arange(L), 8, dtype=torch.float64)
    go = torch.randn(B, L, hidden, dtype=torch.float64)

    want = layer(x, (cos, sin), attention_mask=pad)
    (want * go).sum().backward()
    rot = (shard_sequence(cos, 0), shard_sequence(sin, 0))
    out = cp_layer(shard_sequence(x, 1), rot, attention_mask=shard_sequence(pad, 1))
    (out * shard_sequence(go, 1)).sum().backward()
    assert _max_err(out, shard_sequence(want, 1)) <= TOL
    for (name, p), (_, cp) in zip(layer.named_parameters(), cp_layer.named_parameters()):
        g = cp.grad.clone()
        dist.all_reduce(g)  # each rank's part of the parameter's gradient
        assert _max_err(g, p.grad) <= TOL, (name, _max_err(g, p.grad))
    with pytest.raises(ValueError, match="context-parallel layer"):
        cp_layer(shard_sequence(x, 1), rot, use_cache=True)


def test_layer_with_cp_group():
    spawn(2, _layer_worker)


def _bf16_worker(rank, world, case, device_type):
    """bf16 (on NCCL with CUDA, on gloo on the CPU) under FlashAttention's rule (tests/utils.py): each of out, dq, dk, dv, dbias
    of the CP call within twice the error of the eager reference in bf16 plus the rounding floor,
    against float64 truth (the one-process call on the CPU). The one-GPU call is held to the same
    rule and both errors are printed: a key's gradient under CP is a sum of parts computed by
    different calls, each rounded to bf16 by its kernel, where the one-GPU kernel rounds one float
    sum."""
    dev = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    # Inputs rounded to bf16 first: truth and the bf16 calls then rank the same scores.
    q, k, v, bias, mask, go = _inputs(case, seed=11)
    q, k, v, bias = (t.to(torch.bfloat16).double() for t in (q, k, v, bias))
    W = case["W"]
    mask4 = None if mask is None else mask[:, None, None, :]

    def grads_of(fn, tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        out = fn(*leaves)
        g = go if out.shape[1] == go.shape[1] else shard_sequence(go, 1)
        out.backward(g.to(out.device, out.dtype))
        return [out.detach()] + [t.grad for t in leaves]

    def one(q_, k_, v_, b_, m):
        return flexdma.flash_dma_attention(q_, k_, v_, m, b_, is_causal=True, keep_window_size=W)

    truth = grads_of(lambda *t: one(*t, mask4), (q, k, v, bias))
    lo = [t.to(dev, torch.bfloat16) for t in (q, k, v, bias)]
    dev_mask = None if mask4 is None else mask4.to(dev)
    keep = flexdma.create_mask(lo[3], W, attn_mask=dev_mask, is_causal=True, query_len=q.shape[1])
    eager = grads_of(lambda *t: flexdma.attention_ref(*t[:3], keep, t[3], is_causal=True)[0], lo)
    gpu = grads_of(lambda *t: one(*t, dev_mask), lo)
    local = [shard_sequence(t, 1) for t in lo[:3]] + [shard_sequence(lo[3], 3)]
    local_mask = None if mask is None else shard_sequence(mask, 1).to(dev)
    cp = grads_of(lambda *t: context_parallel_attention(*t, keep_window_size=W, attn_mask=local_mask), local)
    for name, c, g, e, t, d in zip(("out", "dq", "dk", "dv", "dbias"), cp, gpu, eager, truth, (1, 1, 1, 1, 3)):
        t_local = shard_sequence(t, d)
        e_local, g_local = shard_sequence(e, d), shard_sequence(g, d)
        errs = [(x.double().cpu() - t_local).abs().max().item() for x in (c, g_local, e_local)]
        print(
            f"rank {rank}/{world} {name}: cp {errs[0]:.3e} one-gpu {errs[1]:.3e} eager-bf16 {errs[2]:.3e}", flush=True
        )
        assert_close_to_ref(g_local, t_local, e_local, f"one-GPU {name}")
        assert_close_to_ref(c, t_local, e_local, f"CP {name} (rank {rank}/{world})")


GPU_CASE = dict(B=1, L=8192, H=8, KVH=2, D=128, Bb=1, Hb=2, W=512, pad=True)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_nccl_bf16_matches_one_gpu(world):
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    spawn(world, _bf16_worker, GPU_CASE, "cuda", backend="nccl")


def test_gloo_bf16_rule():
    spawn(2, _bf16_worker, dict(B=2, L=256, H=4, KVH=2, D=64, Bb=2, Hb=2, W=24, pad=True), "cpu")


def _run_example(nproc: int, *args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}"]
    cmd += ["-m", "flexdma.examples.doge_cp", "--check", "--dtype", "float64", "--seq-len", "96", "--window", "8"]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # The ranks' lines may interleave on the shared stdout: count what each rank printed.
    out = res.stdout
    assert all(f"rank {r} check:" in out for r in range(nproc)), out
    assert out.count("; ok") == nproc and "MISMATCH" not in out, out
    return res.stdout


@pytest.mark.parametrize(
    "nproc, args",
    [(3, ("--steps", "2")), (4, ("--cp", "2", "--fsdp", "--steps", "2"))],
    ids=["cp3", "fsdp-dp2-cp2"],
)
def test_doge_cp_example_matches_one_process(nproc, args):
    """The recipe (flexdma/examples/doge_cp.py): transformers' Doge with its sequence sharded, the
    loss and every parameter gradient equal to the one-process model's (float64, 1e-10), with
    plain all-reduced gradients over 3 ranks and with FSDP2 over a 2 x 2 data x context mesh."""
    pytest.importorskip("transformers")
    _run_example(nproc, *args)


def _doge_decode_worker(rank, world):
    import transformers

    cfg = transformers.DogeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, keep_window_size=4, is_moe=False,
    )  # fmt: skip
    model = patch_doge(transformers.DogeForCausalLM(cfg).double(), cp_group=dist.group.WORLD)
    ids = shard_sequence(torch.arange(8 * world).view(1, -1) % 64, 1)
    pos = shard_sequence(torch.arange(8 * world).view(1, -1), 1)
    out = model(input_ids=ids, position_ids=pos)  # the default use_cache: a prefill fills it
    with pytest.raises(ValueError, match="decoding"):
        model(input_ids=ids[:, :1], position_ids=pos[:, -1:] + 1, past_key_values=out.past_key_values)


def test_patched_doge_with_cp_rejects_decoding():
    pytest.importorskip("transformers")
    spawn(2, _doge_decode_worker)


def _decode_worker(rank, world):
    """A decode step over a cache sharded unevenly by rank (one shard empty at 3 ranks) against the
    one-process per-key call over the whole cache, float64 (1e-12); what moves is the lists and
    one partial output per rank."""
    cases = [
        dict(B=1, K=37, Q=1, H=2, KVH=1, D=16, Bb=1, Hb=1, W=5),
        dict(B=2, K=40, Q=3, H=4, KVH=2, D=32, Bb=2, Hb=2, W=9, pad=True),
        dict(B=2, K=29, Q=1, H=4, KVH=2, D=16, Bb=1, Hb=4, W=64, pad=True, softcap=3.0),
        dict(B=1, K=50, Q=2, H=2, KVH=2, D=8, Bb=1, Hb=1, W=1),
    ]
    for n, c in enumerate(cases):
        g = torch.Generator().manual_seed(100 + n)
        B, K, Q, H, KVH, D, W = (c[x] for x in ("B", "K", "Q", "H", "KVH", "D", "W"))
        q = torch.randn(B, Q, H, D, generator=g, dtype=torch.float64)
        k, v = (torch.randn(B, K, KVH, D, generator=g, dtype=torch.float64) for _ in range(2))
        bias = torch.rand(c["Bb"], c["Hb"], 1, K, generator=g, dtype=torch.float64)
        mask = (torch.rand(B, K, generator=g) > 0.3) if c.get("pad") else None
        kw = dict(softcap=c.get("softcap", 0.0))
        want = flexdma.flash_dma_attention(
            q, k, v, None if mask is None else mask[:, None, None, :], bias, keep_window_size=W, **kw
        )
        # Shards: a permutation of the positions cut at random points (ranks hold any keys).
        perm = torch.randperm(K, generator=g)
        cuts = sorted(torch.randint(0, K + 1, (world - 1,), generator=g).tolist())
        if world == 3:
            cuts[0] = 0  # rank 0's shard is empty
        own = perm[([0] + cuts)[rank] : (cuts + [K])[rank]].sort().values
        exchange_stats(reset=True)
        got = flexdma.distributed.context_parallel_decode(
            q, k[:, own], v[:, own], bias[..., own], keep_window_size=W, key_index=own,
            attn_mask=None if mask is None else mask[:, own], **kw,
        )  # fmt: skip
        assert _max_err(got, want) <= TOL, (rank, c, _max_err(got, want))
        sent = exchange_stats()["forward_sent_bytes"]
        Bs = B if (mask is not None or c["Bb"] == B) else 1
        lists = 2 * Bs * c["Hb"] * W * 8
        assert sent == (world - 1) * (13 * 8 + lists + B * Q * H * D * 8 + B * H * Q * 8), (sent, c)
    with pytest.raises(ValueError, match="inference-only"):
        flexdma.distributed.context_parallel_decode(
            q.requires_grad_(), k, v, bias, keep_window_size=2, key_index=torch.arange(k.shape[1])
        )


@pytest.mark.parametrize("world", [2, 3])
def test_decode_over_a_sharded_cache(world):
    spawn(world, _decode_worker)
