#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: issue 33's long contexts at the shape of
# Kimi-Linear-48B-A3B (random weights). For each length in LENS (default 131072 and 1048576):
# the time to first token of one prompt of that many tokens in chunks of CHUNK (chunked prefill,
# as a server runs it), its split by op (DS_CUDA_PROFILE=1, eager: the KDA, MLA and other rows),
# then decode at batch 1 with that context, graphs on, as a fraction of the copy rate counting
# what a step reads (the weights and the context's latents). KV in KV_DTYPES (auto fp8; bf16 too).
# TAG: a suffix for the output files. PARTS: "decode ttft" (default) or either alone. FILL: how decode's context is made (zeros by
# default: `bench --decode-fill zeros`, the same bytes read without a second long prefill; prefill
# runs it through the model).
# JSON and profiles under $OUT; headline figures into $OUT/latest.json.
. "$(dirname "$0")/env.sh"
# BIN: the engine's binary (e.g. .devbin/deltaserve_base, a baseline's: pack_devbin.sh)
B="${BIN:-.devbin/deltaserve} bench --model $SHAPE48 --load-format random --device cuda"
CHUNK=${CHUNK:-8192}
failed=""
for n in ${LENS:-131072 1048576}; do
  for kv in ${KV_DTYPES:-auto fp8}; do
    tag="long$((n / 1024))k_$kv${TAG:-}"
    if [[ " ${PARTS:-decode ttft} " == *" decode "* ]]; then
      # decode first (graphs, one rep)
      timeout ${STEP_TIMEOUT:-280} $B --kv-cache-dtype $kv --prefill-chunk $CHUNK --prompt-tokens $CHUNK \
        --reps 1 --decode-context $n --decode-fill ${FILL:-zeros} --decode-steps 4 --batch-sizes 1 \
        --json "$OUT/$tag.json" 2>&1 | tail -3 || failed+=" $tag"
      [ -f "$OUT/$tag.json" ] && latest "bench:$OUT/$tag.json"
    fi
    [[ " ${PARTS:-decode ttft} " == *" ttft "* ]] || continue
    # time to first token with its per-op split
    DS_CUDA_PROFILE=${PROFILE:-1} timeout ${STEP_TIMEOUT:-280} $B --enforce-eager --kv-cache-dtype $kv \
      --prefill-chunk $CHUNK --prompt-tokens $n --reps 1 --decode-context 16 --decode-steps 2 \
      --batch-sizes 1 --json "$OUT/${tag}_ttft.json" 2> "$OUT/${tag}_profile.txt" | tail -3 ||
      failed+=" ${tag}_ttft"
    [ -f "$OUT/${tag}_ttft.json" ] && latest "bench:$OUT/${tag}_ttft.json"
  done
done
[ -z "$failed" ] && echo "all lengths ran" || { echo "failed:$failed"; exit 1; }
