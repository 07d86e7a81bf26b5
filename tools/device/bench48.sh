#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: decode and prefill at the shape of Kimi-Linear-48B-A3B
# with random weights (configs/kimi-linear-48b-a3b), CUDA graphs on, then eager for comparison.
# JSON results under $OUT, the headline figures in $OUT/latest.json (copy it to
# bench/latest.json).  tools/device/bench48.sh [extra bench flags]
. "$(dirname "$0")/env.sh"
B=".devbin/deltaserve bench --model $SHAPE48 --load-format random --device cuda"
$B --prompt-tokens ${PROMPT:-8192} --reps ${REPS:-2} --decode-context ${CTX:-512} --decode-steps 8 \
   --batch-sizes ${BATCHES:-1,8,64,256} --json "$OUT/bench48_graphs.json" "$@" 2>&1 | tail -9
[ "${EAGER:-1}" = 1 ] && $B --enforce-eager --prompt-tokens 512 --reps 1 --decode-context ${CTX:-512} \
   --decode-steps 8 --batch-sizes ${EAGER_BATCHES:-1,8} --json "$OUT/bench48_eager.json" "$@" 2>&1 | tail -5
latest "bench:$OUT/bench48_graphs.json"
exit 0
