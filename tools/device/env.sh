# Sourced first by every device script that runs the packed binaries (`. "$(dirname "$0")/env.sh"`):
# unpacks .devbin (tools/device/unpack_devbin.sh), stops on unset names and failed pipes, moves to
# the repository root, makes $OUT (default /tmp/ds-out) and puts the packed libraries on the path.
"$(dirname "${BASH_SOURCE[0]}")/unpack_devbin.sh"
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-/tmp/ds-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.devbin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# headline figures (tools/bench_latest.py): start from the repository's bench/latest.json, so the
# file that comes back under $OUT is the whole table with this run's keys replaced
[ -f "$OUT/latest.json" ] || cp bench/latest.json "$OUT/latest.json" 2>/dev/null || true
latest() { python3 tools/bench_latest.py --latest "$OUT/latest.json" --machine "$(nvidia-smi \
  --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" "$@" || true; }
# The 48B shape served with drawn weights (serve48.sh, grammar48.sh): its config and a tokenizer of
# its 163,840 ids in /tmp/shape48, no weights read. serve48_start PORT LOG MAX_NUM_SEQS [serve
# flags] starts it and waits for /health (up to 5 minutes; 1 when it never answered);
# serve48_stop PORT stops it the way a user does (SIGINT), then for sure.
serve48_start() {
  local port=$1 log=$2 seqs=$3
  shift 3
  .devbin/deltaserve init-model --shape-of configs/kimi-linear-48b-a3b --out /tmp/shape48 \
    --force || return 1
  .devbin/deltaserve serve --model /tmp/shape48 --load-format dummy --device cuda --port "$port" \
    --max-num-seqs "$seqs" "$@" > "$log" 2>&1 &
  for i in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && return 0
    sleep 0.5
  done
  return 1
}
serve48_stop() {
  local srv
  srv=$(pgrep -of "deltaserve serve .*--port $1")
  [ -n "$srv" ] && kill -INT "$srv"
  for i in $(seq 1 20); do pgrep -f "deltaserve serve .*--port $1" > /dev/null || break; sleep 0.5; done
  pkill -KILL -f "deltaserve serve .*--port $1" 2>/dev/null
  return 0
}
