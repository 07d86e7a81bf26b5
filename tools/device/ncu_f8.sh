#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: Nsight Compute on the FP8 streaming kernel of
# test_cuda_kernels' FP8 bench (issue 32): the first shape (12544 x 2304, one token), the kernel
# with its weights in registers, then through the ring (launches SKIP and SKIP + 23 of it), and
# the BF16 kernel of the same shape. Pipes, warp states, occupancy. Output: $OUT/ncu_f8_*.txt.
. "$(dirname "$0")/env.sh"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 1; }
SEC="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats"
SEC="$SEC --section Occupancy --section LaunchStats --section InstructionStats"
SEC="$SEC --section MemoryWorkloadAnalysis --section SchedulerStats"
run() { # name kernel-regex skip
  timeout 200 "$NCU" --clock-control none --kernel-name-base function -k "regex:$2" \
    --launch-skip "$3" --launch-count 1 $SEC .devbin/test_cuda_kernels --bench-only fp8 \
    > "$OUT/ncu_f8_$1.txt" 2>&1
  echo "== $1 (rc $?)"
  grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc A|spends|stalled|Pipe|pipe|Eligible Warps|No Eligible|Block Limit" \
    "$OUT/ncu_f8_$1.txt" | sed 's/  */ /g' | cut -c1-260 | head -${LINES_MAX:-40}
}
run regs "gemv_f8m_k" ${SKIP:-10}
run ring "gemv_f8m_k" $(( ${SKIP:-10} + 23 ))
run bf16 "gemv_bf16_k" ${SKIP:-10}
