"""`python -m benchmarks perkey`: the per-key top-W path (flash_dma_attention(keep_window_size=W))
against its peers, selection included, one GPU; FlexAttention's peers each in a fresh process a row.

Rows (bf16, causal, per-key bias, W=2048): B=1, H=2, KVH=1 at 8K / 16K / 32K / 128K, D in {128, 64};
the model shapes B=4 L=4K and B=2 L=8K with H=16, KVH=4 and Doge's H=8, KVH=4 at 16K (bias per kv
head); decode (Q=1, K=128K and 512K, W=1024). Scores are drawn so that they do not tie. Peers, same run:
- sdpa: dense causal SDPA over all keys, no mask (the bar);
- flexdma: the per-key path end to end (selection + kernels);
- flex: the same selection through FlexAttention (compiled; its mask_mod reads the selection);
- flex-window: FlexAttention over a sliding window of the last W keys (the same number of keys a
  row keeps, contiguous), with the same bias;
- dense-mask: create_mask + flash_dma_attention with that mask on the dense-mask CUDA kernels
  (only where the mask fits; it is Q x K bools);
- flexdma-cache: a decode step as nn.DynamicMaskAttention runs it from its cache (decode rows only).
Forward = one call; train = forward + backward; bwd = train - forward. Beside them: the listed work
at dense SDPA's measured rate (the ideal: the keys each row keeps, 4 D H per kept key and row
forward, 3.5x that for a training call, over SDPA's FLOP/s on all visible keys in the same run),
flexdma's TFLOP/s on the listed keys, its device launches per call (kernels, memsets, copies) and
its peak memory above the inputs.

`--d 64` (or 128) runs one head dim's rows (the Doge rows go with 128): every peer of the whole
table does not fit one 10-minute call, so a run can be split; the report reads one commit's runs
as one table.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import List, Optional

import torch
import torch.nn.functional as F

import flexdma
import flexdma.integrations.transformers as hf
from flexdma.dense.flex import sparse_mask_kernel_options
from flexdma.integrations.transformers import patch_doge
from flexdma.nn import DMACache
from flexdma.perkey import cache as perkey_cache

from . import configs
from .common import Saving, chosen_peers, in_fresh_process, record, run_section, runs_of, table
from .peers import compiled_flex

SCHEMA = "flexdma-perkey-bench/1"
DENSE_MASK_MAX = 32768  # the dense-mask peer builds Q x K bools: up to 1 GiB at 32K
FLEX_MAX = 65536  # FlexAttention visits every causal tile: kept to lengths it finishes in seconds


def cases(quick: bool = False) -> List[dict]:
    # The rows first (D=128 lengths, the model shapes), then the D=64 rows: a run cut by its
    # time budget keeps the rows the targets name.
    lengths = (32768,) if quick else (8192, 16384, 32768, 131072)
    rows = [dict(name=f"L={L // 1024}K D=128", B=1, L=L, Q=L, H=2, KVH=1, D=128, W=2048, bias_heads=1) for L in lengths]
    model = dict(H=16, KVH=4, D=128, W=2048, bias_heads=4)
    rows.append(dict(name="B=2 L=8K H=16 KVH=4", B=2, L=8192, Q=8192, **model))
    if not quick:
        rows.append(dict(name="B=4 L=4K H=16 KVH=4", B=4, L=4096, Q=4096, **model))
        rows.append(dict(name="Doge H=8 KVH=4 L=16K", B=1, L=16384, Q=16384, **dict(model, H=8)))
        for L in lengths:
            rows.append(dict(name=f"L={L // 1024}K D=64", B=1, L=L, Q=L, H=2, KVH=1, D=64, W=2048, bias_heads=1))
        rows.append(dict(name="B=2 L=8K H=16 KVH=4 D=64", B=2, L=8192, Q=8192, **dict(model, D=64)))
        decode = dict(Q=1, H=2, KVH=1, D=128, W=1024, bias_heads=1, decode=True)
        for K in (131072, 524288):
            rows.append(dict(name=f"decode Q=1 K={K // 1024}K", B=1, L=K, **decode))
    return rows


def head_dims() -> List[int]:
    """The head dims of the rows (what --d chooses among)."""
    return sorted({c["D"] for c in cases()})


def kept_per_row(Q: int, K: int, W: int) -> tuple:
    """(keys all rows keep, keys all rows see) of a causal (bottom-right) call with window W."""
    seen = kept = 0
    off = K - Q
    # Rows whose visible count is below W keep all they see; the rest keep W.
    for first, last in ((0, min(Q, max(0, W - off))), (min(Q, max(0, W - off)), Q)):
        if last <= first:
            continue
        n = last - first
        vis = n * (first + last + 1) // 2 + n * off  # sum over i of (i + 1 + off)
        seen += vis
        kept += vis if first == 0 and W - off > 0 else n * W
    return kept, seen


def flops(c: dict) -> tuple:
    """(listed, dense) forward FLOPs of a case: 4 D H per (row, kept key) and per (row, seen key)."""
    kept, seen = kept_per_row(c["Q"], c["L"], c["W"])
    per = 4 * c["D"] * c["H"] * c["B"]
    return per * kept, per * seen


def _inputs(c: dict, grad: bool):
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(c["B"], c["Q"], c["H"], c["D"], device=dev, dtype=dt, requires_grad=grad)
    k = torch.randn(c["B"], c["L"], c["KVH"], c["D"], device=dev, dtype=dt, requires_grad=grad)
    v = torch.randn(c["B"], c["L"], c["KVH"], c["D"], device=dev, dtype=dt, requires_grad=grad)
    bb = c["B"] if c["bias_heads"] > 1 else 1
    # Doge-like scores: positive, distinct (no all-equal importance).
    bias = torch.exp(torch.randn(bb, c["bias_heads"], 1, c["L"], device=dev)).to(dt).requires_grad_(grad)
    return q, k, v, bias


def _peer_fn(peer: str, c: dict, q, k, v, bias):
    causal = True
    if peer == "sdpa":
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal and c["Q"] > 1, enable_gqa=True)
    if peer in ("flexdma", "flex"):
        backend = "auto" if peer == "flexdma" else "flex"
        return lambda: flexdma.flash_dma_attention(
            q, k, v, None, bias, is_causal=causal, keep_window_size=c["W"], backend=backend
        )
    if peer == "flex-window":
        return _flex_window(c, q, k, v, bias)
    if peer == "flexdma-cache":
        # A decode step as nn.DynamicMaskAttention runs it from its cache (DMACache.attend, routed
        # as the layer routes it): the new key appended, the kept set updated in O(W) and the row's
        # attention over it (on CUDA one kernel), no selection over all K keys.
        k1, v1 = k[:, -1:].detach(), v[:, -1:].detach()
        b1 = bias[..., -1:].detach()
        pad = torch.ones(k.shape[0], 1, dtype=torch.bool, device=k.device)
        # One step first, from the first K - 2 keys: its cache's buffers have spare room (from_full's
        # have none, so a step from it copies the whole cache into grown buffers, which a decoding
        # loop pays once per doubling, not per token). Then the same step each call: the new key
        # goes into the same spare slot (the kept set is updated in place each time: the same work).
        cache = DMACache.from_full(k[:, :-2].detach(), v[:, :-2].detach(), bias[..., :-2].detach(), None, c["W"])
        cache = cache.step(k[:, -2:-1].detach(), v[:, -2:-1].detach(), bias[..., -2:-1].detach(), pad[:, 0])
        scale = c["D"] ** -0.5

        def step():
            how = perkey_cache.route(q, k1, cache.kept_set, c["W"], gathers_bias=True)
            return cache.attend(how, q, k1, v1, b1, pad, scale=scale)[0]

        return step
    if peer == "dense-mask":

        def run():
            mask = flexdma.create_mask(bias.detach(), c["W"], is_causal=causal, query_len=c["Q"])
            return flexdma.flash_dma_attention(q, k, v, mask, bias, is_causal=causal, backend="cuda")

        return run
    raise ValueError(peer)


# _flex_window's default options: flexdma's choice for a block mask that skips most tiles.
SPARSE_MASK_OPTIONS = object()


def _flex_window(c: dict, q, k, v, bias, options=SPARSE_MASK_OPTIONS):
    """FlexAttention (compiled, at `options`: by default those of a mask that skips most tiles) over
    the last W keys a row sees, with the per-key bias as score_mod: the work the per-key path lists,
    but contiguous."""
    from torch.nn.attention.flex_attention import create_block_mask

    W, off, G = c["W"], c["L"] - c["Q"], c["H"] // bias.shape[1]
    batch_on = bias.shape[0] > 1

    def mask_mod(b, h, qi, ki):
        return (ki <= qi + off) & (ki > qi + off - W)

    def score_mod(s, b, h, qi, ki):
        return s + bias[b if batch_on else 0, h // G, 0, ki]

    bm = create_block_mask(mask_mod, None, None, c["Q"], c["L"], device=q.device, BLOCK_SIZE=128)
    training = torch.is_grad_enabled() and q.requires_grad
    opts = (
        sparse_mask_kernel_options(q.device, c["D"], q.dtype, training) if options is SPARSE_MASK_OPTIONS else options
    )
    attend = compiled_flex()
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return lambda: attend(
        qt, kt, vt, score_mod=score_mod, block_mask=bm, enable_gqa=True, kernel_options=opts
    ).transpose(1, 2)


def _device_events(fn, calls: int) -> list:
    """(name, device us) of every device operation (kernel, memset, copy) `calls` calls of fn
    issue, after one call unprofiled (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return [(e.name[:60], e.time_range.elapsed_us()) for e in prof.events() if e.device_type == cuda]


def device_ops(fn) -> dict:
    """The device operations one call of fn issues, counted by name."""
    names: dict = {}
    for name, _ in _device_events(fn, 1):
        names[name] = names.get(name, 0) + 1
    return names


def device_op_times(fn, calls: int = 20) -> dict:
    """The device operations of fn by name, with their mean device time per call in us over
    `calls` calls."""
    times: dict = {}
    for name, us in _device_events(fn, calls):
        times[name] = times.get(name, 0.0) + us / calls
    return {name: round(t, 2) for name, t in times.items()}


def _launches(fn) -> int:
    return sum(device_ops(fn).values())


def _applies(peer: str, c: dict) -> Optional[str]:
    if peer == "flexdma-cache" and not c.get("decode"):
        return "decoding only"
    if peer == "dense-mask" and c["L"] * c["Q"] > DENSE_MASK_MAX**2:
        return f"the dense mask is {c['Q']} x {c['L']} bools"
    if peer == "dense-mask" and "cuda" not in flexdma.available_backends():
        return "the dense-mask CUDA kernels are not built"
    if peer in ("flex", "flex-window") and c["L"] > FLEX_MAX:
        return f"L > {FLEX_MAX}"
    if peer == "flex-window" and c.get("decode"):
        return "not a decode peer"
    return None


def _time(fn, warmup=25, rep=100) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def _peak(fn) -> float:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak / 2**20


# FlexAttention's peers compile one graph a shape; each (row, peer) compiles and runs in a fresh
# process, so that no earlier row's graphs, caches or allocator state weigh on its time.
FRESH_PROCESS_PEERS = ("flex", "flex-window")


def measure(peer: str, c: dict) -> dict:
    """One peer on one row: forward time, peak and launches, and the training call's (forward and
    the gradients of q, k, v and, but for SDPA, the bias), or the error it raised."""
    rec = {}
    try:
        q, k, v, bias = _inputs(c, grad=False)
        with torch.no_grad():
            fn = _peer_fn(peer, c, q, k, v, bias)
            fn()
            rec["fwd_ms"] = _time(fn)
            rec["fwd_peak_mib"] = _peak(fn)
            if peer in ("flexdma", "flexdma-cache"):
                rec["fwd_launches"] = _launches(fn)
        del q, k, v, bias
        if not c.get("decode"):
            q, k, v, bias = _inputs(c, grad=True)
            fwd = _peer_fn(peer, c, q, k, v, bias)
            leaves = (q, k, v) if peer == "sdpa" else (q, k, v, bias)

            def step():
                out = fwd()
                return torch.autograd.grad(out, leaves, torch.ones_like(out))

            step()
            rec["fwd_bwd_ms"] = _time(step, warmup=10, rep=50)
            rec["bwd_ms"] = rec["fwd_bwd_ms"] - rec["fwd_ms"]
            rec["fwd_bwd_peak_mib"] = _peak(step)
            if peer == "flexdma":
                rec["fwd_bwd_launches"] = _launches(step)
            del q, k, v, bias
    except Exception as e:  # a peer failing (out of memory, compile error) is a result too
        rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return rec


PEERS = ("sdpa", "flexdma", "flexdma-cache", "flex", "flex-window", "dense-mask")


def run(
    quick: bool = False, peers=PEERS, budget: float = 480.0, rows: Optional[list] = None, dims: Optional[list] = None
) -> dict:
    """The kernel rows (those of head dims `dims`, all where None); appended to `rows` as they
    finish (the caller saves them as it goes)."""
    t0 = time.time()
    rows = [] if rows is None else rows
    for c in cases(quick):
        if dims is not None and c["D"] not in dims:
            continue
        if budget and time.time() - t0 > budget:
            rows.append(dict(case=c, not_run="time budget"))
            continue
        row = dict(case=c, peers={})
        for peer in peers:
            why = _applies(peer, c)
            if why:
                row["peers"][peer] = dict(skipped=why)
                continue
            rec = in_fresh_process(measure, peer, c) if peer in FRESH_PROCESS_PEERS else measure(peer, c)
            record(row, peer, rec)
        row["listed_flops"], row["dense_flops"] = flops(c)
        rows.append(row)
    return dict(schema=SCHEMA, rows=rows)


DOGE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    keep_window_size=2048,
    is_moe=False,
)


@contextlib.contextmanager
def _without_dynamic_mask():
    """patch_doge's layers with dense causal SDPA over all keys in place of the per-key path, and no
    kept-set decode steps: the same model (projections, rotary, dt_states computed) without its
    dynamic mask (the train step here, generation in benchmarks/decode.py)."""

    def sdpa(q, k, v, mask, bias, *, is_causal, softmax_scale, backend, keep_window_size=None):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        causal = is_causal and q.shape[1] == k.shape[1]
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=softmax_scale, enable_gqa=True)
        return out.transpose(1, 2)

    saved = hf.flash_dma_attention, perkey_cache.MAX_ROWS, hf._set_kept_state
    # No kept sets either: a decode step would otherwise still select over every key to build them.
    hf.flash_dma_attention, perkey_cache.MAX_ROWS, hf._set_kept_state = sdpa, 0, lambda *args: None
    try:
        yield
    finally:
        hf.flash_dma_attention, perkey_cache.MAX_ROWS, hf._set_kept_state = saved


def doge_rows(lengths=(16384, 65536), rows: Optional[list] = None) -> List[dict]:
    """transformers' DogeForCausalLM train step (forward + backward, loss on labels), bf16, B=1, with
    A drawn in [0.5, 1.5] (at Doge's init A = 0 every score ties and every row keeps its first W
    keys: contiguous gathers, a case no trained model has): flexdma through patch_doge, the same
    model without its dynamic mask (dense causal SDPA over all keys: the bar), and
    attn_implementation "sdpa" (Doge's own (B, H, Q, K) dynamic mask)."""
    from transformers import DogeConfig, DogeForCausalLM

    rows = [] if rows is None else rows
    for L in lengths:
        row = dict(case=dict(name=f"Doge train step L={L // 1024}K", L=L, A="U[0.5, 1.5]", **DOGE), peers={})
        for peer in ("flexdma", "no-dynamic-mask", "sdpa"):
            rec = {}
            model = None
            try:
                torch.manual_seed(0)
                cfg = DogeConfig(max_position_embeddings=L, **DOGE)
                model = DogeForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16)
                with torch.no_grad():
                    for layer in model.model.layers:
                        layer.self_attn.A.uniform_(0.5, 1.5)
                if peer == "sdpa":
                    model.set_attn_implementation("sdpa")
                else:
                    patch_doge(model)
                ids = torch.randint(cfg.vocab_size, (1, L), device="cuda")

                def step(model=model):
                    loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                    return loss

                with _without_dynamic_mask() if peer == "no-dynamic-mask" else contextlib.nullcontext():
                    step()
                    # do_bench sizes its repetitions by time (ms): ~1 s gives a 50-400 ms step 3-20
                    # samples for its median (10 ms ran it once).
                    rec["ms"] = _time(step, warmup=100, rep=1000)
                    rec["peak_mib"] = _peak(step) + torch.cuda.memory_allocated() / 2**20
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            del model
            record(row, peer, rec)
        rows.append(row)
    return rows


def _pair(a, b, fmt="{:.3f}") -> str:
    return " / ".join("–" if x is None else fmt.format(x) for x in (a, b))


def markdown(doc: dict) -> str:
    head = [
        "case",
        "flexdma fwd / train ms",
        "dense SDPA fwd / train ms",
        "listed work at SDPA's rate fwd / train ms",
        "flexdma TFLOP/s on listed keys fwd / train",
        "FlexAttention, same selection",
        "FlexAttention, window of W",
        "dense-mask kernels",
        "flexdma-cache",
        "flexdma launches fwd / train",
        "flexdma peak MiB fwd / train",
        "SDPA / flexdma fwd / train",
    ]

    def cells(row) -> list:
        c, P = row["case"], row["peers"]

        def times(peer):
            r = P.get(peer, {})
            if "skipped" in r:
                return f"– ({r['skipped']})"
            if "error" in r:
                return f"error: {r['error'][:60]}"
            return _pair(r.get("fwd_ms"), r.get("fwd_bwd_ms")) if r else "–"

        f, sd = P.get("flexdma", {}), P.get("sdpa", {})
        listed, dense = row.get("listed_flops"), row.get("dense_flops")
        if listed is None and all(k in c for k in ("B", "Q", "L", "H", "D", "W")):
            listed, dense = flops(c)  # runs that predate the stored counts
        ideal = [None, None]
        tflops = [None, None]
        for i, key in enumerate(("fwd_ms", "fwd_bwd_ms")):
            scale = 3.5 if i else 1.0
            if listed and dense and sd.get(key):
                ideal[i] = sd[key] * listed / dense
            if listed and f.get(key):
                tflops[i] = scale * listed / (f[key] * 1e-3) / 1e12
        ratio = [sd[k] / f[k] if sd.get(k) and f.get(k) else None for k in ("fwd_ms", "fwd_bwd_ms")]
        return [
            c["name"],
            times("flexdma"),
            times("sdpa"),
            _pair(*ideal),
            _pair(*tflops, fmt="{:.0f}"),
            times("flex"),
            times("flex-window"),
            times("dense-mask"),
            times("flexdma-cache"),
            _pair(f.get("fwd_launches"), f.get("fwd_bwd_launches"), fmt="{:d}"),
            _pair(f.get("fwd_peak_mib"), f.get("fwd_bwd_peak_mib"), fmt="{:.0f}"),
            _pair(*ratio, fmt="{:.2f}x"),
        ]

    lines = table(head, doc["rows"], cells)
    if doc.get("doge"):
        names = {"flexdma": "flexdma (patch_doge)", "no-dynamic-mask": "without the dynamic mask (dense SDPA)"}
        names["sdpa"] = 'attn_implementation "sdpa" (Doge\'s dense mask)'
        peers_ = [p for p in names if any(p in r["peers"] for r in doc["doge"])]
        a = doc["doge"][0]["case"].get("A", "0 (Doge's init: every score ties)")
        head = [f"transformers Doge train step (B=1, 4 layers, hidden 1024, W=2048, A = {a})"]

        def doge_cells(row) -> list:
            cells = [row["case"]["name"]]
            for p in peers_:
                r = row["peers"].get(p, {})
                if "error" in r:
                    cells.append(f"error: {r['error'][:60]}")
                elif "ms" not in r:  # a run cut before this peer
                    cells.append("not run")
                else:
                    cells.append(f"{r['ms']:.1f} / {r['peak_mib']:.0f}")
            return cells

        lines += [""] + table(head + [f"{names[p]} ms / peak MiB" for p in peers_], doc["doge"], doge_cells)
        if doc.get("doge_commit"):
            lines += ["", f"The Doge rows are commit {doc['doge_commit']}'s run (the newest run that finished them)."]
    return "\n".join(lines)


# The peers the table must show: a run with fewer (--peers, as a before / after comparison of
# flexdma alone) does not replace the newest run that measured them.
TABLE_PEERS = frozenset(("sdpa", "flexdma", "flex", "flex-window"))


def _measured_peers(doc: dict) -> set:
    return {p for r in doc.get("rows", []) for p in r.get("peers", {})}


def _merged(runs: List[dict]) -> List[dict]:
    """One document per (GPU, commit), newest first: a run split over calls (--d, or one a time
    limit cut and a later call finished) read as one, a lone run through the same rules. A row
    measured in a later run replaces the earlier one; a row one run left out is taken from another
    that ran it; the Doge rows are the newest run's that has them. Unfinished while a row is not run, a head dim no run covered, or
    the Doge rows come from a cut run."""
    groups: dict = {}
    for doc in sorted(runs, key=lambda d: d.get("date", "")):
        groups.setdefault((doc.get("gpu_short"), doc.get("commit")), []).append(doc)
    order = [c["name"] for c in cases()]
    all_dims = set(head_dims())
    out = []
    for docs in groups.values():
        covered = set().union(*(set(d.get("dims") or all_dims) for d in docs))
        rows: dict = {}
        for d in docs:  # oldest first: a later measurement wins, a later "not run" does not
            for r in d.get("rows", []):
                if "not_run" not in r or r["case"]["name"] not in rows:
                    rows[r["case"]["name"]] = r
        merged = dict(docs[-1])
        merged["rows"] = sorted(
            rows.values(), key=lambda r: order.index(r["case"]["name"]) if r["case"]["name"] in order else len(order)
        )
        # The Doge rows run last: a run whose budget left rows out still finished them, unless the
        # call's limit cut it (unfinished).
        doge_doc = next((d for d in reversed(docs) if d.get("doge")), None)
        merged["doge"] = doge_doc["doge"] if doge_doc else []
        merged.pop("unfinished", None)
        merged["doge_unfinished"] = bool(doge_doc and doge_doc.get("unfinished"))
        if covered != all_dims or any("not_run" in r for r in merged["rows"]) or merged["doge_unfinished"]:
            merged["unfinished"] = True
        out.append(merged)
    return sorted(out, key=lambda d: d.get("date", ""), reverse=True)


def _note(doc: dict) -> str:
    return (
        "`python -m benchmarks perkey`: bf16, causal, selection time included in flexdma's numbers; "
        "peak = the call's memory above its inputs. The eager calls the host bounds (forward and "
        "training calls at 8K and 16K, the decode rows) read up to 2-3x apart from one run to the next on the GPU "
        "machine's host; benchmarks/perf-log.md lists the runs and their kernels' device times. "
        + (
            "FlexAttention's peers compiled and ran in a fresh process for each row."
            if doc.get("fresh_process_peers")
            else "FlexAttention's peers compiled and ran in the bench's one process, after the earlier rows' graphs."
        )
    )


def section(results_dir: str) -> List[str]:
    """The newest run's tables that measured every peer of the table (else the newest run's), one
    commit's runs read as one (_merged); where that run left the Doge rows out (--peers without
    doge) or was cut in them, the newest finished run's, named. A newer run of fewer peers follows
    as its own section: its rows are the newest numbers; where every run shown is unfinished, the
    newest run that finished follows too."""
    runs = _merged(runs_of(results_dir, SCHEMA))
    if not runs:
        return []
    doc = next((d for d in runs if TABLE_PEERS <= _measured_peers(d)), runs[0])
    if not doc.get("doge") or doc.get("doge_unfinished", doc.get("unfinished")):
        # A cut run's Doge rows may stop short: those of the newest run that finished them.
        earlier = next((d for d in runs if d is not doc and d.get("doge") and not d.get("unfinished")), None)
        if earlier is not None:
            doc = dict(doc, doge=earlier["doge"], doge_commit=earlier.get("commit"))
    out = run_section(doc, "per-key top-W", _note(doc), markdown(doc))
    shown = [doc]
    if runs[0] is not doc and runs[0].get("commit") != doc.get("commit"):
        newest = runs[0]
        peers = ", ".join(sorted(_measured_peers(newest)))
        out += run_section(
            newest, "per-key top-W, the newest run", f"{_note(newest)} Peers: {peers}.", markdown(newest)
        )
        shown.append(newest)
    if all(d.get("unfinished") for d in shown):
        # A run its time budget cut lists rows as not run: the newest run that finished has them.
        done = next((d for d in runs if not d.get("unfinished")), None)
        if done is not None:
            peers = ", ".join(sorted(_measured_peers(done)))
            title = "per-key top-W, the newest run that finished"
            out += run_section(done, title, f"{_note(done)} Peers: {peers}.", markdown(done))
    return out


def main(args, env: dict) -> str:
    peers, doge = chosen_peers(args.peers, PEERS, "doge", "the train step rows", "perkey")
    # --d splits a run over calls by head dim (the report merges one commit's runs); the Doge
    # model's heads are 128 wide.
    try:
        dims = configs.parse_list(args.d, head_dims(), int)
    except ValueError as e:
        raise SystemExit(f"--d: {e}")
    doge = doge and (dims is None or 128 in dims)
    # Written after every row, marked unfinished until the last: a run its call's time limit cuts
    # keeps what it measured.
    doc = dict(schema=SCHEMA, rows=[], unfinished=True, dims=dims, fresh_process_peers=list(FRESH_PROCESS_PEERS))
    name = "perkey" if dims is None else "perkey_d" + "_".join(map(str, dims))
    saving = Saving(doc, args.out, env, name)
    run(quick=args.quick, peers=peers, budget=args.budget, rows=saving.list("rows"), dims=dims)
    if doge and not args.quick:
        try:
            doge_rows(rows=saving.list("doge"))
        except ImportError as e:  # transformers without Doge
            doc["doge_skipped"] = str(e)
    del doc["unfinished"]
    path = saving.save()
    print(f"wrote {path}\n" + markdown(doc), flush=True)
    return path
