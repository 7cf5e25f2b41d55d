#!/usr/bin/env bash
# One GPU call that compares builds of the kernels: each variant is built in place in its own copy
# of the tree (build_ext --inplace: no install, so the builds cannot overwrite each other), all
# at once; then each is timed alone on the GPU, one after the other (scripts/dev/cuda_dev.py);
# then their tests run side by side. Logs and JSON go into OUTDIR/variants.tgz (re-packed after
# every phase, so a call cut off at its limit still returns what finished) and a table is printed.
#   VARIANTS  ';'-separated "name|head dims|nvcc flags|cuda_dev parts|pytest args" (an empty
#             parts or pytest field skips that phase for the variant), e.g.
#             "base|64,128||fwd,bwd|tests/dense/test_cuda_kernel.py;exp|64,128|-DFLEXDMA_EXP_X|bwd|"
#   EXTRA     optional: a command run last, in the first variant's tree (its build imported); $W
#             is the folder packed into variants.tgz; EXTRA_S: seconds the tests leave it
#   DEADLINE_S  seconds for the whole script (default 570); the tests get what the timings leave
# Usage: COMMIT=<sha> VARIANTS="..." bash scripts/gpu/variants_check.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/pick_cxx.sh
out=$1; w=$(mktemp -d); mkdir -p "$out"
t0=$(date +%s); deadline=${DEADLINE_S:-570}
left() { echo $(( deadline - ($(date +%s) - t0) )); }
pack() { tar czf "$out/variants.tgz" -C "$w" . 2>/dev/null; }
export PYTHONUNBUFFERED=1
python3 -m pip install --no-deps --no-index -q .carry/expecttest-*.whl > /dev/null 2>&1
# The specs, parsed once into parallel arrays indexed like `names`.
IFS=';' read -ra specs <<< "${VARIANTS:?VARIANTS is required}"
names=(); dims=(); flags=(); parts=(); tests=()
for spec in "${specs[@]}"; do
  IFS='|' read -r a b c d e <<< "$spec"
  names+=("$a"); dims+=("$b"); flags+=("$c"); parts+=("$d"); tests+=("$e")
done
n=${#names[@]}
jobs=$(( 16 / n > 2 ? 16 / n : 2 ))
echo "commit ${COMMIT:-unknown}; $n variants; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"

for i in "${!names[@]}"; do
  name=${names[$i]}
  d=/tmp/variant_$name; rm -rf "$d"; mkdir -p "$d"
  tar cf - --exclude=./.git --exclude=./build . | tar xf - -C "$d"
  ( cd "$d" && s=$(date +%s) &&
    FLEXDMA_CUDA_ARCHS=90 FLEXDMA_HEAD_DIMS=${dims[$i]} MAX_JOBS=$jobs FLEXDMA_NVCC_FLAGS="${flags[$i]}" \
      timeout 300 python3 setup.py build_ext --inplace > "$w/build_$name.log" 2>&1
    echo "build $name rc=$? in $(( $(date +%s) - s )) s" ) &
done
wait
pack

# Timings: alone on the GPU, in the order given.
for i in "${!names[@]}"; do
  name=${names[$i]}
  [ -z "${parts[$i]}" ] && continue
  t=$(( $(left) - 60 )); [ "$t" -gt 150 ] && t=150
  if [ "$t" -lt 20 ]; then echo "cuda_dev $name: skipped (deadline)"; continue; fi
  ( cd /tmp/variant_$name && PYTHONPATH=. timeout $t python3 scripts/dev/cuda_dev.py --parts "${parts[$i]}" \
      --out "$w/cuda_dev_$name.json" > "$w/cuda_dev_$name.log" 2>&1 )
  echo "cuda_dev $name (${parts[$i]}) rc=$?"
done
pack

# Tests: every variant's at once (small shapes; the GPU has room), each bounded by the deadline.
t=$(( $(left) - ${EXTRA_S:-0} - 15 ))
if [ "$t" -ge 30 ]; then
  for i in "${!names[@]}"; do
    name=${names[$i]}
    [ -z "${tests[$i]}" ] && continue
    ( cd /tmp/variant_$name && PYTHONPATH=. timeout $t bash -c "python3 -m pytest -q -ra -p no:cacheprovider ${tests[$i]}" \
        > "$w/tests_$name.log" 2>&1
      echo "tests $name rc=$? $(tail -1 "$w/tests_$name.log")"; grep -E "^FAILED|^ERROR" "$w/tests_$name.log" | head -10 ) &
  done
  wait
else
  echo "tests: skipped (deadline)"
fi
pack

if [ -n "${EXTRA:-}" ]; then
  t=$(( $(left) - 10 ))
  if [ "$t" -ge 20 ]; then
    ( cd /tmp/variant_${names[0]} && PYTHONPATH=. COMMIT=${COMMIT:-unknown} W=$w timeout $t bash -c "$EXTRA" \
        > "$w/extra.log" 2>&1; echo "extra rc=$?"; tail -30 "$w/extra.log" )
  else
    echo "extra: skipped (deadline)"
  fi
  pack
fi

python3 - "$w" "${names[@]}" <<'PY'
import json, os, sys
w, names = sys.argv[1], sys.argv[2:]
runs = {n: json.load(open(f"{w}/cuda_dev_{n}.json")) for n in names if os.path.exists(f"{w}/cuda_dev_{n}.json")}
keys = sorted({k for r in runs.values() for k, v in r.items() if isinstance(v, float)})
base = names[0]
print(f"{'ms':32s}" + "".join(f"{n:>14s}" for n in runs))
for k in keys:
    row = f"{k:32s}"
    for n, r in runs.items():
        v = r.get(k)
        b = runs.get(base, {}).get(k)
        row += f"{'-':>14s}" if v is None else (f"{v:8.3f} {100 * (v / b - 1):+4.0f}%" if b and n != base else f"{v:14.3f}")
    print(row)
for n, r in runs.items():  # the kernels' split of the backward
    for c in ("per_row", "per_key"):
        ks = r.get(f"{c}_kernels_ms", {})
        print(n, c, {k.split("<")[0].split("::")[-1].split("(")[0] + "/" + str(i): round(v, 3)
                     for i, (k, v) in enumerate(sorted(ks.items(), key=lambda kv: -kv[1])) if v > 0.01})
PY
echo "total $(( $(date +%s) - t0 )) s"
