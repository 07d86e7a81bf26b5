#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: the fused expanded MLA attention's forms
# (DS_CUDA_MLA_FLASH) side by side, ~3-4 minutes on an H100: the mla kernel checks (every form
# against the CPU), the kernel timings at 8192 tokens x 32 heads (cuBLAS, mma.sync, wgmma one and
# two warpgroups, pipelined), a prompt of 8192 tokens at the 48B shape (env.sh's cut on an H100)
# in each of MODES (default "3 4"), then the TTFT of a 131,072-token prompt in each of TTFT_MODES
# (default "1 3 4"; none with TTFT_MODES=""). Logs and JSON under $OUT.
. "$(dirname "$0")/env.sh"
nvidia-smi --query-gpu=name --format=csv,noheader
DS_CUDA_CHECKS=mla timeout 120 .devbin/test_cuda_kernels > "$OUT/mla.log" 2>&1
echo "mla checks rc $? ($(grep -c ' ok$' "$OUT/mla.log") ok, $(grep -c FAIL "$OUT/mla.log") FAIL)"
grep FAIL "$OUT/mla.log" | head -10
# (the expanded timings come first; the absorbed ones after them are cut off)
timeout 50 stdbuf -oL .devbin/test_cuda_kernels --bench-only mla 2>&1 |
  grep -E "gemm bf16|expanded" | head
B=".devbin/deltaserve bench --model $SHAPE48 --load-format random --device cuda"
for F in ${MODES:-3 4}; do
  DS_CUDA_MLA_FLASH=$F timeout 90 $B --prompt-tokens 8192 --reps 3 --decode-context 512 \
    --decode-steps 4 --batch-sizes 1 --json "$OUT/prefill_f$F.json" > /dev/null 2>&1
  python3 -c "import json; j = json.load(open('$OUT/prefill_f$F.json'));
print('mode $F: prompt 8192', round(8192 / j['prompt_tps'] * 1e3, 2), 'ms,',
      round(100 * j['prompt_frac_peak'], 1), '% of cuBLAS; ids', j['decode'][0]['ids_hash'])" ||
    echo "mode $F: prefill failed"
done
for F in ${TTFT_MODES-1 3 4}; do
  DS_CUDA_MLA_FLASH=$F LENS=131072 KV_DTYPES=auto PARTS=ttft PROFILE=0 TAG=_f$F STEP_TIMEOUT=80 \
    timeout 90 bash "$(dirname "$0")/long48.sh" > /dev/null 2>&1
  python3 -c "import json; j = json.load(open('$OUT/long128k_auto_f${F}_ttft.json'));
print('mode $F: TTFT of 131072 tokens', round(131072 / j['prompt_tps'], 3), 's')" ||
    echo "mode $F: TTFT failed"
done
