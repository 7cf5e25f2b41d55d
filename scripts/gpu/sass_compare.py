"""Per-function SASS of the CUDA kernels at two revisions, compared: shows that a change to the
kernel sources (a refactor, a rename, a comment) leaves the machine code as it was, without a GPU.

    python3 scripts/gpu/sass_compare.py BASE_REV [--dims 64,128] [--dims 96] [--rename RE=REPL]

Builds every csrc/cuda/*.cu (and the head dims' instantiations/*.cu) of BASE_REV (git archive) and
of the working tree with setup.py's nvcc
flags for sm_90a (the working tree's scripts/nvcc_flags.py for both), once per head-dim set (--dims,
repeatable; default 64,128), dumps the SASS of every kernel (cuobjdump -sass), and compares
function by function under the demangled name: functions are matched across files, so moving a
kernel to another file is no difference. --rename rewrites demangled names of the base before
matching (a template argument dropped, a namespace changed): e.g.
--rename 'fwd_kernel<(.*?), 1>=fwd_kernel<\\1>'. Instruction text and encodings are compared;
addresses are not (an anonymous namespace demangles without its hash). Exit status 1 on any
difference.
nvcc and cuobjdump come from PATH (or NVCC / CUOBJDUMP); builds are cached under --cache.
"""

import argparse
import concurrent.futures
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# setup.py's flags for sm_90a (scripts/nvcc_flags.py), those of the working tree for both builds.
sys.path.insert(0, ROOT)
from scripts import nvcc_flags as NVCC_FLAGS  # noqa: E402


def tool(name):
    path = os.environ.get(name.upper()) or shutil.which(name)
    if not path:
        sys.exit(f"{name} not found (set {name.upper()})")
    return path


def export_rev(rev, dst):
    """csrc/ of a git revision into dst (a tree without a git checkout of its own)."""
    data = subprocess.run(["git", "-C", ROOT, "archive", rev, "csrc"], capture_output=True, check=True).stdout
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.seek(0)
        tarfile.open(fileobj=f).extractall(dst)


def tree_hash(root):
    h = hashlib.sha1()
    for p in sorted(glob.glob(os.path.join(root, "csrc", "**", "*"), recursive=True)):
        if os.path.isfile(p):
            h.update(os.path.relpath(p, root).encode())
            h.update(open(p, "rb").read())
    return h.hexdigest()[:16]


def build(root, dims, cache, extra):
    """{object path} of every csrc/cuda/*.cu of root and of its head dims' csrc/cuda/instantiations/*.cu,
    built for the head dims."""
    flags = NVCC_FLAGS.nvcc_flags(("90",), dims)
    key = (
        tree_hash(root)
        + "_"
        + "_".join(map(str, dims))
        + "_"
        + hashlib.sha1(" ".join(flags + extra).encode()).hexdigest()[:8]
    )
    out = os.path.join(cache, key)
    os.makedirs(out, exist_ok=True)
    # The instantiation files of the head dims where the revision has them (setup.py's choice).
    srcs = sorted(glob.glob(os.path.join(root, "csrc", "cuda", "*.cu")))
    for d in dims:
        srcs += sorted(glob.glob(os.path.join(root, "csrc", "cuda", "instantiations", f"*_hdim{d}_*.cu")))

    def one(src):
        obj = os.path.join(out, os.path.basename(src) + ".o")
        if not os.path.exists(obj):
            cmd = [tool("nvcc"), "-c", *flags, *extra, "-I", os.path.join(root, "csrc"), src, "-o", obj + ".tmp"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"nvcc {src} failed:\n{proc.stderr[-3000:]}")
            os.replace(obj + ".tmp", obj)
        return obj

    with concurrent.futures.ThreadPoolExecutor(int(os.environ.get("MAX_JOBS", "1"))) as ex:
        return list(ex.map(one, srcs))


def demangle(names):
    if not names:
        return {}
    proc = subprocess.run(
        [shutil.which("cu++filt") or "c++filt"], input="\n".join(names), capture_output=True, text=True, check=True
    )
    return dict(zip(names, proc.stdout.splitlines()))


def functions(objs):
    """{demangled name: [normalised SASS lines]} over the objects."""
    raw = {}
    for obj in objs:
        text = subprocess.run([tool("cuobjdump"), "-sass", obj], capture_output=True, text=True, check=True).stdout
        name = None
        for line in text.splitlines():
            m = re.match(r"\s*Function : (\S+)", line)
            if m:
                name = m.group(1)
                raw[name] = []
                continue
            if name is None or not line.strip():
                continue
            if line.strip().startswith(".section") or "Fatbin" in line:
                name = None
                continue
            # "/*0040*/  IMAD.MOV.U32 R5, RZ, RZ, RZ ;  /* 0x... */": drop the address, and collapse
            # the padding (cuobjdump aligns the columns to the widest address of the object).
            line = re.sub(r"^\s*/\*[0-9a-f]{4,}\*/\s*", "", line).strip()
            raw[name].append(re.sub(r"\s+", " ", line))
    names = demangle(list(raw))
    return {names[n]: body for n, body in raw.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="git revision to compare the working tree with")
    ap.add_argument("--dims", action="append", help="comma-separated head dims of one build (repeatable)")
    ap.add_argument("--rename", action="append", default=[], help="RE=REPL applied to the base's demangled names")
    ap.add_argument("--nvcc-flag", action="append", default=[], help="extra nvcc flag for both builds")
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "flexdma_sass_cache"))
    ap.add_argument("-v", "--verbose", action="store_true", help="print the first differing lines")
    a = ap.parse_args()
    renames = [tuple(r.split("=", 1)) for r in a.rename]
    dim_sets = [tuple(int(x) for x in d.split(",")) for d in (a.dims or ["64,128"])]
    base_dir = tempfile.mkdtemp(prefix="sass_base_")
    export_rev(a.base, base_dir)
    bad = 0
    for dims in dim_sets:
        old = functions(build(base_dir, dims, a.cache, a.nvcc_flag))
        new = functions(build(ROOT, dims, a.cache, a.nvcc_flag))
        for pat, repl in renames:
            old = {re.sub(pat, repl, k): v for k, v in old.items()}
        print(f"head dims {','.join(map(str, dims))}: {len(old)} functions in {a.base}, {len(new)} in the working tree")
        for name in sorted(set(old) | set(new)):
            short = re.sub(r"\(.*", "", name.replace("(anonymous namespace)", "{anon}"))
            if name not in new or name not in old:
                print(f"  {'only in base' if name in old else 'only in tree'}: {name}")
                bad += 1
            elif old[name] != new[name]:
                n_old = sum(1 for line in old[name] if not line.startswith("/*"))
                n_new = sum(1 for line in new[name] if not line.startswith("/*"))
                print(f"  DIFFERENT ({n_old} -> {n_new} instructions): {short}")
                if a.verbose:
                    for i, (x, y) in enumerate(zip(old[name], new[name])):
                        if x != y:
                            print(f"    first difference at line {i}:\n      - {x}\n      + {y}")
                            break
                bad += 1
            else:
                n = sum(1 for line in new[name] if not line.startswith("/*"))
                print(f"  identical ({n} instructions): {short}")
    shutil.rmtree(base_dir, ignore_errors=True)
    print("SASS identical" if not bad else f"{bad} functions differ or are unmatched")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
