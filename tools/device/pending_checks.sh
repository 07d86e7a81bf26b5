#!/usr/bin/env bash
# On the GPU machine, with .devbin carried (tools/device/pack_devbin.sh) and the wheels of
# llguidance, openai, jsonschema, pytest and their needs in .whl (cp3XX-specific ones under
# .whl/bin/cp3XX/): the GPU checks still to run (session 27 ran 1-5 once: bench/RESULTS.md), in one call (~9 min).
#   1. every kernel check (the FP8 split sum of 7148166, the grammar draw kernel);
#   2. tests/e2e/test_structured.py and test_tools.py against `serve --device cuda`, plain and
#      with DSpark (issue 34's GPU end-to-end);
#   3. constrained decoding's cost at the 48B shape, concurrency 32 (tools/device/grammar48.sh),
#      the masks made before the forward and beside it (issue 34's < 5%);
#   4. decode at batch 1 and 32, BF16 then ptpc_fp8 (and ptpc_fp8 with DS_CUDA_F8_PREQUANT=1),
#      graphs (issue 32's ratio in one call);
#   5. Nsight Compute per kernel of a batch-1 step, BF16, ptpc_fp8 and ptpc_fp8 with the codes made
#      first (where the FP8 step's time goes, and what each product's own quantization costs:
#      tools/device/ncu48.sh; bench/RESULTS.md session 27).
#   6. (session 28's open question) is the FP8-to-F16 conversion what holds the FP8 streams back?
#      bench_f8cvt (the conversion alone), then, with .devbin packed by
#      `DS_DEVBIN_F8BITS=1 tools/device/pack_devbin.sh`, the kernels built with -DDS_CUDA_F8_BITS:
#      their checks, the experts' bench and decode at batch 1 against the default build's; and
#      (DS_DEVBIN_F8MMA=1 as well) the same for -DDS_CUDA_F8_MMA, the streams on E4M3 tensor cores.
# The working tree travels whole (64 MiB at most): with the wheels (~16 MiB) the bundled model
# (46 MB) does not fit beside them; leave it out of the call's tree for that call (docs/cuda.md).
#   7. (issue 36) the time to first token through the P/D pair against one server, on the GPU
#      (needs models/gsm-k3 in the tree: not with the wheels);
#   8. (issue 33) long48.sh at 128K (LENS=1048576 for the million-token run: a call of its own).
#   9. (issue 33) chunked KDA: the KDA checks (both forms of pass 1 in modes 1 and 3, and the
#      BF16 mode 2 of session 32, against the CPU), then the timings of 8192 tokens x 32 heads in
#      every mode.
#  10. (issue 33) a long context's MLA: the kernel checks (the expanded attention's blocks and
#      their log-sum-exp merge; decode's absorbed attention on tensor cores, f32, FP8 and BF16
#      rows, and session 33's 16-warp form for BF16 rows, not yet run), their timings, then
#      decode after 1M tokens (long48.sh; the H200: an H100 holds the cut shape's million rows
#      only in FP8 or BF16) on tensor cores (TCS="0 8192" for the f32 kernels too) with BF16,
#      FP8 and f32 rows, and BF16 rows again with 16 warps a block (DS_CUDA_MLA_DECODE_TC_WARPS).
#      Decode's context is zeros (`bench --decode-fill zeros`), not a prefill.
#  11. (issue 33) the time to first token of a 1M-token prompt and its split by op (a call of its
#      own: at the 48B shape its MLA attention alone is minutes).
#  12. (issue 32) the FP8 streams: their checks with K split further (DS_CUDA_F8_SPLIT_MIN, session
#      32: more warps a product), the experts' kernel at one token and decode at batch 1 and 32
#      with the split minimum 4 (default), 2 and 1 beside BF16; with NCU=1 also the experts with
#      the quantizers first and Nsight Compute's occupancy and warp states (ncu_detail.sh) for
#      BF16, FP8, and FP8 with the codes made first (session 32 ran those).
#  13. (issue 32, session 34) the quantizers' rounding on the conversion unit: the bit-for-bit
#      check, the FP8 checks (the ring's word for word), the products' and experts' timings at
#      one token, decode batch 1, 32 and 256 in BF16 and ptpc_fp8 (two rounds, alternating; RINGS=1
#      also the ring's forms, DS_CUDA_F8_RING: removed in session 36, those runs now time the
#      register window), and with the codes made first; PROF=1: the per-op
#      profile of a batch-1 step, BF16 and ptpc_fp8.
#  14. (issue 32, session 34; run in session 35; removed with DS_CUDA_F8_NORM_CODES in session 38)
#  15. (issue 32, session 35) the FP8 streams on E4M3 tensor cores fed the activations' codes as
#      bytes (pack with DS_DEVBIN_F8MMA=1): the FP8 checks of both builds, the products' and one
#      token's experts' timings, decode at batch 1, 32 and 256 (BATCHES) in BF16, ptpc_fp8 and
#      ptpc_fp8 on E4M3 tensor cores, ROUNDS times.
#  17. (issue 32, session 36) one token's FP8 products a warp a row on the CUDA cores
#      (fp8_rows.cuh, DS_CUDA_F8_ROWS): the FP8 checks, the products' and experts' timings at one
#      token in every form, decode batch 1 at 4 (default), 2 and 8 blocks an SM and with the tiles
#      (-1) beside BF16; then decode at batches 2-64 with K whole (DS_CUDA_F8_WHOLE_K=2).
#  18. (issues 32 and 33, session 37) the weights of decode's products prefetched into L2 while the
#      kernels before them run (DS_CUDA_L2_PREFETCH=MB): the matmul checks (a chain of products
#      word for word with and without, eager and graphed), decode batch 1 in BF16 and in ptpc_fp8's
#      forms (the tiles; the dense products a warp a row) at 0/16/32 MB,
#      two rounds; batches 4 and 16 in BF16 with and without.
#  16. (issue 32, session 35; run in session 36) the FP8 streams'
#      K split forced (DS_CUDA_F8_SPLIT: the grid's waves; 0 the rule's): the FP8 checks (among
#      them the forced splits, 8 parts and whole, products and experts), decode batch 1 and 32 at
#      0/1/2/4/8 beside BF16.
#  19. (issues 32, 33, session 38) the router's choice with its lists in shared memory: the
#      checks, decode batch 1 against a baseline's binary (DS_DEVBIN_BASE) with the step's host
#      and device times, and a batch-1 step's kernel timeline (timeline48.sh). (Its first form,
#      run in session 38: the index copies waited for or not, measured the same; removed.)
#  20. (issue 33, session 38; run in session 39: 1-2% slower, removed with DS_CUDA_EXPERT_FLOW)
#  21. (issue 33, session 39; run in session 39) chunked KDA's BF16 mode: its operands handed to the
#      scan in BF16 and pass 1 on BF16 tensor cores (DS_CUDA_KDA_PREP_TC=1 in mode 2): the KDA
#      checks, kda_words.sh (every mode's outputs word for word against a baseline's binary —
#      pack with DS_DEVBIN_BASE_TESTS — the errors against the float64 reference, both binaries'
#      timings), and with test_cuda_kernels_clk in .devbin (DS_DEVBIN_CLOCKS=1) pass 1's phases
#      in every form.
#  22. (issue 32, session 40) one token's FP8 down pass reading its routing before its wait, in
#      its final form (its checks ran in session 40 with a pre-wait L2 prefetch also on, since
#      removed): the moe fp8 checks (mode 10), then ptpc_fp8 decode batch 1 with
#      DS_CUDA_EARLY_EXPERTS on and off, ROUNDS rounds (default 2).
#  23. (issue 33, session 41; run in session 41, removed in session 42: step 24 times the same forms
#      and more) decode's absorbed MLA in its warp-specialized form (BF16 and FP8 rows)
#      (DS_CUDA_MLA_DECODE_WS): the kv rows checks (its words against the 8-warp 32-row kernel's,
#      and the CPU), the kernel alone at 128K and 1M rows beside the other forms, then decode after
#      1M tokens with it on and off (long48.sh), for the latents' dtypes in KVS (default "bf16
#      fp8"; the form takes FP8 rows too, converted by its S warps; DECODE_KVS for the decode runs
#      alone; LENS23 the kernel's lengths), ROUNDS rounds (default 1).
#  24. (issue 33, session 42) FP8 rows' codes moved into BF16 by their bit fields, the scales on the
#      query's and P's side (mla_decode_tc.cu): the kv rows checks, then against a baseline's
#      binaries (pack with DS_DEVBIN_BASE and DS_DEVBIN_BASE_TESTS) the kernel alone over KVS24's
#      rows (default "fp8 bf16": the warp-specialized form's S warps now hold the query in
#      registers, BF16 rows too) at LENS24 (default 1048576) and decode after 1M FP8 tokens
#      (long48.sh), then after 1M BF16 tokens with DS_CUDA_MLA_DECODE_WS 1 (now BF16's default
#      there) and 0, ROUNDS rounds (default 1), alternating; BINS24="" the new binaries alone;
#      NCU24=1 also Nsight Compute on the warp-specialized kernel (ncu_tcd.sh), FP8 and BF16 rows.
#      Session 42 ran the kernels and the FP8 decode on an H100; session 43 the rest on an H100
#      (the per-row checks, the FP8 scores from the staged codes, now the default, BF16's decode
#      after 1M with the form on and off: bench/RESULTS.md). Not yet run: any of it on the H200.
#      (BINS24="" skips the loops over binaries; name a suffix list to run them. WS24: the BF16
#      decode runs' DS_CUDA_MLA_DECODE_WS values, default "1 0"; "" none.)
#  25. (issue 33, session 44) chunked KDA's gate, beta and head norms inside its first pass
#      (DS_CUDA_KDA_RAW): the KDA checks (the raw inputs word for word against the launches they
#      replace, every mode), then prefill of 8192 tokens and decode after 512 (greedy ids) with it
#      on and off, ROUNDS rounds (default 2), alternating; then the eager profile's split with it on.
#      Session 44 ran it on H100s (bench/RESULTS.md); not yet on the H200.
#  26. (issue 33, session 45) expanded MLA's pipelined wgmma form and the shared fl_* pieces
#      (mla_prefill.sh: every form's checks and timings, prompt 8192 in MODES "3 4", the 128K TTFT in
#      "1 3 4"), then the experts' gather from x rounded once (DS_CUDA_EXPERT_X16): the moe checks
#      (the words against the plain gather) and prefill of 8192 tokens with it on and off, ROUNDS
#      rounds. Ran in session 46 on an H100 (bench/RESULTS.md): mode 4 and x16 are the defaults.
#  27. (issue 32, session 46) ptpc_fp8's prefill, its routed experts on FP8 tensor cores through
#      cuBLASLt (moe_fp8_gemm.cu): the moe fp8 checks (modes 11 and 12 against the CPU), then
#      8192 tokens in BF16, ptpc_fp8 and ptpc_fp8 with DS_CUDA_EXPERT_GEMM=0 (the tile kernel, as
#      before; session 21 measured 0.42x BF16's tok/s), then the eager per-op profile of
#      ptpc_fp8's prompt. The dense FP8 products' scales as cuBLASLt's outer-vector scales (no
#      second pass over y) where it has them: the matmul fp8 checks say which form ran. Ran in
#      session 46 on H100s (bench/RESULTS.md). Next: `git cherry-pick c425d0d` (each token
#      quantized once, the gather copying codes), rebuild, pack and run it again against d97c279's
#      prompt time (99.67 ms then).
#  28. (issue 33, session 46; ran in session 47 on an H100: 3xBF16 the default since, bench/RESULTS.md;
#      removed: step 32 times the same lines and more)
#  29. (issue 33, session 46) the BF16 experts' GEMMs as cuBLASLt pointer-array batches
#      (DS_CUDA_EXPERT_LT=1; cublasGemmBatchedEx ran them at 466-505 TFLOP/s, the FP8 experts'
#      cuBLASLt batches at 745-791): the moe checks (modes 7-8), then prefill of 8192 tokens with it
#      on and off, ROUNDS rounds alternating, and its eager profile's expert rows. Not yet run.
#  34. (issue 32, session 48) one token's MXFP4 experts in one part (DS_CUDA_FP4_ONE=1: the
#      activations rounded to BF16 once; 196 instructions a step of the streaming kernel against
#      the three exact parts' 217, by the SASS): the moe mxfp4 checks (the one-part form at 1e-2
#      against the CPU, also with codes of +-0.5 alone), the K3 experts' timings at T=1 and 8 in
#      both forms, then decode of K3's layer shapes (configs/kimi-k3-slice4) at batch 1 and 8 both
#      ways, ROUNDS rounds.
#      Session 49 (after its H100 run of this step): the one-part form stages its operands one
#      part wide and runs three blocks an SM — run the step again (checks, timings, profile).
#      Session 49: step 34 also profiles one token's passes with Nsight Compute (three parts, then
#      one part): issue slots, eligible warps, occupancy — whether fewer instructions a byte can
#      pay (mma.sync E4M3 is emulated on sm_90 — F2FP conversions and two F16 HMMA a k32 mma — so
#      a w4a8 step at fewer instructions needs wgmma: docs/quantization.md §2).
#  35. (issue 32, session 49) decode's FP8 products on wgmma (DS_CUDA_F8_WG=1 dense, 2 one token's
#      routed experts, 3 both;
#      matmul_fp8_wg.cu: the codes straight from the load into native E4M3 tensor cores — mma.sync
#      on E4M3 is F16 underneath on sm_90 — one warpgroup a 64-row tile, K split over blocks with
#      the last block adding the slices in order): the matmul fp8 and moe fp8 checks (modes 8 and
#      14; every split re-run for the same bits), the fp8 and moefp8 benches (the wgmma form beside
#      the tiles and a warp a row at T = 1, 2, and cuBLASLt at T = 16 as the vendor's FP8 rate on
#      the same bytes), then decode of the 48B shape with ptpc_fp8 at batch 1 and 8,
#      DS_CUDA_F8_WG 0, 1 and 3, and BF16,
#      ROUNDS rounds alternating (the greedy ids' hashes beside).
#  36. (issue 32, session 49) the wgmma FP8 form under Nsight Compute: one token's 12544 x 2304
#      product (64% of copy against the tiles' 57%, H100) and 18432 x 2304 (47% against 58%; the
#      bench's launches of the form before it: 3 shapes x 92: two forms at T = 1 and 2), to see
#      what holds the second back; then the bench's products with the codes made first
#      (DS_CUDA_F8_PREQUANT: the form's fixed cost a product is the token's quantization in every
#      block) and decode at batch 1, ptpc_fp8 default against DS_CUDA_F8_WG=1 with codes first.
#  33. (issue 33, session 48) decode's MLA attend at a 512-row context (7 layers of the 48B step at
#      ~20 us each by session 16's what-if: latency, not bytes): the step at batch 1 with the
#      tensor-core kernel from every context (DS_CUDA_MLA_DECODE_TC=1) against its 8192-row
#      default, and with the all-heads kernel forced (DS_CUDA_MLA_ALL_HEADS=2), f32 (auto) and BF16
#      latents, and each with the splits merged by warps (DS_CUDA_MLA_MERGE_WARPS=1), ROUNDS rounds
#      alternating; the greedy ids' hashes say whether the words moved.
#  32. (issue 33, session 47) 3xBF16's first pass on tensor cores too (DS_CUDA_KDA_PREP_TC=1 in
#      mode 4: its block products and solve in 3xBF16; in 3xTF32 that form was no faster, the pass
#      bound by shared memory): the kda checks (mode 4 in both forms of pass 1), the kernel's
#      timings (3xTF32, 3xBF16 with pass 1 f32 and on tensor cores, varlen), prefill A/B.
#  31. (issues 32 and 33, session 47) the experts' gathers (BF16 x16 and FP8 codes) a warp a row, 8
#      rows a block, 16-byte copies: the moe and moe fp8 checks, then prompts of 8192 tokens in BF16
#      and ptpc_fp8 with deltaserve and deltaserve_base (DS_DEVBIN_BASE), ROUNDS rounds alternating.
#  30. (issue 32, session 47) step 27's follow-up with c425d0d cherry-picked (each token quantized
#      once, the gather copying codes): the moe fp8 checks, then ptpc_fp8's prompt of 8192 tokens
#      with deltaserve and deltaserve_base (pack with DS_DEVBIN_BASE = the build before), ROUNDS
#      rounds alternating.
# STEPS: which of them (default "24 22": 22 has not run in its final form, 26 and 27 ran in session
# 46 on H100s, 23 ran in session 41 on an
# H100 without its BF16 decode runs and not on the H200; 20 and 21 ran in session 39, 19 in session 38, 17 in session 37,
# 18 in part; 1-5 ran in sessions 27-28, 6, 7 and 9
# in session 31, 8 at 128K in session 31 on an H100, 9-12 in session 32 on the H200, 9, 10 and 12
# in session 33 on H100s, 10 and 13 in session 34, 9, 14 and 15 in session 35, 9 and 16 in
# session 36: bench/RESULTS.md).
set -u
OUT=${OUT:-/tmp/ds-out}
STEPS=" ${STEPS:-24 22} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
T0=$(date +%s)
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
# checks LOG SECTIONS [SUFFIX]: test_cuda_kernels$SUFFIX's checks of SECTIONS into $OUT/LOG, then
# its exit status and the counts of passed and failed checks on one line
checks() {
  DS_CUDA_CHECKS="$2" timeout 150 ".devbin/test_cuda_kernels${3:-}" > "$OUT/$1" 2>&1
  echo "checks rc $? ($(grep -c ' ok$' "$OUT/$1") ok, $(grep -c FAIL "$OUT/$1") FAIL)"
}
# prefill_ab NAME VAR VALUES: prefill of 8192 tokens at the 48B shape (env.sh's) with VAR set to each
# of VALUES in turn, ROUNDS rounds (default 2) alternating: the prompt line tagged, the JSON in
# $OUT/NAME_VALUE_ROUND.json
prefill_ab() {
  local r v
  for r in $(seq "${ROUNDS:-2}"); do
    for v in $3; do
      env "$2=$v" timeout 120 .devbin/deltaserve bench --model $SHAPE48 --load-format random \
        --device cuda --prompt-tokens 8192 --reps 3 --decode-context 512 --decode-steps 4 \
        --batch-sizes 1 --json "$OUT/$1_${v}_$r.json" 2>&1 | grep -E "^prompt" | sed "s/^/[$2=$v, $r] /"
    done
  done
}
# prompt_bins NAME QUANTS: the same prompt of 8192 tokens by deltaserve and deltaserve_base
# (pack_devbin.sh's DS_DEVBIN_BASE) for each quantization of QUANTS ("none": BF16), ROUNDS rounds
# (default 2) alternating: the prompt line tagged, the JSON in $OUT/NAME_BINARY_QUANT_ROUND.json
prompt_bins() {
  local r q b
  for r in $(seq "${ROUNDS:-2}"); do
    for q in $2; do
      for b in deltaserve deltaserve_base; do
        [ -x ".devbin/$b" ] || continue
        timeout 150 ".devbin/$b" bench --model $SHAPE48 --load-format random --device cuda \
          --prompt-tokens 8192 --reps 3 --decode-context 512 --decode-steps 4 --batch-sizes 1 \
          $([ "$q" = none ] || echo "-q $q") --json "$OUT/$1_${b}_${q}_$r.json" 2>&1 |
          grep -E "^prompt" | sed "s/^/[$b, $q, $r] /"
      done
    done
  done
}
# b48 STEPS BATCHES: the decode benchmark of the 48B shape (env.sh's) as this script runs it
b48() {
  echo "bench --model $SHAPE48 --load-format random --device cuda --prompt-tokens 16 --reps 1" \
    "--decode-context 512 --decode-steps $1 --batch-sizes $2"
}
# ncu_runs SECTION KERNEL_REGEX LAUNCHES "SKIP TAG" ...: ncu_bench.sh on `--bench-only SECTION`
# for each (launches skipped, file tag), then the lines that say what bounds the kernel
ncu_runs() {
  local sec=$1 re=$2 n=$3 f skip tag
  shift 3
  for f in "$@"; do
    read -r skip tag <<< "$f"
    SKIP=$skip TAG=$tag bash "$(dirname "$0")/ncu_bench.sh" "$sec" "$re" "$n" | sed "s/^/[$tag] /"
    grep -E "^  [a-z_0-9]+.*\(|Duration|DRAM Throughput|Issue Slots Busy|Issued Warp Per Sched|No Eligible|Warp Cycles Per Issued|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Grid Size|stalled" \
      "$OUT/ncu_$sec$tag.txt" | sed 's/  */ /g' | cut -c1-150 | head -40
  done
}
# b48_run TAG NAME [VAR=VALUE ...] COMMAND ARGS: runs the bench command (b48's) with --json
# $OUT/NAME.json, then prints under TAG its decode line, the step times' line (DS_CUDA_STEP_TIMES)
# and the greedy ids' hash
b48_run() {
  local tag=$1 name=$2
  shift 2
  env "$@" --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
  echo "[$tag] $(grep -E '^decode batch' "$OUT/$name.txt" | tr -s ' ')" \
    "$(grep -o 'cuda step times.*' "$OUT/$name.txt")" \
    "ids $(grep -o '"ids_hash": "[0-9a-f]*"' "$OUT/$name.json" | tail -1)"
}
PV=$(python3 -c 'import sys;print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
el "python $PV"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl .whl/bin/$PV/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site
python3 -c "import llguidance, openai, jsonschema, pytest; print('python packages ok')"
. "$(dirname "$0")/env.sh"
if want 9; then
el "9. chunked KDA, pass 1 on tensor cores: checks, then timings"
checks kda_check.log kda
grep -E "FAIL|chunked.*out" "$OUT/kda_check.log" | head -30
timeout 120 .devbin/test_cuda_kernels --bench-only kda 2>&1 | grep -E "chunked prefill|copy d2d" |
  tee "$OUT/kda_bench.log"
fi
if want 10; then
el "10. MLA over a long context: checks (blocks, tensor-core decode), timings, decode after 1M tokens"
checks mla_check.log "mla,mla batch,kv rows"
grep -E "FAIL|tensor cores|blocks|checks:" "$OUT/mla_check.log" | head -24
timeout 150 .devbin/test_cuda_kernels --bench-only mla 2>&1 | grep -E "absorbed decode 1 x|expanded" |
  tee "$OUT/mla_bench.log"
# (a card under 120 GB holds the cut shape's million rows only in FP8 or BF16)
KVS=${KV_DTYPES:-$([ "$SHAPE48" = configs/kimi-linear-48b-a3b ] && echo "bf16 fp8 auto" || echo "bf16 fp8")}
for tc in ${TCS:-8192}; do
  DS_CUDA_MLA_DECODE_TC=$tc DS_CUDA_MLA_CTX_BLOCK=131072 LENS=1048576 KV_DTYPES="$KVS" \
    PARTS=decode TAG=_tc$tc STEP_TIMEOUT=150 timeout 400 bash "$(dirname "$0")/long48.sh" 2>&1 |
    grep -E "^decode|failed|all lengths"
done
DS_CUDA_MLA_DECODE_TC_WARPS=16 LENS=1048576 KV_DTYPES=bf16 PARTS=decode TAG=_w16 STEP_TIMEOUT=150 \
  timeout 200 bash "$(dirname "$0")/long48.sh" 2>&1 | grep -E "^decode|failed" | sed "s/^/[16 warps] /"
fi
if want 11; then
el "11. the time to first token of a million-token prompt (a call of its own: ~7 minutes)"
DS_CUDA_MLA_CTX_BLOCK=131072 LENS=1048576 KV_DTYPES="${KV_DTYPES:-auto}" PARTS=ttft \
  STEP_TIMEOUT=${STEP_TIMEOUT:-570} bash "$(dirname "$0")/long48.sh" 2>&1 | tail -6
tail -30 "$OUT"/long1024k_*_profile.txt
fi
if want 12; then
el "12. (issue 32) why the FP8 streams read slowly: the experts' kernel at T=1 with and without the"
el "    quantizers first, decode batch 1 with K split further (DS_CUDA_F8_SPLIT_MIN 4, 2, 1: more"
el "    warps), then Nsight Compute's warp states for BF16, FP8, FP8 with the codes first (NCU=1)"
DS_CUDA_CHECKS="matmul fp8,moe fp8,kda batch" timeout 150 .devbin/test_cuda_kernels 2>&1 |
  grep -E "FAIL|K split|checks:" | head -20
for m in 4 2 1; do
  DS_CUDA_F8_SPLIT_MIN=$m timeout 100 .devbin/test_cuda_kernels --bench-only moefp8 2>&1 |
    grep "bench moe fp8 T=1 " | sed "s/^/[split min $m] /"
done
B48=".devbin/deltaserve $(b48 8 1,32)"
$B48 2>&1 | grep -E "^decode" | sed "s/^/[bf16] /"
for m in 4 2 1; do
  DS_CUDA_F8_SPLIT_MIN=$m $B48 -q ptpc_fp8 2>&1 | grep -E "^decode" | sed "s/^/[fp8, split min $m] /"
done
for w in 4 8; do # one token's experts in more blocks (DS_CUDA_F8_MOE_WAVES), K split to 2 steps
  DS_CUDA_F8_MOE_WAVES=$w DS_CUDA_F8_SPLIT_MIN=2 $B48 -q ptpc_fp8 2>&1 | grep -E "^decode batch 1 " |
    sed "s/^/[fp8, split min 2, experts $w blocks an SM] /"
done
[ "${NCU:-0}" = 1 ] || el "12 done (NCU=1 for Nsight Compute)"
if [ "${NCU:-0}" = 1 ]; then
timeout 100 .devbin/test_cuda_kernels --bench-only moefp8 2>&1 | grep "bench moe fp8 T=1 "
NAME=ncu_fp8d bash "$(dirname "$0")/ncu_detail.sh" -q ptpc_fp8 2>&1 | head -${NCU_LINES:-60}
DS_CUDA_F8_PREQUANT=1 NAME=ncu_fp8p KERNELS="moe_f8m_k|gemv_f8m_k" bash "$(dirname "$0")/ncu_detail.sh" -q ptpc_fp8 2>&1 |
  grep -E "^ [a-z_]+|Duration|DRAM Throughput|Warp Cycles|Achieved Occ" | head -30
NAME=ncu_bf16d bash "$(dirname "$0")/ncu_detail.sh" 2>&1 | head -${NCU_LINES:-40}
fi
fi
if want 13; then
el "13. (issue 32) the quantizers on the conversion unit (session 34): the E4M3 rounding bit for"
el "    bit, the FP8 checks, the FP8 products' and experts' timings, decode BF16 vs ptpc_fp8"
checks fp8_check.log "matmul fp8,moe fp8,kda batch"
grep -E "FAIL|rounding|checks:" "$OUT/fp8_check.log" | head -20
timeout 150 .devbin/test_cuda_kernels --bench-only fp8 2>&1 | grep "T=1 " | head -12
timeout 100 .devbin/test_cuda_kernels --bench-only moefp8 2>&1 | grep "bench moe fp8 T=1 "
B48=".devbin/deltaserve $(b48 16 1,32,256)"
for r in 1 2; do
  $B48 2>&1 | grep -E "^decode" | sed "s/^/[bf16 $r] /"
  $B48 -q ptpc_fp8 2>&1 | grep -E "^decode" | sed "s/^/[fp8 $r] /"
  # RINGS=1: the ring (DS_CUDA_F8_RING depth) with more blocks an SM (dense products, experts)
  [ "${RINGS:-0}" = 1 ] || continue
  for f in "8 2 2" "4 3 3" "4 4 4"; do
    set -- $f
    DS_CUDA_F8_RING=$1 DS_CUDA_F8_GEMV_WAVES=$2 DS_CUDA_F8_MOE_WAVES=$3 $B48 -q ptpc_fp8 \
      --batch-sizes 1 2>&1 | grep -E "^decode batch" | sed "s/^/[fp8 ring $1, $2 | $3 blocks an SM, $r] /"
  done
  DS_CUDA_F8_GEMV_WAVES=3 DS_CUDA_F8_MOE_WAVES=3 $B48 -q ptpc_fp8 --batch-sizes 1 2>&1 |
    grep -E "^decode batch" | sed "s/^/[fp8 registers, 3 | 3 blocks an SM, $r] /"
done
DS_CUDA_F8_PREQUANT=1 $B48 -q ptpc_fp8 --batch-sizes 1 2>&1 | grep -E "^decode" | sed "s/^/[fp8 prequant] /"
if [ "${PROF:-0}" = 1 ]; then # the per-op profile of an eager batch-1 step, BF16 then ptpc_fp8
  for q in none ptpc_fp8; do
    PROMPT=16 BATCHES=1 bash "$(dirname "$0")/profile48.sh" $([ $q = none ] || echo "-q $q") \
      > /dev/null 2>&1
    cp "$OUT/profile.txt" "$OUT/profile_$q.txt"
    grep -A28 -E "decode.*batch 1" "$OUT/profile_$q.txt" | head -30 | sed "s/^/[$q] /"
  done
fi
fi
if want 15; then
el "15. (issue 32, session 35) the FP8 streams on E4M3 tensor cores with the activations' codes as"
el "    bytes (the _f8mma build, DS_DEVBIN_F8MMA=1): checks, products' timings, decode vs default"
for v in "" _f8mma; do
  checks "fp8_check$v.log" "matmul fp8,moe fp8,kda batch" "$v" | sed "s/^/[${v:-default}] /"
  grep -E "FAIL" "$OUT/fp8_check$v.log" | head -8
  timeout 150 .devbin/test_cuda_kernels$v --bench-only fp8 2>&1 | grep "T=1 " | head -6 | sed "s/^/[${v:-default}] /"
  timeout 100 .devbin/test_cuda_kernels$v --bench-only moefp8 2>&1 | grep "bench moe fp8 T=1 " | sed "s/^/[${v:-default}] /"
done
B48="$(b48 16 "${BATCHES:-1,32,256}")"
for r in $(seq "${ROUNDS:-2}"); do
  .devbin/deltaserve $B48 2>&1 | grep -E "^decode batch" | sed "s/^/[bf16 $r] /"
  .devbin/deltaserve $B48 -q ptpc_fp8 2>&1 | grep -E "^decode batch" | sed "s/^/[fp8 $r] /"
  .devbin/deltaserve_f8mma $B48 -q ptpc_fp8 2>&1 | grep -E "^decode batch" | sed "s/^/[fp8 e4m3 mma $r] /"
  # the dense products' ring 4 deep at 3 blocks an SM (the fastest form of the product alone)
  DS_CUDA_F8_RING=4 DS_CUDA_F8_GEMV_WAVES=3 DS_CUDA_F8_MOE_RING=0 .devbin/deltaserve_f8mma $B48 \
    -q ptpc_fp8 --batch-sizes 1 2>&1 | grep -E "^decode batch" | sed "s/^/[fp8 e4m3 mma, ring 4 x 3 $r] /"
done
fi
if want 16; then
el "16. (issue 32, session 35) the FP8 streams' grid: K split forced (DS_CUDA_F8_SPLIT 1/2/4/8) in"
el "    the checks, then decode at batch 1 and 32 beside the rule's split and BF16"
checks fp8_split.log "matmul fp8,moe fp8"
grep -E "FAIL|8 parts|K whole" "$OUT/fp8_split.log" | head -12
B48=".devbin/deltaserve $(b48 16 1,32)"
for r in $(seq "${ROUNDS:-2}"); do
  $B48 2>&1 | grep -E "^decode batch" | sed "s/^/[bf16 $r] /"
  for f in 0 1 2 4 8; do
    DS_CUDA_F8_SPLIT=$f $B48 -q ptpc_fp8 2>&1 | grep -E "^decode batch" | sed "s/^/[fp8 split $f $r] /"
  done
done
fi
if want 17; then
el "17. (issue 32, session 36) one token's FP8 products a warp a row (DS_CUDA_F8_ROWS): the FP8"
el "    checks, the products' and experts' timings, decode batch 1 beside the tiles and BF16;"
el "    then K whole at batches 2-64 (DS_CUDA_F8_WHOLE_K=2 against the rule)"
checks fp8_rows.log "matmul fp8,moe fp8"
grep -E "FAIL|a warp a row" "$OUT/fp8_rows.log" | head -24
timeout 150 .devbin/test_cuda_kernels --bench-only fp8 2>&1 | grep -E "T=1 " | tee "$OUT/fp8_rows_bench.log"
timeout 100 .devbin/test_cuda_kernels --bench-only moefp8 2>&1 | grep -E "T=1 " | tee -a "$OUT/fp8_rows_bench.log"
B48=".devbin/deltaserve $(b48 16 1)"
for r in $(seq "${ROUNDS:-2}"); do
  $B48 2>&1 | grep -E "^decode batch" | sed "s/^/[bf16 $r] /"
  for f in ${ROWS_FORMS:-0 -1 2 8}; do
    DS_CUDA_F8_ROWS=$f $B48 -q ptpc_fp8 2>&1 | grep -E "^decode batch" | sed "s/^/[fp8 rows $f $r] /"
  done
done
B48=".devbin/deltaserve $(b48 8 ${BATCHES:-2,4,8,16,32,64})"
[ -n "${NO_BF16_BATCHES:-}" ] || $B48 2>&1 | grep -E "^decode batch" | sed "s/^/[bf16] /"
for f in 0 2; do
  DS_CUDA_F8_WHOLE_K=$f $B48 -q ptpc_fp8 2>&1 | grep -E "^decode batch" | sed "s/^/[fp8 whole K from $f] /"
done
fi
if want 24; then
el "24. (issue 33, session 42) FP8 rows' codes into BF16 by their bit fields: the kv rows checks,"
el "    the kernel over FP8 and BF16 rows, decode after 1M FP8 tokens against the baseline's binaries"
el "    and after 1M BF16 tokens with the warp-specialized form on and off"
checks s24.log "kv rows" | tee "$OUT/s24.rc"
grep -E "FAIL|2\^k" "$OUT/s24.log" | head -40
ok24=0
grep -q "checks rc 0 (.* 0 FAIL)" "$OUT/s24.rc" && ok24=1
# GATE24=0: the timings whatever the checks said (they are printed above)
[ "${GATE24:-1}" = 0 ] && ok24=1
[ $ok24 = 1 ] && for r in $(seq "${ROUNDS:-1}"); do
  for kv in ${KVS24:-fp8 bf16}; do
    for n in ${LENS24:-1048576}; do
      for b in ${BINS24-_base _mid ""}; do
        [ -x ".devbin/test_cuda_kernels$b" ] || continue
        DS_BENCH_MLA_LONG="$kv $n" timeout 150 ".devbin/test_cuda_kernels$b" --bench-only mla 2>&1 |
          grep -E "absorbed decode 1 x|copy" | sed "s/^/[${b:-new} $r] /"
      done
    done
  done
done
[ $ok24 = 1 ] && for r in $(seq "${ROUNDS:-1}"); do
  for b in ${BINS24-_base ""}; do
    [ -x ".devbin/deltaserve$b" ] || continue
        el "decode after 1M FP8 tokens, deltaserve$b ($r)"
    BIN=".devbin/deltaserve$b" LENS=1048576 KV_DTYPES=fp8 PARTS=decode TAG="_s24${b}_$r" \
      STEP_TIMEOUT=200 bash "$(dirname "$0")/long48.sh" 2>&1 | tail -2
  done
  for ws in ${WS24-1 0}; do
    el "decode after 1M BF16 tokens, DS_CUDA_MLA_DECODE_WS=$ws ($r)"
    DS_CUDA_MLA_DECODE_WS=$ws LENS=1048576 KV_DTYPES=bf16 PARTS=decode TAG="_s24_ws${ws}_$r" \
      STEP_TIMEOUT=200 bash "$(dirname "$0")/long48.sh" 2>&1 | tail -2
  done
done
# NCU24=1: Nsight Compute on the warp-specialized kernel over 1M FP8, then BF16 rows (new binary)
[ $ok24 = 1 ] && [ "${NCU24:-0}" = 1 ] && for kv in fp8 bf16; do
  el "Nsight Compute, mla_tcw_k, $kv rows"
  KREGEX=mla_tcw_k TCD="$kv 1048576" SKIP=3 LINES_MAX=45 bash "$(dirname "$0")/ncu_tcd.sh"
  cp "$OUT/ncu_tcd3.txt" "$OUT/ncu_tcw_$kv.txt"
done
fi
if want 25; then
el "25. (issue 33, session 44) chunked KDA's gate, beta and head norms inside pass 1: the KDA"
el "    checks, prefill 8192 and decode after 512 with DS_CUDA_KDA_RAW on and off, the profile"
checks s25.log kda | tee "$OUT/s25.rc"
grep -E "raw inputs|FAIL" "$OUT/s25.log" | head -60
for r in $(seq "${ROUNDS:-2}"); do
  for raw in 1 0; do
    DS_CUDA_KDA_RAW=$raw timeout 200 .devbin/deltaserve bench --model $SHAPE48 --load-format random \
      --device cuda --prompt-tokens 8192 --reps 3 --decode-context 512 --decode-steps 8 \
      --batch-sizes 1 --json "$OUT/s25_raw${raw}_$r.json" 2>&1 | grep -E "^(prompt|decode)" |
      sed "s/^/[raw $raw, $r] /"
    echo "[raw $raw, $r] $(grep -o '"ids_hash": "[0-9a-f]*"' "$OUT/s25_raw${raw}_$r.json" | tail -1)"
  done
done
DS_CUDA_KDA_RAW=1 BATCHES=1 bash "$(dirname "$0")/profile48.sh" 2>&1 |
  grep -E "kda|^prompt 8192|cuBLAS weight GEMMs alone" | head -20
fi
if want 22; then
el "22. (issue 32, session 40) one token's FP8 down pass reading its routing early: the moe fp8"
el "    checks, then ptpc_fp8 decode batch 1 with DS_CUDA_EARLY_EXPERTS on and off"
checks s22.log "moe fp8"
grep -E "FAIL" "$OUT/s22.log" | head -6
for r in $(seq "${ROUNDS:-2}"); do
  for e in 1 0; do
    b48_run "ptpc_fp8 early $e, $r" "s22_${e}_$r" DS_CUDA_EARLY_EXPERTS=$e .devbin/deltaserve \
      $(b48 16 1) -q ptpc_fp8
  done
done
fi
if want 21; then
el "21. (issue 33, session 39) chunked KDA's BF16 mode: BF16 hand-over, pass 1 on BF16 tensor"
el "    cores: the KDA checks, kda_words.sh, pass 1's phases (timing build)"
checks s21.log "kda"
grep -E "FAIL|bf16|checks:" "$OUT/s21.log" | head -24
[ -x .devbin/test_cuda_kernels_base ] && bash "$(dirname "$0")/kda_words.sh" 2>&1 | tail -40
[ -x .devbin/test_cuda_kernels_clk ] &&
  timeout 120 .devbin/test_cuda_kernels_clk --bench-only kda 2>&1 | grep -E "phases|chunked prefill"
fi
if want 19; then
el "19. (issues 32, 33, session 38) the router's choice with its lists in shared memory: the moe"
el "    checks (the choice against the CPU's), then decode batch 1 against the baseline's binary"
el "    (.devbin/deltaserve_base: DS_DEVBIN_BASE=... pack_devbin.sh) in BF16 and ptpc_fp8, with a"
el "    step's host and device times (DS_CUDA_STEP_TIMES) and the greedy ids' hash, ROUNDS rounds"
el "    (default 3); then a graphed batch-1 step's kernel timeline (timeline48.sh)"
checks s19.log "moe,moe fp8,moe mxfp4"
grep -E "FAIL|route|checks:" "$OUT/s19.log" | head -12
for r in $(seq "${ROUNDS:-3}"); do
  for bin in deltaserve_base deltaserve; do
    [ -x ".devbin/$bin" ] || continue
    for q in bf16 ptpc_fp8; do
      qa=$([ $q = bf16 ] || echo "-q $q")
      b48_run "$bin $q, $r" "s19_${q}_$bin" DS_CUDA_STEP_TIMES=1 .devbin/$bin $(b48 16 1) $qa
    done
  done
done
[ -n "${NO_TL:-}" ] || bash "$(dirname "$0")/timeline48.sh" 2>&1 | head -${TL_LINES:-24}
fi
if want 18; then
el "18. (issues 32, 33, session 37) weights prefetched into L2 before their products"
el "    (DS_CUDA_L2_PREFETCH, MB): the matmul checks (the prefetch's chain word for word, eager and"
el "    graphed), then decode batch 1 in BF16 and in ptpc_fp8's forms with and without it"
checks l2pf.log "matmul,activations"
grep -E "FAIL|L2 prefetch|mul sigmoid" "$OUT/l2pf.log" | head -8
B48=".devbin/deltaserve $(b48 16 1)"
for r in $(seq "${ROUNDS:-2}"); do
  for pf in ${PFS:-0 16 32}; do
    DS_CUDA_L2_PREFETCH=$pf $B48 2>&1 | grep -E "^decode batch" | sed "s/^/[bf16 pf $pf $r] /"
  done
  for pf in ${PFS:-0 16 32}; do
    DS_CUDA_L2_PREFETCH=$pf $B48 -q ptpc_fp8 2>&1 | grep -E "^decode batch" |
      sed "s/^/[fp8 tiles pf $pf $r] /"
    DS_CUDA_L2_PREFETCH=$pf DS_CUDA_F8_ROWS=0 DS_CUDA_F8_MOE_ROWS=-1 \
      $B48 -q ptpc_fp8 2>&1 | grep -E "^decode batch" | sed "s/^/[fp8 dense rows pf $pf $r] /"
  done
  [ -n "${SHORT:-}" ] && continue
  DS_CUDA_F8_ROWS=0 $B48 -q ptpc_fp8 2>&1 | grep -E "^decode batch" |
    sed "s/^/[fp8 all rows $r] /"
done
B48=".devbin/deltaserve $(b48 8 ${BATCHES:-4,16})"
for pf in 0 16; do
  [ -n "${SHORT:-}" ] && break
  DS_CUDA_L2_PREFETCH=$pf $B48 2>&1 | grep -E "^decode batch" | sed "s/^/[bf16 pf $pf] /"
done
if [ -n "${K3:-}" ]; then
  # K3's layer shapes (MXFP4 experts, the chosen experts prefetched too): batch 1 with and without
  K=".devbin/deltaserve bench --model configs/kimi-k3-slice4 --load-format random --device cuda"
  for pf in 0 32 0 32; do
    DS_CUDA_L2_PREFETCH=$pf timeout 120 $K --prompt-tokens 16 --reps 1 --decode-context 512 \
      --decode-steps 16 --batch-sizes 1 2>&1 | grep -E "^decode batch" | sed "s/^/[k3 slice pf $pf] /"
  done
fi
if [ -n "${NCU_ROWS:-}" ]; then
  # where a small FP8 product's time goes: the warp-a-row kernel on 2304 x 4096 (its first
  # (1, 8) launches in the bench), beside BF16's kernel on the same shape
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  SEC="--section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats"
  SEC="$SEC --section InstructionStats --section SchedulerStats"
  for k in "gemv_f8r_k<1, 8>" "gemv_bf16_k<1>"; do
    timeout 120 "$NCU" --clock-control none --kernel-name-base demangled -k "regex:$k" \
      --launch-skip 10 --launch-count 1 $SEC .devbin/test_cuda_kernels --bench-only fp8 \
      > "$OUT/ncu_rows.txt" 2>&1
    echo "== $k (rc $?)"
    grep -E "Grid Size|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|stalled|Eligible Warps" \
      "$OUT/ncu_rows.txt" | sed 's/  */ /g' | cut -c1-220 | head -24
  done
fi
fi
if want 1; then
el "1. kernel checks"
.devbin/test_cuda_kernels > "$OUT/check.log" 2>&1
echo "checks rc $?"
grep -iE "fail|grammar|draw|fp8|mxfp4" "$OUT/check.log" | head -30
fi
if want 2; then
el "2. structured outputs and tool calls on cuda"
.devbin/deltaserve init-model --preset tiny-k3 --out models/tiny-k3 --force > /dev/null || echo "init failed"
for args in "--device cuda" "--device cuda --speculative-method dspark --num-speculative-tokens 4"; do
  DS_SERVE_ARGS="$args" DS_BIN=$PWD/.devbin/deltaserve DS_MODEL=$PWD/models/tiny-k3 timeout 240 \
    python3 -m pytest -q -p no:cacheprovider tests/e2e/test_structured.py tests/e2e/test_tools.py \
    2>&1 | tail -4
done
fi
if want 3; then
el "3. grammar48: the masks before the forward (DS_MASKS_BESIDE=0), then beside it (the default)"
DS_MASKS_BESIDE=0 TAG=_before CONC=32 STEP_TIMEOUT=120 bash "$(dirname "$0")/grammar48.sh" 2>&1 | tail -3
TAG=_beside CONC=32 STEP_TIMEOUT=120 bash "$(dirname "$0")/grammar48.sh" 2>&1 | tail -14
fi
if want 6; then
el "6. FP8 codes to F16: the conversion alone, then the bit form in the kernels"
.devbin/bench_f8cvt 2>&1 | tail -6
if [ -x .devbin/test_cuda_kernels_f8bits ]; then
  VARIANTS="_f8bits"
  [ -x .devbin/test_cuda_kernels_f8mma ] && VARIANTS="$VARIANTS _f8mma"
  for v in $VARIANTS; do
    echo "[$v] checks"
    DS_CUDA_CHECKS="matmul fp8,moe fp8,kda batch" .devbin/test_cuda_kernels$v 2>&1 |
      grep -iE "checks:|FAIL|fp8" | head -16
  done
  for v in "" $VARIANTS; do
    .devbin/test_cuda_kernels$v --bench-only moefp8 2>&1 | grep "bench moe fp8 T=1 " | sed "s/^/[${v:-cvt}] /"
    .devbin/deltaserve$v bench --model $SHAPE48 --load-format random --device cuda -q ptpc_fp8 \
      --prompt-tokens 16 --reps 1 --decode-context 512 --decode-steps 8 --batch-sizes 1 2>&1 |
      grep -E "^decode batch" | sed "s/^/[${v:-cvt}] /"
  done
else
  echo "no test_cuda_kernels_f8bits: pack with DS_DEVBIN_F8BITS=1"
fi
fi
if want 7; then
el "7. issue 36: TTFT through the P/D pair against one server, both on the GPU (pd_gpu.sh step 2)"
if [ -f models/gsm-k3/config.json ]; then
  # MIXED=1: also the mixed workload (decode streams while 4000-token prompts arrive every 2 s),
  # decode ITL p99 through the pair against one server, both on the one GPU (not yet run)
  timeout ${PD_TIMEOUT:-240} python3 bench/pd_bench.py --bin .devbin/deltaserve --model models/gsm-k3 \
    $([ "${MIXED:-0}" = 1 ] && echo "--mixed-s 45 --long-tokens 4000 --long-every-s 2" || echo "--skip mixed") \
    --lengths ${LENGTHS:-500,2000} --reps 2 --extra "--device cuda --kv-cache-memory 2G" \
    > "$OUT/pd_ttft_gpu.txt" 2>&1
  echo "rc $?"; tail -12 "$OUT/pd_ttft_gpu.txt"
else
  echo "no models/gsm-k3 in the tree (the wheels' call leaves it out)"
fi
fi
if want 8; then
el "8. issue 33: long contexts at the 48B shape, 128K (long48.sh)"
LENS=${LENS:-131072} bash "$(dirname "$0")/long48.sh" 2>&1 | tail -20
fi
if want 26; then
el "26. (issue 33, session 45) expanded MLA on wgmma, pipelined (mla_prefill.sh); the experts'"
el "    gather from x rounded once (DS_CUDA_EXPERT_X16): the moe checks, prefill on and off"
bash "$(dirname "$0")/mla_prefill.sh" 2>&1 | tail -16
checks s26.log moe | tee "$OUT/s26.rc"
grep -E "x rounded once|FAIL" "$OUT/s26.log" | head
prefill_ab s26 DS_CUDA_EXPERT_X16 "1 0"
fi
if want 27; then
el "27. (issue 32, session 46) ptpc_fp8 prefill of 8192 tokens against BF16, then its profile"
checks s27.log "moe fp8,matmul fp8" | tee "$OUT/s27.rc"
grep -E "cuBLASLt|FAIL|scales applied" "$OUT/s27.log" | head -24
for q in none ptpc_fp8 ptpc_fp8:0 ptpc_fp8:f32; do
  g=1; [[ $q == *:0 ]] && g=0
  o=2; [[ $q == *:f32 ]] && o=0
  DS_CUDA_EXPERT_BF16_OUT=$o DS_CUDA_EXPERT_GEMM=$g timeout 150 .devbin/deltaserve bench --model $SHAPE48 \
    --load-format random --device cuda --prompt-tokens 8192 --reps 3 --decode-context 512 \
    --decode-steps 4 --batch-sizes 1 $([ $q = none ] || echo "-q ${q%:*}") \
    --json "$OUT/s27_${q/:/_}.json" 2>&1 | grep -E "^prompt" | sed "s/^/[$q] /"
done
PROMPT=8192 BATCHES=1 timeout 200 bash "$(dirname "$0")/profile48.sh" -q ptpc_fp8 > /dev/null 2>&1
mv "$OUT/profile.txt" "$OUT/s27_profile_fp8.txt"
head -60 "$OUT/s27_profile_fp8.txt"
fi
if want 29; then
el "29. (issue 33, session 46) the BF16 experts' GEMMs as cuBLASLt batches (DS_CUDA_EXPERT_LT)"
checks s29.log moe | tee "$OUT/s29.rc"
grep -E "cuBLASLt|FAIL" "$OUT/s29.log" | head -12
prefill_ab s29 DS_CUDA_EXPERT_LT "1 0"
DS_CUDA_EXPERT_LT=1 PROMPT=8192 BATCHES=1 timeout 200 bash "$(dirname "$0")/profile48.sh" > /dev/null 2>&1
grep -E "moe gemm: (gate/up|down)" "$OUT/profile.txt" | head -4
fi
if want 30; then
el "30. (issue 32, session 47) FP8 experts' tokens quantized once: checks, ptpc_fp8 prompt vs the base binary"
checks s30.log "moe fp8" | tee "$OUT/s30.rc"
grep -E "cuBLASLt|FAIL" "$OUT/s30.log" | head -8
prompt_bins s30 ptpc_fp8
fi
if want 31; then
el "31. (issues 32, 33, session 47) the experts' gathers a warp a row: checks, prompts vs the base binary"
checks s31.log "moe,moe fp8" | tee "$OUT/s31.rc"
grep -E "FAIL|x16" "$OUT/s31.log" | head -8
prompt_bins s31 "none ptpc_fp8"
fi
if want 32; then
el "32. (issue 33, session 47) 3xBF16's pass 1 on tensor cores (DS_CUDA_KDA_PREP_TC=1 in mode 4)"
checks s32.log kda | tee "$OUT/s32.rc"
grep -E "3xbf16|FAIL" "$OUT/s32.log" | head -24
timeout 150 stdbuf -oL .devbin/test_cuda_kernels --bench-only kda 2>&1 |
  grep -E "chunked prefill T=8192 H=32 dk=dv=128 \((3xtf32|3xbf16) scan and outputs, pass 1|varlen" | head -12
prefill_ab s32 DS_CUDA_KDA_PREP_TC "1 0"
fi
if want 33; then
el "33. (issue 33, session 48) decode's MLA attend at 512 rows: tensor cores, all heads, merge warps"
checks s33.log "mla batch" | tee "$OUT/s33.rc"
grep -E "merge warps|FAIL" "$OUT/s33.log" | head -12
for r in $(seq "${ROUNDS:-2}"); do
  for kv in auto bf16; do
    b48_run "default, $kv, $r" "s33_def_${kv}_$r" DS_CUDA_STEP_TIMES=1 .devbin/deltaserve \
      $(b48 16 1) --kv-cache-dtype $kv
    b48_run "tc from 1 row, $kv, $r" "s33_tc_${kv}_$r" DS_CUDA_STEP_TIMES=1 DS_CUDA_MLA_DECODE_TC=1 \
      .devbin/deltaserve $(b48 16 1) --kv-cache-dtype $kv
    b48_run "all heads, $kv, $r" "s33_ah_${kv}_$r" DS_CUDA_STEP_TIMES=1 DS_CUDA_MLA_ALL_HEADS=2 \
      .devbin/deltaserve $(b48 16 1) --kv-cache-dtype $kv
    b48_run "tc from 1 row, merge warps, $kv, $r" "s33_tcmw_${kv}_$r" DS_CUDA_STEP_TIMES=1 \
      DS_CUDA_MLA_DECODE_TC=1 DS_CUDA_MLA_MERGE_WARPS=1 .devbin/deltaserve $(b48 16 1) --kv-cache-dtype $kv
    b48_run "merge warps, $kv, $r" "s33_mw_${kv}_$r" DS_CUDA_STEP_TIMES=1 DS_CUDA_MLA_MERGE_WARPS=1 \
      .devbin/deltaserve $(b48 16 1) --kv-cache-dtype $kv
  done
done
fi
if want 34; then
el "34. (issue 32, session 48) one token's MXFP4 experts in one part (DS_CUDA_FP4_ONE)"
checks s34.log "moe mxfp4" | tee "$OUT/s34.rc"
grep -E "one part|FAIL" "$OUT/s34.log" | head -12
timeout 150 .devbin/test_cuda_kernels --bench-only mxfp4 2>&1 | grep -E "bench moe mxfp4|copy d2d"
K=".devbin/deltaserve bench --model configs/kimi-k3-slice4 --load-format random --device cuda"
for r in $(seq "${ROUNDS:-2}"); do
  for v in 0 1; do
    DS_CUDA_FP4_ONE=$v timeout 150 $K --prompt-tokens 16 --reps 1 --decode-context 512 \
      --decode-steps 16 --batch-sizes 1,8 --json "$OUT/s34_${v}_$r.json" 2>&1 |
      grep -E "^decode batch" | sed "s/^/[k3 slice, one part $v, $r] /"
  done
done
# Is the streaming kernel bound by its instructions' issue (session 48's reading of its SASS) or
# by latency at its occupancy? Nsight Compute on one token's up and down pass, three parts, then
# one part (the bench's 23 three-part runs launch 46 before them)
ncu_runs mxfp4 'moe_fp4m_k' 2 "0 _3part" "46 _one"
fi
if want 35; then
el "35. (issue 32, session 49) decode's dense FP8 products on wgmma (DS_CUDA_F8_WG)"
checks s35.log "matmul fp8,moe fp8" | tee "$OUT/s35.rc"
grep -E "wgmma|FAIL" "$OUT/s35.log" | head -40
timeout 200 .devbin/test_cuda_kernels --bench-only fp8,moefp8 2>&1 |
  grep -E "bench matmul|bench moe fp8 T=1|copy d2d" | head -40
for r in $(seq "${ROUNDS:-2}"); do
  b48_run "bf16, $r" "s35_bf16_$r" DS_CUDA_STEP_TIMES=1 .devbin/deltaserve $(b48 16 1,8)
  for v in 0 1 3; do
    b48_run "ptpc_fp8, f8 wgmma $v, $r" "s35_f8_${v}_$r" DS_CUDA_STEP_TIMES=1 DS_CUDA_F8_WG=$v \
      .devbin/deltaserve $(b48 16 1,8) -q ptpc_fp8
  done
done
fi
if want 36; then
el "36. (issue 32, session 49) the wgmma FP8 products under Nsight Compute"
timeout 150 .devbin/test_cuda_kernels --bench-only fp8 2>&1 | grep -E "T=1 .*(wgmma|bf16)" | head -12
for v in "" "DS_CUDA_F8_WG=1 DS_CUDA_F8_PREQUANT=1"; do
  b48_run "ptpc_fp8 $v" "s36_$(echo "$v" | tr -dc 0-9)" DS_CUDA_STEP_TIMES=1 $v .devbin/deltaserve \
    $(b48 16 1) -q ptpc_fp8
done
ncu_runs fp8 'gemv_f8wg_k' 1 "0 _wg12544" "276 _wg18432"
fi
want 4 || want 5 || { el end; exit 0; }
el "4. decode b1 / b32, BF16 then ptpc_fp8"
B=".devbin/deltaserve bench --model $SHAPE48 --load-format random --device cuda"
B="$B --prompt-tokens 512 --reps 1 --decode-context 512 --decode-steps 8 --batch-sizes 1,32"
$B --json "$OUT/b_bf16.json" 2>&1 | grep -E "decode|copy" | head -4
$B -q ptpc_fp8 --json "$OUT/b_fp8.json" 2>&1 | grep -E "decode|copy" | head -4
DS_CUDA_F8_PREQUANT=1 $B -q ptpc_fp8 --json "$OUT/b_fp8_pre.json" 2>&1 | grep -E "decode b" | head -2
el "5. ncu BF16, ptpc_fp8, ptpc_fp8 with the codes made first (DS_CUDA_F8_PREQUANT)"
NAME=ncu_bf16 COUNT=700 bash "$(dirname "$0")/ncu48.sh" 2>&1 | head -24
NAME=ncu_fp8 COUNT=700 bash "$(dirname "$0")/ncu48.sh" -q ptpc_fp8 2>&1 | head -24
DS_CUDA_F8_PREQUANT=1 NAME=ncu_fp8p COUNT=700 bash "$(dirname "$0")/ncu48.sh" -q ptpc_fp8 2>&1 | head -24
el end
