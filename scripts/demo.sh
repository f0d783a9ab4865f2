#!/usr/bin/env bash
# Set up and run infer8's main job on the default model (SmolLM2-135M-Instruct).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec infer8 demo "$@"
