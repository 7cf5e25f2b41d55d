"""`python -m benchmarks topk`: the per-key top-W path (flash_dma_attention(keep_window_size=W))
against its peers, selection included, one GPU, one process.

Rows: B=1, H=2, KVH=1, causal, lengths 32K / 64K / 128K, D in {64, 128}, W=2048, a per-key bias
(1, 1, 1, L); the model shape B=2, L=8192, H=16, KVH=4, D=128, W=2048 with the bias per kv head
(Doge) and per query head; decode (Q=1, K=512K, W=1024). Peers, in the same run:
- sdpa: dense causal SDPA over all keys, no mask (the bar);
- flexdma: the per-key path end to end (selection + kernels);
- flex: the same selection through FlexAttention (compiled; its mask_mod reads the selection);
- dense-mask: create_mask + flash_dma_attention with that mask on the dense-mask CUDA kernels
  (only where the mask fits; it is Q x K bools).
Forward = one call; backward = (forward + backward) - forward. Peak memory is the call's peak
above what was allocated before it (inputs excluded, outputs included).
"""

from __future__ import annotations

import gc
import json
import os
import time
from typing import List, Optional

import torch
import torch.nn.functional as F

import flexdma
from flexdma.integrations.transformers import patch_doge
from flexdma.nn import DMACache

SCHEMA = "flexdma-topk-bench/1"
DENSE_MASK_MAX = 32768  # the dense-mask peer builds Q x K bools: up to 1 GiB at 32K
FLEX_MAX = 65536  # FlexAttention visits every causal tile: kept to lengths it finishes in seconds


def cases(quick: bool = False) -> List[dict]:
    rows = []
    for L in (32768,) if quick else (32768, 65536, 131072):
        for D in (128,) if quick else (128, 64):
            rows.append(dict(name=f"L={L // 1024}K D={D}", B=1, L=L, Q=L, H=2, KVH=1, D=D, W=2048, bias_heads=1))
    rows.append(dict(name="model, bias per kv head", B=2, L=8192, Q=8192, H=16, KVH=4, D=128, W=2048, bias_heads=4))
    if not quick:
        rows.append(
            dict(name="model, bias per query head", B=2, L=8192, Q=8192, H=16, KVH=4, D=128, W=2048, bias_heads=16)
        )
        rows.append(
            dict(name="decode Q=1 K=512K", B=1, L=524288, Q=1, H=2, KVH=1, D=128, W=1024, bias_heads=1, decode=True)
        )
    return rows


def _inputs(c: dict, grad: bool):
    dev, dt = "cuda", torch.bfloat16
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
    if peer == "flexdma-cache":
        # A decode step through nn.DynamicMaskAttention's cache: the kept set updated with the new
        # key in O(W), then attention over the W gathered keys (no selection over all K).
        cache = DMACache.from_full(k.detach(), v.detach(), bias.detach(), None, c["W"])
        k1, v1 = k[:, -1:].detach(), v[:, -1:].detach()
        b1 = bias[..., -1:].detach()
        pad = torch.ones(k.shape[0], dtype=torch.bool, device=k.device)

        def step():
            ks, vs, bb, keep = cache.step(k1, v1, b1, pad).kept()
            return flexdma.flash_dma_attention(q, ks, vs, keep, bb, is_causal=False)

        return step
    if peer == "dense-mask":

        def run():
            mask = flexdma.create_mask(bias.detach(), c["W"], is_causal=causal, query_len=c["Q"])
            return flexdma.flash_dma_attention(q, k, v, mask, bias, is_causal=causal, backend="cuda")

        return run
    raise ValueError(peer)


def _applies(peer: str, c: dict) -> Optional[str]:
    if peer == "flexdma-cache" and not c.get("decode"):
        return "decoding only"
    if peer == "dense-mask" and c["L"] * c["Q"] > DENSE_MASK_MAX**2:
        return f"the dense mask is {c['Q']} x {c['L']} bools"
    if peer == "dense-mask" and "cuda" not in flexdma.available_backends():
        return "the dense-mask CUDA kernels are not built"
    if peer == "flex" and c["L"] > FLEX_MAX:
        return f"L > {FLEX_MAX}"
    return None


def _time(fn, warmup=25, rep=100) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep)


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


def run(
    quick: bool = False, peers=("sdpa", "flexdma", "flexdma-cache", "flex", "dense-mask"), budget: float = 480.0
) -> dict:
    t0 = time.time()
    rows = []
    for c in cases(quick):
        if budget and time.time() - t0 > budget:
            rows.append(dict(case=c, not_run="time budget"))
            continue
        row = dict(case=c, peers={})
        for peer in peers:
            why = _applies(peer, c)
            if why:
                row["peers"][peer] = dict(skipped=why)
                continue
            rec = {}
            try:
                q, k, v, bias = _inputs(c, grad=False)
                with torch.no_grad():
                    fn = _peer_fn(peer, c, q, k, v, bias)
                    fn()
                    rec["fwd_ms"] = _time(fn)
                    rec["fwd_peak_mib"] = _peak(fn)
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
                    del q, k, v, bias
            except Exception as e:  # a peer failing (out of memory, compile error) is a result too
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            gc.collect()
            torch.cuda.empty_cache()
            row["peers"][peer] = rec
            print(
                c["name"], peer, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()}, flush=True
            )
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


def doge_rows(lengths=(16384, 65536)) -> List[dict]:
    """transformers' DogeForCausalLM train step (forward + backward, loss on labels), bf16, B=1:
    flexdma through patch_doge against attn_implementation "sdpa" (Doge's dense dynamic mask)."""
    from transformers import DogeConfig, DogeForCausalLM

    rows = []
    for L in lengths:
        row = dict(case=dict(name=f"Doge train step L={L // 1024}K", L=L, **DOGE), peers={})
        for peer in ("flexdma", "sdpa"):
            rec = {}
            model = None
            try:
                torch.manual_seed(0)
                cfg = DogeConfig(max_position_embeddings=L, **DOGE)
                model = DogeForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16)
                if peer == "flexdma":
                    patch_doge(model)
                else:
                    model.set_attn_implementation("sdpa")
                ids = torch.randint(cfg.vocab_size, (1, L), device="cuda")

                def step(model=model):
                    loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                    return loss

                step()
                rec["ms"] = _time(step, warmup=3, rep=10)
                rec["peak_mib"] = _peak(step) + torch.cuda.memory_allocated() / 2**20
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            del model
            gc.collect()
            torch.cuda.empty_cache()
            row["peers"][peer] = rec
            print(row["case"]["name"], peer, rec, flush=True)
        rows.append(row)
    return rows


def markdown(doc: dict) -> str:
    peers = ["flexdma", "sdpa", "flex", "dense-mask", "flexdma-cache"]
    head = (
        ["case"] + [f"{p} fwd / bwd ms" for p in peers] + ["flexdma peak fwd / train MiB", "flexdma vs sdpa fwd / bwd"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in doc["rows"]:
        c = row["case"]
        if "not_run" in row:
            lines.append(f"| {c['name']} | not run: {row['not_run']} |")
            continue
        cells = [c["name"]]
        for p in peers:
            r = row["peers"].get(p, {})
            if "skipped" in r:
                cells.append(f"– ({r['skipped']})")
            elif "error" in r:
                cells.append(f"error: {r['error'][:60]}")
            elif r:
                b = f"{r['bwd_ms']:.3f}" if "bwd_ms" in r else "–"
                cells.append(f"{r['fwd_ms']:.3f} / {b}")
            else:
                cells.append("–")
        f, s = row["peers"].get("flexdma", {}), row["peers"].get("sdpa", {})
        cells.append(f"{f.get('fwd_peak_mib', float('nan')):.0f} / {f.get('fwd_bwd_peak_mib', float('nan')):.0f}")
        if "fwd_ms" in f and "fwd_ms" in s:
            ratio = f"{s['fwd_ms'] / f['fwd_ms']:.2f}x"
            if "bwd_ms" in f and "bwd_ms" in s:
                ratio += f" / {s['bwd_ms'] / f['bwd_ms']:.2f}x"
            cells.append(ratio)
        else:
            cells.append("–")
        lines.append("| " + " | ".join(cells) + " |")
    if doc.get("doge"):
        lines += [
            "",
            "| transformers Doge train step (B=1, 4 layers, hidden 1024, W=2048) | flexdma (patch_doge) "
            "ms / peak MiB | attn_implementation sdpa ms / peak MiB |",
            "|---|---|---|",
        ]
        for row in doc["doge"]:
            cells = [row["case"]["name"]]
            for p in ("flexdma", "sdpa"):
                r = row["peers"].get(p, {})
                cells.append(
                    f"error: {r['error'][:60]}"
                    if "error" in r
                    else f"{r.get('ms', float('nan')):.1f} / {r.get('peak_mib', float('nan')):.0f}"
                )
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def runs(results_dir: str) -> List[dict]:
    """Every `python -m benchmarks topk` JSON under results_dir, newest first."""
    docs = []
    for name in sorted(os.listdir(results_dir)) if os.path.isdir(results_dir) else []:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(results_dir, name)) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("schema") == SCHEMA:
            docs.append(doc)
    return sorted(docs, key=lambda d: d.get("date", ""), reverse=True)


def section(results_dir: str) -> List[str]:
    """The newest run only: RESULTS.md holds the current tables (earlier runs stay in results/ and
    the performance log)."""
    out = []
    for doc in runs(results_dir)[:1]:
        out += [
            f"## per-key top-W ({doc.get('gpu_short')}, commit {doc.get('commit')})",
            "",
            "`python -m benchmarks topk`: bf16, causal, selection time included in flexdma's numbers; "
            "peak = the call's memory above its inputs.",
            "",
            markdown(doc),
            "",
        ]
    return out


def main(args, env: dict) -> str:
    doc = run(quick=args.quick, budget=args.budget)
    if not args.quick:
        try:
            doc["doge"] = doge_rows()
        except ImportError as e:  # transformers without Doge
            doc["doge_skipped"] = str(e)
    doc.update(env)
    path = os.path.join(args.out, f"{env['gpu_short']}_{env['date'][:10].replace('-', '')}_{env['commit']}_topk.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}\n" + markdown(doc), flush=True)
    return path
