#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: the fused KDA decode (ds_cu_kda_decode_fused) through
# the whole model. The bundled and test models have KDA head dims 16 and 64 and the full-rank
# gate, so their decode steps never take it; the bench-large preset (head dim 128, low-rank gate,
# ~2 GB of random weights, written to $BL first when missing) does. Greedy generation at batch 1
# with the fused kernel and with the seven launches it replaces (DS_CUDA_KDA_FUSED=0) must give
# the same 32 token ids (the same bits, step after step); the CPU's are compared too.
#   BL=dir (default /tmp/bench-large)   tools/device/fused_check.sh
. "$(dirname "$0")/env.sh"
BL=${BL:-/tmp/bench-large}
B=.devbin/deltaserve
[ -f "$BL/config.json" ] || $B init-model --preset bench-large --out "$BL" > "$OUT/bl_init.log" 2>&1 ||
  { echo "fused check: init-model failed"; exit 1; }
P="Question: Tom has 3 apples and buys 5 more. How many apples does he have? Answer:"
fail=0
gen() { # name, device, env...
  local name=$1 dev=$2; shift 2
  env "$@" $B generate --model "$BL" --prompt "$P" -n 32 -t 0 --ignore-eos --print-ids --device "$dev" \
    > "$OUT/fused_$name.txt" 2> "$OUT/fused_$name.err" || { echo "fused check: $name failed"; fail=1; }
}
gen fused cuda DS_BATCH_INVARIANT=1 DS_CUDA_KDA_FUSED=1
grep -q "take the fused KDA kernel" "$OUT/fused_fused.err" || { echo "fused check: the fused kernel did not apply"; fail=1; }
gen unfused cuda DS_BATCH_INVARIANT=1 DS_CUDA_KDA_FUSED=0
gen cpu cpu DS_BATCH_INVARIANT=1
if cmp -s "$OUT/fused_fused.txt" "$OUT/fused_unfused.txt"; then
  echo "fused check: the fused KDA decode's tokens == the seven launches' tokens"
else
  echo "fused check: tokens differ (fused / seven launches):"; cat "$OUT/fused_fused.txt"; echo; cat "$OUT/fused_unfused.txt"; fail=1
fi
cmp -s "$OUT/fused_fused.txt" "$OUT/fused_cpu.txt" && echo "fused check: GPU tokens == CPU tokens" ||
  echo "fused check: GPU and CPU tokens differ (random weights: near-ties are possible; not a failure)"
grep -h "decode" "$OUT/fused_fused.err" | tail -1
exit $fail
