#!/usr/bin/env bash
# On the GPU machine, with .devbin carried (DS_DEVBIN_TESTS="test_engine_prefix test_engine_engine
# cache_fuzz" tools/device/pack_devbin.sh): the prefix cache's differential tester on the CUDA
# backend (docs/prefix-cache.md) — batch-invariant (the contract: bit-exact with cold runs), then
# default matmuls (for information: cuBLAS picks kernels by batch shape). Seconds for each run:
# and, with a third number, batch-invariant at -tp 2 -pp 2 (four ranks sharing the GPU):
#   tools/device/cache_fuzz_gpu.sh [SECONDS_BI] [SECONDS_PLAIN] [SECONDS_DIST] [SEED0]
. "$(dirname "$0")/env.sh"
export OMP_NUM_THREADS=8
bi=${1:-240}
plain=${2:-60}
dist=${3:-0}
seed0=${4:-1}
DS_KERNEL_CHECKS=0 tools/device/cuda_model_check.sh test_engine_prefix test_engine_engine
.devbin/cache_fuzz --device cuda --batch-invariant --seeds 100000 --seed0 "$seed0" --max-seconds "$bi" \
  --save-dir "$OUT/cases" > "$OUT/cache_fuzz_bi.log" 2>&1
echo "batch-invariant: rc $?"; grep -E "^MISMATCH" "$OUT/cache_fuzz_bi.log" | head -5; tail -2 "$OUT/cache_fuzz_bi.log"
if [ "$plain" -gt 0 ]; then
  .devbin/cache_fuzz --device cuda --seeds 100000 --seed0 1 --max-seconds "$plain" \
    > "$OUT/cache_fuzz_plain.log" 2>&1
  echo "default matmuls: rc $?"; grep -E "^MISMATCH" "$OUT/cache_fuzz_plain.log" | head -3; tail -2 "$OUT/cache_fuzz_plain.log"
fi
if [ "$dist" -gt 0 ]; then
  .devbin/cache_fuzz --device cuda --batch-invariant -tp 2 -pp 2 --seeds 100000 \
    --seed0 $((seed0 + 100000)) --max-seconds "$dist" --save-dir "$OUT/cases" \
    > "$OUT/cache_fuzz_dist.log" 2>&1
  echo "batch-invariant -tp 2 -pp 2: rc $?"; grep -E "^MISMATCH" "$OUT/cache_fuzz_dist.log" | head -3; tail -2 "$OUT/cache_fuzz_dist.log"
fi
