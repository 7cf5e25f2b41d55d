#!/usr/bin/env bash
# GPU check of the wide head dims (192 / 256): build with them, their kernel tests and the
# deterministic-backward test, compute-sanitizer on small calls, forward / backward timings at 8K
# against the peers. Usage: COMMIT=<sha> bash tools/wide_check.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/pick_cxx.sh
out=$1; mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 -m pip install --no-deps --no-index -q .carry/expecttest-*.whl > /dev/null 2>&1
{ s=$(date +%s)
  FLEXDMA_CUDA_ARCHS=90 FLEXDMA_HEAD_DIMS=64,128,192,256 MAX_JOBS=16 \
    python3 -m pip install --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1
  echo "build rc=$? in $(( $(date +%s) - s )) s"
  timeout 240 python3 -m pytest -q -ra -p no:cacheprovider tests/test_cuda_kernel.py -k "192 or 256 or determin" \
    > "$out/tests.log" 2>&1
  echo "tests rc=$?"; tail -3 "$out/tests.log"; grep -E "^FAILED|^ERROR" "$out/tests.log" | head -20
  SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  for tool in memcheck racecheck; do
    timeout 100 "$SAN" --tool $tool --error-exitcode 9 python3 tools/kernel_probe.py small 256 smallkey 192 decode 256 \
      > "$out/san_$tool.log" 2>&1
    echo "sanitizer $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/san_$tool.log" | tail -1)"
  done
  for sub in forward backward; do
    timeout 150 python3 -m benchmarks $sub --d 256,192 --lengths 8192 --peers flexdma-cuda,flexattn,dense \
      --out "$out" --commit "${COMMIT:-unknown}" --no-plots > "$out/bench_$sub.log" 2>&1
    echo "bench $sub rc=$?"; tail -8 "$out/bench_$sub.log"
  done
} 2>&1 | tee "$out/wide_check.log"
