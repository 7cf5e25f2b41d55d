"""`python -m benchmarks decode`: decoding with the per-key path, one GPU, one process.

Layer steps (bf16, W=1024, one new token, B=1): H=2, KVH=1, D=128 at 8K / 32K / 128K / 512K cached
keys, and a 7B-class layer (H=32, KVH=8, D=128) at 128K. Peers, same run:
- api: flash_dma_attention(q, k, v, None, bias, is_causal=True, keep_window_size=W) with Q=1: the
  selection over every cached key;
- layer-step: nn.DynamicMaskAttention's cached step (projections, the new key's score, the kept
  set's O(W) update, attention over the W kept keys);
- sdpa: dense SDPA of the new row over every cached key (the bar);
- layer-sdpa: the same layer's projections + dense SDPA over every cached key;
- kernel: the one-op step alone (flexdma.perkey.decode.attend_one, flexdma::decode_step: the kept
  set's update and the new row's attention over it), what layer-step spends in attention.
Generation: transformers' DogeForCausalLM (perkey.DOGE's config, A drawn in [0.5, 1.5]) generating
256 tokens after prompts of 8K / 32K / 128K, B = 1 and 8: prefill time, decode tokens/s and peak
memory, patch_doge (the kept sets beside the cache; with DynamicCache, and with a static cache,
which transformers generates with a compiled forward) against the same model without its dynamic
mask (plain SDPA over every cached key; with either cache) and eager Doge where it fits.
"""

from __future__ import annotations

import time
import types
from typing import List, Optional

import torch
import torch.nn.functional as F

import flexdma
import flexdma.integrations.transformers as hf
from flexdma.nn import DMACache, DynamicMaskAttention
from flexdma.perkey import cache as perkey_cache
from flexdma.perkey import decode as kept_sets

from .common import Saving, captured, chosen_peers, record, run_section, runs_of, table
from .perkey import DOGE, _peak, _time

SCHEMA = "flexdma-decode-bench/1"
PEERS = ("api", "layer-step", "kernel", "sdpa", "layer-sdpa")
# Also timed as a CUDA-graph replay (do_bench: L2 cleared before each): the GPU time without the
# host's launch, which a one-kernel step under do_bench otherwise partly measures.
GRAPHED = ("kernel", "sdpa")
# flexdma-static: patch_doge with cache_implementation="static", which transformers generates with
# a compiled forward (Inductor, CUDA graphs); its compile is in the first, untimed, generate call.
# no-dynamic-mask(-static): the same model's layers with plain SDPA over every cached key
# (_plain_sdpa_forward), with DynamicCache and with a static cache (compiled, as flexdma-static).
GEN_PEERS = ("flexdma", "flexdma-static", "no-dynamic-mask", "no-dynamic-mask-static", "eager")
EAGER_MAX = 8192  # eager Doge builds (B, H, Q, K) masks in its prefill


def cases(quick: bool = False) -> List[dict]:
    lengths = (131072,) if quick else (8192, 32768, 131072, 524288)
    rows = [dict(name=f"K={K // 1024}K H=2 KVH=1", K=K, H=2, KVH=1, D=128, W=1024) for K in lengths]
    if not quick:
        rows.append(dict(name="K=128K H=32 KVH=8 (7B-class)", K=131072, H=32, KVH=8, D=128, W=1024))
    return rows


def _layer(c: dict) -> DynamicMaskAttention:
    torch.manual_seed(0)
    layer = DynamicMaskAttention(
        c["H"] * c["D"], c["H"], c["KVH"], c["D"], keep_window_size=c["W"], device="cuda", dtype=torch.bfloat16
    )
    with torch.no_grad():
        layer.A.uniform_(0.5, 1.5)  # scores that do not tie (Doge's init A = 0 ties every key)
    return layer


def kernel_case(B, H, KVH, D, K, W):
    """One decode step's op alone (flexdma::decode_step through decode.attend_one), on a kept set
    of the first K - 1 keys; the new key never enters, so every call does the same work."""
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, 1, H, D, device=dev, dtype=dt)
    k = torch.randn(B, K, KVH, D, device=dev, dtype=dt)
    v = torch.randn(B, K, KVH, D, device=dev, dtype=dt)
    kept = kept_sets.last_row(torch.exp(torch.randn(B, KVH, K - 1, device=dev)).to(dt), W)
    # Score 0, below every exp(.) score: the new key never enters.
    s_new = torch.zeros(B, KVH, device=dev, dtype=dt)
    eligible = torch.ones(B, KVH, dtype=torch.bool, device=dev)
    return lambda: kept_sets.attend_one(q, k, v, kept, s_new, K - 1, eligible, D**-0.5)


def _peer_fn(peer: str, c: dict):
    dev, dt = "cuda", torch.bfloat16
    B, K, H, KVH, D, W = 1, c["K"], c["H"], c["KVH"], c["D"], c["W"]
    if peer in ("api", "sdpa"):
        torch.manual_seed(0)
        q = torch.randn(B, 1, H, D, device=dev, dtype=dt)
        k = torch.randn(B, K, KVH, D, device=dev, dtype=dt)
        v = torch.randn(B, K, KVH, D, device=dev, dtype=dt)
        if peer == "sdpa":
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            return lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        bias = torch.exp(torch.randn(B, KVH, 1, K, device=dev)).to(dt)
        return lambda: flexdma.flash_dma_attention(q, k, v, None, bias, is_causal=True, keep_window_size=W)
    if peer == "kernel":
        return kernel_case(B, H, KVH, D, K, W)
    layer = _layer(c)
    x = torch.randn(B, 1, H * D, device=dev, dtype=dt)
    cache_k = torch.randn(B, K, KVH, D, device=dev, dtype=dt)
    cache_v = torch.randn(B, K, KVH, D, device=dev, dtype=dt)
    if peer == "layer-step":
        bias = flexdma.dynamic.dynamic_bias(cache_v[:, :-1], layer.dt_proj, layer.A).to(dt)
        cache = DMACache.from_full(cache_k[:, :-2], cache_v[:, :-2], bias[..., :-1], None, W)
        # One step first: its cache's buffers have spare room (from_full's have none, so a step from
        # it copies the whole cache into grown buffers). Then the same step each call: the new key
        # goes into the same spare slot.
        cache = layer(x, attention_mask=None, past_key_value=cache, use_cache=True)[1]
        return lambda: layer(x, attention_mask=None, past_key_value=cache, use_cache=True)[0]
    if peer == "layer-sdpa":

        def step():
            q = layer.q_proj(x).view(B, 1, H, D).transpose(1, 2)
            cache_k[:, -1:] = layer.k_proj(x).view(B, 1, KVH, D)
            cache_v[:, -1:] = layer.v_proj(x).view(B, 1, KVH, D)
            out = F.scaled_dot_product_attention(
                q, cache_k.transpose(1, 2), cache_v.transpose(1, 2), enable_gqa=True
            ).transpose(1, 2)
            return layer.o_proj(out.reshape(B, 1, H * D))

        return step
    raise ValueError(peer)


def run(quick: bool = False, peers=PEERS, budget: float = 300.0, rows: Optional[list] = None) -> list:
    """The layer-step rows; appended to `rows` as they finish (the caller saves them as it goes)."""
    t0 = time.time()
    rows = [] if rows is None else rows
    for c in cases(quick):
        if budget and time.time() - t0 > budget:
            rows.append(dict(case=c, not_run="time budget"))
            continue
        row = dict(case=c, peers={})
        for peer in peers:
            rec = {}
            try:
                with torch.no_grad():
                    fn = _peer_fn(peer, c)
                    fn()
                    rec["ms"] = _time(fn)
                    if peer in GRAPHED:
                        rec["gpu_ms"] = _time(captured(fn))
                    rec["peak_mib"] = _peak(fn)
            except Exception as e:  # out of memory is a result too
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            record(row, peer, rec)
        rows.append(row)
    return rows


# The API with a few new rows after a long context (a chunk, speculative decoding): the few-rows
# route (flexdma/perkey/cache.py: kept sets and one dense-mask call) against the selection over
# every key, same inputs, same run; what FEW_ROWS (the largest row count the route takes) rests on.
API_ROWS = (1, 4, 16, 64)


def api_rows(K: int = 131072, H: int = 2, KVH: int = 1, D: int = 128, W: int = 1024, rows: Optional[list] = None):
    rows = [] if rows is None else rows
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    k = torch.randn(1, K, KVH, D, device=dev, dtype=dt)
    v = torch.randn(1, K, KVH, D, device=dev, dtype=dt)
    bias = torch.exp(torch.randn(1, KVH, 1, K, device=dev)).to(dt)
    taken = perkey_cache.few_rows_ok
    for Q in API_ROWS:
        row = dict(
            case=dict(name=f"K={K // 1024}K H={H} KVH={KVH}, {Q} new rows", K=K, Q=Q, H=H, KVH=KVH, D=D, W=W), peers={}
        )
        q = torch.randn(1, Q, H, D, device=dev, dtype=dt)

        def call():
            return flexdma.flash_dma_attention(q, k, v, None, bias, is_causal=True, keep_window_size=W)

        for peer, route in (("few-rows", lambda c: True), ("selection", lambda c: False)):
            rec = {}
            # The route forced either way (few_rows takes any such call; the default takes it up to
            # perkey_cache.FEW_ROWS rows).
            perkey_cache.few_rows_ok = route
            try:
                with torch.no_grad():
                    call()
                    rec["ms"] = _time(call)
                    rec["gpu_ms"] = _time(captured(call))
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            finally:
                perkey_cache.few_rows_ok = taken
            record(row, peer, rec)
        rows.append(row)
    return rows


def _plain_sdpa_forward(
    self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, cache=None,
    cache_position=None, **kwargs,
):  # fmt: skip
    """A Doge layer without its dynamic mask, for generation: the same projections, rotary and cache
    update (patch_doge's), then attention over every cached key. A prompt (several rows, no earlier
    keys: the benchmark's unpadded prompts) runs causal through SDPA; a decode step's row attends to
    the keys its padding mask keeps (a static cache's: the written ones), the query heads of a group
    stacked as rows."""
    cache = cache if cache is not None else past_key_values
    B, T = hidden_states.shape[:-1]
    q, k, v, _ = hf._doge_projections(self, hidden_states, position_embeddings, cache, cache_position)
    H, KVH = q.shape[1], k.shape[1]
    if T > 1:
        k, v = k[:, :, :T], v[:, :, :T]  # a prompt is the cache's first keys
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling, enable_gqa=True)
        out = out.transpose(1, 2)
    else:
        mask = None
        if getattr(cache, "is_compileable", False):
            # A static cache returns its capacity: the written keys (a device count, no host wait).
            end = hf._static_end(cache, self.layer_idx, cache_position)
            mask = (torch.arange(k.shape[2], device=k.device) < end)[None, None, None, :]
        if attention_mask is not None:
            pad = attention_mask[:, None, None, : k.shape[2]].bool()
            mask = pad if mask is None else mask & pad
        # Two matmuls and a softmax: cuBLAS splits the reduction over the cached keys. (SDPA's flash
        # and efficient kernels give each head one CTA over every key, and cuDNN's builds an
        # execution plan for every new key length: benchmarks/perf-log.md, 'The no-dynamic-mask peer, twice invalid'.)
        s = torch.matmul(q.reshape(B, KVH, H // KVH, -1), k.transpose(-1, -2)).float() * self.scaling
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        out = torch.matmul(s.softmax(-1).to(v.dtype), v)
    return self.o_proj(out.reshape(B, T, -1)), None


def generate_rows(
    prompts=(8192, 32768, 131072), batches=(1, 8), new_tokens=256, budget: float = 600.0, rows: Optional[list] = None
) -> List[dict]:
    from transformers import DogeConfig, DogeForCausalLM

    t0 = time.time()
    rows = [] if rows is None else rows
    for L in prompts:
        for B in batches:
            row = dict(case=dict(name=f"Doge generate B={B} prompt={L // 1024}K", B=B, L=L, new=new_tokens), peers={})
            if budget and time.time() - t0 > budget:
                row["not_run"] = "time budget"
                rows.append(row)
                continue
            for peer in GEN_PEERS:
                rec = {}
                if peer == "eager" and L > EAGER_MAX:
                    row["peers"][peer] = dict(skipped=f"its prefill builds (B, H, {L}, {L}) masks")
                    continue
                model = None
                try:
                    torch.manual_seed(0)
                    cfg = DogeConfig(max_position_embeddings=L + new_tokens, **DOGE)
                    model = DogeForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
                    with torch.no_grad():
                        for layer in model.model.layers:
                            layer.self_attn.A.uniform_(0.5, 1.5)
                    if peer == "eager":
                        model.set_attn_implementation("eager")
                    else:
                        # (the plain peers keep patch_doge's mask interface: (B, K) padding masks)
                        hf.patch_doge(model)
                    if peer.startswith("no-dynamic-mask"):
                        for layer in model.model.layers:
                            layer.self_attn.forward = types.MethodType(_plain_sdpa_forward, layer.self_attn)
                    ids = torch.randint(cfg.vocab_size, (B, L), device="cuda")
                    kw = dict(do_sample=False, pad_token_id=0, min_new_tokens=new_tokens)
                    static = peer.endswith("-static")
                    if static:
                        kw["cache_implementation"] = "static"
                    with torch.no_grad():
                        if static:
                            # Compiles and captures outside the timed calls, at the full length:
                            # generate reuses a static cache at least as long (same shapes, no
                            # recompile), so the shorter prefill call below reuses it too. A
                            # fresh compile a row: another batch size would recompile with
                            # symbolic shapes.
                            torch._dynamo.reset()
                            model.generate(ids, max_new_tokens=new_tokens, **kw)
                        else:
                            # Kernels compiled (Triton) and caches warm outside the timed calls.
                            model.generate(ids, max_new_tokens=2, **dict(kw, min_new_tokens=2))
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                        s = time.perf_counter()
                        model.generate(ids, max_new_tokens=1, **dict(kw, min_new_tokens=1))
                        torch.cuda.synchronize()
                        rec["prefill_s"] = time.perf_counter() - s
                        s = time.perf_counter()
                        model.generate(ids, max_new_tokens=new_tokens, **kw)
                        torch.cuda.synchronize()
                        total = time.perf_counter() - s
                    rec["decode_tokens_per_s"] = B * (new_tokens - 1) / max(total - rec["prefill_s"], 1e-9)
                    rec["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
                except Exception as e:
                    rec["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                del model
                record(row, peer, rec)
            rows.append(row)
    return rows


def _ms_cell(r: dict) -> str:
    """A timed peer's cell: ms (and its GPU time where graph-timed), its error, or a dash."""
    if "error" in r:
        return f"error: {r['error'][:50]}"
    if "ms" not in r:
        return "–"
    return f"{r['ms']:.4f}" + (f" (GPU {r['gpu_ms']:.4f})" if "gpu_ms" in r else "")


def markdown(doc: dict, parts=("rows", "api_rows", "generate")) -> str:
    def step_cells(row) -> list:
        return [row["case"]["name"]] + [_ms_cell(row["peers"].get(p, {})) for p in PEERS]

    def generate_cells(row) -> list:
        cells = [row["case"]["name"]]
        for p in GEN_PEERS:
            r = row["peers"].get(p, {})
            if "skipped" in r:
                cells.append(f"– ({r['skipped']})")
            elif "error" in r:
                cells.append(f"error: {r['error'][:50]}")
            elif r:
                cells.append(f"{r['prefill_s']:.2f} / {r['decode_tokens_per_s']:.0f} / {r['peak_mib']:.0f}")
            else:
                cells.append("–")
        return cells

    lines = []
    if "rows" in parts and doc.get("rows"):
        lines += table(["cached keys, layer"] + [f"{p} ms" for p in PEERS], doc["rows"], step_cells)
    if "api_rows" in parts and doc.get("api_rows"):

        def api_cells(row) -> list:
            return [row["case"]["name"]] + [_ms_cell(row["peers"].get(p, {})) for p in ("few-rows", "selection")]

        head = ["flash_dma_attention, new rows after the cache", "few-rows route ms", "selection over every key ms"]
        lines += [""] * bool(lines) + table(head, doc["api_rows"], api_cells)
    if "generate" in parts and doc.get("generate"):
        head = ["Doge generate (256 new tokens)"] + [f"{p}: prefill s / decode tok/s / peak MiB" for p in GEN_PEERS]
        lines += [""] * bool(lines) + table(head, doc["generate"], generate_cells)
    return "\n".join(lines)


def section(results_dir: str) -> List[str]:
    """The newest run's layer-step and API tables and the newest run's generate table (a run may
    measure only one part: `--peers generate`)."""
    runs = runs_of(results_dir, SCHEMA)
    steps = next((d for d in runs if any(r.get("peers") for r in d.get("rows", []))), None)
    gen = next((d for d in runs if d.get("generate")), None)
    note = (
        "`python -m benchmarks decode`: bf16, one new token a step, W=1024; do_bench medians (GPU: of the "
        "step captured in a CUDA graph, no host time); peak = the call's memory above its inputs "
        "(generate: the process's peak)."
    )
    out = []
    for doc, title, parts in (
        (steps, "per-key decoding", ("rows", "api_rows") + (("generate",) if gen is steps else ())),
        (None if gen is steps else gen, "per-key decoding: Doge generate", ("generate",)),
    ):
        if doc is not None:
            out += run_section(doc, title, note, markdown(doc, parts))
    return out


def main(args, env: dict) -> str:
    peers, generate = chosen_peers(args.peers, PEERS, "generate", "the Doge rows", "decode")
    # Written after every row, marked unfinished until the last: a run its call's time limit cuts
    # keeps what it measured.
    doc = dict(schema=SCHEMA, rows=[], unfinished=True)
    saving = Saving(doc, args.out, env, "decode")
    run(quick=args.quick, peers=peers, budget=args.budget, rows=saving.list("rows"))
    if "api" in peers:
        api_rows(rows=saving.list("api_rows"))
    if generate and not args.quick:
        try:
            generate_rows(budget=args.budget, rows=saving.list("generate"))
        except ImportError as e:  # transformers without Doge
            doc["generate_skipped"] = str(e)
    del doc["unfinished"]
    path = saving.save()
    print(f"wrote {path}\n" + markdown(doc), flush=True)
    return path
