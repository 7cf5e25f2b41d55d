#!/usr/bin/env bash
# GPU check of the staged kernel experiments (FLEXDMA_EXP_*, benchmarks/NOTES.md session 7) in one
# call: a build with the flags in EXP_FLAGS (default: all four; head dims 64,128), its kernel tests
# and cuda_dev timings, then a default build's cuda_dev timings on the same machine.
# Usage: COMMIT=<sha> bash tools/exp_check.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/pick_cxx.sh
out=$1; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
flags=${EXP_FLAGS:--DFLEXDMA_EXP_DBIAS_VEC -DFLEXDMA_EXP_DQ_PREFETCH -DFLEXDMA_EXP_DKV_REUSE -DFLEXDMA_EXP_FWD_PAIR}
python3 -m pip install --no-deps --no-index -q .carry/expecttest-*.whl > /dev/null 2>&1
build() {
  local s=$(date +%s)
  FLEXDMA_CUDA_ARCHS=90 FLEXDMA_HEAD_DIMS=64,128 MAX_JOBS=16 FLEXDMA_NVCC_FLAGS="$1" \
    python3 -m pip install --no-build-isolation --no-deps -e . > "$out/build_$2.log" 2>&1
  echo "build $2 rc=$? in $(( $(date +%s) - s )) s"
}
# The experiments go first: if the call runs out of time, their tests and timings are what must
# have come back (session 6's cuda_dev JSON is the fallback baseline).
{ echo "commit ${COMMIT:-unknown}; experiment flags: $flags"
  build "$flags" exp
  timeout ${TEST_TIMEOUT:-180} python3 -m pytest -q -ra -p no:cacheprovider tests/test_cuda_kernel.py \
    > "$out/tests_exp.log" 2>&1
  echo "kernel tests (exp) rc=$?"; tail -2 "$out/tests_exp.log"; grep -E "^FAILED" "$out/tests_exp.log" | head -20
  timeout 150 python3 benchmarks/cuda_dev.py --out "$out/cuda_dev_exp.json" > "$out/cuda_dev_exp.log" 2>&1
  echo "cuda_dev exp rc=$?"
  build "" base
  timeout 150 python3 benchmarks/cuda_dev.py --out "$out/cuda_dev_base.json" > "$out/cuda_dev_base.log" 2>&1
  echo "cuda_dev base rc=$?"
  python3 - "$out" <<'PY'
import json, sys
d = sys.argv[1]
a, b = (json.load(open(f"{d}/cuda_dev_{k}.json")) for k in ("base", "exp"))
for k in sorted(a):
    if isinstance(a[k], float) and k in b:
        print(f"{k:32s} base {a[k]:8.3f}  exp {b[k]:8.3f}  {100 * (b[k] / a[k] - 1):+6.1f}%")
PY
} 2>&1 | tee "$out/exp_check.log"
