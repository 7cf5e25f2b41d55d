#!/usr/bin/env bash
# The GPU machine's part of the project's checks, in one call:
#   bash tools/gpu_suite.sh build-test OUTDIR   # build for sm_90 (head dims 64,128), GPU tests, self-check
#   bash tools/gpu_suite.sh bench OUTDIR        # the benchmark suite (expects the build in place)
# Logs and JSON go under OUTDIR.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=$1; out=$2; mkdir -p "$out"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
echo "commit $commit" | tee "$out/commit.txt"
if [ "$mode" = build-test ]; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
  ( time FLEXDMA_CUDA_ARCHS=90 FLEXDMA_HEAD_DIMS=${FLEXDMA_HEAD_DIMS:-64,128} MAX_JOBS=16 \
      $PY -m pip install --no-build-isolation --no-deps -e . ) > "$out/build.log" 2>&1
  echo "build rc=$?"; tail -3 "$out/build.log"
  timeout 60 $PY -m flexdma 2>&1 | tee "$out/selfcheck.log"
  timeout ${TEST_TIMEOUT:-420} $PY -m pytest -q -ra -p no:cacheprovider ${PYTEST_ARGS:-tests} 2>&1 | tee "$out/gpu_tests.log" | tail -40
fi
if [ "$mode" = bench ]; then
  timeout ${BENCH_TIMEOUT:-540} bash benchmarks/run_all.sh "$out" 2>&1 | tee "$out/bench.log" | tail -60
fi
