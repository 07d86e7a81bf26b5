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
