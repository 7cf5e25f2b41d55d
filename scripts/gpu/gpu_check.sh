#!/usr/bin/env bash
# One GPU-machine check of the CUDA kernels: build (sm_90, FLEXDMA_HEAD_DIMS), kernel tests,
# timings of the target shapes, an optional Nsight Compute profile of the forward. Everything
# ends up in $1/check.tgz plus a summary on stdout (the machine returns at most a few files).
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/pick_cxx.sh
out=$1; w=$(mktemp -d); mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 -m pip install --no-deps --no-index -q .carry/expecttest-*.whl > /dev/null 2>&1
s=$(date +%s)
FLEXDMA_CUDA_ARCHS=90 FLEXDMA_HEAD_DIMS=${FLEXDMA_HEAD_DIMS:-64,128} MAX_JOBS=16 \
  python3 -m pip install --no-build-isolation --no-deps -e . > "$w/build.log" 2>&1
echo "build rc=$? in $(( $(date +%s) - s )) s"
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/dense/test_cuda_kernel.py} 2>&1 > "$w/tests.log"
tail -4 "$w/tests.log"; grep -E "^FAILED|Error" "$w/tests.log" | head -20
timeout 200 python3 scripts/dev/cuda_dev.py --out "$w/dev.json" > "$w/dev.log" 2>&1; echo "cuda_dev rc=$?"; tail -14 "$w/dev.log"
if [ -n "${NCU_CASE:-}" ]; then
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  timeout 150 "$NCU" --clock-control none --set full --import-source yes -k regex:fwd_kernel --launch-skip 1 -c 1 \
    -f -o "$w/fwd" python3 scripts/gpu/kernel_probe.py $NCU_CASE > "$w/ncu.log" 2>&1
  "$NCU" -i "$w/fwd.ncu-rep" --page details > "$w/fwd.details.txt" 2>&1
  "$NCU" -i "$w/fwd.ncu-rep" --page source --csv --print-source sass > "$w/fwd.sass.csv" 2>&1; rm -f "$w/fwd.ncu-rep"
  grep -E "Duration|Issued Instructions  |Issue Slots Busy|Registers Per|Warp Cycles Per Issued" "$w/fwd.details.txt"
fi
if [ -n "${EXTRA:-}" ]; then bash -c "$EXTRA" > "$w/extra.log" 2>&1; echo "extra rc=$?"; tail -40 "$w/extra.log"; fi
tar czf "$out/check.tgz" -C "$w" .
