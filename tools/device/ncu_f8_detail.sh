#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: the FP8 streaming kernel's instruction mix and stall
# reasons (one launch of test_cuda_kernels' FP8 bench, 12544 x 2304 at one token: SKIP 10 is the
# register form, SKIP 33 the ring), and its SASS where the machine has cuobjdump (issue 32).
. "$(dirname "$0")/env.sh"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 1; }
K=${KERNEL:-gemv_f8m_k}
timeout 200 "$NCU" --clock-control none --kernel-name-base function -k "regex:$K" \
  --launch-skip "${SKIP:-10}" --launch-count 1 \
  --metrics "sass__inst_executed_per_opcode,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,gpu__time_duration.sum" \
  --print-metric-instances values .devbin/test_cuda_kernels --bench-only fp8 > "$OUT/ncu_f8_detail.txt" 2>&1
echo "ncu rc $?"
grep -E "sass__inst_executed_per_opcode|inst_executed.sum|duration" "$OUT/ncu_f8_detail.txt" | cut -c1-1500
grep -E "stalled" "$OUT/ncu_f8_detail.txt" | awk '$NF+0 > 0.05' | sed 's/  */ /g'
CUOBJ=$(command -v cuobjdump || ls /usr/local/cuda*/bin/cuobjdump 2>/dev/null | head -1)
if [ -n "$CUOBJ" ]; then
  "$CUOBJ" -sass -fun "${SASS_FUN:-_Z10gemv_f8m_kILb1EEvPfiPKfiPKtS2_PKhS2_iiiii}" .devbin/test_cuda_kernels \
    > "$OUT/sass_f8.txt" 2>&1
  echo "sass: $(wc -l < "$OUT/sass_f8.txt") lines in $OUT/sass_f8.txt"
else
  echo "no cuobjdump here"
fi
