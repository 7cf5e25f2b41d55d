#!/usr/bin/env bash
# Set up flexdma on this machine and run the main job or the tests.
#   bash dev.sh run    # install, then the main job (the MQAR training example)
#   bash dev.sh test   # install with test extras, then the test suite
# torch is pinned for CPU machines: a range that admits newer releases pulls a multi-GB CUDA build.
# Where a torch is already installed (a CUDA machine), it is kept.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
TORCH_PIN=${FLEXDMA_TORCH:-torch==2.13.0}

install() {
  if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q "$TORCH_PIN"
  fi
  # No build isolation: the extension builds against the torch installed above, and pip does not
  # fetch a second torch into a temporary build environment.
  "$PY" -m pip install -q setuptools wheel ninja
  MAX_JOBS=${MAX_JOBS:-2} "$PY" -m pip install -q --no-build-isolation -e ".$1"
}

case "${1:-}" in
  run)
    install ""
    shift
    if "$PY" -c "import flexdma.examples.mqar" >/dev/null 2>&1; then
      exec "$PY" -m flexdma.examples.mqar "$@"
    fi
    exec "$PY" -m flexdma
    ;;
  test)
    install "[test]"
    shift
    if [ $# -eq 0 ] && [ "${FLEXDMA_SKIP_OLDEST_HF:-0}" != 1 ]; then
      # The Hugging Face tests also against the oldest transformers the project claims
      # (pyproject.toml's lower bound, its newest patch release), installed beside the newest
      # one in a folder of its own; the full suite below runs with the newest.
      oldest=$(sed -n 's/.*"transformers>=\([0-9.]*\)".*/\1/p' pyproject.toml | head -1)
      dir=build/transformers-$oldest
      if ! PYTHONPATH=$dir "$PY" -c "import transformers, sys; sys.exit(not transformers.__version__.startswith('$oldest.'))" 2>/dev/null; then
        rm -rf "$dir"
        "$PY" -m pip install -q --target "$dir" "transformers==$oldest.*"
      fi
      echo "Hugging Face tests with transformers $(PYTHONPATH=$dir "$PY" -c 'import transformers; print(transformers.__version__)')"
      PYTHONPATH=$dir "$PY" -m pytest -q -ra tests/test_doge.py tests/test_hf.py tests/test_compat.py
    fi
    # Triton for the interpreter tests of the per-key Triton kernels (tests/perkey/interpret_*.py),
    # beside the suite where torch came without it: on a CPU machine triton only interprets.
    if ! "$PY" -c "import triton" >/dev/null 2>&1; then
      if ! PYTHONPATH=build/triton "$PY" -c "import triton" >/dev/null 2>&1; then
        rm -rf build/triton
        "$PY" -m pip install -q --no-deps --target build/triton triton
      fi
      export FLEXDMA_TRITON_PATH=$PWD/build/triton
    fi
    set +e
    echo "The whole suite with transformers $("$PY" -c 'import transformers; print(transformers.__version__)')"
    "$PY" -m pytest -q -ra "$@"
    rc=$?
    # pytest exits 5 when nothing was collected: that is a failure of the suite, not a pass.
    exit $rc
    ;;
  *)
    echo "usage: bash dev.sh run|test [args]" >&2
    exit 2
    ;;
esac
