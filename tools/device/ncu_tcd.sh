#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: Nsight Compute on the tensor-core decode MLA kernel
# (mla_decode_tc.cu) for one token over a long context — Speed of Light, occupancy, warp states
# (the dominant stall) and memory — the rows' dtype and length from TCD (default "bf16 1048576",
# test_cuda_mla.c's DS_BENCH_MLA_LONG); SKIP launches skipped first (12 a form: 3 the 32-row tiles,
# 15 the 64-row tiles of FP8 and BF16 rows, 27 BF16's with 16 warps). Output: $OUT/ncu_tcd$SKIP.txt,
# its key lines printed. KREGEX: the kernel (default mla_tcd_k; mla_tcw_k the warp-specialized
# form, whose launches are only its own).
. "$(dirname "$0")/env.sh"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 1; }
DS_BENCH_MLA_LONG=${TCD:-bf16 1048576} timeout 240 "$NCU" --clock-control none \
    --kernel-name-base function -k regex:${KREGEX:-mla_tcd_k} --launch-skip ${SKIP:-3} --launch-count 1 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis --section SchedulerStats --section InstructionStats \
  --section SourceCounters \
  .devbin/test_cuda_kernels --bench-only mla > "$OUT/ncu_tcd${SKIP:-}.txt" 2> "$OUT/ncu_tcd${SKIP:-}.err"
echo "ncu rc $?"
grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issued Ipc|spends|stalled|Stall|L1/TEX Hit|Shared Memory|Bank|Executed Ipc|No Eligible|Active Warps" \
  "$OUT/ncu_tcd${SKIP:-}.txt" | sed 's/  */ /g' | cut -c1-260 | head -${LINES_MAX:-70}
