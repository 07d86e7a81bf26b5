#!/usr/bin/env bash
# On the GPU machine, with .devbin carried (tools/device/pack_devbin.sh made it here): the CPU's
# model and engine tests run unchanged on the GPU (DS_DEVICE=cuda, batch-invariant matmuls: the
# goldens within 1e-4, pipeline stages bit-exact, prefix hits / forks / speculation equal to cold
# runs), then the kernel checks. Logs under $OUT; a table of results last.
#   tools/device/cuda_model_check.sh [test ...]
. "$(dirname "$0")/env.sh"
export DS_SOURCE_DIR=$PWD DS_BUILD_DIR=$PWD/.devbin DS_BIN=$PWD/.devbin/deltaserve
export OMP_NUM_THREADS=8 DS_DEVICE=cuda DS_BATCH_INVARIANT=1
tests=("$@")
[ ${#tests[@]} -eq 0 ] && tests=(test_model_forward test_model_pipeline test_model_draft test_engine_prefix test_engine_engine test_engine_regress)
summary=""
fails=0
for t in "${tests[@]}"; do
  [ -x ".devbin/$t" ] || { summary+="$t: not packed\n"; fails=$((fails+1)); continue; }
  start=$(date +%s%N)
  timeout 300 ".devbin/$t" > "$OUT/$t.log" 2>&1
  rc=$?
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  passed=$(grep -c "^\[       OK \]" "$OUT/$t.log")
  failed=$(grep -c "^\[  FAILED  \]" "$OUT/$t.log")
  summary+=$(printf "%-22s rc %3d  ok %3d  failed %3d  %7d ms" "$t" "$rc" "$passed" "$failed" "$ms")"\n"
  [ $rc -ne 0 ] && { fails=$((fails+1)); grep -B2 -A8 "FAILED\|ERROR\|error" "$OUT/$t.log" | head -40; }
done
if [ "${DS_KERNEL_CHECKS:-1}" = 1 ]; then
  DS_DEVICE=cpu .devbin/test_cuda_kernels > "$OUT/kernels.log" 2>&1
  rc=$?
  summary+="test_cuda_kernels      rc $rc\n"
  [ $rc -ne 0 ] && { fails=$((fails+1)); tail -20 "$OUT/kernels.log"; }
fi
printf "\n$summary"
exit $fails
