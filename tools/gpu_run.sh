#!/usr/bin/env bash
# CUDA kernel check on an H100, in one call: build (sm_90a, head dims 64,128), the CUDA kernel
# tests, compute-sanitizer memcheck + racecheck on a small forward+backward, then the dev timing.
# Usage: bash tools/gpu_run.sh OUTDIR   (logs and JSON go under OUTDIR)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_run.sh OUTDIR}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if ls .carry/*.whl >/dev/null 2>&1; then $PY -m pip install --no-deps --no-index .carry/*.whl > "$out/carry_install.log" 2>&1; fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"

echo "== build"; start=$(date +%s)
FLEXDMA_CUDA_ARCHS=90 FLEXDMA_HEAD_DIMS=64,128 MAX_JOBS=16 timeout 420 \
  $PY -m pip install --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1
rc=$?; echo "build rc=$rc in $(( $(date +%s) - start )) s" | tee "$out/build_status.txt"
grep -E "error|registers|spill" "$out/build.log" | head -40
[ $rc -eq 0 ] || { tail -60 "$out/build.log"; exit 1; }

echo "== tests"
timeout ${TEST_TIMEOUT:-300} $PY -m pytest -q -ra -p no:cacheprovider tests/test_cuda_kernel.py ${PYTEST_ARGS:-} \
  2>&1 | tee "$out/cuda_tests.log" | tail -40

cat > "$out/sanitize_case.py" <<'PYEOF'
import math, torch, flexdma  # noqa: F401
torch.manual_seed(0)
B, H, KVH, D, Q, K = 1, 2, 1, 64, 97, 130
dt, dev = torch.bfloat16, "cuda"
q = torch.randn(B, Q, H, D, device=dev, dtype=dt); k = torch.randn(B, K, KVH, D, device=dev, dtype=dt)
v = torch.randn(B, K, KVH, D, device=dev, dtype=dt); dout = torch.randn_like(q)
for mshape, bshape in (((1, 1, Q, K), (1, 1, Q, K)), ((1, 1, 1, K), (1, 1, 1, K)), ((1, 1, Q, K), (1, 1, Q, 1))):
    mask = torch.rand(mshape, device=dev) < 0.6; bias = torch.randn(bshape, device=dev, dtype=dt)
    out, lse = torch.ops.flexdma.fwd(q, k, v, mask, bias, 1 / math.sqrt(D), True, 0.0, True)
    g = torch.ops.flexdma.bwd(dout, q, k, v, mask, bias, out, lse, 1 / math.sqrt(D), True, 0.0, True, True)
torch.cuda.synchronize(); print("sanitize case ok")
PYEOF
for tool in memcheck racecheck; do
  echo "== compute-sanitizer $tool"
  timeout ${SAN_TIMEOUT:-100} compute-sanitizer --tool $tool $PY "$out/sanitize_case.py" \
    > "$out/sanitizer_$tool.log" 2>&1
  echo "$tool rc=$?"; tail -5 "$out/sanitizer_$tool.log"
done

echo "== timing"
timeout ${BENCH_TIMEOUT:-150} $PY benchmarks/cuda_dev.py --out "$out/cuda_dev.json" 2>&1 | tee "$out/cuda_dev.log" | tail -30
