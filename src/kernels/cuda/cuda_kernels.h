/* cuda_kernels.h — the CUDA backend's kernels (issue 9), one per CPU kernel of kernels/cpu, with
 * the same contracts (see kernels/cpu/kernels.h for what each computes) on device memory.
 *
 * The kernels live one op a file in kernels/cuda (common.cuh holds what they share); each is
 * checked against the CPU's by tests/cuda (test_cuda_kernels, run on the GPU machine by
 * tools/device/cuda_check.sh).
 *
 * Every function takes a ds_cu (one CUDA stream, a cuBLAS handle and scratch) and works on plain
 * cudaMalloc'd pointers; launches are asynchronous on the stream, and ds_cu_sync reports the first
 * error any of them hit. Pure C interface: no CUDA types leak out, so C code links against it. */
#ifndef DS_CUDA_KERNELS_H
#define DS_CUDA_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "base/ds_base.h" /* C declarations: inside the extern "C" block for the .cu side */

typedef struct ds_cu ds_cu;

/* GPUs present (0 when none or no driver). */
int ds_cu_device_count(void);
/* Device `device`; the handle owns a stream and a cuBLAS handle. */
int ds_cu_create(int device, ds_cu **out, ds_err *err);
void ds_cu_free(ds_cu *c);
/* Makes c's device current for the calling thread (the CUDA runtime keeps it per thread: the
 * engine steps in a thread of its own, and a rank may use a GPU other than 0). */
int ds_cu_bind(ds_cu *c, ds_err *err);
/* Waits for the stream; DS_ERR with the CUDA / cuBLAS message if any launch failed. */
int ds_cu_sync(ds_cu *c, ds_err *err);
/* Programmatic dependent launch (sm_90: each kernel may start while the one before it drains;
 * common.cuh says how): on by default where the device has it; off, every launch waits. */
void ds_cu_set_pdl(ds_cu *c, int on);
/* The stream every launch of c goes on (a cudaStream_t), for libraries that queue work on it
 * (NCCL). */
void *ds_cu_stream(ds_cu *c);
/* "NVIDIA H200, 132 SMs, 139.8 GiB" */
const char *ds_cu_device_name(const ds_cu *c);

/* Device memory (plain cudaMalloc; never managed memory). */
void *ds_cu_alloc(ds_cu *c, size_t bytes, ds_err *err);
void ds_cu_dealloc(void *p);
/* Page-locked host memory (cudaMallocHost): copies to and from it skip the driver's staging. */
void *ds_cu_host_alloc(size_t bytes, ds_err *err);
void ds_cu_host_free(void *p);
int ds_cu_upload(ds_cu *c, void *dst, const void *src, size_t bytes, ds_err *err);
int ds_cu_download(ds_cu *c, void *dst, const void *src, size_t bytes, ds_err *err);
/* Two marks on the stream (end 0, then 1) and, once the stream has passed both, the device time
 * between them in ms (-1: not to be had): a step's device span beside its host time. Kept in the
 * context and recorded every step (ds_cu_timer makes and syncs a pair each use). */
int ds_cu_step_mark(ds_cu *c, int end, ds_err *err);
double ds_cu_step_mark_ms(ds_cu *c);
int ds_cu_fill_bytes(ds_cu *c, void *dst, int byte, size_t bytes, ds_err *err);

/* A weight matrix W[rows][cols], row-major, in device memory (docs/quantization.md):
 *  - DS_CU_BF16 (0, what a zeroed or positional initialiser gives): data [rows][cols] BF16;
 *  - DS_CU_FP8 (ptpc_fp8): data [rows][cols] E4M3 codes, scale f32 [rows]; W[r][c] =
 *    e4m3(code) * scale[r], and a product quantizes its activations per token (w8a8);
 *  - DS_CU_MXFP4 (routed experts only, ds_cu_moe_experts_mxfp4): data [rows][cols/2] packed E2M1,
 *    scale [rows][cols/32] E8M0 bytes.
 * A stack of matrices of different dtypes (ptpc with an excluded member) is runs != NULL: n_runs
 * matrices of `cols` columns whose rows follow one another; a product writes each run's output
 * columns of the same y (data is then NULL). */
enum { DS_CU_BF16 = 0, DS_CU_FP8 = 1, DS_CU_MXFP4 = 2 };
typedef struct ds_cu_mat {
    const uint16_t *data; /* BF16 elements, or the codes (bytes) of FP8 / MXFP4 */
    int rows, cols;
    int dtype;                    /* DS_CU_* */
    const void *scale;            /* FP8: f32 [rows]; MXFP4: u8 [rows][cols/32]; BF16: NULL */
    const struct ds_cu_mat *runs; /* a stack of mixed dtypes, or NULL */
    int n_runs;
} ds_cu_mat;

/* y[t][r] = sum_c x[t][c] W[r][c] (y = x W^T, as ds_matmul). x: [T][ldx] f32, y: [T][ldy] f32.
 * T = 1 (K a multiple of 8, x 16-byte aligned): a GEMV kernel reads W once and keeps
 * x in f32, as the CPU does. Larger T: x is rounded to BF16 for cuBLAS (BF16 x BF16 -> F32, F32
 * accumulation), so the error against the CPU is that of BF16 operands (~1e-3). */
int ds_cu_matmul(ds_cu *c, float *y, int ldy, const float *x, int ldx, int T, const ds_cu_mat *w,
                 ds_err *err);
/* FP8 (w->dtype DS_CU_FP8): each token's row of x gets s_t = ds_ptpc_scale(amax) and codes
 * e4m3(x * (1 / s_t)) as ds_ptpc_quantize_act; y[t][r] = (sum_c xq[t][c] code[r][c] * s_t) *
 * scale[r], the sum in f32 (every term exact), so only the order of the additions separates it
 * from the CPU. Up to the streaming bound (and always with batch invariance) a weight-streaming
 * FP8 kernel; above it FP8 tensor cores through cuBLASLt (E4M3 x E4M3 -> f32, no fast
 * accumulation) and a kernel applying the two scales in that order (K % 16 == 0; else the
 * streaming kernel at every T). */
/* H matmuls in one launch (per-head projections): for h < H, y_h = x_h W_h^T with y_h = y + h ys,
 * x_h = x + h xs, W_h = w->data + h ws ([N][K] = w->rows x w->cols each); rows ldy / ldx apart.
 * Same numerics as ds_cu_matmul. */
int ds_cu_matmul_heads(ds_cu *c, float *y, int ldy, size_t ys, const float *x, int ldx, size_t xs,
                       int T, const ds_cu_mat *w, size_t ws, int H, ds_err *err);
/* ptpc_fp8 on the device, bit for bit ds_ptpc_quantize: each row of src [rows][full_cols] BF16
 * gets scales[r] = ds_ptpc_scale(max |row|) over its whole row and codes [rows][nc] = e4m3(src[r]
 * [c0 + c] * (1 / scales[r])) for c < nc (a column slice holds the unsliced matrix's codes). */
int ds_cu_ptpc_quantize_bf16(ds_cu *c, uint8_t *codes, float *scales, const uint16_t *src, int rows,
                             int full_cols, int c0, int nc, ds_err *err);
/* The activations' half, as ds_ptpc_quantize_act but as codes: xq [T][ldq] E4M3 (columns
 * [K, ldq) zero), s [T]; x [T][ldx] f32. */
int ds_cu_ptpc_quantize_act(ds_cu *c, uint8_t *xq, int ldq, float *s, const float *x, int ldx,
                            int T, int K, ds_err *err);
/* out[t][:] = row ids[t] of E in f32: out [T][E.cols]; ids in device memory. */
void ds_cu_embed(ds_cu *c, float *out, const ds_cu_mat *e, const int32_t *ids, int T);
/* The same for a vocabulary slice: e holds rows [v0, v0 + e->rows); other tokens embed as zeros
 * (summed over the TP group, every rank ends with the whole embedding). */
void ds_cu_embed_range(ds_cu *c, float *out, const ds_cu_mat *e, const int32_t *ids, int T, int v0);
/* y[t] = w ⊙ x[t] / sqrt(mean(x[t]^2) + eps); x, y: [T][D]; w: [D]; y may == x. */
void ds_cu_rmsnorm(ds_cu *c, float *y, const float *x, const float *w, int T, int D, float eps);
/* out[i] = silu(gate[i]) * up[i] */
void ds_cu_swiglu(ds_cu *c, float *out, const float *gate, const float *up, size_t n);
/* The KDA delta-rule recurrence, as ds_kda_recurrent: q, k: [T][H][dk]; v: [T][H][dv];
 * g: [T][H][dk] (log decay); beta: [T][H]; S: [H][dk][dv] in/out; o: [T][H][dv];
 * S_rows (or NULL): [T][H][dk][dv] the state after each token (speculative rollback).
 * dk must be 16, 32, 64 or 128 (the state column lives in registers). */
int ds_cu_kda_recurrent(ds_cu *c, float *o, const float *q, const float *k, const float *v,
                        const float *g, const float *beta, float *S, float *S_rows, int T, int H,
                        int dk, int dv, ds_err *err);
/* The same over a batch of sequences in one launch (decode, verify and short prefills): sequence
 * z runs tokens [seg_off[z], seg_off[z+1]) of the packed q/k/v/g/beta/o ([tokens][H][...]) on its
 * own state S[z] ([H][dk][dv]), writing the state after its token t to S_rows[z] + t*rows_stride
 * ([H][dk][dv] each; rows_stride 0 means packed, H*dk*dv) when S_rows and S_rows[z] are not NULL.
 * seg_off [n_seq+1], S [n_seq] and S_rows [n_seq] are device arrays. skip_from > 0: segments of
 * at least that many tokens without rows are left alone (ds_cu_kda_chunked runs them). Both read
 * the states before waiting for the kernel launched just before them, which must not write them. */
int ds_cu_kda_recurrent_batch(ds_cu *c, float *o, const float *q, const float *k, const float *v,
                              const float *g, const float *beta, const int32_t *seg_off,
                              float *const *S, float *const *S_rows, size_t rows_stride, int n_seq,
                              int H, int dk, int dv, int skip_from, ds_err *err);

/* The same recurrence over long segments in chunks of 64 tokens (dk = dv = 64 or 128; no verify
 * rows): the states at chunk boundaries are carried by a sequential scan, everything else is
 * computed per chunk in parallel (see kda_chunked.cu). seg_start / seg_len [n_seq] are the host's
 * copies of the segments' token ranges (length 0: leave that sequence alone); S [n_seq] is the
 * device array of states, as above. Synchronises the stream (its chunk table is built here), so
 * never inside a graph capture. */
int ds_cu_kda_chunked(ds_cu *c, float *o, const float *q, const float *k, const float *v,
                      const float *g, const float *beta, const int *seg_start, const int *seg_len,
                      float *const *S, int n_seq, int H, int dk, int dv, ds_err *err);
/* Chunked KDA's gate, beta and head norms inside its first pass (ds_cu_kda_chunked_raw): g is then
 * f_b's output before the gate and beta NULL; q and k are the convs' outputs before their norms.
 * Pass 1 makes what ds_cu_kda_gate and ds_cu_l2norm_heads2 would have made of them, the same
 * bits, where it stages them; nothing writes the activated values back (q, k and g keep the raw
 * ones). A prompt's step saves those two launches and their passes over q, k and g. */
typedef struct {
    const float *A_log, *dt_bias; /* [H], [H * dk] (ds_cu_kda_gate's) */
    int lower_bound_form;
    float lb;
    const float *b_in; /* beta's logits: token t, head h at b_in[t * ld_b + h] */
    int ld_b;
    float q_scale, eps; /* q's head norm times q_scale, k's times 1 (ds_cu_l2norm_heads2's) */
} ds_cu_kda_raw;
int ds_cu_kda_chunked_raw(ds_cu *c, float *o, const float *q, const float *k, const float *v,
                          const float *f, const ds_cu_kda_raw *raw, const int *seg_start,
                          const int *seg_len, float *const *S, int n_seq, int H, int dk, int dv,
                          ds_err *err);
/* ds_cu_kda_chunked's scan and output passes: mode 1 on TF32 tensor cores (~3e-4 relative error
 * instead of 5e-7), 3 3xTF32 (each operand split into two TF32 parts: about f32's accuracy), 2
 * BF16 (the operands rounded to BF16, FLA chunk_kda's precision on BF16 inputs; pass 1 in f32),
 * 4 3xBF16 (each operand split into two BF16 parts on 2's step: ~16 bits, at half 3's tensor
 * time; pass 1 in f32), 0 f32 on CUDA cores. A context starts at 0; the model sets 4 unless
 * DS_CUDA_KDA_TC says otherwise. tests/cuda checks modes 1 and 2 against the CPU at 1e-2 and
 * 3e-2, modes 0, 3 and 4 at f32's 1e-4. */
void ds_cu_set_kda_tc(ds_cu *c, int mode);
/* In modes 1, 3 and 4, pass 1's products between 16-row blocks (the bulk of A = K K^T and P = Q K^T
 * with their decays) on tensor cores in the same precision as the scan; a context starts with it
 * on (tests/cuda checks both forms); 0 keeps pass 1 on CUDA cores in f32 as in mode 0 (the
 * model's default: no faster in 3xTF32, docs/tuning.md; DS_CUDA_KDA_PREP_TC=1 turns it on). */
void ds_cu_set_kda_prep_tc(ds_cu *c, int on);
/* In the tensor-core modes, the outputs made by the scan (pass 3 inside pass 2: the chunks'
 * starting states and U never go through memory; the same bits) — on in a new context; 0 keeps
 * the third pass (tests/cuda compares both forms bit for bit; DS_CUDA_KDA_FUSED_OUT=0). */
void ds_cu_set_kda_out_fused(ds_cu *c, int on);
/* The routed experts' down pass reads its routing and first weights before waiting for the up
 * pass (they are older than it): on by default (DS_CUDA_EARLY_EXPERTS=0 turns it off; a shorter
 * batch-1 step of the 48B shape: bench/RESULTS.md session 9). The ptpc FP8 experts' one-token
 * down pass likewise (session 40). */
void ds_cu_set_early_experts(ds_cu *c, int on);
/* One-token matmuls through the experts' kernel (ds_cu_set_gemv_wide) load their first weights
 * before waiting for the previous kernel, as gemv_bf16_k does (their routing is a constant): on
 * by default in the model (DS_CUDA_WIDE_EARLY=0 turns it off), off in a new context (a shorter
 * batch-1 step of the 48B shape: bench/RESULTS.md session 11). */
void ds_cu_set_wide_early(ds_cu *c, int on);
/* One-token matmuls of one warp a row go through the routed experts' kernel (4 rows a warp, x in
 * shared memory; the same bits): on by default in the model (DS_CUDA_GEMV_WIDE=0 turns it off),
 * off in a new context. */
void ds_cu_set_gemv_wide(ds_cu *c, int on);
/* The batched short conv of width 4 with the width known at compile time (window in registers,
 * inputs loaded ahead; the same bits): on by default in the model (DS_CUDA_CONV_FIXED=0 turns it
 * off), off in a new context. */
void ds_cu_set_conv_fixed(ds_cu *c, int on);
/* Built with DS_KDA_PREP_CLOCKS: the cycles chunked KDA's first pass spent in each of its six
 * phases since the last call (summed over blocks; then zeroed); -1 in other builds. */
int ds_cu_kda_prep_clocks(double cycles[6]);
/* Can ds_cu_kda_chunked run this head shape? */
int ds_cu_kda_chunked_supports(int dk, int dv);

/* As ds_short_conv_silu: in [T][C], w [C][W] (W <= 8), tail [W-1][C] in/out, out [T][C]. */
int ds_cu_short_conv_silu(ds_cu *c, float *out, const float *in, int T, int C, const float *w,
                          int W, float *tail, ds_err *err);
/* As ds_kda_gate: f, g [T][H*dk]; A_log [H]; dt_bias [H*dk]. With beta given, the same launch
 * also writes beta [T][H] = sigmoid(b_in[t * ld_b + h]) (as ds_cu_sigmoid, bit for bit). */
void ds_cu_kda_gate(ds_cu *c, float *g, const float *f, int T, int H, int dk, const float *A_log,
                    const float *dt_bias, int lower_bound_form, float lb, float *beta,
                    const float *b_in, int ld_b);
/* As ds_l2norm_heads (in place, x [T][H][d]) and ds_gated_rmsnorm_heads (y, o, gate [T][H][d]). */
void ds_cu_l2norm_heads(ds_cu *c, float *x, int T, int H, int d, float eps, float scale);
/* Two of them in one launch: x scaled by scale, x2 by scale2 (KDA's q and k). */
void ds_cu_l2norm_heads2(ds_cu *c, float *x, float scale, float *x2, float scale2, int T, int H,
                         int d, float eps);
void ds_cu_gated_rmsnorm_heads(ds_cu *c, float *y, const float *o, const float *gate,
                               const float *w, int T, int H, int d, float eps);
/* As ds_attnres_mix; cands: a device array of m (<= 32) device pointers to [T][D]. */
int ds_cu_attnres_mix(ds_cu *c, float *out, const float *const *cands, int m, const float *np,
                      int T, int D, float eps, ds_err *err);
/* As ds_mla_attend_absorbed over a paged latent pool (pool [pages][block_size][row], block_table
 * on the device): qbar, obar [T][Ha][R]; qr [T][Ha][dr]; causal token t sees rows
 * 0..min(pos0+t, n_ctx-1), as on the CPU. Split over the context in chunks of 256 rows, merged
 * by a second kernel (flash-decoding). The block table is read before the kernel waits for the
 * one before it (PDL): that one must not write it. */
int ds_cu_mla_attend_absorbed(ds_cu *c, float *obar, const float *qbar, const float *qr, int T,
                              int Ha, int R, int dr, const float *pool, const int32_t *block_table,
                              int block_size, int row, int pos0, int n_ctx, int causal, float scale,
                              ds_err *err);

/* As ds_mla_attend_expanded (prefill): q [T][Ha][dn+dr]; kN [n_ctx][Ha][dn]; kR [n_ctx][dr];
 * v [n_ctx][Ha][dvh]; o [T][Ha][dvh]; causality and the n_ctx cap as above. */
int ds_cu_mla_attend_expanded(ds_cu *c, float *o, const float *q, const float *kN, const float *kR,
                              const float *v, int T, int n_ctx, int Ha, int dn, int dr, int dvh,
                              int pos0, int causal, float scale, ds_err *err);
/* Long contexts attended a block of keys at a time (the expanded keys and values of a million
 * tokens would not fit beside the weights): ds_cu_mla_lse_ok says whether T rows of this head
 * shape can run the fused kernel, which can also write lse [T][Ha], each row's log-sum-exp (-inf:
 * no key seen; pos0 may be negative for a block that starts after a row's position); then
 * ds_cu_mla_merge_lse folds a block's o / lse (ob, lb) into the running o / lse, rows = T * Ha. */
int ds_cu_mla_lse_ok(const ds_cu *c, int T, int dn, int dr, int dvh);
int ds_cu_mla_attend_expanded_lse(ds_cu *c, float *o, float *lse, const float *q, const float *kN,
                                  const float *kR, const float *v, int T, int n_ctx, int Ha, int dn,
                                  int dr, int dvh, int pos0, int causal, float scale, ds_err *err);
int ds_cu_mla_merge_lse(ds_cu *c, float *o, float *lse, const float *ob, const float *lb, int rows,
                        int dvh, ds_err *err);
/* Context rows a prompt chunk's expanded attention takes at a time (0: all); the model sets
 * DS_CUDA_MLA_CTX_BLOCK's (default 0 until a GPU run has checked the blocks in the model). */
void ds_cu_set_mla_ctx_block(ds_cu *c, int rows);
int ds_cu_mla_ctx_block(const ds_cu *c);
/* As ds_moe_route for T tokens at once: z [T][E] router logits, bias [E] or NULL; idx, w [T][k].
 * k and n_group at most 64. */
int ds_cu_moe_route(ds_cu *c, int32_t *idx, float *w, const float *z, const float *bias, int T,
                    int E, int k, int n_group, int topk_group, int renormalize, float scale,
                    int hf_kl_quirk, ds_err *err);

/* Routed experts (docs/model.md §5): out[t] (+)= sum_j w[t][j] down_e(act(gate_e x_t, up_e x_t)),
 * e = idx[t][j], in slot order. x, out [T][D]; idx, w [T][k] (device, e.g. from ds_cu_moe_route);
 * gate_up [E][2I][D] BF16 (an expert's gate rows, then its up rows); down [E][D][I] BF16;
 * act: SwiGLU, or SiTU with its betas (as ds_act_situ). accumulate: add to out instead of
 * writing it. T * k at most 65535. With D and I multiples of 8 the routed rows are grouped by
 * expert first, so each chosen expert's weights are read once per call (E: experts in gate_up).
 * Either way a row's result does not depend on the other rows. Tensor parallelism: gate_up and
 * down hold this rank's experts [e0, e0 + E) only (idx stays global); rows routed elsewhere add
 * nothing here (the all-reduce adds them). Without it e0 = 0 and E = all experts. */
int ds_cu_moe_experts(ds_cu *c, float *out, const float *x, const int32_t *idx, const float *w,
                      int T, int k, int E, int e0, int D, int I, const uint16_t *gate_up,
                      const uint16_t *down, int situ, float situ_beta, float situ_lin_beta,
                      int accumulate, ds_err *err);

/* The same with MXFP4 experts (docs/quantization.md): gate_up codes [E][2I][D/2] and scales
 * [E][2I][D/32], down codes [E][D][I/2] and scales [E][D][I/32] (D and I multiples of 32).
 * Decode and batch invariance: a weight-streaming kernel on BF16 tensor cores that dequantizes
 * in registers (each weight exact; f32 activations as three BF16 parts, exact: the CPU's numbers
 * up to the order of the sums). Batches
 * of at least the tensor-core bound (ds_cu_set_expert_mma_min; with ds_cu_set_expert_mma and
 * D, I multiples of 128): BF16 tensor cores fed with the weights dequantized in registers and the
 * activations in BF16 (w4a16), on the device (capturable). */
int ds_cu_moe_experts_mxfp4(ds_cu *c, float *out, const float *x, const int32_t *idx,
                            const float *w, int T, int k, int E, int e0, int D, int I,
                            const uint8_t *gu_codes, const uint8_t *gu_scales,
                            const uint8_t *dn_codes, const uint8_t *dn_scales, int situ,
                            float situ_beta, float situ_lin_beta, int accumulate, ds_err *err);
/* One token's (and small batches') MXFP4 experts through the streaming kernel with the
 * activations rounded to BF16 once instead of split into three exact BF16 parts (moe_mxfp4.cu's
 * fp4_mma_step ONE): w4a16 as the tensor-core path for batches. Never with batch invariance (the
 * three parts keep every product exact). */
void ds_cu_set_fp4_one_part(ds_cu *c, int on);

/* Routed experts held as ptpc FP8 (docs/quantization.md §3): gate_up codes [E][2I][D] E4M3 with
 * row scales gu_scales [E][2I] f32 (an expert's gate rows, then its up rows), down codes [E][D][I]
 * and dn_scales [E][D]; otherwise as ds_cu_moe_experts. As the CPU: each token's input quantized
 * per token, gate and up (sum * s_t) * s_r, act in f32, its row quantized per (token, expert)
 * before the down product. One token, or batches below the tensor-core bound (and with batch
 * invariance): the weight-streaming kernel; batches from the bound (ds_cu_set_expert_mma, D and I
 * multiples of 128): F16 tensor cores on the E4M3 values (exact), f32 accumulation. D and I
 * multiples of 16, I at most 12288. */
int ds_cu_moe_experts_fp8(ds_cu *c, float *out, const float *x, const int32_t *idx, const float *w,
                          int T, int k, int E, int e0, int D, int I, const uint8_t *gu_codes,
                          const float *gu_scales, const uint8_t *dn_codes, const float *dn_scales,
                          int situ, float situ_beta, float situ_lin_beta, int accumulate,
                          ds_err *err);

/* Routed experts of steps with >= 64 routed rows per local expert on average (prefill) through
 * cuBLAS tensor-core GEMMs (pointer-array batches over padded per-expert panels, experts bucketed
 * by row count), activations rounded to BF16 (not with batch invariance, nor inside a graph
 * capture: the layout is read on the host); ptpc FP8 experts (ds_cu_moe_experts_fp8) likewise on
 * FP8 tensor cores through cuBLASLt, their activations quantized per token. On in the engine
 * unless DS_CUDA_EXPERT_GEMM=0 (tests/cuda: check_moe_experts_gemm, check_moe_fp8's mode 11). */
void ds_cu_set_expert_gemm(ds_cu *c, int on);
/* Those experts' cuBLASLt products (FP8, and BF16 with ds_cu_set_expert_lt) as one call an
 * expert instead of a pointer-array batch a bucket (what runs where cuBLASLt has no pointer-array
 * algorithm): 0 in a new context and in the engine; tests/cuda checks both. */
void ds_cu_set_lt_each(ds_cu *c, int on);
/* How many steps' routed experts (per layer) have run through those cuBLAS / cuBLASLt paths in
 * this context: what a check reads to know which path ran. */
long ds_cu_expert_gemm_runs(const ds_cu *c);
/* Those BF16 GEMMs as cuBLASLt pointer-array batches (the FP8 experts' calls, lt_batched) instead
 * of cublasGemmBatchedEx, a bucket falling back to the latter where cuBLASLt has no algorithm:
 * an option (DS_CUDA_EXPERT_LT; session 47 on an H100: the same rate as cublasGemmBatchedEx, a
 * prompt within the spread), 0 in a new context and in the engine unless set. ds_cu_expert_lt_runs:
 * the calls whose every batch went through it. */
void ds_cu_set_expert_lt(ds_cu *c, int on);
long ds_cu_expert_lt_runs(const ds_cu *c);
/* ptpc FP8 products on cuBLASLt (T > 2 tokens) take their row and token scales as cuBLASLt's
 * outer-vector scales where it has an algorithm for them, else (and with on = 1, for comparisons)
 * run with unit scales and apply them in a second pass over y. 0 in a new context and in the
 * engine. ds_cu_f8_lt_vec_runs: how many products cuBLASLt scaled itself in this context. */
void ds_cu_set_f8_lt_unit(ds_cu *c, int on);
long ds_cu_f8_lt_vec_runs(const ds_cu *c);
/* Those GEMMs' down pass writing each routed row's output in BF16 instead of f32 (the combine
 * then reads half the bytes; each expert's output rounded to BF16 before the weighted sum), and
 * with on = 2 their gate/up pass too (rounded before the activation); the FP8 experts' cuBLASLt
 * down sums likewise for on >= 1 (rounded before their scales; their gate/up sums stay f32): 2 in
 * the engine unless DS_CUDA_EXPERT_BF16_OUT says otherwise (its accuracy: bench/RESULTS.md session
 * 44); 0 in a new context. */
void ds_cu_set_expert_bf16_out(ds_cu *c, int on);
/* Those GEMMs' gather of the routed rows from x rounded to BF16 once ([T][D]: a prompt's 8192 x
 * 2304 is 38 MB, so the k copies of a row mostly come from L2) instead of each routed row
 * rounding its f32 row again; the same words either way. 0 in a new context; the engine reads
 * DS_CUDA_EXPERT_X16. */
void ds_cu_set_expert_x16(ds_cu *c, int on);
/* Grouped routed experts of steps of >= 40 tokens (batch decode, verify, short prefill chunks) on
 * BF16 tensor cores (wmma), on the device so the step stays capturable (not with batch
 * invariance; 2I and D multiples of 256). On in the engine unless DS_CUDA_EXPERT_MMA=0
 * (tests/cuda: check_moe_experts_mode, mode 3). */
void ds_cu_set_expert_mma(ds_cu *c, int on);
/* Those batches' experts through a kernel that streams the weights as tensor-core A operands
 * straight from memory (mma.sync, tokens as BF16 B operands, the activation applied in the up
 * pass's registers) instead of wmma over shared-memory chunks: on in the engine unless
 * DS_CUDA_EXPERT_TC=0 (tests/cuda: check_moe_experts_mode, mode 4; K % 64 == 0). */
void ds_cu_set_expert_tc(ds_cu *c, int on);
/* Tokens a step from which batches' experts take the tensor-core path (0: the default, 40;
 * DS_CUDA_EXPERT_MMA_MIN in the engine). */
void ds_cu_set_expert_mma_min(ds_cu *c, int tokens);
/* Matmuls (and per-head matmuls) of up to `rows` rows go through the weight-streaming kernel
 * instead of cuBLAS (0: the default, two rows; DS_CUDA_GEMV_MAX_T in the engine). */
void ds_cu_set_gemv_max_t(ds_cu *c, int rows);
/* 1: a ptpc FP8 product of up to 8 tokens has the activations' quantizer write their codes first
 * and reads them (two launches), instead of every block quantizing the tokens itself (one), and
 * a token's FP8 routed experts go through the batches' streaming path (quantizers, then the
 * streams): what the in-kernel quantization costs (bench/RESULTS.md, sessions 27 and 32). */
void ds_cu_set_f8_prequant(ds_cu *c, int on);
/* The FP8 weight-streaming kernels split K until a warp has at least `steps` 64-column steps (0:
 * the default, 4; fp8_stream.cuh's f8_splits): fewer steps, more warps a product. A function of
 * the matrix, so batch invariance holds at any value; the fused KDA decode's f_b and g_b (K 128)
 * stay one warp a tile at every value. DS_CUDA_F8_SPLIT_MIN in the engine. */
void ds_cu_set_f8_split_min(ds_cu *c, int steps);
/* An experiment: where that rule splits a product's K at all, split it into `parts` (1, 2, 4 or
 * 8; 0: the rule's), to measure how the grid's waves fill (fp8_stream.cuh's f8_splits_forced).
 * Batch invariance holds at any value. DS_CUDA_F8_SPLIT in the engine. */
void ds_cu_set_f8_split(ds_cu *c, int parts);
/* One token's FP8 routed experts: at most blocks_per_sm blocks an SM a routed row's worth (0: the
 * default, 2), each quantizing the row once for its tiles; more: more blocks, fewer tiles each
 * one after another. The sums do not change. DS_CUDA_F8_MOE_WAVES in the engine. */
void ds_cu_set_f8_moe_waves(ds_cu *c, int blocks_per_sm);
/* An FP8 product of up to 8 tokens that quantizes them itself: at most blocks_per_sm blocks an
 * SM (0: the default, 2), each quantizing once for its tiles. The sums do not change.
 * DS_CUDA_F8_GEMV_WAVES in the engine. */
void ds_cu_set_f8_gemv_waves(ds_cu *c, int blocks_per_sm);
/* With batch invariance off, the FP8 weight-streaming kernels keep K whole (one warp a tile, no
 * partial sums) for calls of at least `tokens` tokens (0: never; the split then follows the
 * matrix alone, fp8_stream.cuh's f8_splits). DS_CUDA_F8_WHOLE_K in the engine. */
void ds_cu_set_f8_whole_k(ds_cu *c, int tokens);
/* One token's FP8 products (dense, and the routed experts) with batch invariance off: a warp a row
 * on the CUDA cores (fp8_rows.cuh), at most blocks_per_sm blocks an SM each quantizing the token
 * once (0: the default, 4); below 0 off (fp8_stream.cuh's tiles, as with batch invariance). The
 * sums' order differs from the tiles'. DS_CUDA_F8_ROWS in the engine. */
void ds_cu_set_f8_rows(ds_cu *c, int blocks_per_sm);
/* Decode's FP8 products on Hopper's FP8 tensor cores through wgmma (matmul_fp8_wg.cu: the codes
 * straight from the load into the tensor core, no conversion): which, bit 1 the dense products of
 * up to 8 tokens, bit 2 one token's routed experts; batch invariance off, whole 64-column steps.
 * Its sums' order is its own. Takes precedence over the forms below. DS_CUDA_F8_WG in the
 * engine. */
void ds_cu_set_f8_wg(ds_cu *c, int which);
/* The same for one token's routed experts alone (ds_cu_set_f8_rows sets both).
 * DS_CUDA_F8_MOE_ROWS in the engine. */
void ds_cu_set_f8_moe_rows(ds_cu *c, int blocks_per_sm);
/* A what-if (wrong results, the timing is what counts, as ds_cu_set_skip): decode's FP8 products
 * skip quantizing their tokens (codes left unset, scale 1), to measure what the quantizer in
 * every block costs a step. DS_CUDA_F8_NOQUANT=1 in the engine. */
void ds_cu_set_f8_noquant(ds_cu *c, int on);
/* Expanded MLA of segments with >= 128 query rows through cuBLAS (scores and values as strided-
 * batched BF16 GEMMs over the heads, a row softmax between). On in the engine unless
 * DS_CUDA_MLA_GEMM=0 (tests/cuda: check_mla_expanded_gemm). */
void ds_cu_set_mla_gemm(ds_cu *c, int on);
/* ... and, for Kimi's head shape (dn + dr = 192, dvh = 128), as one fused flash-attention kernel
 * (no scores in memory) instead of the two GEMMs: mode 1 on mma.sync, 2 on Hopper's wgmma (sm_90
 * devices; mode 1 elsewhere), 3 on wgmma with two warpgroups a block, 4 that with its products
 * beside the softmax, 0 the GEMMs; 0 in a new context, DS_CUDA_MLA_FLASH in the engine
 * (tuning.h). */
void ds_cu_set_mla_flash(ds_cu *c, int mode);
/* A side stream for a chain of launches that does not depend on what the main stream issues
 * next: after ds_cu_side_begin every launch (and cuBLAS call) goes to the side stream, forked
 * from the main one; ds_cu_side_end returns to the main stream (the side work runs on beside
 * it); ds_cu_side_join makes the main stream wait for it (ds_cu_moe_experts joins before adding
 * onto its output; ds_cu_sync and ds_cu_capture_end join too). No-ops unless enabled with
 * ds_cu_set_side (before any capture: it creates the stream) and while profiling. */
int ds_cu_set_side(ds_cu *c, int on, ds_err *err);
int ds_cu_side_begin(ds_cu *c, ds_err *err);
int ds_cu_side_end(ds_cu *c, ds_err *err);
int ds_cu_side_join(ds_cu *c, ds_err *err);
/* Decode's weight streams prefetched into L2 while the small kernels before them run: a weight
 * product of few tokens (ds_cu_matmul up to its streaming bound) first starts, on a stream of its
 * own, a prefetch of up to mb MB of its weights (cp.async.bulk.prefetch.L2), issued after the
 * previous weight stream (ds_cu_l2_mark) has finished — so it fills the time the memory would
 * otherwise sit idle, and the product finds its first rows in L2. A hint: results are unchanged.
 * mb 0 turns it off; needs sm_90; off while profiling; joined by ds_cu_sync and capture's end.
 * DS_CUDA_L2_PREFETCH in the engine. */
int ds_cu_set_l2_prefetch(ds_cu *c, int mb, ds_err *err);
/* Marks the end of a weight stream issued outside ds_cu_matmul (the routed experts): the next
 * prefetch starts after it. */
int ds_cu_l2_mark(ds_cu *c, ds_err *err);
/* The routed experts' weights prefetched likewise once the kernel marked last (the router's
 * choice: mark right after it) has written idx [n] (global expert ids; this rank holds e0 ..
 * e0 + El - 1, whose gate|up blocks of gu_bytes sit at gu and down blocks of dn_bytes at dn): each
 * chosen expert's first MB / n of gate|up and half that of down. */
int ds_cu_l2_prefetch_experts(ds_cu *c, const int32_t *idx, int n, int e0, int El, const void *gu,
                              size_t gu_bytes, const void *dn, size_t dn_bytes, ds_err *err);
/* ds_cu_mla_attend_absorbed_batch with one block per (token, split) for all heads, each latent row
 * read once instead of once per head (not with batch invariance; Ha * R a multiple of 256 with at
 * most 64 outputs per thread). on = 1: taken when the step has enough (token, split) blocks to
 * fill the GPU; 2: whenever the shape allows (the checks); 0: never. The engine uses 1 unless
 * DS_CUDA_MLA_ALL_HEADS=0 (check_mla_batch covers it). */
void ds_cu_set_mla_all_heads(ds_cu *c, int on);
/* absorbed MLA's splits merged with the splits spread over a block's warps (mla_merge_w_k) instead
 * of one thread an output going through them all (mla_merge_k) */
void ds_cu_set_mla_merge_warps(ds_cu *c, int on);
/* ds_cu_mla_attend_absorbed_batch on tensor cores (BF16 query, rows and probabilities, f32
 * accumulation; mla_decode_tc.cu) for steps whose context cap is at least min_rows (0: never;
 * not with batch invariance; R 512, dr 64, Ha 16 or 32). The engine's value: DS_CUDA_MLA_DECODE_TC
 * (tuning.c); check_mla_batch_tc covers it. */
void ds_cu_set_mla_decode_tc(ds_cu *c, int min_rows);
/* Its tile for FP8 and BF16 rows: 64 rows (a two-stage ring), else 32 (the engine's value:
 * DS_CUDA_MLA_DECODE_TC_TILE, tuning.c). */
void ds_cu_set_mla_decode_tc_tile(ds_cu *c, int rows);
/* Its warps a block for BF16 rows in 64-row tiles: 16 (the query in shared memory, half the
 * registers a thread), else 8 (the engine's value: DS_CUDA_MLA_DECODE_TC_WARPS, tuning.c). */
void ds_cu_set_mla_decode_tc_warps(ds_cu *c, int warps);
/* Its warp-specialized form (16 warps, half making tile it's scores and softmax while the other
 * half adds tile it - 1's outputs and stages the rows; 32-row tiles; the same words as the 8-warp
 * 32-row form: mla_decode_tc.cu) for steps whose context cap is at least min_rows (0: never): FP8
 * and BF16 rows. The engine's value: DS_CUDA_MLA_DECODE_WS (tuning.c). */
void ds_cu_set_mla_decode_ws(ds_cu *c, int min_rows);
/* That form's FP8 rows (on): the score warps take their fragments straight from the staged codes
 * and each output warp converts the columns it multiplies, instead of the score warps converting
 * the tile for both (off: the 8-warp 32-row form's words; on: each k-step's channels added in
 * another order). The engine's value: DS_CUDA_MLA_WS_OCONV (tuning.c). */
void ds_cu_set_mla_ws_oconv(ds_cu *c, int on);
/* Built with DS_MLA_TCW_CLOCKS: the cycles the warp-specialized form's warps spent in each of its
 * ten phases since the last call (mla_decode_tc.cu; lane 0 of every warp summed; then zeroed); -1
 * in other builds. */
int ds_cu_mla_tcw_clocks(double cycles[10]);

/* ---- glue for the model forward (src/backend/cuda/step.c, layers.c) ---- */
/* Batch-invariant matmuls (see ds_model_opts.batch_invariant): on, every ds_cu_matmul streams the
 * weights with f32 activations in tiles of 8 tokens, so a token's bits never depend on T. */
void ds_cu_set_batch_invariant(ds_cu *c, int on);
void ds_cu_add(ds_cu *c, float *y, const float *x, size_t n); /* y += x */
void ds_cu_mul(ds_cu *c, float *y, const float *x, size_t n); /* y *= x */
void ds_cu_sigmoid(ds_cu *c, float *x, size_t n);             /* in place */
/* y *= sigmoid(x): ds_cu_sigmoid on x, then ds_cu_mul, in one launch, bit for bit (x kept) */
void ds_cu_mul_sigmoid(ds_cu *c, float *y, const float *x, size_t n);
/* P += a, then y = rmsnorm(P) ⊙ w (as ds_add then ds_rmsnorm): P, a, y [T][D]. */
void ds_cu_add_rmsnorm(ds_cu *c, float *y, float *P, const float *a, const float *w, int T, int D,
                       float eps);
/* h [rows][2I]: gate half <- act(gate, up) in place (SwiGLU, or SiTU with its betas), as the
 * CPU's dense MLP computes from its separate gate and up projections. */
void ds_cu_act_pairs(ds_cu *c, float *h, int rows, int I, int situ, float beta, float lin_beta);
/* ds_cu_rmsnorm over rows with strides: x [T][ldx], y [T][ldy], D <= ld. */
void ds_cu_rmsnorm_ld(ds_cu *c, float *y, int ldy, const float *x, int ldx, const float *w, int T,
                      int D, float eps);
/* For i < n: dst row (dst_rows ? dst_rows[i] : i) = src row (src_rows ? src_rows[i] : i), width
 * floats; rows ldd / lds floats apart; the index arrays are device memory. Scatters latent rows
 * into the paged pool, gathers them back, gathers the rows that want logits. */
int ds_cu_move_rows(ds_cu *c, float *dst, size_t ldd, const int32_t *dst_rows, const float *src,
                    size_t lds, const int32_t *src_rows, int n, int width, ds_err *err);
/* Quantized latent rows (dtype DS_KV_FP8 or DS_KV_BF16, kernels/shared/kv_row.h): pool row
 * dst_rows[i] (row_bytes apart) <- the stored form of src row i ([R + dr] floats, rows lds apart),
 * i < n; the same bytes the CPU writes. */
int ds_cu_kv_store(ds_cu *c, int dtype, uint8_t *pool, size_t row_bytes, const int32_t *dst_rows,
                   const float *src, size_t lds, int n, int R, int dr, ds_err *err);
/* cl [n][R], kr [n][dr] <- the values of quantized pool rows rows[i] (device arrays). */
int ds_cu_kv_gather(ds_cu *c, int dtype, float *cl, float *kr, const uint8_t *pool,
                    size_t row_bytes, const int32_t *rows, int n, int R, int dr, ds_err *err);
/* rows x width floats between pitched device buffers (pitches in floats), by a kernel. */
int ds_cu_copy_2d(ds_cu *c, float *dst, size_t ldd, const float *src, size_t lds, size_t width,
                  size_t rows, ds_err *err);
/* ds_cu_short_conv_silu for every sequence of a step, and for up to three projections side by
 * side (KDA's q, k, v), in one launch. Sequence z runs tokens [seg_off[z], seg_off[z+1]). */
typedef struct ds_cu_conv_batch {
    int n_proj, C, W; /* projections (1..3), channels per projection, kernel width (<= 8) */
    const float *in;  /* [tokens][ld_in]: projection j's inputs at columns [j C, (j+1) C) */
    int ld_in;
    float *out; /* projection j's output [tokens][C] at out + j * out_stride */
    size_t out_stride;
    const float *w;      /* [n_proj][C][W] */
    float *const *tails; /* [n_seq] device: projection 0's tail [W-1][C], projection j's at
                            + j (W-1) C */
    float *const *rows;  /* [n_seq] device, or NULL; NULL entries too: where a sequence keeps the
                            tails after each token t (at + t rows_stride, laid out as tails) */
    size_t rows_stride;
    const int32_t *seg_off; /* [n_seq + 1] device */
    int n_seq;
    int n_tokens; /* seg_off[n_seq] (the host's copy: how many time chunks to run) */
} ds_cu_conv_batch;
int ds_cu_short_conv_silu_batch(ds_cu *c, const ds_cu_conv_batch *b, ds_err *err);
/* A decode step's KDA middle in one launch, for sequences of one token each and no rollback rows
 * (and the low-rank output gate): per (head, sequence), the short convs of the head's q, k and v
 * channels (tails updated), the head norms of q (scaled by q_scale) and k, f_b's and g_b's rows of
 * the head against f_a x and g_a x, the decay gate and beta, the recurrence and the gated output
 * norm — what ds_cu_short_conv_silu_batch, ds_cu_l2norm_heads2, ds_cu_matmul (one token, twice),
 * ds_cu_kda_gate, ds_cu_kda_recurrent_batch and ds_cu_gated_rmsnorm_heads do, with the same
 * operations on every value, so the same bits, in one launch instead of seven. */
typedef struct ds_cu_kda_decode {
    const float *pre; /* [n_seq][ld]: raw q, k, v at columns [0, P), [P, 2P), [2P, 3P); f_a x at
                         fa_off, g_a x at ga_off, b x at b_off (P = H dk) */
    int ld, fa_off, ga_off, b_off;
    const float *conv_w;      /* [3][P][W] */
    float *const *tails;      /* [n_seq] device: as ds_cu_conv_batch's */
    const uint16_t *f_b;      /* [P][Kf] BF16: the decay gate's up-projection (or FP8 codes [P][Kf]
                                 bytes when f_bs is set) */
    const uint16_t *g_b;      /* [P][Kg] BF16: the output gate's (likewise) */
    const float *f_bs, *g_bs; /* [P] their row scales (ptpc FP8, docs/quantization.md §3), or
                                 NULL: BF16 */
    int Kf, Kg;               /* their columns: the first Kf of f_a x, Kg of g_a x */
    const float *A_log;       /* [H] */
    const float *dt_bias;     /* [P] */
    const float *o_norm;      /* [dk] */
    int lower_bound_form;
    float lb, q_scale, eps, norm_eps; /* the gate's lower bound; q's scale, the head norms' eps;
                                         the output norm's */
    float *const *S;                  /* [n_seq] device: each sequence's state [H][dk][dk] */
    float *y;                         /* [n_seq][H][dk]: the gated, normed output */
    int n_seq, H, dk, W;
} ds_cu_kda_decode;
/* Can ds_cu_kda_decode_fused take this shape (dk 128, conv width 4, Kf and Kg multiples of 8 up
 * to 128; f8: f_b and g_b ptpc FP8, multiples of 16) on this GPU (sm_90: clusters)? */
int ds_cu_kda_decode_fits(const ds_cu *c, int dk, int W, int Kf, int Kg, int f8);
int ds_cu_kda_decode_fused(ds_cu *c, const ds_cu_kda_decode *d, ds_err *err);
/* ds_cu_mla_attend_absorbed for the tokens of many sequences in one launch (causal): token t sits
 * at position tok_pos[t] of its sequence, whose block table starts at tables + tok_bt[t];
 * max_ctx bounds every tok_pos + 1. Query (t, h)'s rope part is qr[(t Ha + h) ldqr + 0..dr)
 * (ldqr = dr packed, or the stride of the full query rows so that it is read in place). Device
 * arrays; tables, tok_bt and tok_pos are read before the kernel waits for the one before it
 * (PDL), so that one must not write them (the forward uploads them before the step). The pool's
 * rows are row_bytes apart, of kv_dtype's form (kernels/shared/kv_row.h: f32 [R + dr], FP8 or
 * BF16), read as f32 in registers. */
int ds_cu_mla_attend_absorbed_batch(ds_cu *c, float *obar, const float *qbar, const float *qr,
                                    int ldqr, int T, int Ha, int R, int dr, const void *pool,
                                    int kv_dtype, const int32_t *tables, const int32_t *tok_bt,
                                    const int32_t *tok_pos, int max_ctx, int block_size,
                                    size_t row_bytes, float scale, ds_err *err);
/* A copy in any direction (unified addressing), done when it returns. */
int ds_cu_copy_any(ds_cu *c, void *dst, const void *src, size_t bytes, ds_err *err);
/* d [rows][cols] <- scale x U[-1, 1) from (key, index in the whole tensor): element (i, j) is
 * element (row0 + i, col0 + j) of a tensor of full_cols columns, the value the CPU's random
 * weights have there (model.c hash_uniform, then rounded to BF16 to nearest even). */
int ds_cu_fill_random_bf16(ds_cu *c, uint16_t *d, size_t rows, size_t cols, uint64_t key,
                           size_t row0, size_t col0, size_t full_cols, float scale, ds_err *err);
/* A random MXFP4 matrix's slice, the CPU's draw (rand_hash.h): codes [rows][cols/2] and scales
 * [rows][cols/32] of rows [row0, row0 + rows) and columns [col0, col0 + cols) of a tensor of
 * full_cols columns (col0, cols and full_cols multiples of 32); e2: the scales' exponent. */
int ds_cu_fill_random_mxfp4(ds_cu *c, uint8_t *codes, uint8_t *scales, size_t rows, size_t cols,
                            uint64_t key, size_t row0, size_t col0, size_t full_cols, int e2,
                            ds_err *err);
/* dst [cols][rows] = src [rows][cols]^T, BF16 (weights reshaped once at load). */
int ds_cu_transpose_bf16(ds_cu *c, uint16_t *dst, const uint16_t *src, int rows, int cols,
                         ds_err *err);
/* Can a kernel read p (device or managed memory)? 0 for plain host memory. */
int ds_cu_is_device_ptr(const void *p);
/* Free device memory in bytes. */
size_t ds_cu_mem_free(ds_cu *c);

/* RoPE on rows of x [rows][ldx]: lanes (2i, 2i+1), i < half, of row r turned by
 * cs [rows / per][half][2] = {cos, sin} of row r / per (GPT-J pairing, the DSpark draft's);
 * rows <= 65535. */
int ds_cu_rope_pairs(ds_cu *c, float *x, int ldx, int rows, int per, const float *cs, int half,
                     ds_err *err);

/* Greedy tokens (ds_argmax) of rows x [rows][V], each row cut in `parts` so that a short batch
 * still spreads over the GPU: keys [rows][parts] receive each part's best as a 64-bit key (the
 * value's bits ordered as floats are, above the inverted index; 0 for a part of NaN), and
 * ds_cu_argmax_token reduces a row's keys on the host after they are downloaded. */
int ds_cu_argmax_parts(int rows, int V); /* the parts that fill the GPU for this shape */
void ds_cu_argmax_rows(ds_cu *c, uint64_t *keys, const float *x, int rows, int V, int parts);
static inline int32_t ds_cu_argmax_token(const uint64_t *keys, int parts) {
    uint64_t best = 0;
    for (int p = 0; p < parts; p++) best = keys[p] > best ? keys[p] : best;
    return best ? (int32_t) ~(uint32_t)best : 0; /* a row of NaN: 0, as ds_argmax */
}

/* One row's sampling, as ds_row_draw (sample/sampler.h) turned into numbers: */
typedef struct ds_cu_draw {
    double u;       /* the uniform, [0, 1) */
    float inv_t;    /* 1.0f / temperature, computed as sampler.c does */
    float top_p;    /* >= 1: off */
    float min_w;    /* min_p clamped to [0, 1]; 0: off */
    float presence; /* penalties */
    float frequency;
    int greedy; /* the argmax of the edited row, no draw */
    int top_k;  /* 0: off (< V) */
    int row;    /* the row of x */
    int edits;  /* offset in edits: n_counts (id, count) pairs, n_mask ids, then the
                   ceil(n_allow / 32) words of a constrained row's allowed-ids bitmask */
    int n_counts, n_mask;
    int n_allow; /* 0: no bitmask; else ids >= n_allow and ids whose bit is clear get -inf */
} ds_cu_draw;

/* tokens[n] (host) = ds_sample_row of rows d[i].row of x [.][ld] (device; edited in place) — the
 * same token for the same row and uniform. d[n] and edits[n_edits] are host memory. Synchronises.
 */
int ds_cu_draw_rows(ds_cu *c, int32_t *tokens, float *x, size_t ld, int V, const ds_cu_draw *d,
                    int n, const int32_t *edits, size_t n_edits, ds_err *err);

/* The ceilings figures are reported against, measured now: the device-to-device copy rate
 * (GB/s, read + written) and cuBLAS's BF16 GEMM rate (TFLOP/s). */
int ds_cu_measure_limits(ds_cu *c, double *copy_gbs, double *gemm_tflops, ds_err *err);

/* ---- CUDA graphs: a step's launches captured once, replayed in one launch ---- */
typedef struct ds_cu_graph ds_cu_graph;
/* Between begin and end, launches on the stream are recorded, not run; nothing may synchronise or
 * allocate (scratch must already be grown: run the same shape eagerly first). */
int ds_cu_capture_begin(ds_cu *c, ds_err *err);
int ds_cu_capture_end(ds_cu *c, ds_cu_graph **out, ds_err *err);
int ds_cu_graph_launch(ds_cu *c, ds_cu_graph *g, ds_err *err);
void ds_cu_graph_free(ds_cu_graph *g);
/* Changes whenever one of the backend's scratch buffers moved: graphs captured before hold stale
 * addresses. */
uint64_t ds_cu_epoch(ds_cu *c);

/* ---- per-op profile (DS_CUDA_PROFILE=1; eager steps only: a captured graph has no marks) ----
 * ds_cu_prof_mark(c, label) opens an interval that the next mark (or the step's end) closes;
 * ds_cu_prof_step_end waits for the stream and adds each interval's device time to its label;
 * ds_cu_prof_report prints the labels by time (per step and share) to f (NULL: discards them) and
 * starts over. Labels are
 * string literals. Without ds_cu_prof_enable every call returns at once. */
void ds_cu_prof_enable(ds_cu *c, int on);
/* A timeline of every kernel the process runs from now on (graph nodes included): CSV rows of
 * start and duration (ns, the device's clock), stream and mangled name, written to path by
 * ds_cu_timeline_close (called at exit too) — through CUPTI, opened here (an error names what
 * is missing). One a process; a second open is a no-op. DS_CUDA_TIMELINE in the engine. */
int ds_cu_timeline_open(const char *path, ds_err *err);
void ds_cu_timeline_close(void);
void ds_cu_prof_mark(ds_cu *c, const char *label);
void ds_cu_prof_step_end(ds_cu *c);
void ds_cu_prof_report(ds_cu *c, FILE *f, const char *title);
/* The weight GEMMs that cuBLAS ran since the last report (their own profile label, FLOPs of the
 * rows multiplied, not of padding): TFLOP/s, and their device ms a step in *ms_per_step; 0 when
 * none ran or no profile is on. */
double ds_cu_prof_gemm_tflops(ds_cu *c, double *ms_per_step);
/* A what-if for finding a graph's critical path (DS_CUDA_SKIP; benchmarks only: the results are
 * wrong): the kernels launched under these ';'-separated profile labels are left out (cuBLAS
 * calls, copies and stream joins stay), in graphs too; NULL or "" launches everything. */
int ds_cu_set_skip(ds_cu *c, const char *labels, ds_err *err);

/* ---- timing (device events on the stream) --------------------------------------------------- */
typedef struct ds_cu_timer ds_cu_timer;
ds_cu_timer *ds_cu_timer_start(ds_cu *c);
/* Milliseconds since start (waits for the stream); frees the timer. */
double ds_cu_timer_stop(ds_cu *c, ds_cu_timer *t);
/* A device-to-device copy of `bytes` (the bandwidth ceiling). */
int ds_cu_copy_d2d(ds_cu *c, void *dst, const void *src, size_t bytes, ds_err *err);
/* C[m][n] = A[m][k] B[n][k]^T in BF16 with F32 accumulation, all BF16 (the GEMM rate ceiling). */
int ds_cu_gemm_bf16(ds_cu *c, uint16_t *C, const uint16_t *A, const uint16_t *B, int m, int n,
                    int k, ds_err *err);

#ifdef __cplusplus
}
#endif

#endif
