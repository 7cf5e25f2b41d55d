"""`python -m benchmarks varlen`: packed sequences (flash_dma_attention_varlen) against the same
documents called one by one, padded into a batch, and dense attention within documents; one GPU,
one process.

Rows (bf16, causal within each document, per-key bias, W=2048, H=16, KVH=4): a packed batch of
documents whose lengths are drawn with a fixed seed from [512, 16384], the last one trimmed so they
sum to exactly 65536 tokens, at D=128, and a second mix (another seed) at D=64; --quick: one mix of
[512, 4096] summing to 16384. The lengths are in each row's case. Peers, same run, each timed
forward and forward + backward (do_bench medians), with its peak memory:
- flexdma-packed: flash_dma_attention_varlen over the packed tokens, bias (KVH, total),
  keep_window_size=W; also its device launches per call;
- flexdma-per-doc: flash_dma_attention on each document alone ((1, L, H, D), bias (1, KVH, 1, L)),
  each call timed on its own and the times summed (the 1.1x target's denominator), and all of them
  called back to back in one function;
- flexdma-padded: the documents right-padded to the longest into a batch (B = the documents), a
  (B, 1, 1, Lmax) bool key-padding mask, the bias padded with zeros, keep_window_size=W (skipped
  where its estimated memory does not fit the GPU);
- flex-docmask: compiled FlexAttention over the packed tokens with a document + causal mask_mod
  (create_block_mask from the offsets), no bias: dense attention within documents (the bar);
- sdpa-jagged: torch SDPA over nested tensors of the jagged layout (the backend SDPA picks, which
  is recorded: flash_attn_varlen-style kernels), KV heads expanded to H where SDPA's nested path
  does not take GQA; skipped with the reason where it does not run;
- flexdma-dense-packed / flexdma-dense-per-doc: flexdma-packed / flexdma-per-doc without the
  window (every key of the document, the per-key bias kept): the dense kernels' packed path against
  the same documents one by one.
Forward = one call; train = forward + backward; bwd = train - forward. Beside them: the listed work
at the dense bar's measured rate (the ideal: the keys each row of each document keeps over the keys
it sees, times the dense time of SDPA jagged, else FlexAttention's). Targets (the issue): packed <=
1.1x the per-document sum, padded >= 2x packed, memory O(total tokens).
"""

from __future__ import annotations

import gc
import random
import time
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F

import flexdma
from flexdma.dense.flex import sparse_mask_kernel_options

from .common import Saving, newest_section, record, run_section, runs_of, table
from .peers import compiled_flex
from .perkey import _launches, _pair, _peak, _time, kept_per_row

SCHEMA = "flexdma-varlen-bench/1"
PEERS = (
    "flexdma-packed",
    "flexdma-per-doc",
    "flexdma-padded",
    "flex-docmask",
    "sdpa-jagged",
    "flexdma-dense-packed",
    "flexdma-dense-per-doc",
)
# The peers of the comparison (the per-key packed call and its bars): a run with all of them
# is the one RESULTS.md shows whole.
BAR_PEERS = PEERS[:5]
PER_DOC = ("flexdma-per-doc", "flexdma-dense-per-doc")
# The padded batch runs where its estimate stays under this share of the free memory (the rest:
# allocator slack and the per-key path's workspaces the estimate leaves out).
PADDED_FREE_SHARE = 0.8


class _Skip(Exception):
    """This peer does not run here (recorded as skipped, with the reason)."""


def doc_lengths(total: int, lo: int, hi: int, seed: int) -> List[int]:
    """Lengths drawn uniformly from [lo, hi] until they reach `total`, the last trimmed to the rest.
    A draw that would leave a rest shorter than lo is cut to leave exactly lo (or takes the whole
    rest where that is at most hi), so every length lies in [lo, hi] and they sum to `total`."""
    rng = random.Random(seed)
    out: List[int] = []
    rest = total
    while rest > 0:
        n = rng.randint(lo, hi)
        if rest - n < lo:
            n = rest if rest <= hi else rest - lo
        out.append(n)
        rest -= n
    return out


def cases(quick: bool = False) -> List[dict]:
    common = dict(H=16, KVH=4, W=2048, bias_heads=4, dtype="bf16", causal=True)
    if quick:
        mixes = [dict(total=16384, lo=512, hi=4096, seed=0, D=128)]
    else:
        # The mix first: a run cut by its time budget keeps the row the targets name.
        mixes = [dict(total=65536, lo=512, hi=16384, seed=0, D=128), dict(total=65536, lo=512, hi=16384, seed=1, D=64)]
    rows = []
    for m in mixes:
        lengths = doc_lengths(m["total"], m["lo"], m["hi"], m["seed"])
        name = (
            f"{len(lengths)} docs of {m['lo']}..{m['hi'] // 1024}K = {m['total'] // 1024}K tokens, "
            f"D={m['D']} (seed {m['seed']})"
        )
        rows.append(dict(name=name, lengths=lengths, **m, **common))
    return rows


def flops(c: dict) -> Tuple[int, int]:
    """(listed, dense) forward FLOPs of a case: 4 D H per (row, kept key) and per (row, seen key),
    each document on its own."""
    kept = seen = 0
    for n in c["lengths"]:
        k, s = kept_per_row(n, n, c["W"])
        kept, seen = kept + k, seen + s
    per = 4 * c["D"] * c["H"]
    return per * kept, per * seen


def padded_bytes(c: dict) -> int:
    """Estimated memory of the padded batch's training call: q, out, dout, dq in bf16 and dq's
    float32 accumulator per query head; k, v, dk, dv per kv head; the bias and its gradient; lse."""
    tokens = len(c["lengths"]) * max(c["lengths"])
    H, KVH, D = c["H"], c["KVH"], c["D"]
    per_token = 2 * 4 * H * D + 4 * H * D + 2 * 4 * KVH * D + 2 * 2 * KVH + 4 * H
    return tokens * per_token


def _offsets(lengths: List[int]) -> List[int]:
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    return offs


def _inputs(c: dict):
    """The packed tokens (no grad; each peer makes its own leaves from them)."""
    dev, dt = "cuda", torch.bfloat16
    T, H, KVH, D = c["total"], c["H"], c["KVH"], c["D"]
    torch.manual_seed(0)
    q = torch.randn(T, H, D, device=dev, dtype=dt)
    k = torch.randn(T, KVH, D, device=dev, dtype=dt)
    v = torch.randn(T, KVH, D, device=dev, dtype=dt)
    # Doge-like scores: positive, distinct (no all-equal importance).
    bias = torch.exp(torch.randn(KVH, T, device=dev)).to(dt)
    return q, k, v, bias


def _leaves(grad: bool, *ts):
    return [t.detach().clone().requires_grad_(grad) for t in ts]


Unit = Tuple[Callable, list]  # a call and the leaves its backward differentiates


def _units(peer: str, c: dict, base, grad: bool, notes: dict) -> List[Unit]:
    """The calls a peer makes over the case, each with its leaves: one call, or one per document
    (flexdma-per-doc). Built outside the timed region (block masks, padding, nested offsets)."""
    q0, k0, v0, b0 = base
    lengths, W, H, KVH = c["lengths"], c["W"], c["H"], c["KVH"]
    offs = _offsets(lengths)
    Lmax = max(lengths)
    if peer.startswith("flexdma-dense-"):
        W = None  # every key of the document
    if peer in ("flexdma-packed", "flexdma-dense-packed"):
        q, k, v, bias = _leaves(grad, q0, k0, v0, b0)
        cu = torch.tensor(offs, dtype=torch.int32, device=q.device)

        def packed():
            return flexdma.flash_dma_attention_varlen(
                q, k, v, cu, cu, Lmax, Lmax, bias, is_causal=True, keep_window_size=W
            )

        return [(packed, [q, k, v, bias])]
    if peer in PER_DOC:
        units = []
        for a, b in zip(offs, offs[1:]):
            q, k, v, bias = _leaves(grad, q0[None, a:b], k0[None, a:b], v0[None, a:b], b0[None, :, None, a:b])

            def one(q=q, k=k, v=v, bias=bias):
                return flexdma.flash_dma_attention(q, k, v, None, bias, is_causal=True, keep_window_size=W)

            units.append((one, [q, k, v, bias]))
        return units
    if peer == "flexdma-padded":
        B = len(lengths)
        qp = q0.new_zeros(B, Lmax, H, c["D"])
        kp, vp = (k0.new_zeros(B, Lmax, KVH, c["D"]) for _ in range(2))
        # Padded keys are masked out; their bias only has to be finite.
        bp = b0.new_zeros(B, KVH, 1, Lmax)
        for i, (a, b) in enumerate(zip(offs, offs[1:])):
            qp[i, : b - a], kp[i, : b - a], vp[i, : b - a] = q0[a:b], k0[a:b], v0[a:b]
            bp[i, :, 0, : b - a] = b0[:, a:b]
        keep = torch.arange(Lmax, device=q0.device)[None, :] < torch.tensor(lengths, device=q0.device)[:, None]
        mask = keep[:, None, None, :]
        q, k, v, bias = _leaves(grad, qp, kp, vp, bp)
        notes["padded_tokens"] = B * Lmax

        def padded():
            return flexdma.flash_dma_attention(q, k, v, mask, bias, is_causal=True, keep_window_size=W)

        return [(padded, [q, k, v, bias])]
    if peer == "flex-docmask":
        return [_flex_docmask(c, base, grad)]
    if peer == "sdpa-jagged":
        return [_sdpa_jagged(c, base, grad, offs, notes)]
    raise ValueError(peer)


_DOC_MASK_OPTIONS = object()  # flex.sparse_mask_kernel_options' choice


def _flex_docmask(c: dict, base, grad: bool, opts=_DOC_MASK_OPTIONS) -> Unit:
    """Compiled FlexAttention (at flexdma's options for document masks, or the kernel options
    `opts`) over the packed tokens as one sequence, a key visible where it is in the query's
    document and not after it."""
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = _leaves(grad, *base[:3])
    T = c["total"]
    lengths = torch.tensor(c["lengths"], device=q.device)
    doc = torch.repeat_interleave(torch.arange(len(c["lengths"]), device=q.device, dtype=torch.int32), lengths)

    def mask_mod(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (ki <= qi)

    # Compiled: the uncompiled builder materializes the T x T mask (4 GiB at 64K).
    bm = create_block_mask(mask_mod, None, None, T, T, device=q.device, BLOCK_SIZE=128, _compile=True)
    if opts is _DOC_MASK_OPTIONS:
        opts = sparse_mask_kernel_options(q.device, c["D"], q.dtype, grad)
    attend = compiled_flex()
    qt, kt, vt = (t[None].transpose(1, 2) for t in (q, k, v))

    def fn():
        return attend(qt, kt, vt, block_mask=bm, enable_gqa=True, kernel_options=opts).transpose(1, 2)[0]

    return fn, [q, k, v]


def _sdpa_jagged(c: dict, base, grad: bool, offs: List[int], notes: dict) -> Unit:
    """SDPA over jagged nested tensors: one (B, H, j, D) view of the packed tokens, no copy of q.
    Its fused kernels take equal head counts only when training (and a broadcast of 1 otherwise),
    so KV heads are expanded to H inside the call unless native GQA runs and agrees."""
    try:
        from torch.nested import nested_tensor_from_jagged
    except ImportError as e:
        raise _Skip(f"torch has no jagged nested tensors ({e})")
    q, k, v = _leaves(grad, *base[:3])
    G = c["H"] // c["KVH"]
    offsets = torch.tensor(offs, dtype=torch.int64, device=q.device)
    lo, hi = min(c["lengths"]), max(c["lengths"])

    def nested(t):
        return nested_tensor_from_jagged(t, offsets, min_seqlen=lo, max_seqlen=hi).transpose(1, 2)

    def call(expand: bool):
        kk, vv = (t.repeat_interleave(G, dim=1) for t in (k, v)) if expand else (k, v)
        nq, nk, nv = nested(q), nested(kk), nested(vv)
        out = F.scaled_dot_product_attention(nq, nk, nv, is_causal=True, enable_gqa=not expand)
        return out.transpose(1, 2).values()

    try:
        ref = call(True).detach()
    except Exception as e:  # no backend takes causal nested inputs in this torch / on this GPU
        raise _Skip(f"{type(e).__name__}: {str(e)[:160]}")
    expand = True
    try:
        native = call(False).detach()
        expand = not torch.allclose(native.float(), ref.float(), atol=2e-2, rtol=2e-2)
        if expand:
            notes["kv_expanded"] = "native GQA disagreed with the expanded call"
    except Exception as e:
        notes["kv_expanded"] = f"enable_gqa: {type(e).__name__}: {str(e)[:100]}"
    del ref
    try:
        from torch.nested._internal.sdpa import _select_sdp_backend

        kk, vv = (t.repeat_interleave(G, dim=1) for t in (k, v)) if expand else (k, v)
        # In the caller's grad mode: SDPA's choice depends on whether the inputs require grad.
        picked = _select_sdp_backend(nested(q), nested(kk), nested(vv), None, 0.0, True, not expand)
        notes["backend"] = getattr(picked, "name", str(picked))
    except Exception:  # a private helper: the record goes without it
        pass
    return (lambda: call(expand)), [q, k, v]


def _applies(peer: str, c: dict) -> Optional[str]:
    if peer == "flexdma-padded" and torch.cuda.is_available():
        need, free = padded_bytes(c), torch.cuda.mem_get_info()[0]
        if need > PADDED_FREE_SHARE * free:
            return f"the padded batch needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
    return None


def _step(fn, leaves):
    """One training call: forward, then the gradients of every leaf."""

    def run():
        out = fn()
        return torch.autograd.grad(out, leaves, torch.ones_like(out))

    return run


def _measure_mode(peer: str, c: dict, mode: str, rec: dict) -> None:
    grad = mode == "fwd_bwd"
    notes: dict = {}
    units = _units(peer, c, _inputs(c), grad, notes)
    calls = [_step(fn, leaves) if grad else fn for fn, leaves in units]
    whole = calls[0] if len(calls) == 1 else (lambda: [f() for f in calls])
    reps = dict(warmup=10, rep=50) if grad else {}
    with torch.enable_grad() if grad else torch.no_grad():
        whole()  # compiles, autotunes, warms the caches
        if peer in PER_DOC:
            per = [_time(f, **reps) for f in calls]
            rec[f"per_doc_{mode}_ms"] = per
            rec[f"{mode}_ms"] = sum(per)
            rec[f"back_to_back_{mode}_ms"] = _time(whole, **reps)
        else:
            rec[f"{mode}_ms"] = _time(whole, **reps)
        rec[f"{mode}_peak_mib"] = _peak(whole)
        if peer in ("flexdma-packed", "flexdma-dense-packed"):
            rec[f"{mode}_launches"] = _launches(whole)
    for k, v in notes.items():
        rec[k if k == "padded_tokens" else f"{mode}_{k}"] = v


def _measure(peer: str, c: dict, rec: dict) -> None:
    """Fills rec with the peer's forward and training times, peaks and notes; raises on failure
    (what was measured before stays in rec)."""
    for mode in ("fwd", "fwd_bwd"):
        _measure_mode(peer, c, mode, rec)  # its tensors freed on return, before the next mode's
        gc.collect()
        torch.cuda.empty_cache()
    rec["bwd_ms"] = rec["fwd_bwd_ms"] - rec["fwd_ms"]


def run(
    quick: bool = False,
    peers=PEERS,
    budget: float = 480.0,
    rows: Optional[list] = None,
    save: Optional[Callable] = None,
) -> dict:
    """The rows; each appended to `rows` when it starts and `save` called after every peer (a case
    holds minutes of work: a run its call's limit cuts keeps the peers it finished)."""
    t0 = time.time()
    rows = [] if rows is None else rows
    save = save or (lambda: None)
    for c in cases(quick):
        if budget and time.time() - t0 > budget:
            rows.append(dict(case=c, not_run="time budget"))
            continue
        row = dict(case=c, peers={})
        row["listed_flops"], row["dense_flops"] = flops(c)
        rows.append(row)
        for peer in peers:
            if budget and time.time() - t0 > budget:
                row["peers"][peer] = dict(skipped="time budget")
                save()
                continue
            rec: dict = {}
            try:
                why = _applies(peer, c)
                if why:
                    raise _Skip(why)
                _measure(peer, c, rec)
            except _Skip as e:
                rec["skipped"] = str(e)
            except Exception as e:  # a peer failing (out of memory, compile error) is a result too
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            record(row, peer, rec, hide="per_doc")
            save()
    return dict(schema=SCHEMA, rows=rows)


def _cell(r: Optional[dict]) -> str:
    """fwd / train ms, with why a part is missing."""
    if not r:
        return "not run"
    times = r.get("fwd_ms") is not None or r.get("fwd_bwd_ms") is not None
    why = ""
    if "skipped" in r:
        why = f"({r['skipped']})"
    elif "error" in r:
        why = f"error: {r['error'][:60]}"
    if not times:
        return f"– {why}" if "skipped" in r else (why or "–")
    return _pair(r.get("fwd_ms"), r.get("fwd_bwd_ms")) + (f" ({why})" if why else "")


def _ratio(a: dict, b: dict) -> str:
    return _pair(
        *[a[k] / b[k] if a.get(k) and b.get(k) else None for k in ("fwd_ms", "fwd_bwd_ms")],
        fmt="{:.2f}x",
    )


def markdown(doc: dict) -> str:
    head = [
        "case",
        "flexdma packed fwd / train ms",
        "sum of per-document calls fwd / train ms",
        "packed / per-doc sum (target <= 1.1)",
        "per-document calls back to back fwd / train ms",
        "padded batch fwd / train ms",
        "padded / packed (target >= 2)",
        "FlexAttention doc-mask, dense fwd / train ms",
        "SDPA jagged, dense fwd / train ms",
        "listed work at the dense rate fwd / train ms",
        "flexdma launches fwd / train",
        "flexdma packed peak MiB fwd / train",
        "padded peak MiB fwd / train",
        "dense (no window) packed fwd / train ms",
        "dense sum of per-document calls fwd / train ms",
        "dense packed / per-doc sum",
    ]

    def cells(row) -> list:
        c, P = row["case"], row["peers"]
        packed, per, padded = (P.get(p, {}) for p in ("flexdma-packed", "flexdma-per-doc", "flexdma-padded"))
        jag, flex = P.get("sdpa-jagged", {}), P.get("flex-docmask", {})
        back = _pair(per.get("back_to_back_fwd_ms"), per.get("back_to_back_fwd_bwd_ms")) if per else "not run"
        jag_cell = _cell(P.get("sdpa-jagged"))
        extra = [x for x in (jag.get("fwd_bwd_backend") or jag.get("fwd_backend"),) if x]
        if jag.get("fwd_bwd_kv_expanded") or jag.get("fwd_kv_expanded"):
            extra.append("KV heads expanded")
        if extra and jag.get("fwd_ms") is not None:
            jag_cell += f" ({', '.join(extra)})"
        listed, dense = row.get("listed_flops"), row.get("dense_flops")
        if listed is None and "lengths" in c:
            listed, dense = flops(c)
        bar, src = (jag, "SDPA jagged") if jag.get("fwd_ms") is not None else (flex, "FlexAttention")
        ideal = [bar[k] * listed / dense if listed and dense and bar.get(k) else None for k in ("fwd_ms", "fwd_bwd_ms")]
        ideal_cell = _pair(*ideal) + (f" (at {src}'s rate)" if any(x is not None for x in ideal) else "")
        return [
            c["name"],
            _cell(P.get("flexdma-packed")),
            _cell(P.get("flexdma-per-doc")),
            _ratio(packed, per),
            back,
            _cell(P.get("flexdma-padded")),
            _ratio(padded, packed),
            _cell(P.get("flex-docmask")),
            jag_cell,
            ideal_cell,
            _pair(packed.get("fwd_launches"), packed.get("fwd_bwd_launches"), fmt="{:d}"),
            _pair(packed.get("fwd_peak_mib"), packed.get("fwd_bwd_peak_mib"), fmt="{:.0f}"),
            _pair(padded.get("fwd_peak_mib"), padded.get("fwd_bwd_peak_mib"), fmt="{:.0f}"),
            _cell(P.get("flexdma-dense-packed")),
            _cell(P.get("flexdma-dense-per-doc")),
            _ratio(P.get("flexdma-dense-packed", {}), P.get("flexdma-dense-per-doc", {})),
        ]

    lines = table(head, doc["rows"], cells)
    lines.append("")
    for row in doc["rows"]:
        c = row["case"]
        if "lengths" in c:
            lines.append(f"- {c['name']}: document lengths {', '.join(str(n) for n in c['lengths'])}")
    return "\n".join(lines).rstrip()


def section(results_dir: str) -> List[str]:
    """The newest run that has every peer of the comparison (BAR_PEERS); a newer run of some peers only (a check of flexdma's own
    rows) is named beneath it with its table."""
    runs = runs_of(results_dir, SCHEMA)
    complete = [d for d in runs if _has_every_peer(d)]
    note = (
        "`python -m benchmarks varlen`: bf16, causal within each document, per-key bias, W=2048, H=16, KVH=4; "
        "per-document sum = each document's call timed alone, summed; padded = right-padded to the longest "
        "document; FlexAttention and SDPA jagged attend densely within documents, no bias; peak = the call's "
        "memory above its inputs."
    )
    if not complete:
        return newest_section(results_dir, SCHEMA, "packed sequences (varlen)", note, markdown)
    out = run_section(complete[0], "packed sequences (varlen)", note, markdown(complete[0]))
    newer = [d for d in runs if d.get("date", "") > complete[0].get("date", "")]
    if newer:
        out += run_section(
            newer[0],
            "packed sequences (varlen), flexdma's rows only",
            "A later run of some peers only.",
            markdown(newer[0]),
        )
    return out


def _has_every_peer(doc: dict) -> bool:
    rows = doc.get("rows") or []
    return bool(rows) and all(
        all(p in row.get("peers", {}) and "skipped" not in row["peers"][p] for p in BAR_PEERS) for row in rows
    )


def main(args, env: dict) -> str:
    peers = PEERS
    if args.peers:
        peers = tuple(args.peers.split(","))
        unknown = [p for p in peers if p not in PEERS]
        if unknown:
            raise SystemExit(f"--peers: varlen knows {', '.join(PEERS)}, got {unknown}")
    if not torch.cuda.is_available():
        raise SystemExit("`varlen` times on a CUDA GPU; none is visible")
    # Written after every peer, marked unfinished until the last: a run its call's time limit cuts
    # keeps what it measured.
    doc = dict(schema=SCHEMA, rows=[], unfinished=True)
    saving = Saving(doc, args.out, env, "varlen")
    run(quick=args.quick, peers=peers, budget=args.budget, rows=saving.list("rows"), save=saving.save)
    del doc["unfinished"]
    path = saving.save()
    print(f"wrote {path}\n" + markdown(doc), flush=True)
    return path
