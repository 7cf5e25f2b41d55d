#!/usr/bin/env bash
# Diagnosis run on the GPU machine: build, CUDA kernel tests, Nsight Compute profiles of the
# forward and backward kernels, FlexAttention forward profile. Output under $1.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 -m pip install --no-deps --no-index -q .carry/expecttest-*.whl > /dev/null 2>&1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
s=$(date +%s)
FLEXDMA_CUDA_ARCHS=90 FLEXDMA_HEAD_DIMS=${FLEXDMA_HEAD_DIMS:-64,128} MAX_JOBS=16 \
  python3 -m pip install --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1
echo "build rc=$? in $(( $(date +%s) - s )) s"
prof() {  # name, kernel regex, skip, count, probe args...
  local name=$1 re=$2 skip=$3 cnt=$4; shift 4
  timeout 150 "$NCU" --clock-control none --set full --import-source yes -k "regex:$re" --launch-skip "$skip" \
    -c "$cnt" -f -o "$out/$name" python3 tools/kernel_probe.py "$@" > "$out/$name.ncu.log" 2>&1
  echo "ncu $name rc=$?"
  "$NCU" -i "$out/$name.ncu-rep" --page details > "$out/$name.details.txt" 2>&1
  "$NCU" -i "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/$name.sass.csv" 2>&1
  gzip -f "$out/$name.sass.csv"; rm -f "$out/$name.ncu-rep"
}
[ -n "$NCU" ] && {
  prof fwd_nomask16k fwd_kernel 1 1 nomask16k
  prof fwd_perrow32k fwd_kernel 1 1 perrow32k
  prof bwd8k "dq_kernel|dkv_kernel" 2 2 bwd8k
}
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_kernel.py 2>&1 | tail -8 > "$out/cuda_tests.log"
tail -3 "$out/cuda_tests.log"
CUDA_LAUNCH_BLOCKING=1 timeout 60 python3 -c "
import torch, flexdma
q=torch.randn(1,8,4,64,device='cuda',dtype=torch.bfloat16); k=torch.randn(1,8,3,64,device='cuda',dtype=torch.bfloat16)
try:
    torch.ops.flexdma.fwd(q,k,k,None,None,0.125,False,0.0,True); print('no error raised')
except Exception as e: print('raised', type(e).__name__, str(e)[:300])
" > "$out/direct_op.log" 2>&1; echo "direct op rc=$?"; cat "$out/direct_op.log" | tail -3
timeout 200 python3 tools/flex_probe.py > "$out/flex_probe.log" 2>&1; echo "flex_probe rc=$?"
grep "^==\|sum\|shapes" "$out/flex_probe.log"
