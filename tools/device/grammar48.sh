#!/usr/bin/env bash
# On the GPU machine, with .devbin carried and llguidance importable by python3 (its wheel
# installed with `pip --target`, PYTHONPATH set): what constrained decoding costs a decode step at
# batch 32 (issue 34), at the shape of Kimi-Linear-48B-A3B (random weights, its 163,840-id
# tokenizer). One `serve`, then `bench serve` at concurrency CONC twice in turn, plain and with
# every request carrying a json_schema response_format; TPOT and ITL are what compare. A
# constrained output may end early at its grammar's end; the plain run after it asks for the same
# lengths (--output-lens-from), since shorter outputs alone make each token carry more admissions. Rows of the
# two runs: $OUT/grammar48${TAG}_{plain,schema}*.json (TAG: a suffix of one's own for a second
# setting in the same call, e.g. DS_MASKS_BESIDE=0 TAG=_before), the ratio printed last.
. "$(dirname "$0")/env.sh"
PORT=${PORT:-8125}
CONC=${CONC:-32}
serve48_start $PORT "$OUT/grammar48.log" 64 "$@" || { echo "the server never came up"; exit 1; }
# strings and arrays of them without an upper count: the grammar stays open for the whole output
# unless the model closes it
RF='{"type":"json_schema","json_schema":{"name":"notes","schema":{"type":"object","properties":{"title":{"type":"string","maxLength":80},"notes":{"type":"array","items":{"type":"object","properties":{"id":{"type":"integer"},"text":{"type":"string"},"tags":{"type":"array","items":{"enum":["alpha","beta","gamma"]}}},"required":["id","text"]}}},"required":["title","notes"],"additionalProperties":false}}}'
b() { # name extra-args...
  local name=$1; shift
  timeout ${STEP_TIMEOUT:-150} .devbin/deltaserve bench serve --url "http://127.0.0.1:$PORT" \
    --num-prompts $((4 * CONC)) --concurrency $CONC --input-len ${IN_LEN:-128} \
    --output-len ${OUT_LEN:-256} --seed 1 --out "$OUT/grammar48${TAG:-}_$name.json" "$@" | tail -14
}
# each plain run asks for exactly the output lengths its constrained run produced (ignore_eos), so
# both runs admit the same requests at the same token counts and only the masks differ
for rep in 1 2; do
  b schema$rep --response-format "$RF"
  b plain$rep --output-lens-from "$OUT/grammar48${TAG:-}_schema$rep.json"
done
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^[a-z:]*(grammar_(compiles|cache_hits|mask|accept)|engine_step)[a-z_]*(total)?\{" | head -8
serve48_stop $PORT
python3 - "$OUT" "${TAG:-}" <<'PY'
import json, sys
d = {n: json.load(open(f"{sys.argv[1]}/grammar48{sys.argv[2]}_{n}.json"))
     for n in ("plain1", "schema1", "plain2", "schema2")}
for n, r in d.items():
    print(f"{n}: completed {r['completed']} failed {r['failed']} mean TPOT {r['mean_tpot_ms']:.3f} "
          f"ms, median ITL {r['median_itl_ms']:.3f} ms, p99 ITL {r['p99_itl_ms']:.3f} ms, "
          f"output tokens {r['total_output_tokens']}")
for k in ("mean_tpot_ms", "median_itl_ms"):
    p = min(d["plain1"][k], d["plain2"][k]); s = min(d["schema1"][k], d["schema2"][k])
    print(f"{k}: schema / plain = {s / p:.4f} (best of two each: {s:.3f} vs {p:.3f})")
PY
