"""Where the per-key kernels' warps wait, from Nsight Compute's warp-state samples.

python -m scripts.dev.ncu_samples calls B L H KVH D PLANES
    the selection, forward and backward of one per-key training call, twice (for
    `ncu --set full --import-source yes -k regex:<kernel> --launch-skip 1 -c 1`).
python -m scripts.dev.ncu_samples regions SOURCE.csv ...
    a summary of `ncu -i REPORT --page source --csv --print-source sass`: the samples of the
    kernel's roles (the instructions before the first setmaxnreg, the computing warpgroups' after
    its increase, the loader's after its decrease), their stall reasons, and the computing warps'
    samples by kind of instruction (a branch right after an mbarrier try-wait is that wait's loop).
"""

from __future__ import annotations

import collections
import csv
import math
import re
import sys


def calls(B: int, L: int, H: int, KVH: int, D: int, planes: int) -> None:
    import torch

    from scripts.dev.perkey_dev import _bwd, _fwd, _inputs, _route, _select

    torch.manual_seed(0)
    q, k, v, bias = _inputs(B, L, H, KVH, D, planes)
    do = torch.randn_like(q)
    scale = 1 / math.sqrt(D)
    r = _route(q, k, v, bias, 2048, True)
    for _ in range(2):
        sel = _select(q, bias, 2048, True, r)
        out, lse, resid = _fwd(r, q, k, v, bias, sel, scale, True)
        _bwd(r, do, q, k, v, bias, sel, out, lse, resid, scale, True)
    torch.cuda.synchronize()


def _op(src: str) -> str:
    s = re.sub(r"^@!?U?P\w+\s+", "", src.strip())
    return s.split()[0] if s else ""


_MATH = ("MUFU", "FMNMX", "FFMA", "FADD", "FMUL", "FSEL", "FSETP")
_MEM = ("LDS", "LDSM", "STS", "STSM", "STG", "LDG", "REDG")


def _kind(op: str, prev: str) -> str:
    base = op.split(".")[0]
    if op.startswith("SYNCS.PHASECHK") or (base == "BRA" and "SYNCS.PHASECHK" in prev):
        return "mbarrier waits"
    if base == "HGMMA":
        return "wgmma issue"
    if op.startswith("WARPGROUP.DEPBAR"):
        return "wgmma waits"
    if base in _MATH:
        return "score / softmax math"
    if base in _MEM:
        return "shared / global loads, stores, reductions"
    if base in ("BAR", "SHFL", "VOTE", "VOTEU") or op.startswith("SYNCS.ARRIVE"):
        return "barriers, shuffles, votes"
    return "integer, uniform, branches"


def regions(path: str) -> None:
    rows = list(csv.reader(open(path)))
    head, body = rows[1], rows[2:]
    col = {c: i for i, c in enumerate(head)}
    stalls = [c for c in head if c.startswith("stall_") and "(Not Issued)" not in c]
    role, prev = "prologue", ""
    by_role: dict = collections.defaultdict(lambda: [0, collections.Counter(), collections.Counter()])
    for r in body:
        src, n = r[col["Source"]], int(r[col["# Samples"]])
        if "USETMAXREG.TRY_ALLOC" in src:
            role = "computing warpgroups"
        elif "USETMAXREG.DEALLOC" in src:
            role = "loader"
        acc = by_role[role]
        acc[0] += n
        for c in stalls:
            acc[1][c[6:]] += int(r[col[c]])
        if role == "computing warpgroups":
            acc[2][_kind(_op(src), prev)] += n
        prev = src
    total = sum(a[0] for a in by_role.values())
    print(f"{path}: {total} samples")
    for role, (n, st, kinds) in by_role.items():
        if not n:
            continue
        print(f"  {role}: {100 * n / total:.0f}% of the samples")
        print("    stalls: " + ", ".join(f"{k} {100 * v / n:.0f}%" for k, v in st.most_common(8)))
        if kinds:
            print("    by instruction: " + ", ".join(f"{k} {100 * v / n:.0f}%" for k, v in kinds.most_common()))


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("calls", "regions"):
        raise SystemExit(__doc__)
    if sys.argv[1] == "calls":
        calls(*map(int, sys.argv[2:8]))
    else:
        for p in sys.argv[2:]:
            regions(p)
