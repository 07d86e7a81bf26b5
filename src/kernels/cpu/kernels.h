/* kernels.h — the CPU compute kernels. Activations are f32; big weight matrices stay in their file
 * dtype (BF16, F16 or F32) and are widened in registers. The instruction set is chosen once at run
 * time (AVX-512 / AVX2+FMA / portable C); DS_ISA=scalar|avx2|avx512 in the environment forces one.
 * Threads: OpenMP inside the kernels; callers are single-threaded.
 *
 * Every kernel has a float64 reference in tests/unit/ (docs/architecture.md invariant 1). */
#ifndef DS_KERNELS_H
#define DS_KERNELS_H

#include "base/ds_base.h"
#include "io/safetensors.h"
#include "kernels/shared/kv_row.h"

/* ---- ISA selection ----------------------------------------------------------------------------
 */
typedef enum { DS_ISA_SCALAR = 0, DS_ISA_AVX2 = 1, DS_ISA_AVX512 = 2 } ds_isa;
void ds_kernels_init(void); /* idempotent; reads DS_ISA, checks cpuid */
ds_isa ds_kernels_isa(void);
const char *ds_isa_name(ds_isa isa);
void ds_kernels_force_isa(ds_isa isa); /* tests: run the same case on every supported path */
int ds_isa_supported(ds_isa isa);

/* ---- matrices ---------------------------------------------------------------------------------
 */
/* A weight matrix W[rows][cols], row-major, in its file dtype or a quantized format
 * (docs/quantization.md; element formats in kernels/shared/quant.h):
 *  - DS_DT_F32, DS_DT_F16, DS_DT_BF16: data [rows][cols] elements; scale NULL.
 *  - DS_DT_F8_E4M3 (ptpc_fp8): data [rows][cols] E4M3 codes, scale f32 [rows]: W[r][c] =
 *    e4m3(data[r][c]) * scale[r]. A product with it quantizes its activations too, one scale a
 *    token (w8a8): y[t][r] = s_t * scale[r] * sum_c e4m3(x[t][c] / s_t) * e4m3(data[r][c]).
 *  - DS_DT_MXFP4: data [rows][cols/2] bytes (element 2i in the low nibble), scale u8 E8M0
 *    [rows][cols/32]: W[r][c] = fp4(code) * 2^(scale[r][c/32] - 127); activations stay f32
 *    (w4a16 on the GPU). cols % 32 == 0. */
typedef struct ds_mat {
    const void *data;
    ds_dtype dtype;
    int rows, cols;
    const void *scale;
} ds_mat;

/* Rows [row0, row0+n) of W as a matrix of its own (scales follow). */
ds_mat ds_mat_rows(const ds_mat *w, int row0, int n);
/* Bytes of data of one row, of the scales of one row (0 without). */
size_t ds_mat_row_bytes(const ds_mat *w);
size_t ds_mat_scale_row_bytes(const ds_mat *w);

/* y[t][r] = sum_c x[t][c] * W[r][c]   for t < T, r < W.rows  (y = x W^T; y overwritten).
 * x: [T][ldx] (ldx >= W.cols), y: [T][ldy] (ldy >= W.rows). */
void ds_matmul(float *y, int ldy, const float *x, int ldx, int T, const ds_mat *w);
/* y[t][c] = sum_r x[t][r] * W[r][c]   (y = x W; y: [T][ldy], x: [T][ldx], ldx >= W.rows). */
void ds_matmul_t(float *y, int ldy, const float *x, int ldx, int T, const ds_mat *w);
/* ptpc_fp8 (docs/quantization.md): each row of W [rows][cols] (F32, F16 or BF16) gets the scale
 * ds_ptpc_scale(max |W[r][:]|) over its whole row, and columns [c0, c0+nc) of it become E4M3
 * codes: codes [rows][nc], scales [rows]. The scale comes from the whole row, so a column slice
 * taken for tensor parallelism has the codes the unsliced matrix has. */
void ds_ptpc_quantize(uint8_t *codes, float *scales, const ds_mat *w, int c0, int nc);
/* The activations' half of ptpc: each token's row x[t][0..K) gets s[t] = ds_ptpc_scale(amax)
 * and xq[t][c] = e4m3(x[t][c] * (1 / s[t])) as its f32 value. x: [T][ldx], xq: [T][K], s: [T]. */
void ds_ptpc_quantize_act(float *xq, float *s, const float *x, int ldx, int T, int K);
/* out[t][:] = row ids[t] of E widened to f32: out [T][E.cols]. */
void ds_embed(float *out, const ds_mat *e, const int32_t *ids, int T);

/* ---- elementwise / norms ----------------------------------------------------------------------
 */
/* y[t] = w ⊙ x[t] / sqrt(mean(x[t]^2) + eps), statistics in f32; x,y: [T][D], w: [D]; y may == x.
 */
void ds_rmsnorm(float *y, const float *x, const float *w, int T, int D, float eps);
/* In place, per head: x[t][h] = x[t][h] / sqrt(sum x^2 + eps) * scale; x: [T][H][d]. */
void ds_l2norm_heads(float *x, int T, int H, int d, float eps, float scale);
/* y[t][h] = RMSNorm_{w,eps}(o[t][h]) ⊙ sigmoid(gate[t][h]); o, gate, y: [T][H][d], w: [d]. */
void ds_gated_rmsnorm_heads(float *y, const float *o, const float *gate, const float *w, int T,
                            int H, int d, float eps);
void ds_add(float *y, const float *x, size_t n);           /* y += x */
void ds_axpy(float *y, float a, const float *x, size_t n); /* y += a x */
void ds_sigmoid_inplace(float *x, size_t n);
/* out[i] = silu(gate[i]) * up[i] */
void ds_act_swiglu(float *out, const float *gate, const float *up, size_t n);
/* out[i] = beta*tanh(g/beta)*sigmoid(g) * phi(u), phi(u) = lin_beta*tanh(u/lin_beta) if lin_beta >
 * 0 else u (docs/model.md §5.1). */
void ds_act_situ(float *out, const float *gate, const float *up, size_t n, float beta,
                 float lin_beta);

/* ---- KDA --------------------------------------------------------------------------------------
 */
/* Causal depthwise conv + SiLU with a carried tail.
 * in: [T][C] pre-conv projections; w: [C][W] (tap W-1 multiplies the current token);
 * tail: [W-1][C] the previous W-1 pre-conv inputs, oldest first (zeros for a new sequence), updated
 * in place to the last W-1 inputs; out: [T][C] = silu(conv). out must not alias in. */
void ds_short_conv_silu(float *out, const float *in, int T, int C, const float *w, int W,
                        float *tail);
/* Forget gate (docs/model.md §3.3). f: [T][H*dk] = W_fb W_fa x; dt_bias: [H*dk]; A_log: [H];
 * g: [T][H*dk] log decay (<= 0). lower_bound_form: g = lb*sigmoid(exp(A_log)*(f+dt_bias)),
 * else g = -exp(A_log)*softplus(f+dt_bias). */
void ds_kda_gate(float *g, const float *f, int T, int H, int dk, const float *A_log,
                 const float *dt_bias, int lower_bound_form, float lb);
/* The delta-rule recurrence (docs/model.md §3.4), K-first state.
 * q, k: [T][H][dk] (L2-normalised; q already scaled by dk^-1/2); v: [T][H][dv]; g: [T][H][dk];
 * beta: [T][H]; S: [H][dk][dv] f32, in/out; o: [T][H][dv].
 * S_rows, if non-NULL: [T][H][dk][dv], the state after each token (for speculative rollback). */
void ds_kda_recurrent(float *o, const float *q, const float *k, const float *v, const float *g,
                      const float *beta, float *S, float *S_rows, int T, int H, int dk, int dv);
/* Chunked form (docs/model.md §3.6), same contract and result as ds_kda_recurrent (without S_rows).
 * chunk: chunk length (64 in production; any >= 1). */
void ds_kda_chunked(float *o, const float *q, const float *k, const float *v, const float *g,
                    const float *beta, float *S, int T, int H, int dk, int dv, int chunk);

/* ---- MLA --------------------------------------------------------------------------------------
 */
/* A paged latent cache: row for position p lives at
 * pool + ((size_t)block_table[p / block_size] * block_size + p % block_size) * (bytes a row).
 * A row holds the values [c (R) | kR (dr)], row = R + dr, in the form dtype names
 * (kernels/shared/kv_row.h: f32, FP8 or BF16). The attention kernels read FP8 and BF16 rows as
 * their f32 values. */
typedef struct ds_latent_view {
    void *pool;
    const int32_t *block_table;
    int block_size;
    int row;   /* values per row: kv_lora_rank + qk_rope_head_dim */
    int R;     /* kv_lora_rank (needed with FP8 rows and by ds_latent_store / ds_latent_load) */
    int dtype; /* DS_KV_* */
} ds_latent_view;

/* Bytes of one stored row of v. */
static inline size_t ds_latent_row_bytes(const ds_latent_view *v) {
    return ds_kv_row_bytes(v->dtype, v->R, v->row - v->R);
}
/* Where position pos's row starts. */
static inline uint8_t *ds_latent_at(const ds_latent_view *v, int pos) {
    return (uint8_t *)v->pool +
           ((size_t)v->block_table[pos / v->block_size] * (size_t)v->block_size +
            (size_t)(pos % v->block_size)) *
               ds_latent_row_bytes(v);
}
/* Position pos's row of an f32 view. */
static inline float *ds_latent_row(const ds_latent_view *v, int pos) {
    return (float *)ds_latent_at(v, pos);
}
/* Stores x [row] as position pos's row (quantized with fp8). */
void ds_latent_store(const ds_latent_view *v, int pos, const float *x);
/* c [R] and kR [dr] <- the values position pos's row reads back as. */
void ds_latent_load(const ds_latent_view *v, int pos, float *c, float *kr);

/* Absorbed attention over the latent cache (docs/model.md §4.4). Query t sits at position pos0+t
 * and, when causal, attends to rows 0..pos0+t; otherwise to rows 0..n_ctx-1. qbar: [T][Ha][R] (=
 * W_UK_h^T qN_h); qr: [T][Ha][dr]; each cache row is [c (R) | kR (dr)]; obar: [T][Ha][R] = sum_t'
 * softmax(scale*(qbar.c + qr.kR)) c. */
void ds_mla_attend_absorbed(float *obar, const float *qbar, const float *qr, int T, int Ha, int R,
                            int dr, const ds_latent_view *kv, int pos0, int n_ctx, int causal,
                            float scale);
/* Expanded attention (docs/model.md §4.3). q: [T][Ha][dn+dr]; kN: [n_ctx][Ha][dn]; kR: [n_ctx][dr]
 * (shared by heads); v: [n_ctx][Ha][dvh]; o: [T][Ha][dvh]. Causality as above. */
void ds_mla_attend_expanded(float *o, const float *q, const float *kN, const float *kR,
                            const float *v, int T, int n_ctx, int Ha, int dn, int dr, int dvh,
                            int pos0, int causal, float scale);

/* ---- MoE --------------------------------------------------------------------------------------
 */
/* Router for one token (docs/model.md §5.3). z: [E] f32 logits; bias: [E] or NULL.
 * Outputs idx: [k] expert ids, w: [k] combine weights (unbiased sigmoid scores, renormalised when
 * renormalize && k > 1, times scale). n_group > 1 enables group-limited selection.
 * hf_kl_quirk: combine with the biased scores and mask groups with 0 (HF-KL remote code). */
void ds_moe_route(int32_t *idx, float *w, const float *z, const float *bias, int E, int k,
                  int n_group, int topk_group, int renormalize, float scale, int hf_kl_quirk);

/* ---- AttnRes ----------------------------------------------------------------------------------
 */
/* out[t] = sum_j alpha_j(t) cands[j][t], alpha = softmax_j(sum_d rmsnorm(cands[j][t])[d] * np[d])
 * (docs/model.md §6.2). cands: m pointers to [T][D]; np: [D] = norm weight ⊙ proj weight; out:
 * [T][D] (may alias none of the candidates). */
void ds_attnres_mix(float *out, const float *const *cands, int m, const float *np, int T, int D,
                    float eps);

/* ---- sampling helpers -------------------------------------------------------------------------
 */
/* The greedy token of x[n]: the lowest index among the largest values; NaN never wins; 0 when
 * every value is NaN. */
int ds_argmax(const float *x, int n);
/* ds_argmax of a row of n values held in blocks of block_len (the last one cut at n), block t at
 * x + t * stride: vocabulary-parallel logits as the ranks' blocks are gathered. */
int ds_argmax_blocks(const float *x, size_t stride, int block_len, int n);

#endif
