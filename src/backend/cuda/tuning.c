/* tuning.c — the CUDA backend's switches read from the environment once, at attach, and set on
 * the device context (tuning.h holds the table of them). */
#include "backend/cuda/tuning.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A flag: unset or empty means dflt, a number above 0 on, anything else off. */
static int env_flag(const char *name, int dflt) {
    const char *v = getenv(name);
    return v && *v ? atoi(v) > 0 : dflt;
}

/* A count: unset or empty means dflt, else the number. */
static int env_count(const char *name, int dflt) {
    const char *v = getenv(name);
    return v && *v ? atoi(v) : dflt;
}

/* The variable's value, or NULL when it is unset or empty. */
static const char *env_text(const char *name) {
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

/* chunked KDA on tensor cores: 1 TF32, 2 BF16, 3 3xTF32, 4 3xBF16 (ds_cu_set_kda_tc) */
static int kda_tc_mode(void) {
    /* 3xBF16 by default: an error within a few times f32's (checked at f32's tolerance, as
     * 3xTF32 is) in less time than 3xTF32 (bench/RESULTS.md, session 47). TF32 is faster
     * still and alone a quarter of FLA's error on f32 inputs, but through the bundled model (no
     * batch invariance) it moved the GPU's logits further from the CPU's and TP 2's further from
     * one GPU's (sessions 10 and 17; docs/tuning.md). */
    const char *tc = getenv("DS_CUDA_KDA_TC");
    int mode = 4;
    if (tc && *tc) {
        if (!strcmp(tc, "0") || !strcmp(tc, "1") || !strcmp(tc, "2") || !strcmp(tc, "3") ||
            !strcmp(tc, "4"))
            mode = atoi(tc);
        else
            fprintf(stderr,
                    "[deltaserve] DS_CUDA_KDA_TC=%s: 0 (f32), 1 (TF32), 2 (BF16), 3 (3xTF32) or 4 "
                    "(3xBF16); "
                    "using 4\n",
                    tc);
    }
    return mode;
}

void ds_cuda_tuning_read(ds_cuda_tuning *t) {
    memset(t, 0, sizeof *t);
    /* the faster paths are on unless turned off (for comparisons); the profile is opt-in */
    t->expert_gemm = env_flag("DS_CUDA_EXPERT_GEMM", 1);
    /* 2 (both passes write BF16): a prompt 7% faster at the 48B shape (the passes are bound by
     * their bytes), and the bundled model's logits about as far from the CPU's as with f32 outputs
     * (6.6e-3, 6.2e-3 with the down pass alone, 6.3e-3 with neither, over 600 tokens; each
     * expert's output rounded to BF16 before the weighted sum, gate/up's before the activation:
     * bench/RESULTS.md session 44) */
    t->expert_bf16_out = env_count("DS_CUDA_EXPERT_BF16_OUT", 2); /* 1: the down pass alone */
    t->expert_x16 = env_flag("DS_CUDA_EXPERT_X16", 1);
    t->expert_lt = env_flag("DS_CUDA_EXPERT_LT", 0);
    t->expert_mma = env_flag("DS_CUDA_EXPERT_MMA", 1);
    t->expert_tc = env_flag("DS_CUDA_EXPERT_TC", 1);
    /* tuning knobs (0: the kernels' defaults) */
    t->expert_mma_min = env_count("DS_CUDA_EXPERT_MMA_MIN", 0);
    t->gemv_max_t = env_count("DS_CUDA_GEMV_MAX_T", 0);
    t->f8_prequant = env_flag("DS_CUDA_F8_PREQUANT", 0);
    t->f8_split_min = env_count("DS_CUDA_F8_SPLIT_MIN", 0);
    t->f8_split = env_count("DS_CUDA_F8_SPLIT", 0); /* (an experiment: the grid's waves) */
    t->f8_moe_waves = env_count("DS_CUDA_F8_MOE_WAVES", 0);
    t->f8_gemv_waves = env_count("DS_CUDA_F8_GEMV_WAVES", 0);
    t->f8_noquant = env_flag("DS_CUDA_F8_NOQUANT", 0); /* a what-if (wrong results) */
    /* one token's FP8 products a warp a row: off — faster on wide matrices alone, no faster in a
     * batch-1 step of the 48B shape's, its experts slower (bench/RESULTS.md session 37) */
    t->f8_rows = env_count("DS_CUDA_F8_ROWS", -1);
    /* decode's FP8 products on wgmma: off — faster alone on two of four one-token shapes, slower
     * in a batch-1 step (bench/RESULTS.md session 49) */
    t->f8_wg = env_count("DS_CUDA_F8_WG", 0); /* bit 1 dense, bit 2 one token's experts */
    /* the same for one token's routed experts (default: as the dense products) */
    t->f8_moe_rows = env_count("DS_CUDA_F8_MOE_ROWS", t->f8_rows);
    /* K whole in the FP8 streams from 4 tokens (batch invariance off): faster at every batch
     * from 4 to 32 measured, no faster at 2 (bench/RESULTS.md session 37) */
    t->f8_whole_k = env_count("DS_CUDA_F8_WHOLE_K", 4);
    t->mla_gemm = env_flag("DS_CUDA_MLA_GEMM", 1);
    /* 3 (wgmma, two warpgroups a block): a prompt of 8192 tokens 3% faster than on mma.sync at
     * the 48B shape, the kernel's error as close to the CPU's (bench/RESULTS.md session 45);
     * devices before sm_90 run mode 1 */
    t->mla_flash = env_count("DS_CUDA_MLA_FLASH", 4);
    t->early_experts = env_flag("DS_CUDA_EARLY_EXPERTS", 1);
    t->wide_early = env_flag("DS_CUDA_WIDE_EARLY", 1);
    t->gemv_wide = env_flag("DS_CUDA_GEMV_WIDE", 1);
    t->conv_fixed = env_flag("DS_CUDA_CONV_FIXED", 1);
    /* sequences up to which a decode step's KDA middle is one kernel (0: never) */
    t->kda_fused_set = env_text("DS_CUDA_KDA_FUSED");
    t->kda_fused = env_count("DS_CUDA_KDA_FUSED", DS_CUDA_KDA_FUSE_MAX);
    t->kda_tc = kda_tc_mode();
    /* off: checked, but no faster in the default 3xTF32 mode (the pass is bound by shared
     * memory: docs/tuning.md, bench/RESULTS.md session 31) */
    t->kda_prep_tc = env_flag("DS_CUDA_KDA_PREP_TC", 0);
    /* the tensor-core scan makes the outputs (no third pass; the same bits) */
    t->kda_out_fused = env_flag("DS_CUDA_KDA_FUSED_OUT", 1);
    /* the gate, beta and the head norms inside chunked KDA's first pass when every segment of a
     * step runs in chunks: the same bits without two launches and their passes over q, k and g
     * (bench/RESULTS.md session 44) */
    t->kda_raw = env_flag("DS_CUDA_KDA_RAW", 1);
    /* a prompt chunk's expanded MLA attention over at most this many context rows at a time
     * (its f32 expansion is ~68 KB a row at the 48B shape: a million rows would not fit beside
     * the weights; with blocks of 131072 a million-token prompt prefills on one H200,
     * bench/RESULTS.md session 32); 0: the whole context at once */
    t->mla_ctx_block = env_count("DS_CUDA_MLA_CTX_BLOCK", 131072);
    t->side = env_flag("DS_CUDA_SIDE", 1);
    /* 8 MB: a batch-1 step 1% faster in ptpc_fp8, as fast in BF16; 16 MB and more slower (the
     * prefetches then evict what the products are reading): bench/RESULTS.md session 37 */
    t->l2_prefetch = env_count("DS_CUDA_L2_PREFETCH", 8);
    t->mla_all_heads = env_flag("DS_CUDA_MLA_ALL_HEADS", 1);
    /* decode's absorbed MLA on tensor cores from this context cap (BF16 operands, as the prefill's
     * fused kernel): faster than the f32 kernels at every length timed, from 32K rows
     * (bench/RESULTS.md session 32; the crossover below that is not measured); 0: the f32
     * kernels always */
    t->mla_decode_tc = env_count("DS_CUDA_MLA_DECODE_TC", 8192);
    /* its tile for FP8 and BF16 rows (32 or 64 rows): 64 was 6-9% faster at a million BF16
     * rows and ~6% at FP8 ones in two H100 calls (bench/RESULTS.md session 33) */
    t->mla_decode_tc_tile = env_count("DS_CUDA_MLA_DECODE_TC_TILE", 64);
    /* its warps a block for BF16 rows (8 or 16): 16 was faster at every length timed, the
     * kernel alone and a decode step after a million tokens (bench/RESULTS.md session 34) */
    t->mla_decode_tc_warps = env_count("DS_CUDA_MLA_DECODE_TC_WARPS", 16);
    /* its warp-specialized form from this context cap (FP8 and BF16 rows): faster than the other
     * forms at a million rows, the kernel and a decode step, slower at 128K rows (bench/RESULTS.md
     * sessions 41, 42) */
    t->mla_decode_ws = env_count("DS_CUDA_MLA_DECODE_WS", 1 << 20);
    /* its FP8 scores straight from the staged codes, each output warp converting its own columns:
     * faster than the score warps converting the tile, over the kernel alone and a decode step
     * after 1M FP8 tokens (bench/RESULTS.md session 43) */
    t->mla_ws_oconv = env_flag("DS_CUDA_MLA_WS_OCONV", 1);
    /* absorbed MLA's splits merged with the splits spread over a block's warps (off until timed:
     * pending_checks.sh step 33, ncu_mla_fixed.sh) */
    t->mla_merge_warps = env_flag("DS_CUDA_MLA_MERGE_WARPS", 0);
    /* one token's MXFP4 experts with the activations in one BF16 part (off until timed against
     * the exact three parts: pending_checks.sh step 34) */
    t->fp4_one = env_flag("DS_CUDA_FP4_ONE", 0);
    const char *pdl = getenv("DS_CUDA_PDL"); /* (on unless exactly "0", as the kernels read it) */
    t->pdl = !(pdl && !strcmp(pdl, "0"));
    t->profile = env_flag("DS_CUDA_PROFILE", 0);
    t->skip = env_text("DS_CUDA_SKIP");
    t->step_times = env_flag("DS_CUDA_STEP_TIMES", 0);
    t->timeline = env_text("DS_CUDA_TIMELINE");
    t->nccl = env_flag("DS_NCCL", 1);
    t->draft_device = env_flag("DS_DRAFT_DEVICE", 1);
}

int ds_cuda_tuning_apply(const ds_cuda_tuning *t, ds_cu *c, ds_err *err) {
    ds_cu_set_expert_gemm(c, t->expert_gemm);
    ds_cu_set_expert_bf16_out(c, t->expert_bf16_out);
    ds_cu_set_expert_x16(c, t->expert_x16);
    ds_cu_set_expert_lt(c, t->expert_lt);
    ds_cu_set_expert_mma(c, t->expert_mma);
    ds_cu_set_expert_tc(c, t->expert_tc);
    ds_cu_set_expert_mma_min(c, t->expert_mma_min);
    ds_cu_set_gemv_max_t(c, t->gemv_max_t);
    ds_cu_set_f8_prequant(c, t->f8_prequant);
    ds_cu_set_f8_split_min(c, t->f8_split_min);
    ds_cu_set_f8_split(c, t->f8_split);
    ds_cu_set_f8_moe_waves(c, t->f8_moe_waves);
    ds_cu_set_f8_gemv_waves(c, t->f8_gemv_waves);
    ds_cu_set_f8_noquant(c, t->f8_noquant);
    ds_cu_set_f8_rows(c, t->f8_rows);
    ds_cu_set_f8_wg(c, t->f8_wg);
    ds_cu_set_f8_moe_rows(c, t->f8_moe_rows);
    ds_cu_set_f8_whole_k(c, t->f8_whole_k);
    ds_cu_set_mla_gemm(c, t->mla_gemm);
    ds_cu_set_mla_flash(c, t->mla_flash);
    ds_cu_set_early_experts(c, t->early_experts);
    ds_cu_set_wide_early(c, t->wide_early);
    ds_cu_set_gemv_wide(c, t->gemv_wide);
    ds_cu_set_conv_fixed(c, t->conv_fixed);
    ds_cu_set_kda_tc(c, t->kda_tc);
    ds_cu_set_kda_prep_tc(c, t->kda_prep_tc);
    ds_cu_set_kda_out_fused(c, t->kda_out_fused);
    ds_cu_set_mla_ctx_block(c, t->mla_ctx_block);
    /* a side stream for independent chains within a step (ds_cu_side_begin) */
    ds_err side_err;
    if (ds_cu_set_side(c, t->side, &side_err)) /* not fatal */
        fprintf(stderr, "[deltaserve] %s: one stream per step\n", side_err.msg);
    if (ds_cu_set_l2_prefetch(c, t->l2_prefetch, &side_err)) /* not fatal either */
        fprintf(stderr, "[deltaserve] %s: no L2 prefetch\n", side_err.msg);
    ds_cu_set_mla_all_heads(c, t->mla_all_heads);
    ds_cu_set_mla_decode_tc(c, t->mla_decode_tc);
    ds_cu_set_mla_decode_tc_tile(c, t->mla_decode_tc_tile);
    ds_cu_set_mla_decode_tc_warps(c, t->mla_decode_tc_warps);
    ds_cu_set_mla_decode_ws(c, t->mla_decode_ws);
    ds_cu_set_mla_ws_oconv(c, t->mla_ws_oconv);
    ds_cu_set_mla_merge_warps(c, t->mla_merge_warps);
    ds_cu_set_fp4_one_part(c, t->fp4_one);
    ds_cu_set_pdl(c, t->pdl);
    ds_cu_prof_enable(c, t->profile);
    if (t->f8_noquant)
        fprintf(stderr, "[deltaserve] DS_CUDA_F8_NOQUANT=1: FP8 decode products skip their "
                        "quantizer (results are wrong; for timing only)\n");
    if (t->timeline && ds_cu_timeline_open(t->timeline, err)) return DS_ERR;
    if (t->skip) {
        fprintf(stderr,
                "[deltaserve] DS_CUDA_SKIP=%s: those kernels are left out (results are "
                "wrong; for timing only)\n",
                t->skip);
        if (ds_cu_set_skip(c, t->skip, err)) return DS_ERR;
    }
    return DS_OK;
}
