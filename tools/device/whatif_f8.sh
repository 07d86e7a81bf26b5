#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: a graphed batch-1 step of the 48B shape, BF16 then
# ptpc_fp8, with the weight products left out and with everything but them left out (whatif48.sh's
# DS_CUDA_SKIP; the results are wrong, the timings are what count): how much of each step is its
# products' and how much the rest's (issue 32); then ptpc_fp8 with the products' quantizers left
# out (DS_CUDA_F8_NOQUANT: what they cost).
P="kda qkv;kda o_proj;moe shared experts;moe grouped experts;moe fp8 experts;mla q, kv_a"
P="$P;mla absorbed q, o;mla gate, o_proj;dense mlp;final norm, lm_head"
R="norms, residual, attnres;kda gates, beta;kda conv+l2norm;kda recurrence;kda out gate, norm"
R="$R;moe router;moe group;moe combine;mla absorbed attend;greedy tokens;embed;moe routed experts"
for q in "" "-q ptpc_fp8"; do
  echo "== ${q:-bf16}"
  CASES="$P
$R
moe grouped experts;moe fp8 experts
kda qkv;kda o_proj;moe shared experts;mla q, kv_a;mla gate, o_proj;dense mlp" \
    bash "$(dirname "$0")/whatif48.sh" 1 $q
done
echo "== ptpc_fp8 with the products' quantizers left out (DS_CUDA_F8_NOQUANT=1)"
DS_CUDA_F8_NOQUANT=1 CASES="$P
moe grouped experts;moe fp8 experts" bash "$(dirname "$0")/whatif48.sh" 1 -q ptpc_fp8
