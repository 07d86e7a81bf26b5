#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: the serving table of issue 33 at the shape of
# Kimi-Linear-48B-A3B (random weights): one `serve`, then `bench serve` with mixed lengths
# (prompts IN_LEN +- 50%, outputs OUT_LEN +- 50%) at each concurrency of CONCS (1 16 64 256):
# output tokens/s, TTFT, TPOT and ITL p50 / p99. JSON under $OUT, rows into $OUT/latest.json.
. "$(dirname "$0")/env.sh"
PORT=${PORT:-8123}
serve48_start $PORT "$OUT/serve48.log" 256 "$@" || { echo "the server never came up"; exit 1; }
failed=""
for c in ${CONCS:-1 16 64 256}; do
  n=$((c < 16 ? 16 : 2 * c))
  timeout ${STEP_TIMEOUT:-150} .devbin/deltaserve bench serve --url "http://127.0.0.1:$PORT" \
    --num-prompts $n --concurrency $c --input-len ${IN_LEN:-1024} --output-len ${OUT_LEN:-256} \
    --random-range-ratio 0.5 --seed 1 --out "$OUT/serve48_c$c.json" | tail -14 || failed+=" c$c"
  [ -f "$OUT/serve48_c$c.json" ] && latest "serve:c$c:$OUT/serve48_c$c.json"
done
serve48_stop $PORT
[ -z "$failed" ] && echo "all concurrencies ran" || { echo "failed:$failed"; exit 1; }
