#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: Nsight Compute's detail pages (speed of light,
# occupancy, warp stalls, memory) for the kernels of one `test_cuda_kernels --bench` section,
# each launch profiled alone. Output: $OUT/ncu_<section>$TAG.txt (the first launches that match,
# after SKIP of them when set).
#   tools/device/ncu_bench.sh SECTION KERNEL_REGEX [LAUNCHES]
#   e.g. tools/device/ncu_bench.sh kda 'kda_chunk' 3
. "$(dirname "$0")/env.sh"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 1; }
timeout 300 "$NCU" --clock-control none --section SpeedOfLight --section Occupancy \
  --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
  --section ComputeWorkloadAnalysis \
  --section LaunchStats --kernel-name-base function -k "regex:$2" --launch-count "${3:-3}" \
  --launch-skip "${SKIP:-0}" .devbin/test_cuda_kernels --bench-only "$1" > "$OUT/ncu_$1${TAG:-}.txt" 2>&1
echo "ncu rc $?"
