# Sourced first by every device script that runs the packed binaries (`. "$(dirname "$0")/env.sh"`):
# unpacks .devbin (tools/device/unpack_devbin.sh), stops on unset names and failed pipes, moves to
# the repository root, makes $OUT (default /tmp/ds-out) and puts the packed libraries on the path.
"$(dirname "${BASH_SOURCE[0]}")/unpack_devbin.sh"
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-/tmp/ds-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.devbin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PATH=$PWD/.devbin:$PATH # (ucx_perftest)
[ -d .devbin/lib/ucx ] && export UCX_MODULE_DIR=$PWD/.devbin/lib/ucx
# headline figures (tools/bench_latest.py): start from the repository's bench/latest.json, so the
# file that comes back under $OUT is the whole table with this run's keys replaced
[ -f "$OUT/latest.json" ] || cp bench/latest.json "$OUT/latest.json" 2>/dev/null || true
# (keys under h200. or h100. by the card the figures come from)
latest() {
  local gpu
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  python3 tools/bench_latest.py --latest "$OUT/latest.json" --machine "$gpu" \
    --prefix "$(case "$gpu" in *H100*) echo h100 ;; *) echo h200 ;; esac)" "$@" || true
}
# The 48B shape: configs/kimi-linear-48b-a3b where its BF16 weights fit (H200, 139 GiB), else the
# same model cut to its first SHAPE48_LAYERS layers (default 16: 4 MLA of 16 as 7 of 27), so
# an H100 (78 GiB) can run the same scripts; every figure then says which it was (SHAPE48_NOTE).
SHAPE48=configs/kimi-linear-48b-a3b
SHAPE48_NOTE="48B shape, 27 layers"
if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)" \
     -lt 120000 ] 2>/dev/null; then
  SHAPE48=/tmp/k48-cut
  mkdir -p "$SHAPE48"
  python3 - "${SHAPE48_LAYERS:-16}" <<'PY'
import json, sys
n = int(sys.argv[1])
c = json.load(open("configs/kimi-linear-48b-a3b/config.json"))
la = c["linear_attn_config"]
c["num_hidden_layers"] = n
la["kda_layers"] = [i for i in la["kda_layers"] if i <= n]
la["full_attn_layers"] = [i for i in la["full_attn_layers"] if i <= n]
json.dump(c, open("/tmp/k48-cut/config.json", "w"), indent=1)
PY
  SHAPE48_NOTE="48B shape cut to its first ${SHAPE48_LAYERS:-16} layers (card under 120 GB)"
fi
echo "env.sh: $SHAPE48_NOTE"
# The 48B shape served with drawn weights (serve48.sh, grammar48.sh): its config and a tokenizer of
# its 163,840 ids in /tmp/shape48, no weights read. serve48_start PORT LOG MAX_NUM_SEQS [serve
# flags] starts it and waits for /health (up to 5 minutes; 1 when it never answered);
# serve48_stop PORT stops it the way a user does (SIGINT), then for sure.
serve48_start() {
  local port=$1 log=$2 seqs=$3
  shift 3
  .devbin/deltaserve init-model --shape-of "$SHAPE48" --out /tmp/shape48 \
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
