#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: where one token's absorbed MLA decode spends its time
# at short and long contexts — Nsight Compute's duration of each kernel of a call (the
# tensor-core kernel and the splits' merge, mla_tcw_k / mla_tcd_k and mla_merge_k) for BF16 rows
# at each of LENS (default "32768 131072 1048576"), beside `--bench-only mla`'s event timing of
# the whole call (test_cuda_mla.c's DS_BENCH_MLA_LONG: forms 1-3 make 36 merges, then the
# warp-specialized form's pairs; the first two pairs skipped), and the same for the splits' merge
# by warps (mla_merge_w_k, its two launches after two). Output: $OUT/ncu_mla_<len>.txt.
. "$(dirname "$0")/env.sh"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 1; }
for n in ${LENS:-32768 131072 1048576}; do
  DS_BENCH_MLA_LONG="${DT:-bf16} $n" timeout 120 .devbin/test_cuda_kernels --bench-only mla 2>&1 |
    grep -E "absorbed decode 1 x $n rows.*warp-specialized(, merge warps)?(, graph of [0-9]+)?\)"
  DS_BENCH_MLA_LONG="${DT:-bf16} $n" timeout 200 "$NCU" --clock-control none \
    --kernel-name-base function -k regex:"mla_tcw_k|mla_merge_k" --launch-skip 40 --launch-count 4 \
    --section SpeedOfLight --section LaunchStats \
    .devbin/test_cuda_kernels --bench-only mla > "$OUT/ncu_mla_$n.txt" 2>&1
  echo "ncu $n rc $?"
  # the splits' merge by warps (mla_merge_w_k, session 48): only the merge-warps runs launch it
  DS_BENCH_MLA_LONG="${DT:-bf16} $n" timeout 200 "$NCU" --clock-control none \
    --kernel-name-base function -k regex:"mla_merge_w_k" --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section LaunchStats \
    .devbin/test_cuda_kernels --bench-only mla >> "$OUT/ncu_mla_$n.txt" 2>&1
  echo "ncu merge warps $n rc $?"
  grep -E "^  [a-z_]+.*\(|Duration|Grid Size|Block Size|DRAM Throughput" "$OUT/ncu_mla_$n.txt" |
    sed 's/  */ /g' | cut -c1-160 | head -24
done
