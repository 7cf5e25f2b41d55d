#!/usr/bin/env bash
# Forward-only CUDA check on an H100, in one call: build (sm_90a, head dims 64,128), the CUDA
# kernel tests, compute-sanitizer memcheck + racecheck on small forwards, then forward timings
# of the benchmarks/cuda_dev.py shapes (no backward timing: it takes minutes).
# Usage: bash tools/gpu_run_fwd.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_run_fwd.sh OUTDIR}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"

echo "== build"; start=$(date +%s)
FLEXDMA_CUDA_ARCHS=90 FLEXDMA_HEAD_DIMS=64,128 MAX_JOBS=16 timeout 300 \
  $PY -m pip install --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1
rc=$?; echo "build rc=$rc in $(( $(date +%s) - start )) s"
grep -E "error|spill" "$out/build.log" | head -20
[ $rc -eq 0 ] || { tail -60 "$out/build.log"; exit 1; }

echo "== tests"
timeout ${TEST_TIMEOUT:-150} $PY -m pytest -q -ra -p no:cacheprovider tests/test_cuda_kernel.py 2>&1 | tail -25

cat > "$out/sanitize_fwd.py" <<'PYEOF'
import math, torch, flexdma  # noqa: F401
torch.manual_seed(0)
B, H, KVH, Q, K = 1, 2, 1, 97, 130
dt, dev = torch.bfloat16, "cuda"
for D in (64, 128):
    q = torch.randn(B, Q, H, D, device=dev, dtype=dt); k = torch.randn(B, K, KVH, D, device=dev, dtype=dt)
    v = torch.randn(B, K, KVH, D, device=dev, dtype=dt)
    for mshape, bshape in (((1, 1, Q, K), (1, 1, Q, K)), ((1, 1, 1, K), (1, 1, 1, K)), ((1, 1, Q, K), (1, 1, Q, 1))):
        mask = torch.rand(mshape, device=dev) < 0.6; bias = torch.randn(bshape, device=dev, dtype=dt)
        torch.ops.flexdma.fwd(q, k, v, mask, bias, 1 / math.sqrt(D), True, 0.0, True)
    torch.ops.flexdma.fwd(q, k, v, None, None, 1 / math.sqrt(D), False, 0.0, True)
torch.cuda.synchronize(); print("sanitize fwd ok")
PYEOF
for tool in memcheck racecheck; do
  echo "== compute-sanitizer $tool"
  timeout ${SAN_TIMEOUT:-80} compute-sanitizer --tool $tool $PY "$out/sanitize_fwd.py" > "$out/sanitizer_$tool.log" 2>&1
  echo "$tool rc=$?"; tail -3 "$out/sanitizer_$tool.log"
done

echo "== forward timing"
cat > "$out/fwd_timing.py" <<'PYEOF'
import json, math, sys, torch
sys.path.insert(0, ".")
from benchmarks.cuda_dev import bench, top_w_mask
fwd = torch.ops.flexdma.fwd
dev, dt = "cuda", torch.bfloat16
B, H, KVH, D, L, W = 1, 2, 1, 128, 32768, 1024
scale = 1.0 / math.sqrt(D)
torch.manual_seed(0)
q = torch.randn(B, L, H, D, device=dev, dtype=dt); k = torch.randn(B, L, KVH, D, device=dev, dtype=dt)
v = torch.randn(B, L, KVH, D, device=dev, dtype=dt)
res = {"device": torch.cuda.get_device_name(), "seqlen": L, "window": W}
for name, bshape in (("per_row", (1, 1, L, L)), ("per_key", (1, 1, 1, L))):
    bias = torch.randn(bshape, device=dev, dtype=dt); mask = top_w_mask(bias, L, L, W)
    res[f"{name}_fwd_ms"] = bench(lambda: fwd(q, k, v, mask, bias, scale, True, 0.0, True)); print(res, flush=True)
    del bias, mask; torch.cuda.empty_cache()
q2, k2, v2 = (t[:, :16384].contiguous() for t in (q, k, v))
res["nomask_causal_16k_fwd_ms"] = bench(lambda: fwd(q2, k2, v2, None, None, scale, True, 0.0, True))
qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q2, k2, v2))
ks, vs = ks.expand(-1, H, -1, -1), vs.expand(-1, H, -1, -1)
res["sdpa_causal_16k_fwd_ms"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True))
print(json.dumps(res, indent=1)); json.dump(res, open(sys.argv[1], "w"), indent=1)
PYEOF
timeout ${BENCH_TIMEOUT:-120} $PY "$out/fwd_timing.py" "$out/cuda_fwd.json" 2>&1 | tail -12
