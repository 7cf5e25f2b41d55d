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
    set +e
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
