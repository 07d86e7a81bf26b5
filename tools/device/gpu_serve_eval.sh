#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: the bundled model's eval served from the GPU, one
# process against the seed's configuration at the pipeline depth one GPU allows (issue 10):
# -pp 2 (both ranks on the one GPU), DSpark k = 7, prefix caching, the RAM offload tier; then
# the same at -tp 2 (and first DSpark on one process).
# Accuracy both ways, acceptance and tokens per forward; and whether the two runs' completions
# are the same text.   tools/device/gpu_serve_eval.sh [LIMIT]
. "$(dirname "$0")/env.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
LIMIT=${1:-1319}
B=.devbin/deltaserve
run() { # name port args...
  local name=$1 port=$2; shift 2
  $B serve --model models/gsm-k3 --device cuda --port $port --kv-cache-memory 4G "$@" > "$OUT/$name.log" 2>&1 &
  local pid=$!
  for i in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    sleep 0.5
  done
  python3 tools/device/gpu_eval.py --url "http://127.0.0.1:$port" --limit "$LIMIT" --json "$OUT/$name.json"
  # stop it the way a user does (SIGINT to the server itself: $! can name the shell that started
  # it, which ignores SIGINT as a background job — what looked like a -pp server that would not
  # stop in session 4), and never wait long
  local srv
  srv=$(pgrep -of "deltaserve serve .*--port $port")
  [ -n "$srv" ] && kill -INT "$srv" 2>/dev/null
  for i in $(seq 1 20); do kill -0 $pid 2>/dev/null || break; sleep 0.5; done
  kill -TERM $pid 2>/dev/null
  for i in $(seq 1 20); do kill -0 $pid 2>/dev/null || break; sleep 0.5; done
  kill -KILL $pid 2>/dev/null; pkill -KILL -f "deltaserve serve" 2>/dev/null
  wait $pid 2>/dev/null
}
run one 8101
# DSpark alone on one process (what speculation buys without the pipeline's hops)
run one_dspark 8104 --speculative-method dspark --num-speculative-tokens 7 --kv-offload-ram 1G
run pp2_dspark 8102 -pp 2 --speculative-method dspark --num-speculative-tokens 7 --kv-offload-ram 1G
# tensor parallelism too (two ranks on the one GPU): the draft on the sampling rank's GPU with a
# whole copy of lm_head
run tp2_dspark 8103 -tp 2 --speculative-method dspark --num-speculative-tokens 7 --kv-offload-ram 1G
python3 - "$OUT" <<'PY'
import json, sys
a = json.load(open(f"{sys.argv[1]}/one.json"))
for name in ("one_dspark", "pp2_dspark", "tp2_dspark"):
    b = json.load(open(f"{sys.argv[1]}/{name}.json"))
    same = sum(x == y for x, y in zip(a["texts"], b["texts"]))
    print(f"{name}: completions identical to one process: {same} of {a['n']}")
PY
