#!/usr/bin/env bash
# GPU check of the wide head dims (192 / 256): build with them, their kernel tests, sanitizer on
# small calls, forward / backward timings at 8K against the peers. Logs and JSON under $OUT.
set -uo pipefail
. tools/pick_cxx.sh
export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 -m pip install --no-deps --no-index -q .carry/expecttest-*.whl > /dev/null 2>&1
s=$(date +%s)
FLEXDMA_CUDA_ARCHS=90 FLEXDMA_HEAD_DIMS=64,128,192,256 MAX_JOBS=16 python3 -m pip install --no-build-isolation --no-deps -e . > $OUT/build.log 2>&1
echo "build rc=$? in $(( $(date +%s) - s )) s"; grep -E "spill|error" $OUT/build.log | grep -v " 0 bytes spill" | head
timeout 240 python3 -m pytest -q -ra -p no:cacheprovider tests/test_cuda_kernel.py -k "192 or 256 or determin" > $OUT/tests.log 2>&1
echo "tests rc=$?"; tail -3 $OUT/tests.log; grep -E "^FAILED|^ERROR" $OUT/tests.log | head -20
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
for tool in memcheck racecheck; do
  timeout 100 $SAN --tool $tool --error-exitcode 9 python3 tools/kernel_probe.py small 256 smallkey 192 decode 256 > $OUT/san_$tool.log 2>&1
  echo "sanitizer $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $OUT/san_$tool.log | tail -1)"
done
timeout 150 python3 -m benchmarks forward --d 256,192 --lengths 8192 --peers flexdma-cuda,flexattn,sdpa,dense --out $OUT --commit ${COMMIT} --no-plots > $OUT/bench_fwd.log 2>&1; echo "bench fwd rc=$?"; tail -12 $OUT/bench_fwd.log
timeout 150 python3 -m benchmarks backward --d 256,192 --lengths 8192 --peers flexdma-cuda,flexattn,dense --out $OUT --commit ${COMMIT} --no-plots > $OUT/bench_bwd.log 2>&1; echo "bench bwd rc=$?"; tail -12 $OUT/bench_bwd.log
