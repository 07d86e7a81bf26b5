#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: where a step's device time goes at the shape of
# Kimi-Linear-48B-A3B (random weights), op by op (DS_CUDA_PROFILE=1: device events around each
# op of eager steps). Prefill of PROMPT tokens (warm: the first of two reps is dropped), then
# decode at each batch of BATCHES after a CTX-token context. The tables go to $OUT/profile.txt.
. "$(dirname "$0")/env.sh"
DS_CUDA_PROFILE=1 .devbin/deltaserve bench --model $SHAPE48 --load-format random \
  --device cuda --enforce-eager --prompt-tokens ${PROMPT:-8192} --reps 2 --decode-context ${CTX:-512} \
  --decode-steps 4 --batch-sizes ${BATCHES:-1,256} "$@" 2> "$OUT/profile.txt" | tail -7
cat "$OUT/profile.txt"
