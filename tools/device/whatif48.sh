#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: where a graphed batch-1 decode step of the
# Kimi-Linear-48B-A3B shape spends its time, as what-ifs — the step timed again with the kernels of
# one profile label (or a set of them) left out (DS_CUDA_SKIP; the results are wrong, the timing is
# what counts). A label whose removal saves more than its kernels take alone sits on the critical
# path; one that saves nothing runs beside it. Output: one line per case, ms per step and the
# saving against the full step.   tools/device/whatif48.sh [batch [bench options, e.g. -q ptpc_fp8]]
# CASES (lines of labels) replaces the list below.
# (Leaving out "moe router" leaves the experts without valid rows, so its saving includes theirs.)
. "$(dirname "$0")/env.sh"
B=${1:-1}
shift || true
EXTRA="$*"
step() {
  DS_CUDA_SKIP="$1" .devbin/deltaserve bench --model $SHAPE48 --load-format random \
    --device cuda --prompt-tokens 16 --reps 1 --decode-context 512 --decode-steps 8 --batch-sizes "$B" \
    $EXTRA 2>/dev/null | awk -v b="$B" '$1 == "decode" && $3 == b { print $5 }'
}
full=$(step "")
printf "%-60s %8s ms\n" "(everything)" "$full"
while IFS= read -r labels; do
  [ -z "$labels" ] && continue
  ms=$(step "$labels")
  printf "%-60s %8s ms  saves %s ms\n" "$labels" "$ms" "$(awk -v a="$full" -v b="$ms" 'BEGIN { printf "%.3f", a - b }')"
done < <(if [ -n "${CASES:-}" ]; then printf '%s\n' "$CASES"; else cat <<'CASES'
norms, residual, attnres
kda qkv
kda gates, beta
kda conv+l2norm
kda recurrence
kda out gate, norm
kda o_proj
kda gates, beta;kda conv+l2norm;kda recurrence;kda out gate, norm
moe shared experts
moe router
moe group;moe grouped experts
moe combine
moe router;moe combine;norms, residual, attnres
mla q, kv_a;mla absorbed q, o;mla absorbed attend;mla gate, o_proj
mla q, kv_a
mla absorbed q, o
mla absorbed attend
mla gate, o_proj
final norm, lm_head
norms, residual, attnres;kda gates, beta;kda conv+l2norm;kda recurrence;kda out gate, norm;moe router;moe combine;moe shared experts;mla absorbed q, o;mla absorbed attend
CASES
fi)
