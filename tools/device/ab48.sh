#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: the 48B-shape decode step (graphs) under each setting
# given, e.g. tools/device/ab48.sh "" "DS_CUDA_EARLY_EXPERTS=0" — one line
# per setting and batch size; the first setting is timed again last, so that drift between runs
# shows. BATCHES (default 1,8) picks the batch sizes; PROMPT=8192 also times a prompt that long
# (REPS=3 with it: one repetition includes the first prompt's set-up).
. "$(dirname "$0")/env.sh"
[ $# -gt 0 ] || set -- ""
for setting in "$@" "$1"; do
  env $setting .devbin/deltaserve bench --model $SHAPE48 --load-format random \
    --device cuda --prompt-tokens "${PROMPT:-16}" --reps "${REPS:-1}" --decode-context 512 --decode-steps 8 \
    --batch-sizes "${BATCHES:-1,8}" 2>/dev/null | grep -E "^decode batch${PROMPT:+|^prompt}" |
    sed "s|^|${setting:-(defaults)}: |"
done
