#!/usr/bin/env bash
# Install infer8 into the current Python. `setup.sh` installs what serving needs (the demo);
# `setup.sh test` adds the test and benchmark extras. CPU torch is pinned so a fresh machine
# never pulls a multi-GB CUDA build; a GPU user installs their torch first (README).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
if [ "${1:-}" = "test" ]; then
  "$PY" -m pip install -q -e ".[test,bench]"
else
  "$PY" -m pip install -q -e .
fi
