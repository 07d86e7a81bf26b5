#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: issue 32's formats on the GPU — every kernel check
# (FP8 products, MXFP4 experts, the FP8 latent cache among them), the CPU's model tests on the GPU
# with the formats' goldens, then the benchmarks: MXFP4 experts at Kimi-K3's layer shapes
# (configs/kimi-k3-slice4), and at the Kimi-Linear-48B shape BF16 against ptpc_fp8 (decode batch 1
# and 256, prompt 8192) and the f32 latent cache against FP8 at 32K context. PART=check|bench|all
# (default all). JSON under $OUT; a line per part that failed at the end.
. "$(dirname "$0")/env.sh"
failed=""
PART=${PART:-all}
if [ "$PART" != bench ]; then
  DS_CUDA_CHECKS=${CHECKS:-"matmul,moe,mla batch,matmul fp8,moe mxfp4,kv rows,moe fp8"} DS_DEVICE=cpu \
    timeout 240 .devbin/test_cuda_kernels > "$OUT/kernels.log" 2>&1 || failed+=" kernels"
  grep -E "FAIL|fp8|mxfp4|checks" "$OUT/kernels.log" | grep -v "^ok" | tail -12
  DS_KERNEL_CHECKS=0 timeout 400 tools/device/cuda_model_check.sh test_model_forward \
    test_model_quant test_model_pipeline test_engine_prefix 2>&1 | tail -8 || failed+=" model-check"
fi
if [ "$PART" != check ]; then
  K=".devbin/deltaserve bench --model configs/kimi-k3-slice4 --load-format random --device cuda"
  timeout 200 $K --prompt-tokens ${K3_PROMPT:-4096} --reps 1 --decode-context 512 --decode-steps 8 \
    --batch-sizes 1,64 --json "$OUT/k3slice_mxfp4.json" 2>&1 | tail -6 || failed+=" k3-slice"
  B=".devbin/deltaserve bench --model $SHAPE48 --load-format random --device cuda"
  for q in none ${QUANTS:-ptpc_fp8}; do
    timeout 200 $B -q "$q" --prompt-tokens 8192 --reps 2 --decode-context 512 --decode-steps 8 \
      --batch-sizes 1,256 --json "$OUT/b48_$q.json" 2>&1 | tail -5 || failed+=" bench-$q"
  done
  for kv in auto fp8; do
    timeout 150 $B --kv-cache-dtype $kv --prompt-tokens 512 --reps 1 --decode-context 32768 \
      --decode-steps 8 --batch-sizes 1,16 --json "$OUT/b48_kv_$kv.json" 2>&1 | tail -4 ||
      failed+=" bench-kv-$kv"
  done
  timeout 100 .devbin/test_cuda_kernels --bench-only fp8,mxfp4,moefp8 2>&1 | grep "^bench" > "$OUT/qbench.txt"
  cat "$OUT/qbench.txt"
fi
[ -z "$failed" ] && echo "all parts ran" || { echo "failed:$failed"; exit 1; }
