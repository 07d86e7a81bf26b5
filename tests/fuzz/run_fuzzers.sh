#!/usr/bin/env bash
# Runs every libFuzzer target of BUILD_DIR for SECONDS each:  run_fuzzers.sh BUILD_DIR SECONDS
#
# Each target starts from its committed seeds (tests/fuzz/corpus/<target>/, which also hold every
# crashing input found so far, so they are replayed first) plus the corpus it grew in earlier runs
# (BUILD_DIR/fuzz-corpus/<target>/, not committed). A crash, leak, sanitizer report or timeout
# stops that target; its input is copied into the committed corpus as crash-<target>-<hash> and
# the script exits 1 after the other targets have run. One line per target says what happened.
set -u
BUILD=${1:?usage: run_fuzzers.sh BUILD_DIR SECONDS}
SECONDS_EACH=${2:?usage: run_fuzzers.sh BUILD_DIR SECONDS}
HERE=$(cd "$(dirname "$0")" && pwd)
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
status=0
for src in "$HERE"/fuzz_*.c; do
  t=$(basename "$src" .c)
  bin="$BUILD/$t"
  [ -x "$bin" ] || { echo "fuzz: $bin is not built"; status=1; continue; }
  seeds="$HERE/corpus/$t"
  work="$BUILD/fuzz-corpus/$t"
  art="$BUILD/fuzz-artifacts/$t"
  mkdir -p "$seeds" "$work" "$art"
  log="$BUILD/fuzz-$t.log"
  # -timeout: one input taking this long is a finding (a hang); -rss_limit_mb likewise.
  "$bin" -max_total_time="$SECONDS_EACH" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$art/" "$work" "$seeds" >"$log" 2>&1
  rc=$?
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1)
  if [ $rc -ne 0 ]; then
    status=1
    found=0
    for a in "$art"/*; do
      [ -f "$a" ] || continue
      kind=$(basename "$a" | cut -d- -f1)
      dst="$seeds/$kind-$t-$(sha1sum "$a" | cut -c1-12)"
      cp "$a" "$dst" && rm -f "$a" && found=1 && echo "fuzz: $t: kept $dst"
    done
    echo "fuzz: $t FAILED (rc $rc, ${execs:-?} runs) — log: $log"
    grep -m1 -E 'ERROR: |runtime error|fuzz invariant failed|Timeout|out-of-memory' "$log" || tail -5 "$log"
    [ $found = 1 ] || echo "fuzz: $t: no crashing input was written"
  else
    echo "fuzz: $t ok: ${SECONDS_EACH}s, ${execs:-?} runs, ${cov:-cov ?}"
  fi
done
exit $status
