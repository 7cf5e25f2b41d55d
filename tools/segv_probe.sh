#!/usr/bin/env bash
# Backtrace of the crash seen when a direct op call fails its input check (H=4, KVH=3), and of
# the AOTInductor test's crash.
cat > /tmp/direct.py <<'PY'
import sys, torch, flexdma
dev = sys.argv[1]
q = torch.randn(1, 8, 4, 64, device=dev, dtype=torch.bfloat16); k = torch.randn(1, 8, 3, 64, device=dev, dtype=torch.bfloat16)
try:
    torch.ops.flexdma.fwd(q, k, k, None, None, 0.125, False, 0.0, True); print("no error raised")
except Exception as e:
    print("raised", type(e).__name__, str(e)[:200])
PY
CG=$(command -v cuda-gdb || ls /usr/local/cuda*/bin/cuda-gdb 2>/dev/null | head -1)
timeout 120 "$CG" -batch -ex run -ex "bt 14" --args python3 /tmp/direct.py cpu 2>&1 | grep -v "^\[New Thread\|^\[Thread" | grep -E "^#|signal|SIG" | cut -c1-260
python3 -c "import torch; print(torch.__version__, torch._C._GLIBCXX_USE_CXX11_ABI)"; g++ --version | head -1
ldd flexdma/_C*.so | head -20
timeout 200 "$CG" -batch -ex run -ex "bt 20" --args python3 -m pytest -q -x -p no:cacheprovider "tests/test_compile_model.py::test_aoti_package_runs[cuda]" 2>&1 | grep -v "^\[New Thread\|^\[Thread" | grep -E "^#|signal|SIG|passed|failed|Error" | cut -c1-260 | head -40
