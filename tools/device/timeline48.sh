#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: the timeline of graphed batch-1 decode steps at the
# 48B shape (env.sh's; random weights) under Nsight Systems, every graph node traced as its own
# kernel (--cuda-graph-trace=node): start and end of each kernel on the device, so that the gaps
# between kernels and the overlap of the side and prefetch streams show — what a per-op profile
# (eager, serialised) and the what-ifs (left-out kernels) cannot. Output: $OUT/$NAME.csv (one row
# a kernel: start ns, duration ns, stream, name) and tools/timeline_step.py's summary of the last
# steps in $OUT/$NAME.txt.
#   tools/device/timeline48.sh [bench options, e.g. -q ptpc_fp8]   NAME=file stem (default tl)
. "$(dirname "$0")/env.sh"
NSYS=$(command -v nsys || ls /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda/bin/nsys \
  /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)
[ -n "$NSYS" ] || { echo "nsys not found"; ls /opt/nvidia 2>/dev/null; exit 1; }
N=${NAME:-tl}
rm -f "/tmp/$N.nsys-rep" "/tmp/$N.sqlite"
timeout 300 "$NSYS" profile -o "/tmp/$N" --trace cuda --cuda-graph-trace node --sample none \
  --cpuctxsw none .devbin/deltaserve bench --model $SHAPE48 --load-format random --device cuda \
  --prompt-tokens 16 --reps 1 --decode-context 512 --decode-steps "${STEPS:-24}" --batch-sizes 1 \
  "$@" > "$OUT/$N.bench.txt" 2>&1
echo "nsys rc $?"
timeout 200 "$NSYS" export --type sqlite -o "/tmp/$N.sqlite" "/tmp/$N.nsys-rep" > /dev/null 2>&1
python3 - "/tmp/$N.sqlite" "$OUT/$N.csv" <<'PY'
import csv, sqlite3, sys
db = sqlite3.connect(sys.argv[1])
q = ("SELECT k.start, k.end - k.start, k.streamId, s.value FROM CUPTI_ACTIVITY_KIND_KERNEL k "
     "JOIN StringIds s ON s.id = k.shortName ORDER BY k.start")
with open(sys.argv[2], "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["start_ns", "dur_ns", "stream", "name"])
    n = 0
    for r in db.execute(q):
        w.writerow(r)
        n += 1
print(f"timeline: {n} kernels")
PY
python3 tools/timeline_step.py "$OUT/$N.csv" | tee "$OUT/$N.txt"
