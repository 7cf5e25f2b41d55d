#!/usr/bin/env bash
# The wheel of README's Install, checked on the GPU machine: build it (sm_90a; head dims
# FLEXDMA_HEAD_DIMS, default 64,128 to save time), check what it holds, install it into a fresh
# folder of its own, ahead of the machine's torch on the path, and run the GPU
# smoke tests there with no nvcc on PATH, against the installed wheel, not the source tree:
# `python -m flexdma` and a few GPU tests (TESTS: pytest arguments relative to tests/).
#   bash scripts/gpu/wheel_check.sh OUTDIR     # summary on stdout, OUTDIR/wheel_check.log, build log
# Exit status 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/pick_cxx.sh
out=${1:?usage: bash scripts/gpu/wheel_check.sh OUTDIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)
log=$out/wheel_check.log
PY=${PYTHON:-python3}
w=$(mktemp -d)
export PYTHONUNBUFFERED=1
TESTS=${TESTS:-"dense/test_cuda_kernel.py
perkey/test_perkey.py -k test_cuda_head_dims_match_reference
packed/test_varlen.py -k test_cuda_packed_kernels_equal_documents or test_cuda_dense_packed_kernels_equal_documents"}
failed=0
say() { echo "$*" | tee -a "$log"; }
check() { if [ "$2" = 0 ]; then say "ok   $1"; else say "FAIL $1 (rc=$2)"; failed=1; fi; }

: > "$log"
say "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
say "$($PY -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")')"
say "CXX=${CXX:-} CC=${CC:-} nvcc: $(command -v nvcc) ($(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*'))"

# 1. The wheel, with README's command (switches as README gives them).
s=$(date +%s)
FLEXDMA_CUDA_ARCHS=90 FLEXDMA_HEAD_DIMS=${FLEXDMA_HEAD_DIMS:-64,128} MAX_JOBS=${MAX_JOBS:-16} \
  timeout 480 $PY -m pip wheel --no-build-isolation --no-deps --no-index -w "$w/dist" . > "$out/wheel_build.log" 2>&1
rc=$?
check "build the wheel ($(( $(date +%s) - s )) s; log: wheel_build.log)" $rc
[ $rc = 0 ] || { tail -30 "$out/wheel_build.log"; exit 1; }
whl=$(ls "$w"/dist/flexdma-*.whl)
say "wheel: $(basename "$whl"), $(du -h "$whl" | cut -f1)"

# 2. What it holds: the package's modules as the source tree has them (no stale or missing one), the
# extension and its build record, and nothing else (no tests/, benchmarks/, scripts/).
$PY - "$whl" >> "$log" 2>&1 <<'EOF'
import pathlib, sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
print("  top level:", sorted({n.split("/")[0] for n in names}))
mods = {n for n in names if n.endswith(".py")}
src = {p.as_posix() for p in pathlib.Path("flexdma").rglob("*.py")}
so = [n for n in names if n.startswith("flexdma/_C") and n.endswith(".so")]
other = [n for n in names if not n.startswith(("flexdma/", "flexdma-"))]
print(f"  {len(mods)} modules, extension {so}")
problems = {"outside the package": other, "not in the source tree": sorted(mods - src),
            "missing": sorted(src - mods), "no extension": [] if len(so) == 1 else ["flexdma/_C*.so"]}
for what, found in problems.items():
    if found:
        print(f"  {what}: {found}")
sys.exit(any(problems.values()))
EOF
check "the wheel holds the package, its extension and nothing else" $?

# 3. A fresh folder of its own for the wheel, ahead of the machine's packages (torch, pytest) on
# the path: a venv does not see a torch the machine provides through PYTHONPATH.
$PY -m pip install -q --no-index --no-deps --target "$w/site" "$whl" >> "$log" 2>&1
check "install the wheel into a fresh folder (pip install --target)" $?
VPY=$PY

# 4. The smoke tests: nvcc (and the CUDA toolkit's folder) off PATH, run from a folder that holds
# copies of the tests only, so `import flexdma` can find nothing but the installed wheel.
path=$(echo "$PATH" | tr ':' '\n' | while read -r d; do [ -n "$d" ] && [ ! -x "$d/nvcc" ] && echo "$d"; done | paste -sd:)
mkdir -p "$w/run/tests" && cp -r tests/conftest.py tests/utils.py tests/test_*.py tests/dense tests/perkey tests/packed "$w/run/tests/"
cd "$w/run"
run() { env -u CUDA_HOME -u CUDA_PATH PYTHONPATH="$w/site${PYTHONPATH:+:$PYTHONPATH}" PATH="$path" "$@"; }
run sh -c '! command -v nvcc' > /dev/null
check "no nvcc on the tests' PATH" $?
run "$VPY" -c "import flexdma, os, sys; sys.exit(not os.path.realpath(flexdma.__file__).startswith(os.path.realpath('$w/site') + os.sep))"
check "flexdma imports from the installed wheel ($(run "$VPY" -c 'import flexdma; print(flexdma.__file__)' 2>/dev/null))" $?
run "$VPY" -W error -c "import flexdma" >> "$log" 2>&1
check "import flexdma without a warning (python -W error)" $?
run timeout 120 "$VPY" -m flexdma >> "$log" 2>&1
check "python -m flexdma (build report and self-check, in the log)" $?
while read -r t; do
  [ -n "$t" ] || continue
  file=${t%% *}; args=${t#"$file"}; k=${args#*-k }
  if [ "$k" != "$args" ]; then set -- -k "$k"; else set --; fi
  # No pyproject.toml here: the gpu marker is registered on the command line.
  run timeout 300 "$VPY" -m pytest -q -ra -p no:cacheprovider -o "markers=gpu: needs a CUDA device" \
    "tests/$file" "$@" < /dev/null > "$w/pytest.log" 2>&1
  rc=$?
  cat "$w/pytest.log" >> "$log"
  # A run whose every test skipped (nothing built for the device) is no smoke test.
  passed=$(grep -Eo '[0-9]+ passed' "$w/pytest.log" | tail -1)
  [ $rc = 0 ] && [ -z "$passed" ] && rc=5
  check "pytest tests/$t: $(tail -1 "$w/pytest.log")" $rc
done <<< "$TESTS"

cd - > /dev/null
rm -rf "$w"
say "$([ $failed = 0 ] && echo 'wheel check passed' || echo 'wheel check FAILED')"
exit $failed
