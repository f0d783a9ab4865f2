#!/usr/bin/env bash
# A/B: a baseline checkout (BASE, e.g. `git worktree add /tmp/base 81695ce`, the commit issue #19 measured) vs this tree, float32,
# interleaved per workload (this machine drifts 10-30% between runs). Usage: BASE=/tmp/base bash benchmarks/baseline_ab.sh
set -u
OUT=${OUT:-/tmp/baseline_ab}; mkdir -p $OUT; BASE=${BASE:?set BASE to a checkout of the baseline commit}; HEAD_TREE=${HEAD_TREE:-$(cd "$(dirname "$0")/.." && pwd)}
COMMON="--dtype float32 --max-num-seqs 32 --kv-cache-memory-bytes 1073741824 --max-num-batched-tokens 4096"
CLI="python -m infer8.cli"
offline() {  # tree tag kvdtype n in out
  local tree=$1 tag=$2 kv=$3 n=$4 in=$5 out=$6
  (cd $tree && PYTHONPATH=$tree timeout 1200 $CLI bench throughput $COMMON --kv-cache-dtype $kv \
     --num-requests $n --input-len $in --output-len $out --disable-tqdm --json $OUT/$tag.json > $OUT/$tag.log 2>&1)
  python -c "import json;d=json.load(open('$OUT/$tag.json'));r=d.get('result',d);print('$tag', round(r['elapsed_s'],1), 's', round(r['output_tokens_per_s'],1), 'tok/s')" 2>&1 | tail -1
}
online() {  # tree tag
  local tree=$1 tag=$2
  (cd $tree && PYTHONPATH=$tree exec $CLI serve $COMMON --port 8124 --host 127.0.0.1 --uvicorn-log-level warning > $OUT/$tag.serve.log 2>&1) &
  local spid=$!
  for i in $(seq 120); do curl -s localhost:8124/health > /dev/null && break; sleep 1; done
  local B="$CLI bench serve --base-url http://127.0.0.1:8124 --input-len 128 --max-concurrency 32 --ignore-eos --disable-tqdm"
  (cd $HEAD_TREE && $B --num-requests 32 --output-len 4 --seed 7919 > /dev/null 2>&1)  # warm-up: other prompts
  (cd $HEAD_TREE && $B --num-requests 64 --output-len 128 --seed 0 --json $OUT/$tag.json > $OUT/$tag.log 2>&1)
  grep -E "output token throughput" $OUT/$tag.log | sed "s/^/$tag /"
  kill $spid; wait $spid 2>/dev/null; pkill -f "port 8124"; sleep 2
}
run_both() {  # fn tagprefix args...
  local fn=$1 pre=$2; shift 2
  $fn $BASE $pre-base "$@"
  $fn $HEAD_TREE $pre-head "$@"
}
run_both offline W1-r1 auto 64 128 128
run_both online online-r1
run_both offline W3-r1 auto 8 2048 128
run_both offline W1fp8-r1 fp8_e4m3 64 128 128
run_both offline W1-r2 auto 64 128 128
run_both online online-r2
echo done
