#!/usr/bin/env bash
# On the GPU machine (the device tool runs it from the repo root): build the CUDA kernels and their
# checks, run every check against the CPU backend, then the timings; the log goes to $OUT.
#   tools/device/cuda_check.sh [--no-bench]
set -uo pipefail
OUT=${OUT:-/tmp/ds-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
tools/cuda_build.sh build-cuda-dev 2>&1 | tee "$OUT/build.log" || exit 1
cp build-cuda-dev/ptxas.txt "$OUT/" 2>/dev/null
args=--bench
[ "${1:-}" = --no-bench ] && args=
build-cuda-dev/test_cuda_kernels $args 2>&1 | tee "$OUT/check.log"
exit "${PIPESTATUS[0]}"
