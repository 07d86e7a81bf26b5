#!/usr/bin/env bash
# Replays every saved failing seed of the cache fuzzer (tests/cachefuzz/cases/*.case: one line of
# cache_fuzz arguments each). A case whose -tp/-pp need MPI runs through mpirun like any other.
set -u
bin=$1
dir=$2
n=0
fail=0
for c in "$dir"/*.case; do
  [ -e "$c" ] || continue
  n=$((n + 1))
  if ! "$bin" --case "$c" > /tmp/cache-fuzz-case.$$ 2>&1; then
    echo "FAILED: $c"; cat /tmp/cache-fuzz-case.$$; fail=$((fail + 1))
  fi
done
rm -f /tmp/cache-fuzz-case.$$
echo "$((n - fail)) passed, $fail failed"
[ "$fail" = 0 ] && [ "$n" -gt 0 ]
