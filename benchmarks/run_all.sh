#!/usr/bin/env bash
# The benchmark suite on an H100, every section against every peer, in six calls of <= 9 minutes:
#   PART=1 bash benchmarks/run_all.sh OUTDIR [COMMIT]   # forward, decode-mask
#   PART=2 bash benchmarks/run_all.sh OUTDIR [COMMIT]   # backward, equivalence
#   PART=3 bash benchmarks/run_all.sh OUTDIR [COMMIT]   # window sweep (per-row bias)
#   PART=4 bash benchmarks/run_all.sh OUTDIR [COMMIT]   # what 1 and 2 leave out: D=64 per-key, D=64 decode
#   PART=5 bash benchmarks/run_all.sh OUTDIR [COMMIT]   # more D=64 per-key, window sweep (per-key)
#   PART=6 bash benchmarks/run_all.sh OUTDIR [COMMIT]   # the longest D=64 per-key rows, equivalence (D=128)
#   PART=7 bash benchmarks/run_all.sh OUTDIR [COMMIT]   # the kernel issue's target rows only, in one call
# OUTDIR receives one JSON per subcommand (plots are left to `python -m benchmarks report`, which
# also rewrites benchmarks/RESULTS.md once the JSON files are in benchmarks/results/) and run.log.
# COMMIT defaults to `git describe --always --dirty`; pass it where the tree has no .git.
# Env: BUILD=1 builds flexdma for sm_90 first (counted in the deadline); QUICK=1 runs the --quick
# subsets; DEADLINE_S (default 540) bounds the whole script: each section gets what is left, and
# its --budget stops it starting new cases early enough to finish the one under way.
# Sizes are chosen to fit: the full sweeps (python -m benchmarks forward, etc.) take longer.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: run_all.sh OUTDIR [COMMIT]}; mkdir -p "$out"
commit=${2:-$(git describe --always --dirty 2>/dev/null || echo nogit)}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
t0=$(date +%s); deadline=${DEADLINE_S:-540}
exec > >(tee -a "$out/run.log") 2>&1

if [ "${BUILD:-0}" = 1 ]; then
  echo "== build"
  FLEXDMA_CUDA_ARCHS=90 FLEXDMA_HEAD_DIMS=64,128 MAX_JOBS=${MAX_JOBS:-16} timeout 360 \
    $PY -m pip install --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1
  echo "build rc=$? in $(( $(date +%s) - t0 )) s"
fi
$PY -c "import torch, flexdma; print(torch.cuda.get_device_name(), 'flexdma backends:', flexdma.available_backends())"

# section CAP_S ARGS...: run one subcommand with at most CAP_S seconds (less if the deadline is near)
section() {
  local cap=$1; shift
  local left=$(( deadline - ($(date +%s) - t0) ))
  local t=$(( cap < left ? cap : left ))
  if [ "$t" -lt 20 ]; then echo "== skip $1: deadline"; return; fi
  local s=$(date +%s)
  echo "== $* (timeout ${t} s)"
  timeout "$t" $PY -m benchmarks "$@" --out "$out" --commit "$commit" --no-plots --budget $(( t > 50 ? t - 35 : t / 2 ))
  echo "== $1 rc=$? in $(( $(date +%s) - s )) s"
}

if [ "${QUICK:-0}" = 1 ]; then
  section 150 forward --quick --lengths 1024,4096,16384,32768
  section 60 decode-mask --quick
  section 100 backward --quick
  section 80 window --quick
  section 80 equivalence --quick --d 128
else
  # The seed's tables: every power of two from 256 to 32K (training) and to 512K (decode), both
  # head dims, both bias kinds; the window sweep at 32K in x4 steps (D=128, both bias kinds).
  LENGTHS=256,512,1024,2048,4096,8192,16384,32768
  case "${PART:-1}" in
    1)  # ~450 s: two FlexAttention peers compile each shape (2-30 s); then one query against 256 .. 512K keys
      section 300 forward --lengths $LENGTHS --d 128,64
      section 170 decode-mask --d 128,64 --lengths 256,512,1024,2048,4096,8192,16384,32768,65536,131072,262144,524288 ;;
    2)  # ~300 s: sdpa's backward is skipped above 16K (LIMITS: ~75 ms a call)
      section 330 backward --lengths $LENGTHS --d 128,64
      section 80 equivalence --quick ;;
    3)  # ~15 s a window at 32K (forward + backward, every peer)
      section 260 window --d 128 --bias per-row --windows 32,128,512,2048,8192,32768 ;;
    4)  # what parts 1 and 2 leave out within their budgets (the report merges a subcommand's
        # files of one commit): the D=64 per-key training rows and the D=64 decode rows
      section 110 forward --lengths 2048,4096,8192,16384,32768 --d 64 --bias per-key
      section 150 backward --lengths 1024,2048,4096,8192,16384,32768 --d 64 --bias per-key
      section 150 decode-mask --d 64 --lengths 256,512,1024,2048,4096,8192,16384,32768,65536,131072,262144,524288 ;;
    5)  # more of the D=64 per-key rows (each case compiles two FlexAttention peers: 30-60 s),
        # the window sweep with a per-key bias
      section 120 forward --lengths 8192,16384,32768 --d 64 --bias per-key
      section 200 window --d 128 --bias per-key --windows 32,128,512,2048,8192,32768 ;;
    6)  # the longest D=64 per-key rows, and the equivalence cases part 2 leaves out (D=128, odd
        # lengths, decoding)
      section 100 forward --lengths 32768 --d 64 --bias per-key
      section 220 backward --lengths 16384,32768 --d 64 --bias per-key
      section 200 equivalence --d 128 ;;
    7)  # the kernel issue's target table and nothing else, so that it fits one call: the 32K
        # training rows (W=1024, both bias kinds, D=128 and 64) forward and backward, decoding up
        # to 512K keys, the per-key W=2048 rows and their block-sparse W=32 counterpart; the
        # peers the table names (our FlexAttention backend and `auto` would only add compiles)
      P=--peers=flexdma-cuda,sdpa,flexattn,dense
      section 150 forward --lengths 32768 --d 128,64 $P
      section 130 backward --lengths 32768 --d 128,64 $P
      section 70 decode-mask --d 128,64 --lengths 4096,65536,524288 $P
      section 130 window --d 128 --bias per-key --windows 32,2048 $P ;;
  esac
fi
echo "== total $(( $(date +%s) - t0 )) s; files:"; ls -la "$out"
