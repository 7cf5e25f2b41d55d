"""Tables and plots from the benchmark JSON files; regenerates benchmarks/RESULTS.md.

`python -m benchmarks report` reads every flexdma-bench JSON in benchmarks/results/, keeps the
newest file of each (GPU, subcommand), and writes RESULTS.md with its tables and plots, each
headed by the commit, GPU, date and versions that produced it. Nothing in RESULTS.md is typed by
hand.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Dict, List, Optional

from . import cp, cpu, decode, perkey, varlen
from .common import gpu_short
from .configs import FLEXDMA_PEERS, PEERS, Case

SCHEMA = "flexdma-bench/1"
CPU_SCHEMA = cpu.SCHEMA  # benchmarks/cpu.py: its own rows and table
_SHORT = {"ok": None, "oom": "OOM", "error": "err", "skipped": "skip", "unavailable": "n/a"}


def _cell(r: Optional[dict], fmt="{:.3f}", key="ms") -> str:
    if not r:
        return "–"
    if r.get("status") != "ok":
        return _SHORT.get(r.get("status"), "?")
    v = r.get(key)
    return "–" if v is None else fmt.format(v)


def _peers_in(doc: dict) -> List[str]:
    """Peers with a column: those that could run on the machine (the header says why the others did not)."""
    seen = []
    for row in doc.get("rows", []):
        for p in row.get("results", {}):
            if p not in seen and p not in doc.get("peer_notes", {}):
                seen.append(p)
    order = {p: i for i, p in enumerate(PEERS)}
    return sorted(seen, key=lambda p: order.get(p, len(order)))


def _lead(doc: dict) -> Optional[str]:
    """The flexdma backend whose speedups the summary table shows: auto if it ran, else the first that did."""
    for p in FLEXDMA_PEERS:
        if any(row.get("results", {}).get(p, {}).get("status") == "ok" for row in doc.get("rows", [])):
            return p
    return None


def _case_cells(row: dict) -> List[str]:
    dirn = row.get("dir", "fwd+bwd")
    return [
        row["mode"],
        dirn,
        row["bias"],
        str(row["D"]),
        str(row["Q"]),
        str(row["K"]),
        str(row["W"]),
        f"{row.get('density', float('nan')):.4f}",
    ]


_CASE_HEAD = ["mode", "dir", "bias", "D", "Q", "K", "W", "density"]


def _table(head: List[str], body: List[List[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def timing_summary(doc: dict) -> str:
    peers = _peers_in(doc)
    lead = _lead(doc)
    others = [p for p in peers if p not in FLEXDMA_PEERS]
    head = _CASE_HEAD + [f"{p} ms" for p in peers] + ([f"{lead} vs {p}" for p in others] if lead else [])
    body = []
    for row in doc.get("rows", []):
        res = row.get("results", {})
        cells = _case_cells(row) + [_cell(res.get(p)) for p in peers]
        if lead:
            sp = row.get("speedup", {}).get(lead, {})
            cells += [f"{sp[p]:.2f}x" if p in sp else "–" for p in others]
        body.append(cells)
    return _table(head, body)


def timing_detail(doc: dict) -> str:
    head = _CASE_HEAD + ["peer", "ms", "TFLOP/s", "GB/s", "peak MiB", "extra MiB", "note"]
    body = []
    for row in doc.get("rows", []):
        for p, r in row.get("results", {}).items():
            if p in doc.get("peer_notes", {}):
                continue
            note = "" if r.get("status") == "ok" else f"{r.get('status')}: {r.get('reason', '')}"[:120]
            body.append(
                _case_cells(row)
                + [
                    p,
                    _cell(r),
                    _cell(r, "{:.1f}", "tflops"),
                    _cell(r, "{:.0f}", "gbps"),
                    _cell(r, "{:.0f}", "peak_mib"),
                    _cell(r, "{:.0f}", "extra_mib"),
                    note.replace("|", "/").replace("\n", " "),
                ]
            )
    return _table(head, body)


def equivalence_table(doc: dict) -> str:
    head = (
        _CASE_HEAD[:1]
        + _CASE_HEAD[2:]
        + ["impl", "ok"]
        + [f"{n} max abs / rel" for n in ("out", "dq", "dk", "dv", "dbias")]
    )
    body = []
    for row in doc.get("rows", []):
        base = [c for i, c in enumerate(_case_cells(row)) if i != 1]
        ref = row.get("lowp_reference", {})
        body.append(
            base
            + ["bf16 eager reference", "(tol. base)"]
            + [
                f"{ref[n]['max_abs']:.2e} / {ref[n]['rel']:.2e}" if n in ref else "–"
                for n in ("out", "dq", "dk", "dv", "dbias")
            ]
        )
        for p, r in row.get("results", {}).items():
            if r.get("status") != "ok":
                body.append(base + [p, f"{r.get('status')}: {r.get('reason', '')}"[:100].replace("|", "/")] + ["–"] * 5)
                continue
            body.append(
                base
                + [p, "yes" if r.get("within_tol") else "NO"]
                + [
                    f"{r[n]['max_abs']:.2e} / {r[n]['rel']:.2e}" if n in r else "–"
                    for n in ("out", "dq", "dk", "dv", "dbias")
                ]
            )
    return _table(head, body)


def header(doc: dict) -> str:
    dirty = {True: " (dirty tree)", False: "", None: ""}[doc.get("dirty")]
    lines = [
        f"`{doc.get('subcommand')}` on {doc.get('gpu')}, commit {doc.get('commit')}{dirty}, {doc.get('date')}; "
        f"torch {doc.get('torch')}, CUDA {doc.get('cuda')}, Triton {doc.get('triton')}"
    ]
    if "timing" in doc:
        t = doc["timing"]
        lines.append(
            f"Times: {t.get('stat')} of {t.get('tool')} (warm-up {t.get('warmup_ms')} ms, rep "
            f"{t.get('rep_ms')} ms), milliseconds. B=1, H=2, KVH=1, bf16, causal; TFLOP/s over the kept "
            f"pairs, GB/s over the bytes that must move; `A vs P` = P's time / A's time."
        )
    if any("sdpa" in row.get("results", {}) for row in doc.get("rows", [])) and "timing" in doc:
        lines.append(
            "`sdpa` times include folding the mask into the bias (`bias.masked_fill(~mask, -inf)`), "
            "which a caller holding a mask and a bias pays on every call; `dense` has no mask or bias."
        )
    flex_bwd = [
        r["results"]["flexattn"]
        for r in doc.get("rows", [])
        if r.get("dir") == "bwd" and r.get("results", {}).get("flexattn", {}).get("status") == "ok"
    ]
    if flex_bwd and not any("best_options" in r for r in flex_bwd):
        lines.append(
            "- `flexattn` backward here ran with the small-block backward tiles only, before its option "
            "sets were timed per run: not its fastest (see `benchmarks/perf-log.md`, 'Issue 28: workspaces "
            "through the op layer, wide-head per-key tiles, FlexAttention options')."
        )
    for p, why in doc.get("peer_notes", {}).items():
        lines.append(f"- `{p}` not run: {why}")
    if doc.get("not_run"):
        lines.append(f"- not run (time budget or input failure): {', '.join(doc['not_run'])}")
    if doc.get("elapsed_s") is not None:
        n = len(doc.get("_paths", [])) or 1
        what = "the invocation" if n == 1 else f"the {n} invocations merged here"
        lines.append(f"- wall time of {what}: {doc['elapsed_s']:.0f} s")
    return "\n".join(lines)


def markdown(doc: dict, detail: bool = False) -> str:
    """Header and tables of one JSON document; the summary table comes last."""
    if doc.get("subcommand") == "equivalence":
        return header(doc) + "\n\n" + equivalence_table(doc) + "\n"
    parts = [header(doc)]
    if detail:
        parts.append(timing_detail(doc))
    parts.append(timing_summary(doc))
    return "\n\n".join(parts) + "\n"


def plot(doc: dict, stem: str) -> List[str]:
    """One PNG per JSON: time vs length (or vs window), one line per peer, a panel per (dir, D, bias)."""
    if doc.get("subcommand") == "equivalence" or not doc.get("rows"):
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    xkey = "W" if doc.get("subcommand") == "window" else "K"
    panels: Dict[tuple, list] = {}
    for row in doc["rows"]:
        panels.setdefault((row.get("dir", "fwd"), row["D"], row["bias"]), []).append(row)
    n = len(panels)
    cols = min(n, 2)
    rows_n = -(-n // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(6.5 * cols, 4.2 * rows_n), squeeze=False)
    # One colour per peer in every panel (a peer missing from a panel must not shift the others).
    colour = {p: f"C{i}" for i, p in enumerate(_peers_in(doc))}
    for ax, ((dirn, d, bias), rows) in zip(axes.flat, sorted(panels.items())):
        for p in _peers_in(doc):
            pts = sorted(
                (r[xkey], r["results"][p]["ms"]) for r in rows if r["results"].get(p, {}).get("status") == "ok"
            )
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p, color=colour[p])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("window W" if xkey == "W" else "sequence length (keys)")
        ax.set_ylabel("ms (median)")
        ax.set_title(f"{doc['subcommand']} {dirn}, D={d}, {bias} bias")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(f"{doc.get('gpu')} · commit {doc.get('commit')} · {doc.get('date', '')[:10]}", fontsize=9)
    fig.tight_layout()
    path = stem + ".png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]


def _case_key(row: dict) -> str:
    # The name not_run entries use.
    return Case(row["mode"], row["Q"], row["K"], row["W"], row["D"], row["bias"]).key


def _merge(docs: List[dict]) -> dict:
    """One document from several runs of a subcommand at one commit (a sweep split over calls):
    rows of later runs replace the same case of earlier ones, and a case counts as not run only
    if no run measured it."""
    docs = sorted(docs, key=lambda d: (d.get("date", ""), d["_path"]))
    out = dict(docs[-1])
    rows: Dict[str, dict] = {}
    for d in docs:
        for r in d.get("rows", []):
            rows[(_case_key(r), r.get("dir"))] = r
    # Sweep order: mode, head dim (as the CLI runs them: larger first), bias kind, lengths, window.
    out["rows"] = sorted(
        rows.values(),
        key=lambda r: (r["mode"], -r["D"], r["bias"] != "per-row", r["Q"], r["K"], r["W"], r.get("dir") != "fwd"),
    )
    out["not_run"] = sorted(
        {n for d in docs for n in d.get("not_run", []) if n.split(":")[0] not in {k for k, _ in rows}}
    )
    out["elapsed_s"] = sum(d.get("elapsed_s") or 0 for d in docs)
    out["peer_notes"] = {k: v for d in docs for k, v in (d.get("peer_notes") or {}).items()}
    out["argv"] = [d.get("argv") for d in docs] if len(docs) > 1 else docs[0].get("argv")
    out["_paths"] = [d["_path"] for d in docs]
    return out


def load_results(results_dir: str) -> List[dict]:
    """Every flexdma-bench JSON under results_dir: per (GPU, subcommand) the newest commit's runs,
    merged into one document, in subcommand order."""
    groups: Dict[tuple, Dict[str, List[dict]]] = {}
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or doc.get("schema") not in (SCHEMA, CPU_SCHEMA):
            continue  # other tools' files share the folder
        doc["_path"] = path
        k = (doc.get("gpu_short"), doc.get("subcommand"))
        groups.setdefault(k, {}).setdefault(doc.get("commit") or "", []).append(doc)
    merged = []
    for by_commit in groups.values():
        newest = max(by_commit.values(), key=lambda ds: max((d.get("date", ""), d["_path"]) for d in ds))
        if newest[0].get("schema") == CPU_SCHEMA:  # one run measures every row: the newest stands alone
            doc = max(newest, key=lambda d: (d.get("date", ""), d["_path"]))
            merged.append(dict(doc, _paths=[doc["_path"]]))
            continue
        merged.append(_merge(newest))
    order = {s: i for i, s in enumerate(("forward", "backward", "window", "decode", "equivalence", "cpu"))}
    return sorted(merged, key=lambda d: (d.get("gpu_short") or "", order.get(d.get("subcommand"), 99)))


def cuda_dev_section(results_dir: str) -> List[str]:
    """The newest `scripts/dev/cuda_dev.py` run with model-shape rows: the dense-mask kernels
    (torch.ops.flexdma.fwd / bwd, tile activity bits inside the forward) against FlexAttention and
    dense SDPA in the same run, and that run's 32K, no-mask and decode rows."""
    paths = sorted(glob.glob(os.path.join(results_dir, "*_cuda_dev.json")))
    runs = []
    for path in paths:
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if any(k.startswith("model_") for k in doc):
            runs.append((doc.get("run_at", ""), os.path.basename(path), doc))
    if not runs:
        return []
    _, name, doc = max(runs, key=lambda r: r[:2])  # the newest run (by its time, then name)
    sets = doc.get("model_flex_option_sets")
    flex_note = (
        "FlexAttention computes the bias gradient too"
        + (
            f", timed with each kernel option set ({', '.join(sets)}) and shown at its fastest per direction."
            if sets
            else ", with the small-block backward config only (not its fastest)."
        )
        if doc.get("model_flex_bias_grad")
        else "In this run FlexAttention's bias did not require grad (no bias gradient) while its backward "
        "ran with the small-block config a bias gradient needs: its bwd times are not comparable to "
        "flexdma's."
    )
    if sets and "key_tile_64" not in sets and any(re.match(r"model_\d+_d64_", k) for k in doc):
        # FlexAttention's sm_90 default forward tile at head dim 64 (128 keys on four warps) is its
        # slow case with a captured bias; a run whose option sets lacked the 64-key tile did not
        # time FlexAttention's best forward there.
        flex_note += (
            " Its D=64 forward ran without the 64-key forward tile (key_tile_64), which on sm_90 ran"
            " 24x faster than its default there with a window mask (perf log, 'FlexAttention at head dim"
            " 64 on sm_90'): not its best."
        )
    fwd_note = (
        "flexdma fwd = the forward op as inference runs it (a training forward also stores out's rounding "
        "error, out_resid)"
        if doc.get("fwd_inference")
        else "flexdma fwd = the forward op storing out_resid too (as training runs it)"
    )
    ms = lambda k: f"{doc[k]:.3f}" if isinstance(doc.get(k), (int, float)) and doc[k] > 0 else "–"  # noqa: E731
    shapes = sorted({m.group(1) for k in doc if (m := re.match(r"model_(\d+_d\d+)_", k))})
    body = []
    for shape in sorted(shapes, key=lambda x: (x.split("_")[1], int(x.split("_")[0]))):
        L, d = shape.split("_")
        pre = f"model_{shape}_"
        row = [f"B={16384 // int(L)} L={L} {d.replace('d', 'D=')}"]
        for peer in ("flexdma", "flexattn", "sdpa"):
            row.append(f"{ms(pre + peer + '_fwd_ms')} / {ms(pre + peer + '_bwd_ms')}")
        body.append(row)
    same_run = [
        ["32K, per-row bias, mask W=1024: fwd / bwd", f"{ms('per_row_fwd_ms')} / {ms('per_row_bwd_ms')}"],
        ["32K, per-row bias: bwd, deterministic", ms("per_row_bwd_det_ms")],
        ["32K, per-key bias, mask W=1024: fwd / bwd", f"{ms('per_key_fwd_ms')} / {ms('per_key_bwd_ms')}"],
        [
            "16K causal, no mask: flexdma / dense SDPA",
            f"{ms('nomask_causal_16k_fwd_ms')} / {ms('sdpa_causal_16k_fwd_ms')}",
        ],
        [
            "decode Q=1 K=512K: flexdma / dense SDPA",
            f"{ms('decode_524288_fwd_ms')} / {ms('decode_524288_dense_sdpa_ms')}",
        ],
    ] + [
        # Part maskbits: the API's forward with a create_mask mask, its tile bits from what
        # create_mask knew, against a copy whose bits the op computes from the mask.
        [
            f"32K API forward, {kind} create_mask mask: bits from create_mask / from the mask",
            f"{ms(f'maskbits{tag}_selection_fwd_ms')} / {ms(f'maskbits{tag}_copy_fwd_ms')}",
        ]
        for kind, tag in (("per-key", ""), ("row-wise", "_per_row"))
        if f"maskbits{tag}_selection_fwd_ms" in doc
    ]
    # A run of the model part alone has none of these: no empty table.
    same_run = [r for r in same_run if set(r[1].replace("/", " ").split()) != {"–"}]
    out = [
        f"## dense-mask kernels at model shapes ({gpu_short(doc.get('device', ''))}, `{name}`)",
        "",
        "`python -m scripts.dev.cuda_dev --parts fwd,bwd,nomask,decode,model[,maskbits]`: B x L = 16K tokens, H=16, "
        "KVH=4, bf16, causal, mask (B, KVH, L, L) = top-L/4 keys of a bias (B, KVH, 1, L) per row; "
        "flexdma = torch.ops.flexdma.fwd / bwd (CUDA), FlexAttention compiled with the same mask and bias, "
        f"dense SDPA over all keys; {fwd_note}; bwd = fwd+bwd minus fwd (flexdma: the backward "
        f"op alone, with the bias gradient). {flex_note} A negative or missing time is shown as –.",
        "",
        _table(["shape", "flexdma fwd / bwd ms", "FlexAttention fwd / bwd ms", "dense SDPA fwd / bwd ms"], body),
        "",
    ]
    if same_run:
        out += [_table(["same run, B=1 H=2 KVH=1 D=128", "ms"], same_run), ""]
    return out


def write_results_md(results_dir: str, md_path: str) -> str:
    docs = load_results(results_dir)
    out = [
        "# flexdma benchmark results",
        "",
        "Generated by `python -m benchmarks report` from the JSON files in `benchmarks/results/` "
        "(the newest per GPU and subcommand); do not edit by hand. Reproduce a section with "
        "`python -m benchmarks <subcommand>` (see `benchmarks/run_all.sh`).",
        "",
    ]
    if not docs:
        out.append("No results yet.")
    md_dir = os.path.dirname(os.path.abspath(md_path))
    for doc in docs:
        if doc.get("schema") == CPU_SCHEMA:
            out += [f"## cpu ({doc.get('gpu_short')})", "", cpu.markdown(doc)]
            continue
        out += [f"## {doc.get('subcommand')} ({doc.get('gpu_short')})", "", markdown(doc, detail=False)]
        stem = os.path.splitext(doc["_paths"][0])[0]
        pngs = plot(doc, stem)
        for png in pngs:
            out += [f"![{doc.get('subcommand')}]({os.path.relpath(png, md_dir)})", ""]
        if doc.get("subcommand") != "equivalence":
            out += [
                "<details><summary>per-peer detail (TFLOP/s, GB/s, peak memory)</summary>",
                "",
                timing_detail(doc),
                "",
                "</details>",
                "",
            ]
    out += perkey.section(results_dir)
    out += decode.section(results_dir)
    out += varlen.section(results_dir)
    out += cp.section(results_dir)
    out += cuda_dev_section(results_dir)
    with open(md_path, "w") as f:
        f.write("\n".join(out).rstrip() + "\n")
    return md_path
