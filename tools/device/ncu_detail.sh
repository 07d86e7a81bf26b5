#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: why a decode kernel streams below the copy rate. Nsight
# Compute's Speed of Light, occupancy, launch and warp-state sections (with their rule hints: the
# dominant stall) for the first few launches of the named kernels in an eager batch-1 decode step
# at the 48B shape. Output: $OUT/$NAME.txt, its key lines printed.
#   KERNELS=regex (default the FP8 and BF16 streaming kernels)  COUNT=launches (default 6)
#   SKIP=launches of those kernels skipped first (default 40: past the first layer's)
#   tools/device/ncu_detail.sh [bench options, e.g. -q ptpc_fp8]    NAME=file stem
. "$(dirname "$0")/env.sh"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 1; }
N=${NAME:-ncu_detail}
timeout 300 "$NCU" --clock-control none --kernel-name-base function \
  -k "regex:${KERNELS:-moe_f8m_k|gemv_f8m_k|moe_grouped_k|gemv_bf16_k}" \
  --launch-skip "${SKIP:-40}" --launch-count "${COUNT:-6}" \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis \
  .devbin/deltaserve bench --model $SHAPE48 --load-format random --device cuda --enforce-eager \
  --prompt-tokens 1 --reps 1 --decode-context 1 --decode-steps 2 --batch-sizes 1 "$@" \
  > "$OUT/$N.txt" 2> "$OUT/$N.err"
echo "ncu rc $?"
grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occ|Registers Per|Grid Size|Waves Per SM|Warp Cycles Per Issued|Block Limit Reg|spends|stalled|Issue Slot|L2 Hit" \
  "$OUT/$N.txt" | sed 's/  */ /g' | cut -c1-230 | head -${LINES_MAX:-90}
