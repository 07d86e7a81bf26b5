#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: the timeline of graphed batch-1 decode steps at the
# 48B shape (env.sh's; random weights), every kernel with its start and end on the device's clock
# and its stream, graph nodes included (DS_CUDA_TIMELINE: CUPTI's activity records; libcupti
# packed by pack_devbin.sh) — so that the gaps between a step's kernels and the overlap of the
# side and prefetch streams show, which the per-op profile (eager, serialised) and the what-ifs
# (left-out kernels) cannot. Output: $OUT/$NAME.csv (one row a kernel) and tools/timeline_step.py's
# summary of the last steps in $OUT/$NAME.txt.
#   tools/device/timeline48.sh [bench options, e.g. -q ptpc_fp8]   NAME=file stem (default tl)
#   BATCH (default 1), DECODE_STEPS (default 24)
. "$(dirname "$0")/env.sh"
N=${NAME:-tl}
DS_CUDA_TIMELINE="$OUT/$N.csv" timeout 300 .devbin/deltaserve bench --model $SHAPE48 \
  --load-format random --device cuda --prompt-tokens 16 --reps 1 --decode-context 512 \
  --decode-steps "${DECODE_STEPS:-24}" --batch-sizes "${BATCH:-1}" "$@" > "$OUT/$N.bench.txt" 2>&1
echo "bench rc $? ($(wc -l < "$OUT/$N.csv") kernels); $(grep -E '^decode batch' "$OUT/$N.bench.txt")"
python3 tools/timeline_step.py "$OUT/$N.csv" | tee "$OUT/$N.txt"
