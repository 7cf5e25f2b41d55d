"""`python -m benchmarks <subcommand>`: time flexdma against its peers, in one process, on one GPU.

Subcommands: forward, backward (training lengths at W=1024), window (window sweep at one
length, forward and backward), decode-mask (one query, long keys, the dense-mask kernels and
their peers), equivalence (agreement of every implementation with the float64 reference), perkey (the
per-key top-W path, keep_window_size, against dense SDPA and its peers; benchmarks/perkey.py), decode
(decoding on the per-key path: layer steps and Doge generate; benchmarks/decode.py), varlen (packed
sequences against per-document calls, a padded batch and dense attention within documents;
benchmarks/varlen.py), cp (context parallel over the ranks of a torchrun: benchmarks/cp.py; not
part of `all`), all, report
(regenerate RESULTS.md from the JSON), cpu (the CPU kernel against SDPA on the CPU, fp32; see
benchmarks/cpu.py; not part of `all`).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import re
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import List, Optional

import torch

import flexdma
from flexdma.dense.naive import attention_ref

from . import configs, cp, cpu, decode, perkey, report, varlen
from . import inputs as inputs_mod
from . import peers as peers_mod
from .common import gpu_short, peak_memory, public_argv, write_json

WARMUP_MS, REP_MS = 25, 100
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# ---------------------------------------------------------------------------------------------
# Environment and output files


def _git(*args) -> Optional[str]:
    try:
        return subprocess.run(
            ["git", *args],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.strip()
    except Exception:
        return None


def environment(commit: Optional[str] = None) -> dict:
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name()
    else:
        gpu = f"cpu ({platform.processor() or platform.machine()})"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    fd_version = getattr(flexdma, "__version__", None)
    backends = flexdma.available_backends() if hasattr(flexdma, "available_backends") else None
    dirty = None
    if commit is not None and commit.endswith("-dirty"):  # as `git describe --always --dirty` writes it
        commit, dirty = commit[: -len("-dirty")], True
    elif commit is None:
        commit = _git("rev-parse", "--short", "HEAD")
        status = _git("status", "--porcelain")
        dirty = bool(status) if status is not None else None
    return {
        "gpu": gpu,
        "gpu_short": gpu_short(gpu),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "flexdma": fd_version,
        "available_backends": backends,
        "commit": commit or "nogit",
        "dirty": dirty,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def _commit_label(value: str) -> str:
    """--commit: a revision as git names it (letters, digits, '.', '_', '-'), since it becomes part of
    the result file's name; anything else (a '+', a '/', a space) is refused, not rewritten."""
    if not re.fullmatch(r"[0-9A-Za-z._-]+", value):
        raise argparse.ArgumentTypeError(
            f"got {value!r}: needs a revision label of letters, digits, '.', '_' or '-' (it names the result file)"
        )
    return value


def result_path(out_dir: str, env: dict, subcommand: str) -> str:
    day = env["date"][:10].replace("-", "")
    return os.path.join(out_dir, f"{env['gpu_short']}_{day}_{env['commit']}_{subcommand}.json")


class Progress:
    """tqdm when installed, plain prints otherwise."""

    def __init__(self, total: int, desc: str):
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            self.bar = None
        self.total, self.n, self.desc = total, 0, desc

    def step(self, label: str):
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label[:60])
            self.bar.update(1)
        else:
            print(f"[{self.desc} {self.n}/{self.total}] {label}", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------------
# Timing


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"))


def _error_record(e: BaseException) -> dict:
    if isinstance(e, peers_mod.Unavailable):
        return {"status": "unavailable", "reason": str(e)}
    if (
        isinstance(e, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))
        or "out of memory" in str(e).lower()
    ):
        return {"status": "oom", "reason": str(e).splitlines()[0][:300] if str(e) else "OutOfMemoryError"}
    return {"status": "error", "reason": f"{type(e).__name__}: {str(e)[:400]}"}


def time_peer(peer: str, case: configs.Case, inp, direction: str) -> dict:
    """The peer's time at its best option set (each set's time or error kept under "options")."""
    sets = peers_mod.option_sets(peer)
    if sets == [None]:
        return _time_peer(peer, case, inp, direction, None)
    tried = {name: _time_peer(peer, case, inp, direction, name) for name in sets}
    ok = {n: r for n, r in tried.items() if r.get("status") == "ok"}
    best = min(ok, key=lambda n: ok[n]["ms"]) if ok else None
    rec = dict(tried[best if best else sets[0]], best_options=best)
    rec["options"] = {
        n: (r["ms"] if r.get("status") == "ok" else r.get("reason", r.get("status"))) for n, r in tried.items()
    }
    return rec


def _time_peer(peer: str, case: configs.Case, inp, direction: str, options) -> dict:
    backward = direction == "bwd"
    t = SimpleNamespace(
        mask=inp.mask, **{n: getattr(inp, n).detach().requires_grad_(backward) for n in ("q", "k", "v", "bias")}
    )
    rec: dict = {}
    fn = out = None
    try:
        t0 = time.perf_counter()
        fn, wrt = peers_mod.prepare(peer, case, t, backward=backward, options=options)
        if backward:
            out = fn()  # first call compiles; this graph is the one the timed backward walks
            call = lambda: torch.autograd.grad(out, wrt, inp.dout, retain_graph=True)  # noqa: E731
        else:
            call = fn
        call()
        torch.cuda.synchronize()
        rec["prep_s"] = time.perf_counter() - t0
        rec["ms"] = _bench(call)
        rec.update(peak_memory(call))
        rec["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 - a peer's failure is a result, not a crash
        if isinstance(e, KeyboardInterrupt):
            raise
        rec = _error_record(e)
    finally:
        del fn, out, t
        _free()
    return rec


def _derive(row: dict, case: configs.Case) -> None:
    """TFLOP/s and GB/s of each ok result, and each flexdma backend's speedup over every peer."""
    for r in row["results"].values():
        if r.get("status") == "ok" and r["ms"] > 0:
            r["tflops"] = row["flops"] / (r["ms"] * 1e-3) / 1e12
            r["gbps"] = row["bytes"] / (r["ms"] * 1e-3) / 1e9
    speed = {}
    for mine in configs.FLEXDMA_PEERS:
        m = row["results"].get(mine, {})
        if m.get("status") != "ok":
            continue
        speed[mine] = {p: r["ms"] / m["ms"] for p, r in row["results"].items() if p != mine and r.get("status") == "ok"}
    row["speedup"] = speed


def run_timing(subcommand: str, cases: List[configs.Case], peers: List[str], args, env: dict) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit(f"`{subcommand}` times on a CUDA GPU; none is visible (equivalence and report run on CPU)")
    path = result_path(args.out, env, subcommand)
    doc = dict(
        schema="flexdma-bench/1",
        subcommand=subcommand,
        argv=public_argv(sys.argv[1:]),
        **env,
        timing=dict(warmup_ms=WARMUP_MS, rep_ms=REP_MS, stat="median", tool="triton.testing.do_bench"),
        peers=peers,
        peer_notes={},
        rows=[],
        not_run=[],
    )
    for p in peers:
        note = peers_mod.peer_note(p)
        if note:
            doc["peer_notes"][p] = note
    start = time.perf_counter()
    steps = sum(len(c.dirs) for c in cases) * len(peers)
    prog = Progress(steps, subcommand)
    for case in cases:
        if args.budget and time.perf_counter() - start > args.budget:
            doc["not_run"].append(case.key)
            continue
        try:
            t0 = time.perf_counter()
            inp = inputs_mod.make_inputs(case, "cuda", seed=args.seed)
            torch.cuda.synchronize()
            inputs_s = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001
            if isinstance(e, KeyboardInterrupt):
                raise
            doc["not_run"].append(f"{case.key}: inputs: {_error_record(e)['reason']}")
            _free()
            continue
        for direction in case.dirs:
            row = dict(
                case.as_dict(),
                dir=direction,
                pairs=inp.pairs,
                density=inp.density,
                inputs_s=inputs_s,
                flops=inputs_mod.flops(case, inp.pairs, direction),
                bytes=inputs_mod.bytes_moved(case, direction),
                results={},
            )
            for p in peers:
                why = doc["peer_notes"].get(p) or (None if args.no_limits else configs.limit_reason(p, direction, case))
                if why:
                    row["results"][p] = {"status": "skipped", "reason": why}
                else:
                    row["results"][p] = time_peer(p, case, inp, direction)
                prog.step(f"{case.key} {direction} {p}")
            _derive(row, case)
            doc["rows"].append(row)
        del inp
        _free()
        doc["elapsed_s"] = time.perf_counter() - start
        write_json(path, doc)  # after every case, so a run cut short keeps what it measured
    prog.close()
    doc["elapsed_s"] = time.perf_counter() - start
    write_json(path, doc)
    _finish(doc, path, args)
    return doc


# ---------------------------------------------------------------------------------------------
# Equivalence with the float64 reference


def _errors(x: torch.Tensor, ref: torch.Tensor) -> dict:
    x, ref = x.double(), ref.double()
    diff = (x - ref).abs()
    return {
        "max_abs": float(diff.max()),
        "rel": float(diff.max() / ref.abs().max().clamp_min(1e-30)),
        "finite": bool(torch.isfinite(x).all()),
    }


def _outputs_and_grads(fn, wrt, dout):
    out = fn()
    grads = torch.autograd.grad(out, wrt, dout.to(out.dtype), allow_unused=True)
    return [out.detach()] + [g.detach() if g is not None else None for g in grads]


NAMES = ("out", "dq", "dk", "dv", "dbias")


def run_equivalence(cases: List[configs.Case], peers: List[str], args, env: dict) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = result_path(args.out, env, "equivalence")
    doc = dict(
        schema="flexdma-bench/1",
        subcommand="equivalence",
        argv=public_argv(sys.argv[1:]),
        **env,
        device=device,
        rule="within_tol: rel error <= 2 x the bf16 eager reference's rel error + 1e-3, per tensor",
        peers=peers,
        peer_notes={},
        rows=[],
        not_run=[],
    )
    for p in peers:
        note = peers_mod.peer_note(p)
        if note:
            doc["peer_notes"][p] = note
    peers = [p for p in peers if p not in doc["peer_notes"]]
    prog = Progress(len(cases) * len(peers), "equivalence")
    start = time.perf_counter()
    for case in cases:
        inp = inputs_mod.make_inputs(case, device, seed=args.seed)

        def ref_fn(dtype, t):
            return lambda: attention_ref(t.q, t.k, t.v, t.mask, t.bias, is_causal=True)[0]

        def leaves(dtype):
            return SimpleNamespace(
                mask=inp.mask,
                **{n: getattr(inp, n).detach().to(dtype).requires_grad_(True) for n in ("q", "k", "v", "bias")},
            )

        t64 = leaves(torch.float64)
        truth = _outputs_and_grads(ref_fn(torch.float64, t64), [t64.q, t64.k, t64.v, t64.bias], inp.dout)
        tl = leaves(inp.q.dtype)
        lowp = _outputs_and_grads(ref_fn(inp.q.dtype, tl), [tl.q, tl.k, tl.v, tl.bias], inp.dout)
        lowp_err = {n: _errors(x, r) for n, x, r in zip(NAMES, lowp, truth)}
        row = dict(case.as_dict(), density=inp.density, lowp_reference=lowp_err, results={})
        for p in peers:
            try:
                t = leaves(inp.q.dtype)
                fn, wrt = peers_mod.prepare(p, case, t, backward=True)
                got = _outputs_and_grads(fn, wrt, inp.dout)
                errs = {n: _errors(x, r) for n, x, r in zip(NAMES, got, truth) if x is not None}
                ok = all(e["finite"] and e["rel"] <= 2 * lowp_err[n]["rel"] + 1e-3 for n, e in errs.items())
                row["results"][p] = dict(status="ok", within_tol=ok, **errs)
            except BaseException as e:  # noqa: BLE001
                if isinstance(e, KeyboardInterrupt):
                    raise
                row["results"][p] = _error_record(e)
            _free()
            prog.step(f"{case.key} {p}")
        doc["rows"].append(row)
        write_json(path, doc)
    prog.close()
    doc["elapsed_s"] = time.perf_counter() - start
    write_json(path, doc)
    _finish(doc, path, args)
    return doc


# ---------------------------------------------------------------------------------------------


def _finish(doc: dict, path: str, args) -> None:
    pngs = [] if args.no_plots else report.plot(doc, os.path.splitext(path)[0])
    print(f"\nwrote {path}" + "".join(f"\nwrote {p}" for p in pngs), flush=True)
    print(report.markdown(doc, detail=True), flush=True)


def _parse(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "subcommand",
        choices=[
            "forward",
            "backward",
            "window",
            "decode-mask",
            "equivalence",
            "perkey",
            "decode",
            "varlen",
            "cp",
            "all",
            "report",
            "cpu",
        ],
    )
    ap.add_argument(
        "--out", default=RESULTS_DIR, help="directory for the JSON and PNG files (default benchmarks/results)"
    )
    ap.add_argument("--quick", action="store_true", help="a ~2-minute subset")
    ap.add_argument("--d", default=None, help="head dims, e.g. 64,128")
    ap.add_argument("--bias", default=None, help="bias kinds: per-row,per-key")
    ap.add_argument(
        "--peers",
        default=None,
        help=f"comma-separated subset of {','.join(configs.PEERS)} (cp: of its parts {','.join(cp.SECTIONS)})",
    )
    ap.add_argument(
        "--lengths", default=None, help="override the query/key lengths (forward/backward/decode; cp: total tokens)"
    )
    ap.add_argument("--windows", default=None, help="override the windows (window)")
    ap.add_argument("--length", type=int, default=configs.WINDOW_LENGTH, help="the window sweep's length")
    ap.add_argument(
        "--budget",
        type=float,
        default=540.0,
        help="seconds after which no new case starts (the rest is listed as not_run); 0 = none",
    )
    ap.add_argument("--no-limits", action="store_true", help="also run peers past their LIMITS (slow)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument(
        "--commit",
        default=None,
        type=_commit_label,
        help="record this commit instead of asking git (a -dirty suffix marks a dirty tree)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=6, help="cpu: forward repetitions (fwd+bwd: half as many)")
    ap.add_argument("--results", default=RESULTS_DIR, help="report: directory of JSON files to read")
    ap.add_argument(
        "--md",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"),
        help="report: markdown file to write",
    )
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.subcommand == "report":
        path = report.write_results_md(args.results, args.md)
        print(f"wrote {path}")
        return 0
    if args.subcommand == "perkey":
        perkey.main(args, environment(args.commit))
        return 0
    if args.subcommand == "decode":
        decode.main(args, environment(args.commit))
        return 0
    if args.subcommand == "varlen":
        varlen.main(args, environment(args.commit))
        return 0
    if args.subcommand == "cp":
        # Each rank takes its GPU before the environment is read (no context on GPU 0 for all).
        cp.main(args, environment)
        return 0
    ds = configs.parse_list(args.d, configs.ANY_HEAD_DIMS, int) or list(configs.HEAD_DIMS)
    biases = configs.parse_list(args.bias, configs.BIAS_KINDS) or list(configs.BIAS_KINDS)
    all_peers = list(configs.PEERS)
    if args.subcommand == "equivalence" or args.subcommand == "all":
        all_eq = peers_mod.equivalence_peers()
    chosen = configs.parse_list(args.peers, sorted(set(configs.PEERS) | {f"flexdma-{b}" for b in ("cpu",)}))
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else None
    windows = [int(x) for x in args.windows.split(",")] if args.windows else None
    for name, vals in (("--lengths", lengths), ("--windows", windows)):
        if vals is not None and any(v <= 0 for v in vals):
            raise SystemExit(f"{name} must be positive integers")
    env = environment(args.commit)
    if args.subcommand == "cpu":
        cpu.run(args, env, result_path(args.out, env, "cpu"))
        return 0
    kw = dict(quick=args.quick, ds=ds, biases=biases)

    def timing_peers():
        return [p for p in all_peers if chosen is None or p in chosen]

    sub = args.subcommand
    if sub in ("forward", "all"):
        run_timing("forward", configs.training_cases(("fwd",), lengths=lengths, **kw), timing_peers(), args, env)
    if sub in ("backward", "all"):
        run_timing("backward", configs.training_cases(("bwd",), lengths=lengths, **kw), timing_peers(), args, env)
    if sub in ("window", "all"):
        run_timing(
            "window",
            configs.window_cases(("fwd", "bwd"), windows=windows, length=args.length, **kw),
            timing_peers(),
            args,
            env,
        )
    if sub in ("decode-mask", "all"):
        # The dense-mask kernels' decode rows (the JSON section keeps its name, "decode").
        run_timing("decode", configs.decode_cases(lengths=lengths, **kw), timing_peers(), args, env)
    if sub in ("equivalence", "all"):
        eq_peers = [p for p in all_eq if chosen is None or p in chosen]
        run_equivalence(configs.equivalence_cases(quick=args.quick, ds=ds, biases=biases), eq_peers, args, env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
