#!/usr/bin/env bash
# One GPU call that completes a run of the target rows the suite's part 7 left out (decode at
# 512K keys, the D=64 forward rows, the per-key window rows), plus compute-sanitizer on small
# forward / backward / decode calls and the quick kernel timings. OUTDIR gets the JSON and logs.
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/pick_cxx.sh
out=$1; commit=${2:-unknown}; mkdir -p "$out"/w
export PYTHONUNBUFFERED=1 PYTHONPATH=.
FLEXDMA_CUDA_ARCHS=90 FLEXDMA_HEAD_DIMS=64,128 MAX_JOBS=16 python3 -m pip install --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1
echo "build rc=$?"
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer | head -1)
for t in memcheck racecheck; do
  timeout 120 "$SAN" --tool $t --error-exitcode 9 python3 tools/kernel_probe.py small 64 small 128 smallkey 128 decode 128 > "$out/san.tmp" 2>&1
  echo "compute-sanitizer $t rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/san.tmp" | tail -1)"
done | tee "$out/sanitizer.log"
rm -f "$out/san.tmp"
b() { timeout "$1" python3 -m benchmarks "${@:3}" --out "$2" --commit "$commit" --no-plots --budget $(( $1 - 20 )) >> "$out/bench.log" 2>&1; echo "$3 rc=$?"; }
b 60 "$out" decode --d 128,64 --lengths 524288
b 90 "$out/w" window --d 128 --bias per-key --windows 32,2048
b 150 "$out" forward --lengths 32768 --d 64
timeout 120 python3 benchmarks/cuda_dev.py --out "$out/cuda_dev.json" > "$out/cuda_dev.log" 2>&1; echo "cuda_dev rc=$?"
grep -E "^per_|nomask_causal|decode_524288" "$out/cuda_dev.log"
