#!/usr/bin/env bash
# Set up and run the test suite: every test but the slow group (under 10 minutes on 2 cores).
# `bash scripts/test.sh -m slow` runs the slow group; .ci/run runs both.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec "${PYTHON:-python3}" -m pytest -q -m "not slow" "$@"
