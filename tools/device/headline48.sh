#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: the headline figures of the 48B shape in one call
# (~1-4 minutes; on an H200 the full shape, else env.sh's cut): the chunked KDA checks, prefill of
# 8192 tokens and decode at batch 1, 32 and 256 in BF16, the same in ptpc_fp8, and decode
# at batch 1 after a million tokens of BF16 latents (long48.sh). JSON under $OUT, the figures into
# $OUT/latest.json (copy it to bench/latest.json). A call that needs the full shape names kind
# nvidia-h200 with needs_h200 (its BF16 weights do not fit an H100).
set -u
. "$(dirname "$0")/env.sh"
echo "shape: $SHAPE48 ($SHAPE48_NOTE)"
DS_CUDA_CHECKS=kda timeout 120 .devbin/test_cuda_kernels > "$OUT/kda_check.log" 2>&1
echo "kda checks rc $? ($(grep -c ' ok$' "$OUT/kda_check.log") ok, $(grep -c FAIL "$OUT/kda_check.log") FAIL)"
B=".devbin/deltaserve bench --model $SHAPE48 --load-format random --device cuda"
timeout 200 $B --prompt-tokens 8192 --reps 2 --decode-context 512 --decode-steps 8 \
  --batch-sizes 1,32,256 --json "$OUT/bf16.json" 2>&1 | grep -E "^(prefill|prompt|decode|copy)"
latest "bench:$OUT/bf16.json"
timeout 200 $B -q ptpc_fp8 --prompt-tokens 8192 --reps 2 --decode-context 512 --decode-steps 8 \
  --batch-sizes 1,32,256 --json "$OUT/fp8.json" 2>&1 | grep -E "^(prompt|decode|copy)" | sed 's/^/[fp8] /'
latest "bench:$OUT/fp8.json"
LENS=1048576 KV_DTYPES=bf16 PARTS=decode STEP_TIMEOUT=200 timeout 230 \
  bash "$(dirname "$0")/long48.sh" 2>&1 | grep -E "^decode|failed"
