/* tuning.h — the CUDA backend's switches: every DS_CUDA_* environment variable (and the two other
 * switches the backend reads, DS_NCCL and DS_DRAFT_DEVICE), read once when a model is attached
 * (ds_cuda_tuning_read) into one struct that the rest of the backend reads. The faster paths are
 * on unless turned off (for comparisons); the profile and the what-if are opt-in.
 *
 * A flag (F) is on for a number above 0 and off for anything else; unset or empty keeps the
 * default. A count (N) is the number itself (atoi); unset or empty keeps the default.
 *
 *   variable               kind   default  what it changes
 *   DS_CUDA_EXPERT_GEMM    F      1        prefill steps' routed experts (>= 64 rows a local
 *                                          expert on average) as cuBLAS tensor-core GEMMs (FP8
 *                                          experts: cuBLASLt's FP8 tensor cores)
 *   DS_CUDA_EXPERT_BF16_OUT N     2        those GEMMs write BF16: 2 both passes (gate/up's
 *                                          outputs rounded before the activation, each routed
 *                                          row's output before the weighted sum), 1 the down
 *                                          pass alone, 0 neither (f32)
 *   DS_CUDA_EXPERT_X16     F      1        those GEMMs gather their rows from x rounded to BF16
 *                                          once (the same words)
 *   DS_CUDA_EXPERT_LT      F      0        those GEMMs as cuBLASLt pointer-array batches instead
 *                                          of cublasGemmBatchedEx (no faster on an H100)
 *   DS_CUDA_EXPERT_MMA     F      1        grouped routed experts of steps of >= 40 tokens on BF16
 *                                          tensor cores, on the device (capturable)
 *   DS_CUDA_EXPERT_TC      F      1        those through the mma.sync kernel that streams the
 *                                          weights as A operands; 0: the older wmma kernel
 *   DS_CUDA_EXPERT_MMA_MIN N      0        tokens from which they take the tensor-core path
 *                                          (0: the kernels' default, 40)
 *   DS_CUDA_GEMV_MAX_T     N      0        matmuls of up to this many rows stream the weights
 *                                          instead of cuBLAS (0: the kernels' default, 2)
 *   DS_CUDA_F8_PREQUANT    F      0        ptpc FP8 products of <= 8 tokens read codes the
 *                                          activations' quantizer wrote first, instead of each
 *                                          block quantizing its tokens (what that costs)
 *   DS_CUDA_MLA_GEMM       F      1        expanded MLA of >= 128 query rows through cuBLAS
 *   DS_CUDA_MLA_FLASH      N      4        ... and for Kimi's head shape as one flash kernel
 *                                          (1 on mma.sync, 2 on wgmma, 3 on wgmma with two
 *                                          warpgroups a block, 4 that pipelined, 0 off)
 *   DS_CUDA_EARLY_EXPERTS  F      1        the experts' down pass (BF16; FP8 at one token) reads
 *                                          its routing and first weights before waiting for the
 *                                          up pass
 *   DS_CUDA_WIDE_EARLY     F      1        one-token matmuls through the experts' kernel load
 *                                          their first weights before the wait
 *   DS_CUDA_GEMV_WIDE      F      1        one-token matmuls of one warp a row through the routed
 *                                          experts' kernel
 *   DS_CUDA_CONV_FIXED     F      1        the short conv of width 4 compiled for its width
 *                                          (0: the width read at run time)
 *   DS_CUDA_KDA_FUSED      N      2        decode steps of up to this many sequences run KDA's
 *                                          middle as one kernel (0: never); when set, a line says
 *                                          whether that applies to the model
 *   DS_CUDA_KDA_TC         0-4    4        chunked KDA's passes in f32 (0), TF32 (1), BF16 (2),
 *                                          3xTF32 (3) or 3xBF16 (4); another value: a line, then 4
 *   DS_CUDA_KDA_RAW        F      1        a step whose segments all run in chunks (a prompt's)
 *                                          makes KDA's gate, beta and head norms in chunked KDA's
 *                                          first pass (the same bits; 0: their own launches)
 *   DS_CUDA_SIDE           F      1        a side stream for independent chains within a step (if
 *                                          it cannot be made: a line, and one stream)
 *   DS_CUDA_L2_PREFETCH    N      8        MB of each decode weight stream prefetched into L2 on a
 *                                          stream of its own while the kernels before it run (0:
 *                                          off; if the stream cannot be made: a line, and off)
 *   DS_CUDA_MLA_ALL_HEADS  F      1        absorbed MLA with one block a (token, split) for all
 *                                          heads when the step has enough of them
 *   DS_CUDA_PDL            "0"    on       programmatic dependent launch (sm_90); exactly "0"
 *                                          turns it off
 *   DS_CUDA_PROFILE        F      0        the device time of each op of the eager steps
 *                                          (ds_model_profile_report prints it)
 *   DS_CUDA_TIMELINE       path   unset    every kernel's start, duration and stream (graph
 *                                          nodes too) as CSV in that file (CUPTI: a line and no
 *                                          model where it cannot be had; tools/timeline_step.py)
 *   DS_CUDA_STEP_TIMES     F      0        decode steps' host time beside their device time (the
 *                                          first upload to the last kernel), a line at detach
 *   DS_CUDA_SKIP           labels unset    the kernels of these ';'-separated profile labels left
 *                                          out (wrong results: timing what-ifs only; a line says
 *                                          so)
 *   DS_NCCL                F      1        a TP group's sums through NCCL when every rank has a
 *                                          GPU of its own (else through the host and MPI)
 *   DS_DRAFT_DEVICE        F      1        the DSpark draft on the target's GPU (0: on the host)
 */
#ifndef DS_BACKEND_CUDA_TUNING_H
#define DS_BACKEND_CUDA_TUNING_H

#include "kernels/cuda/cuda_kernels.h"

enum { DS_CUDA_KDA_FUSE_MAX = 2 }; /* DS_CUDA_KDA_FUSED's default (layers.c kda_fused says why) */

typedef struct ds_cuda_tuning {
    int expert_gemm, expert_mma, expert_tc;
    int expert_bf16_out; /* the cuBLAS experts writing BF16: 1 the down pass, 2 gate/up's too */
    int expert_x16;      /* ... gathering from x rounded once */
    int expert_lt;       /* ... as cuBLASLt pointer-array batches */
    int expert_mma_min, gemv_max_t; /* 0: the kernels' defaults */
    int f8_prequant;
    int f8_split_min;  /* 0: the kernels' default */
    int f8_split;      /* K split forced (0: the rule) */
    int f8_moe_waves;  /* 0: the kernels' default */
    int f8_gemv_waves; /* 0: the kernels' default */
    int f8_noquant;    /* a what-if: FP8 products skip quantizing (wrong results) */
    int f8_rows;       /* one token's FP8 products a warp a row: blocks an SM (0: 4; < 0 off) */
    int f8_moe_rows;   /* the same for one token's routed experts */
    int f8_wg;         /* decode's FP8 products on wgmma: bit 1 dense, bit 2 experts */
    int f8_whole_k;    /* tokens from which the FP8 streams keep K whole (0: never) */
    int mla_gemm, mla_flash;
    int early_experts, wide_early, gemv_wide, conv_fixed;
    int kda_fused;             /* sequences up to which a decode step's KDA middle is one kernel */
    const char *kda_fused_set; /* DS_CUDA_KDA_FUSED as given, or NULL when unset or empty */
    int kda_tc;                /* 0, 1 or 3 */
    int kda_prep_tc;           /* pass 1 on tensor cores too (in modes 1 and 3) */
    int kda_out_fused;         /* chunked KDA: the scan makes the outputs */
    int kda_raw; /* chunked KDA's first pass makes the gate, beta and head norms (prompt steps) */
    int mla_ctx_block; /* context rows a chunk's expanded attention takes at a time */
    int side, mla_all_heads;
    int l2_prefetch;   /* MB (0: off) */
    int mla_decode_tc; /* context rows from which absorbed MLA runs on tensor cores (0: never) */
    int mla_decode_tc_tile;  /* its tile for FP8 and BF16 rows (32 or 64) */
    int mla_decode_tc_warps; /* its warps a block for BF16 rows in 64-row tiles (8 or 16) */
    int mla_decode_ws;       /* context cap from which its warp-specialized form runs (0: never) */
    int mla_ws_oconv;    /* that form's FP8 scores from the staged codes, output warps converting */
    int mla_merge_warps; /* absorbed MLA's splits merged by a block's warps (mla_merge_w_k) */
    int fp4_one;         /* MXFP4 streaming experts: the activations in one BF16 part (w4a16) */
    int pdl;
    int profile;
    const char *skip;     /* DS_CUDA_SKIP's labels, or NULL when unset or empty */
    const char *timeline; /* DS_CUDA_TIMELINE's path, or NULL */
    int step_times;       /* decode steps' host and device times, reported at detach */
    int nccl;
    int draft_device;
} ds_cuda_tuning;

/* Fills t from the environment (the table above); prints the line for a bad DS_CUDA_KDA_TC. */
void ds_cuda_tuning_read(ds_cuda_tuning *t);
/* Sets t's switches on the device context c (batch invariance, the model's option, is set by
 * attach before); a side stream that cannot be made is a line, not an error. Fails only for
 * DS_CUDA_SKIP labels the kernels do not know. */
int ds_cuda_tuning_apply(const ds_cuda_tuning *t, ds_cu *c, ds_err *err);

#endif
