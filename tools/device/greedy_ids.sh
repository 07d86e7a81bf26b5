#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: the greedy token ids of a few prompts, one sequence at
# a time on the GPU (deterministic: no batch around it), for the bundled model and bench-large's
# random checkpoint (written by all.sh to /tmp/bench-large; skipped when absent). Two builds that
# must compute the same thing (a restructure) print the same file: $OUT/greedy_ids.txt.
. "$(dirname "$0")/env.sh"
f="$OUT/greedy_ids.txt"
: > "$f"
gen() { # model prompt
  echo "== $1 :: $2" >> "$f"
  .devbin/deltaserve generate --model "$1" --device cuda -t 0 -n 48 --ignore-eos --print-ids \
    -p "$2" 2>/dev/null | tail -1 >> "$f"
}
for p in "Mia has 23 apples. She buys 3 bags with 12 apples in each bag. How many apples does she have now?" \
         "Q: A train travels 60 km in 1 hour. How far does it go in 5 hours?\nA:" "Hello!"; do
  gen models/gsm-k3 "$p"
done
if [ -f /tmp/bench-large/config.json ]; then
  gen /tmp/bench-large "The quick brown fox"
  gen /tmp/bench-large "1 2 3 4 5 6 7 8"
fi
cat "$f"
