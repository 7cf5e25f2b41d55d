#!/usr/bin/env bash
# The GPU machine's part of the project's checks:
#   bash tools/gpu_suite.sh build-test OUTDIR   # build for sm_90 (head dims 64,128), self-check, GPU tests, flex check
#   bash tools/gpu_suite.sh bench OUTDIR        # the benchmark suite (expects the build in place)
# Logs and JSON go under OUTDIR. COMMIT names the commit measured (the copy may have no .git).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=$1; out=$2; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
PY=${PYTHON:-python3}
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [ "$mode" = build-test ]; then
  { echo "commit $commit"; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; } > "$out/env.txt"
  s=$(date +%s)
  FLEXDMA_CUDA_ARCHS=90 FLEXDMA_HEAD_DIMS=${FLEXDMA_HEAD_DIMS:-64,128} MAX_JOBS=16 \
    $PY -m pip install --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1
  echo "build rc=$? in $(( $(date +%s) - s )) s" | tee -a "$out/env.txt"
  timeout 120 $PY -m flexdma 2>&1 | tee "$out/selfcheck.log"
  # CPU-only cases ran in CI; here the CUDA kernel, FlexAttention on GPU and GPU API paths.
  timeout ${TEST_TIMEOUT:-330} $PY -m pytest -q -ra -p no:cacheprovider tests -k "not cpu" 2>&1 \
    | tee "$out/gpu_tests.log" | tail -25
  timeout ${FLEX_TIMEOUT:-120} $PY benchmarks/flex_check.py --out "$out/flex_check.json" > "$out/flex_check.log" 2>&1
  echo "flex_check rc=$?"; tail -15 "$out/flex_check.log"
fi
if [ "$mode" = bench ]; then
  DEADLINE_S=${DEADLINE_S:-540} bash benchmarks/run_all.sh "$out" "$commit"
fi
