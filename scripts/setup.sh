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
# Every dependency at the version CI tests (scripts/constraints.txt).
if [ "${1:-}" != "test" ]; then
  "$PY" -m pip install -q -c scripts/constraints.txt -e .
  exit 0
fi
"$PY" -m pip install -q -c scripts/constraints.txt -e ".[test,bench]"
# The web console's browser tests drive Debian's chromium through playwright (installed with the
# test extra above); playwright's own browser download is not used. Root only, and only if missing.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium
fi
