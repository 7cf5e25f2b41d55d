#!/usr/bin/env bash
# The GPU machine's part of the project's checks, in parts that each fit one 10-minute call:
#   bash scripts/gpu/gpu_suite.sh tests OUTDIR          # self-check, GPU tests of the API, compile, correctness (CUDA), kernels
#   bash scripts/gpu/gpu_suite.sh tests2 OUTDIR         # the other GPU tests (flex, HF, MQAR, ops, correctness on
#                                                 # FlexAttention)
#   bash scripts/gpu/gpu_suite.sh perkey OUTDIR         # the per-key path's (its ops, cache steps, nn, Doge, masks), the
#                                                 # non-finite inputs' and packed sequences' GPU tests (XDIST=10
#                                                 # fits one call; the interpreter tests are CPU tests)
#   bash scripts/gpu/gpu_suite.sh aoti OUTDIR           # AOTInductor (its own process: a crash takes nothing else)
#   bash scripts/gpu/gpu_suite.sh sanitizer OUTDIR      # compute-sanitizer (memcheck, racecheck) on small calls
#   bash scripts/gpu/gpu_suite.sh ncu OUTDIR            # Nsight Compute on per-key kernels (NCU_KERNELS, default select_kernel)
#                                                 # at NCU_LENGTHS (default 32768 131072), head dim NCU_D (128),
#                                                 # NCU_SHAPE "B H KVH PLANES" (default "1 2 1 1"): ncu.txt
#   bash scripts/gpu/gpu_suite.sh flexcheck OUTDIR      # the FlexAttention path's check (scripts/dev/flex_check.py)
#   bash scripts/gpu/gpu_suite.sh checks OUTDIR         # sanitizer + flexcheck
#   bash scripts/gpu/gpu_suite.sh cudadev OUTDIR        # scripts/dev/cuda_dev.py: the target shapes, kernel split
#   bash scripts/gpu/gpu_suite.sh selbench OUTDIR       # scripts/dev/select_bench.py: the per-key selection alone
#   bash scripts/gpu/gpu_suite.sh hostparts OUTDIR      # scripts/dev/host_parts.py 8192 and host_small.py (cuda), three
#                                                 # processes each: the eager call's host time and its parts
#   bash scripts/gpu/gpu_suite.sh perkeybench OUTDIR      # python -m benchmarks perkey (PEERS: its --peers; default all;
#                                                 # PERKEY_D: its --d, the head dims' rows, e.g. 64: every peer
#                                                 # fits one call a head dim, the report merges the commit's runs)
#   bash scripts/gpu/gpu_suite.sh decodebench OUTDIR    # python -m benchmarks decode
#   bash scripts/gpu/gpu_suite.sh varlenbench OUTDIR    # python -m benchmarks varlen (packed sequences; VARLEN_PEERS: its --peers)
#   bash scripts/gpu/gpu_suite.sh cachestep OUTDIR      # scripts/dev/cache_step.py 131072,524288, three processes
#   bash scripts/gpu/gpu_suite.sh dogeprofile OUTDIR    # scripts/dev/doge_decode_profile.py: a Doge decode token, profiled
#   PART=1..7 bash scripts/gpu/gpu_suite.sh bench OUTDIR # one part of the benchmark suite (run_all.sh)
#   bash scripts/gpu/gpu_suite.sh tests+sanitizer OUTDIR # parts joined by '+' run in one call, in the order
#                                                 # tests, perkey, sanitizer, ncu, cudadev, selbench, hostparts, cachestep, dogeprofile, perkeybench, decodebench, varlenbench,
#                                                 # tests2, flexcheck, bench, aoti
# Every call builds first (sm_90, setup.py's head dims unless FLEXDMA_HEAD_DIMS names some; ~95 s
# for all six); SKIP_BUILD=1 keeps the extension a warm machine's earlier call built. The pytest
# runs name every test in the log (-v: a run cut off by the call's limit still says what passed)
# and fail a test that runs past PER_TEST_S seconds (pytest-timeout; default 240), so a hang names
# itself. They run in one process unless XDIST (pytest-xdist workers) says otherwise: 8 workers on
# the one GPU ran the kernel tests ~10x slower than one process. Logs
# and JSON go under OUTDIR (a few files: the machine returns at most eight). COMMIT names the
# commit measured (the copy may have no .git).
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/pick_cxx.sh
modes=" ${1//+/ } "; out=$2; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
PY=${PYTHON:-python3}
# CALL_S (the call's limit) caps each later step's timeout by the time left, so a slow step ends
# in its own timeout and the log still gets its tally.
t0=$(date +%s)
cap() { local left=$(( ${CALL_S:-100000} - ($(date +%s) - t0) - 10 )); [ $left -lt 1 ] && left=1; echo $(( $1 < left ? $1 : left )); }
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
$PY -m pip install --no-deps --no-index -q .carry/expecttest-*.whl > /dev/null 2>&1
# pytest's log of one run appended to the suite's, with a count a cut-off run still has.
tally() { cat "$out/pytest.tmp" >> "$log"; echo "$1 rc=$2: $(grep -c ' PASSED' "$out/pytest.tmp") passed, $(grep -c ' FAILED' "$out/pytest.tmp") failed, $(grep -c ' SKIPPED' "$out/pytest.tmp") skipped" | tee -a "$log"; grep -E '^(FAILED|ERROR)|Timeout' "$out/pytest.tmp" | head -20; rm -f "$out/pytest.tmp"; }
has() { [[ "$modes" == *" $1 "* || ( "$modes" == *" checks "* && ( $1 == sanitizer || $1 == flexcheck ) ) ]]; }
xd="-n ${XDIST:-0}"; [ "${XDIST:-0}" = 0 ] && xd=""
# Each worker's CPU cases (float64 gradcheck, Inductor on the CPU) get a share of the cores: twelve
# workers of sixteen threads each ran such cases past the per-test limit (39d3909's log).
[ "${XDIST:-0}" != 0 ] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / XDIST > 0 ? $(nproc) / XDIST : 1 ))}
$PY -c "import pytest_timeout" 2>/dev/null && xd="$xd --timeout ${PER_TEST_S:-240}"

log=$out/gpu_$(echo "$1" | tr '+' '_').log
{ echo "commit $commit"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  echo "CXX=${CXX:-} CC=${CC:-}"; s=$(date +%s)
  if [ "${SKIP_BUILD:-0}" = 1 ] && ls flexdma/_C*.so > /dev/null 2>&1; then echo "build kept (SKIP_BUILD=1)"
  else
    FLEXDMA_CUDA_ARCHS=90 MAX_JOBS=16 \
      $PY -m pip install --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1
    echo "build rc=$? in $(( $(date +%s) - s )) s"
  fi
  readelf -d flexdma/_C*.so | grep -c "libstdc++" | sed 's/^/libstdc++ NEEDED entries: /'; } 2>&1 | tee "$log"

# CPU-only cases ran in CI; here the CUDA kernels, FlexAttention on GPU and the GPU API paths.
# In one process `tests` takes ~60 s and `tests2` ~360 s (fdb00e0): the correctness matrix's
# FlexAttention cases (75, each an Inductor compile) run with tests2. tests+tests2 fit one call with
# the build. AOTInductor runs on its own: a crash there must not take the other results with it.
if has tests; then
  timeout 120 $PY -m flexdma >> "$log" 2>&1; echo "selfcheck rc=$?" | tee -a "$log"
  timeout $(cap ${TEST_TIMEOUT:-420}) $PY -m pytest $xd -v -ra -p no:cacheprovider tests/test_api.py tests/test_benchmarks.py \
    tests/test_compile_model.py tests/dense/test_correctness.py tests/dense/test_cuda_kernel.py -k "not cpu and not aoti and not flex-" \
    --durations=12 > "$out/pytest.tmp" 2>&1
  tally "gpu tests" $?
fi
if has perkey; then
  timeout $(cap ${TEST_TIMEOUT:-540}) $PY -m pytest $xd -v -ra -p no:cacheprovider tests/perkey/test_perkey.py tests/perkey/test_perkey_ops.py \
    tests/test_nonfinite.py tests/packed/test_varlen.py tests/test_doge.py tests/test_nn.py tests/test_masks.py \
    tests/test_usage.py -k "not cpu and not interpreter" --durations=30 -o faulthandler_timeout=${FAULT_S:-120} \
    > "$out/pytest.tmp" 2>&1
  tally "gpu tests (per-key, nn, Doge, masks, non-finite, packed)" $?
fi
if has sanitizer; then
  SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  for tool in memcheck racecheck; do
    # One process for every case: forward + backward at the wgmma head dims and both dbias paths
    # (the wide ones on their two-pass dk/dv path), the forward with head pairs, and the split-key
    # decode forward.
    # SAN_CASES: a subset of kernel_probe's cases (the kernels a change touched).
    cases=${SAN_CASES:-small 64 small 128 smallkey 128 small 256 smallkey 192 pairs 128 pairs 64 decode 128 topk 64 topk 128 topkdecode 128 cachestep 128 cachestep 64}
    timeout $(cap ${SAN_TIMEOUT:-240}) "$SAN" --tool $tool --error-exitcode 9 $PY scripts/gpu/kernel_probe.py $cases > "$out/san.tmp" 2>&1
    echo "compute-sanitizer $tool ($cases) rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/san.tmp" | tail -1)" | tee -a "$log"
    cp "$out/san.tmp" "$out/san_$tool.log"
  done
  rm -f "$out/san.tmp"
fi
if has ncu; then
  # One kernel of the per-key training call (NCU_SHAPE "B H KVH PLANES", default "1 2 1 1": B=1
  # H=2 KVH=1, one selection plane; head dim NCU_D (128)) at each length: Nsight Compute's details
  # page and the warp-state samples by role.
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  d=${NCU_D:-128}; read -r nb nh nkv np <<< "${NCU_SHAPE:-1 2 1 1}"
  for L in ${NCU_LENGTHS:-32768 131072}; do
    for kern in ${NCU_KERNELS:-select_kernel}; do
      rep=$out/ncu_${kern}_$((L / 1024))k_d$d
      timeout $(cap 200) "$NCU" --clock-control none --set full --import-source yes -k regex:$kern --launch-skip 1 -c 1 \
        -f -o "$rep" $PY -m scripts.dev.ncu_samples calls $nb $L $nh $nkv $d $np > "$out/ncu.tmp" 2>&1
      echo "ncu $kern B=$nb L=$L H=$nh KVH=$nkv D=$d rc=$?" | tee -a "$log"; tail -3 "$out/ncu.tmp" >> "$log"
      { echo "## $kern B=$nb L=$L H=$nh KVH=$nkv planes=$np D=$d"; "$NCU" -i "$rep.ncu-rep" --page details; } >> "$out/ncu.txt" 2>&1
      "$NCU" -i "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.sass.csv" 2>&1
      $PY -m scripts.dev.ncu_samples regions "$rep.sass.csv" >> "$out/ncu.txt" 2>&1
      grep -E "^ *Duration|Issue Slots Busy" "$out/ncu.txt" | tail -2 | tee -a "$log"
      rm -f "$rep.ncu-rep" "$rep.sass.csv" "$out/ncu.tmp"
    done
  done
fi
if has cudadev; then
  timeout 200 $PY scripts/dev/cuda_dev.py --out "$out/cuda_dev.json" > "$out/cuda_dev.log" 2>&1
  echo "cuda_dev rc=$?" | tee -a "$log"; grep -E '^(per_|decode|nomask|sdpa)|_ms"' "$out/cuda_dev.log" | tail -24
fi
if has selbench; then
  timeout $(cap 200) $PY -m scripts.dev.select_bench --out "$out/select_bench.json" > "$out/select_bench.log" 2>&1
  echo "select_bench rc=$?" | tee -a "$log"; grep case "$out/select_bench.log" | cut -c1-240
fi
if has hostparts; then
  timeout $(cap 240) $PY -m scripts.dev.host_parts 8192 > "$out/host_parts.log" 2>&1
  echo "host_parts rc=$?" | tee -a "$log"; grep "host/wall" "$out/host_parts.log" | tee -a "$log"
  # The spread over processes is the machine's: report it, not one number.
  for r in 1 2 3; do $PY scripts/dev/host_small.py "run$r" cuda; done 2>&1 | tee -a "$log"
fi
if has cachestep; then
  # The cached decode step's host time and its parts (scripts/dev/cache_step.py), three processes.
  for r in 1 2 3; do timeout $(cap 120) $PY -m scripts.dev.cache_step 131072,524288; done > "$out/cache_step.log" 2>&1
  echo "cache_step rc=$?" | tee -a "$log"; cat "$out/cache_step.log" | tail -40
fi
if has dogeprofile; then
  timeout $(cap 400) $PY -m scripts.dev.doge_decode_profile > "$out/doge_profile.log" 2>&1
  echo "doge_decode_profile rc=$?" | tee -a "$log"; grep '^==' "$out/doge_profile.log"
fi
if has perkeybench; then
  timeout $(cap 560) $PY -m benchmarks perkey ${PEERS:+--peers $PEERS} ${PERKEY_D:+--d $PERKEY_D} --budget $(( $(cap 560) - 60 )) --commit "$commit" \
    --out "$out" > "$out/perkey_bench.log" 2>&1
  echo "benchmarks perkey rc=$?" | tee -a "$log"; grep '^|' "$out/perkey_bench.log" | head -20
fi
if has decodebench; then
  timeout $(cap 560) $PY -m benchmarks decode --budget $(( $(cap 560) - 60 )) --commit "$commit" --out "$out" \
    > "$out/decode_bench.log" 2>&1
  echo "benchmarks decode rc=$?" | tee -a "$log"; grep '^|' "$out/decode_bench.log" | head -20
fi
if has varlenbench; then
  timeout $(cap 560) $PY -m benchmarks varlen ${VARLEN_PEERS:+--peers $VARLEN_PEERS} --budget $(( $(cap 560) - 60 )) --commit "$commit" \
    --out "$out" > "$out/varlen_bench.log" 2>&1
  echo "benchmarks varlen rc=$?" | tee -a "$log"; grep -E '^(\||- )' "$out/varlen_bench.log" | head -20
fi
if has tests2; then
  timeout $(cap ${TEST2_TIMEOUT:-${TEST_TIMEOUT:-360}}) $PY -m pytest $xd -v -ra -p no:cacheprovider tests/dense/test_flex.py tests/test_hf.py \
    tests/test_mqar.py tests/dense/test_ops.py tests/dense/test_correctness.py \
    -k "not cpu and not aoti and (flex- or not test_correctness)" --durations=12 > "$out/pytest.tmp" 2>&1
  tally "gpu tests (2)" $?
fi
if has flexcheck; then
  timeout ${FLEX_TIMEOUT:-150} $PY scripts/dev/flex_check.py --out "$out/flex_check.json" > "$out/flex_check.log" 2>&1
  echo "flex_check rc=$?" | tee -a "$log"; tail -40 "$out/flex_check.log"
fi
if has bench; then
  DEADLINE_S=${DEADLINE_S:-500} bash benchmarks/run_all.sh "$out" "$commit" > /dev/null 2>&1
  tail -30 "$out/run.log"; rm -f "$out"/*.png
fi
if has aoti; then
  timeout $(cap ${AOTI_TIMEOUT:-200}) $PY -m pytest -q -ra -p no:cacheprovider tests/test_compile_model.py -k aoti >> "$log" 2>&1
  echo "aoti tests rc=$?" | tee -a "$log"
fi
# The logs name the tree's copy, the output folder and the Python install by their paths on the
# machine: kept relative (the tree as '.', the install as 'site-packages', the interpreter as
# 'python3'), they say the same.
site=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" 2>/dev/null)
exe=$($PY -c "import sys; print(sys.executable)" 2>/dev/null)
for f in "$out"/*.log "$out"/*.txt "$out"/*.json; do
  [ -f "$f" ] && sed -i -e "s#$out/##g" -e "s#$PWD#.#g" ${site:+-e "s#$site#site-packages#g"} ${exe:+-e "s#$exe#python3#g"} "$f"
done
