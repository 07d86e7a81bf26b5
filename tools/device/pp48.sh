#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: the 48B shape (random weights) decoding at batch 1, 16
# and 64 as one process and as two pipeline stages (-pp 2, both ranks on this GPU when it is the
# only one: they take turns on it, as the stages of one step do anyway), with CUDA graphs and with
# --enforce-eager — what graphs buy under pipeline parallelism. A line per run; JSON under $OUT.
#   tools/device/pp48.sh [extra bench flags]
. "$(dirname "$0")/env.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
B=".devbin/deltaserve bench --model $SHAPE48 --load-format random --device cuda"
fail=0
for run in "one:" "pp2:-pp 2" "pp2_eager:-pp 2 --enforce-eager" "one_eager:--enforce-eager"; do
  name=${run%%:*} flags=${run#*:}
  timeout 300 $B --prompt-tokens ${PROMPT:-512} --reps 1 --decode-context ${CTX:-512} --decode-steps 8 \
    --batch-sizes ${BATCHES:-1,16,64} --json "$OUT/pp48_$name.json" $flags "$@" > "$OUT/pp48_$name.log" 2>&1 ||
    { fail=1; echo "$name: failed"; tail -5 "$OUT/pp48_$name.log"; }
  grep -E "^(prompt|decode batch)" "$OUT/pp48_$name.log" | sed "s|^|$name: |"
done
# the same model every way (random weights are drawn per tensor, whichever rank holds a slice):
# the greedy tokens of every batch size agree
python3 - "$OUT" <<'PY' || fail=1
import json, sys
runs = {n: json.load(open(f"{sys.argv[1]}/pp48_{n}.json")) for n in ["one", "pp2", "pp2_eager", "one_eager"]}
ref = [d["ids_hash"] for d in runs["one"]["decode"]]
bad = [n for n, r in runs.items() if [d["ids_hash"] for d in r["decode"]] != ref]
print("pp48: greedy tokens the same in all four runs" if not bad else f"pp48: greedy tokens differ: {bad}")
sys.exit(1 if bad else 0)
PY
exit $fail
