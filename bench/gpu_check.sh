#!/usr/bin/env bash
# The one device script (issue 14): the GPU tests, then `moerun bench` over the placements, as JSON under $OUT.
# On a machine without CUDA the same steps run on the CPU stand-in with a small model (CI runs that).
#
#   OUT=/tmp/out bash bench/gpu_check.sh            # a lent GPU: under 8 minutes on one H200
#   bash bench/gpu_check.sh --standin               # the stand-in, here
#
# A bare GPU machine has torch and triton but not moerun's other packages: wheels carried in ./.whl (see
# /work/.library/device/README.md) are installed first, then moerun from this tree with its C kernels.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import moerun.kernels.cpu, gguf" 2>/dev/null; then
  if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . || exit 1
fi
exec "$PY" bench/gpu_check.py "$@"
