"""Helpers the benchmark runners share (cli.py, cpu.py, perkey.py, decode.py): the recorded command
line, the JSON writer and reader, a table's report section. Imports nothing of the other benchmark
modules."""

from __future__ import annotations

import gc
import json
import os
import re
import time
from typing import Dict, List

import torch


def public_argv(argv: List[str]) -> List[str]:
    """The command line as recorded: directory arguments are where this run wrote, not part of what it measured."""
    out, skip = [], False
    for a in argv:
        if skip:
            out.append("DIR")
            skip = False
        elif a in ("--out", "--results", "--md"):
            out.append(a)
            skip = True
        elif a.split("=", 1)[0] in ("--out", "--results", "--md"):
            out.append(a.split("=", 1)[0] + "=DIR")
        else:
            out.append(a)
    return out


def issue_time(fn, n: int, warmup: int = 0) -> tuple:
    """(host, wall) seconds a call of `fn`, issued n times back to back: host is the time to issue
    them, wall adds draining the GPU. Where host is near wall the GPU waited on the host (or the
    launch queue filled)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    return host, (time.perf_counter() - t0) / n


def print_profile(fn, n: int, sort: str = "tottime", lines: int = 25) -> None:
    """cProfile of n calls of `fn` (the GPU drained after them), its `lines` heaviest functions by
    `sort`: where an eager call's host time goes."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats(sort).print_stats(lines)


def write_json(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
    os.replace(tmp, path)


def runs_of(results_dir: str, schema: str) -> List[dict]:
    """Every JSON document of `schema` under results_dir, newest first."""
    docs = []
    for name in sorted(os.listdir(results_dir)) if os.path.isdir(results_dir) else []:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(results_dir, name)) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("schema") == schema:
            docs.append(doc)
    return sorted(docs, key=lambda d: d.get("date", ""), reverse=True)


def newest_section(results_dir: str, schema: str, title: str, note: str, markdown) -> List[str]:
    """RESULTS.md's section of the newest run of `schema` only (earlier runs stay in git history and
    benchmarks/perf-log.md): a heading with the GPU and commit, a note, the run's table."""
    out = []
    for doc in runs_of(results_dir, schema)[:1]:
        out += run_section(doc, title, note, markdown(doc))
    return out


def gpu_short(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; anything without a recognizable model -> its first word
    ('device' for an empty name)."""
    m = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Z]?)\b", name.upper())
    if m:
        return m.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "", (name.lower().split() or [""])[0]) or "device"


def run_section(doc: dict, title: str, note: str, text: str) -> List[str]:
    """One run's RESULTS.md section: a heading with its GPU and commit, a note, its tables."""
    return [f"## {title} ({doc.get('gpu_short')}, commit {doc.get('commit')})", "", note, "", text, ""]


def save_run(doc: dict, out_dir: str, env: dict, name: str) -> str:
    """The run's JSON, named by GPU, date, commit and `name`; its path."""
    doc.update(env)
    path = os.path.join(out_dir, f"{env['gpu_short']}_{env['date'][:10].replace('-', '')}_{env['commit']}_{name}.json")
    write_json(path, doc)
    return path


def chosen_peers(arg: str, peers: tuple, extra: str, what: str, bench: str) -> tuple:
    """(peers, whether `extra` runs) of a --peers argument: a subset of `peers` plus the optional
    `extra` part (`what` says what it is), all of them where the argument is empty."""
    if not arg:
        return peers, True
    names = tuple(arg.split(","))
    unknown = [p for p in names if p not in peers + (extra,)]
    if unknown:
        raise SystemExit(f"--peers: {bench} knows {', '.join(peers)} and {extra} ({what}), got {unknown}")
    return tuple(p for p in names if p != extra), extra in names


def table(head: list, rows: list, cells) -> List[str]:
    """A markdown table: the header, then a line a row of cells(row), or "not run" and the reason
    where the run left the row out."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        if "not_run" in row:
            lines.append(f"| {row['case']['name']} | not run: {row['not_run']} |")
        else:
            lines.append("| " + " | ".join(cells(row)) + " |")
    return lines


def in_fresh_process(fn, *args):
    """fn(*args) in a spawned process of its own (its result comes back pickled): a compiled peer
    timed there starts from no earlier compile, cache or allocator state. A process that dies
    without a result (a crash in a kernel or the compiler) gives {"error": ...}."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(fn, *args).result()
        except concurrent.futures.process.BrokenProcessPool as e:
            return {"error": f"the fresh process died: {e}"}


def record(row: dict, peer: str, rec: dict, hide: str = "") -> None:
    """A peer's record into its row, printed as it lands (a cut run's log keeps it; `hide`: a prefix
    of keys too long to print), after the peer's memory went back to the device (the next peer's
    peak starts clean)."""
    gc.collect()
    torch.cuda.empty_cache()
    row["peers"][peer] = rec
    shown = {
        k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items() if not (hide and k.startswith(hide))
    }
    print(row["case"]["name"], peer, shown, flush=True)


def captured(fn):
    """fn captured in a CUDA graph (after three warm-up calls on a side stream): its replay runs
    the same kernels without the host's launch time. Timed with do_bench (which clears L2 before
    each call), it is the GPU time of a step whose inputs come from DRAM."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return g.replay


class Saving:
    """A run's document, saved (save_run, under `name`) whenever one of its lists grows: a run its
    call's time limit cuts keeps what it measured."""

    def __init__(self, doc: dict, out: str, env: dict, name: str):
        self.doc, self.out, self.env, self.name = doc, out, env, name

    def save(self) -> str:
        return save_run(self.doc, self.out, self.env, self.name)

    def list(self, key: str) -> list:
        saving = self

        class Rows(list):
            def append(self, row):
                super().append(row)
                saving.save()

        self.doc[key] = Rows()
        return self.doc[key]


def peak_memory(fn) -> Dict[str, float]:
    """Peak allocated memory during one call, absolute and above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    res = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del res
    return {"peak_mib": peak / 2**20, "extra_mib": (peak - before) / 2**20}
