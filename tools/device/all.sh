#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: everything one device call can check and time in
# about 4 minutes — every kernel against the CPU, the CPU's model and engine tests on the GPU,
# -pp 2 / -tp 2 against one GPU, the per-op profile and the 48B-shape benchmark with graphs, the
# bundled eval served from the GPU (300 problems, one process, PP 2 and TP 2 + DSpark + prefix +
# offload), the fused KDA decode through a whole model (fused_check.sh), and the KDA, expert and
# MLA kernel timings. A line per part that failed at the end;
# logs and JSON under $OUT.
. "$(dirname "$0")/env.sh"
failed=""
# bench-large's random checkpoint (for fused_check.sh, at the end) written beside the first parts
.devbin/deltaserve init-model --preset bench-large --out /tmp/bench-large > "$OUT/bl_init.log" 2>&1 &
bl_pid=$!
tools/device/cuda_model_check.sh 2>&1 | tail -8 || failed+=" model-check"
tools/device/cuda_pp_check.sh 2>&1 | tail -4 || failed+=" pp-check"
PROMPT=8192 BATCHES=1,256 timeout 200 tools/device/profile48.sh > "$OUT/profile_all.txt" 2>&1 ||
  failed+=" profile"
EAGER=0 timeout 200 tools/device/bench48.sh 2>&1 | tail -7 || failed+=" bench"
# the prompt again with chunked KDA on CUDA cores in f32 (the default is 3xTF32 tensor cores)
DS_CUDA_KDA_TC=0 OUT=/tmp/ds-kda-f32 EAGER=0 BATCHES=1 REPS=2 timeout 100 tools/device/bench48.sh 2>&1 |
  grep "prompt" | sed "s/^/DS_CUDA_KDA_TC=0: /" || failed+=" bench-kda-f32"
timeout 200 tools/device/gpu_serve_eval.sh "${EVAL_LIMIT:-300}" 2>&1 | grep -v Killed | tail -7 ||
  failed+=" eval"
wait $bl_pid
timeout 120 tools/device/greedy_ids.sh > /dev/null 2>&1 || failed+=" greedy-ids"
BL=/tmp/bench-large timeout 120 tools/device/fused_check.sh 2>&1 | tail -5 || failed+=" fused-check"
timeout 120 .devbin/test_cuda_kernels --bench kda,moe,mla 2>&1 | grep "^bench" > "$OUT/kernel_bench.txt" ||
  failed+=" kernel-bench"
cat "$OUT/kernel_bench.txt"
echo "profile tables: $OUT/profile_all.txt"
# what comes back is at most 8 files: the logs and arrays in one archive, the profile beside it
(cd "$OUT" && tar czf /tmp/ds-logs.tgz --exclude profile_all.txt --exclude bench48_graphs.json --exclude kernel_bench.txt --exclude greedy_ids.txt . &&
  find . -mindepth 1 ! -name profile_all.txt ! -name bench48_graphs.json ! -name kernel_bench.txt ! -name greedy_ids.txt -delete &&
  mv /tmp/ds-logs.tgz .)
[ -z "$failed" ] && echo "all parts ran" || { echo "failed:$failed"; exit 1; }
