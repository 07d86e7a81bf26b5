#!/usr/bin/env bash
# On the GPU machine, with .devbin and .whl carried: issue 9's KDA prefill comparison side by
# side in one run — deltaserve's chunked kernel (test_cuda_kernels --bench, 8192 tokens x 32
# heads of 128 x 128) and flash-linear-attention's chunk_kda on the same shape (fla_kda_bench.sh;
# Triton compiles first: budget ~5 minutes of device time) — and both scored on one set of inputs
# against a float64 reference computed token by token; then the same tokens as 8 x 1024 and
# 32 x 256 sequences in one call (varlen), both engines timed.
. "$(dirname "$0")/env.sh"
io=/tmp/kda_io
mkdir -p "$io"
tools/device/fla_kda_bench.sh gen "$io" || exit 1
.devbin/test_cuda_kernels --kda-io "$io" 8192 32 128 || exit 1
.devbin/test_cuda_kernels --bench-only kda 2>&1 | grep -E "bench kda (chunked|recurrent) (prefill|varlen)" |
  tee "$OUT/kda_vs_fla.log"
tools/device/fla_kda_bench.sh score "$io" 2>&1 | grep -E "fla chunk_kda|deltaserve chunked|Error|error" |
  tee -a "$OUT/kda_vs_fla.log"
latest "kda:$OUT/kda_vs_fla.log"
