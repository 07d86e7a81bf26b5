#!/usr/bin/env bash
# On the GPU machine: the quantized weights' checks (FP8 products and quantizers, MXFP4 experts and
# their random draw) and the BF16 matmul and MoE checks beside them, then their timings; run from a
# folder holding pack_devbin.sh's bin.tar.xz and this script (carried: the device sends the
# session's checkout). The logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")" || exit 1
OUT=${OUT:-/tmp/ds-out}
mkdir -p "$OUT"
if [ -f bin.tar.xz ]; then tar xJf bin.tar.xz && rm -f bin.tar.xz; fi
export LD_LIBRARY_PATH=$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
DS_CUDA_CHECKS=${DS_CUDA_CHECKS:-"matmul,moe,matmul fp8,moe mxfp4"} ./test_cuda_kernels 2>&1 |
  tee "$OUT/check.log" | grep -E "FAIL|fp8|mxfp4|ptpc|checks:|device"
rc=${PIPESTATUS[0]}
./test_cuda_kernels --bench-only "${DS_QUANT_BENCH:-fp8,mxfp4}" 2>&1 | tee "$OUT/bench.log"
exit "$rc"
