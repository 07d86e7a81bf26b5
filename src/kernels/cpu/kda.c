/* kda.c — Kimi Delta Attention kernels (docs/model.md §3): the short causal conv, the forget gate,
 * the per-token delta-rule recurrence (decode, speculative verify) and its chunked form (prefill).
 *
 * The recurrent state is K-first, S[h][c][v] (c < dk key channel, v < dv value column), f32.
 * Every value column of S evolves on its own: the prediction error e_t[v] reads only column v, and
 * the write and the read touch column v only through e_t[v]. So both forms split their work over
 * (head, block of KDA_VB value columns), which keeps all cores busy even with few heads.
 *
 * Numerics of the chunked form. A chunk needs the decay between two of its tokens,
 * e^{Γ_i − Γ_j} = Π_{s=j+1..i} e^{g_s} (per channel), for every pair j <= i. We build it as that
 * running product of the per-token factors e^{g_s} <= 1, one multiply per pair and channel:
 * nothing is ever exponentiated with a positive argument (e^{Γ_i}·e^{−Γ_j} overflows once a chunk's
 * Γ passes −88, and K3's lower-bound gate lets a 64-token chunk reach −320), and no cumulative sum
 * is differenced, which would cost |Γ|·2^-24 ≈ 2e-5 absolute error in the exponent. The rounding of
 * the product is the same as the recurrence's own (it multiplies S by the same factors). */
#include "kernels/cpu/kernels.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* Value columns per work item: 4 vectors of 8, so a block's accumulators stay in registers. */
#define KDA_VB 32
/* Decay factors and products below this are set to zero. They are far below anything an f32 output
 * can resolve, and keeping them out of the subnormal range avoids x86's slow microcode assists. */
#define KDA_TINY 1e-30f
/* Upper bound on the chunked form's per-chunk scratch (all heads of a window of chunks). */
#define KDA_SCRATCH_BYTES ((size_t)64 << 20)
/* Channels whose decay factors one pass of the recurrence computes at a time (stack buffer). */
#define KDA_CB 64
/* Channels per tile of the short conv (its taps are transposed into a stack tile of this width). */
#define CONV_CB   64
#define CONV_WMAX 16

/* Hot leaf functions get an x86-64-v3 (AVX2) clone picked at load time (ifunc) and a baseline one.
 * (Under -std=c11 gcc does not contract a*b+c, so the clone issues multiply and add separately.) */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define KDA_HOT __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define KDA_HOT
#endif

/* Helpers are force-inlined so that each clone of a hot function compiles them for its own ISA. */
#define KDA_INLINE static inline __attribute__((always_inline))

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
KDA_INLINE void v8_ld(v8f *d, const float *p) {
    memcpy(d, p, sizeof *d);
}
KDA_INLINE void v8_st(float *p, const v8f *s) {
    memcpy(p, s, sizeof *s);
}

KDA_INLINE float flush_tiny(float x) {
    return fabsf(x) < KDA_TINY ? 0.0f : x;
}
/* The same on 8 lanes, through the bits (vector ?: is C++ only). */
KDA_INLINE void v8_flush_tiny(v8f *x) {
    const v8i tiny = {0x0DA24260, 0x0DA24260, 0x0DA24260, 0x0DA24260,
                      0x0DA24260, 0x0DA24260, 0x0DA24260, 0x0DA24260}; /* bits of 1e-30f */
    v8i b;
    memcpy(&b, x, sizeof b);
    b &= ~((b & 0x7fffffff) < tiny); /* a comparison yields -1 (all bits) where true */
    memcpy(x, &b, sizeof b);
}
/* All lanes set to x. */
KDA_INLINE void v8_splat(v8f *d, float x) {
    for (int i = 0; i < 8; i++) (*d)[i] = x;
}
/* Lanes of a where mask is set (all bits), else lanes of b. */
KDA_INLINE void v8_select(v8f *d, const v8i *mask, const v8f *a, const v8f *b) {
    v8i ia, ib;
    memcpy(&ia, a, sizeof ia);
    memcpy(&ib, b, sizeof ib);
    ia = (ia & *mask) | (ib & ~*mask);
    memcpy(d, &ia, sizeof ia);
}
/* e^x on 8 lanes for x <= 0 (larger x give 1), flushed to 0 below KDA_TINY. Cody-Waite reduction
 * and Cephes' degree-6 polynomial (measured <= 1 ulp on [-69, 0]), branch-free: the decay factors
 * are one exp per token and channel, as many as the multiply-adds of a pass over the state, so
 * libm's scalar expf would cost as much as the recurrence itself. */
KDA_INLINE void v8_exp_nonpos(v8f *y, const v8f *x) {
    v8f v = *x, zero = {0}, lo, c;
    v8_splat(&lo, -87.0f); /* e^-87 is already far below KDA_TINY */
    v8i mask = v > zero;
    v8_select(&v, &mask, &zero, &v);
    mask = v < lo;
    v8_select(&v, &mask, &lo, &v);
    v8_splat(&c, 12582912.0f);               /* 1.5 * 2^23: adding it rounds to an integer */
    const v8f m = (v * 1.44269504f + c) - c; /* round(v / ln 2), in [-126, 0] */
    v8f r = v - m * 0.693359375f;            /* ln 2 in two pieces: m * hi is exact */
    r = r - m * -2.12194440e-4f;
    v8f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    v8f e = p * r * r + r + 1.0f;
    v8i bits = (__builtin_convertvector(m, v8i) + 127) << 23; /* 2^m */
    v8f scale;
    memcpy(&scale, &bits, sizeof scale);
    e *= scale;
    v8_flush_tiny(&e);
    *y = e;
}
/* y[i] = e^{x[i]} for i < n, as v8_exp_nonpos (the last partial vector is padded, so every lane
 * gets the same arithmetic). */
KDA_INLINE void exp_nonpos(float *y, const float *x, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f t;
        v8_ld(&t, x + i);
        v8_exp_nonpos(&t, &t);
        v8_st(y + i, &t);
    }
    if (i < n) {
        float pad[8] = {0};
        memcpy(pad, x + i, sizeof(float) * (size_t)(n - i));
        v8f t;
        v8_ld(&t, pad);
        v8_exp_nonpos(&t, &t);
        v8_st(pad, &t);
        memcpy(y + i, pad, sizeof(float) * (size_t)(n - i));
    }
}
/* σ(x) on 8 lanes from e^{-|x|} (never a positive exponent): 1/(1+e) for x >= 0, e/(1+e)
 * below. Lanes under -69 give 0 (the true value is below 1e-30). */
KDA_INLINE void v8_sigmoid(v8f *y, const v8f *x) {
    v8f neg_abs, e, one, num, zero = {0};
    v8i bits;
    memcpy(&bits, x, sizeof bits);
    bits |= (v8i){INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN,
                  INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN}; /* set the sign bit: -|x| */
    memcpy(&neg_abs, &bits, sizeof bits);
    v8_exp_nonpos(&e, &neg_abs);
    v8_splat(&one, 1.0f);
    v8i pos = *x >= zero;
    v8_select(&num, &pos, &one, &e);
    *y = num / (one + e);
}
enum { ACT_SILU, ACT_LB_GATE };
/* In place over x[0..n): ACT_SILU: x σ(x); ACT_LB_GATE: lb σ(a x). The last partial vector is
 * padded, so every element gets the same arithmetic. */
KDA_INLINE void act_row(float *x, int n, int kind, float a, float lb) {
    for (int i = 0; i < n; i += 8) {
        const int m = DS_MIN(8, n - i);
        float pad[8] = {0};
        memcpy(pad, x + i, sizeof(float) * (size_t)m);
        v8f v, s;
        v8_ld(&v, pad);
        if (kind == ACT_SILU) {
            v8_sigmoid(&s, &v);
            v *= s;
        } else {
            v *= a;
            v8_sigmoid(&s, &v);
            v = s * lb;
        }
        v8_st(pad, &v);
        memcpy(x + i, pad, sizeof(float) * (size_t)m);
    }
}
/* ln(1 + e^x) without overflow: exact for every x (fla returns x for x > 20, which differs by
 * < 2.1e-9). */
KDA_INLINE float softplus(float x) {
    return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)));
}

/* ---- short conv ---------------------------------------------------------------------------- */

/* Channels [c0, c0+nc) of the conv over all T tokens. */
static KDA_HOT void conv_tile(float *out, const float *in, int T, int C, int c0, int nc,
                              const float *w, int W, const float *tail) {
    float wt[CONV_WMAX][CONV_CB]; /* wt[j - j0][c - c0] = w[c][j]: taps made contiguous in c */
    for (int t = 0; t < T; t++) memset(out + (size_t)t * C + c0, 0, sizeof(float) * (size_t)nc);
    for (int j0 = 0; j0 < W; j0 += CONV_WMAX) {
        int nj = DS_MIN(CONV_WMAX, W - j0);
        for (int j = 0; j < nj; j++)
            for (int c = 0; c < nc; c++) wt[j][c] = w[(size_t)(c0 + c) * W + j0 + j];
        for (int t = 0; t < T; t++) {
            float *y = out + (size_t)t * C + c0; /* [nc] */
            for (int j = 0; j < nj; j++) {
                /* Input row under tap j0+j; before token 0 it comes from the carried tail. */
                int src = t - (W - 1) + j0 + j;
                const float *x =
                    (src >= 0 ? in + (size_t)src * C : tail + (size_t)(W - 1 + src) * C) + c0;
                const float *wj = wt[j];
                for (int c = 0; c < nc; c++) y[c] += wj[c] * x[c];
            }
        }
    }
    for (int t = 0; t < T; t++) act_row(out + (size_t)t * C + c0, nc, ACT_SILU, 0.0f, 0.0f);
}

void ds_short_conv_silu(float *out, const float *in, int T, int C, const float *w, int W,
                        float *tail) {
    if (T <= 0 || C <= 0 || W <= 0) return;
    int ntile = (C + CONV_CB - 1) / CONV_CB;
#pragma omp parallel for schedule(static) if ((size_t)T * C * W > 32768)
    for (int b = 0; b < ntile; b++) {
        int c0 = b * CONV_CB;
        conv_tile(out, in, T, C, c0, DS_MIN(CONV_CB, C - c0), w, W, tail);
    }
    /* New tail = the last W-1 rows of (old tail ++ in). Row i comes from a row index >= i of the
     * old tail, so updating in increasing i never reads a row already overwritten. */
    for (int i = 0; i < W - 1; i++) {
        int src = T - (W - 1) + i;
        const float *from = src >= 0 ? in + (size_t)src * C : tail + (size_t)(W - 1 + src) * C;
        memmove(tail + (size_t)i * C, from, sizeof(float) * (size_t)C);
    }
}

/* ---- forget gate --------------------------------------------------------------------------- */

/* One token's gates: f, g: [H*dk]. */
static KDA_HOT void kda_gate_row(float *g, const float *f, int H, int dk, const float *A_log,
                                 const float *dt_bias, int lower_bound_form, float lb) {
    for (int h = 0; h < H; h++) {
        const float a = expf(A_log[h]);
        const float *fh = f + (size_t)h * dk, *bias = dt_bias + (size_t)h * dk;
        float *gh = g + (size_t)h * dk;
        if (lower_bound_form) {
            for (int c = 0; c < dk; c++) gh[c] = fh[c] + bias[c];
            act_row(gh, dk, ACT_LB_GATE, a, lb);
        } else {
            for (int c = 0; c < dk; c++) gh[c] = -a * softplus(fh[c] + bias[c]);
        }
    }
}

void ds_kda_gate(float *g, const float *f, int T, int H, int dk, const float *A_log,
                 const float *dt_bias, int lower_bound_form, float lb) {
    const size_t P = (size_t)H * dk;
#pragma omp parallel for schedule(static) if ((size_t)T * P > 65536)
    for (int t = 0; t < T; t++)
        kda_gate_row(g + t * P, f + t * P, H, dk, A_log, dt_bias, lower_bound_form, lb);
}

/* ---- recurrence ---------------------------------------------------------------------------- */

/* Columns [v0, v0+nv) of head h over T tokens (docs/model.md §3.4), in place on S. With
 * nv == KDA_VB the error and output rows live in registers; narrower blocks use the plain loops. */
static KDA_HOT void kda_recurrent_block(float *o, const float *q, const float *k, const float *v,
                                        const float *g, const float *beta, float *S, float *S_rows,
                                        int T, int H, int dk, int dv, int h, int v0, int nv) {
    float *Sh = S + (size_t)h * dk * dv + v0; /* [dk][dv] (row stride dv), columns [0, nv) used */
    float d[KDA_CB];                          /* decay factors of channels [c0, c0+KDA_CB) */
    float e[KDA_VB], acc[KDA_VB];             /* [nv] error, then output (narrow blocks) */
    const int vec = nv == KDA_VB;
    for (int t = 0; t < T; t++) {
        const size_t th = (size_t)t * H + h;
        const float *qt = q + th * dk, *kt = k + th * dk, *gt = g + th * dk; /* [dk] */
        const float *vt = v + th * dv + v0;                                  /* [nv] */
        const float b = beta[th];
        /* Decay, and predict v from the decayed state in the same pass over S. */
        v8f e0 = {0}, e1 = {0}, e2 = {0}, e3 = {0};
        for (int x = 0; x < nv; x++) e[x] = 0.0f;
        for (int c0 = 0; c0 < dk; c0 += KDA_CB) {
            const int nc = DS_MIN(KDA_CB, dk - c0);
            exp_nonpos(d, gt + c0, nc);
            for (int c = c0; c < c0 + nc; c++) {
                float *row = Sh + (size_t)c * dv;
                const float dc = d[c - c0], kc = kt[c];
                if (vec) {
                    v8f s0, s1, s2, s3;
                    v8_ld(&s0, row), v8_ld(&s1, row + 8), v8_ld(&s2, row + 16),
                        v8_ld(&s3, row + 24);
                    s0 *= dc, s1 *= dc, s2 *= dc, s3 *= dc;
                    v8_st(row, &s0), v8_st(row + 8, &s1), v8_st(row + 16, &s2),
                        v8_st(row + 24, &s3);
                    e0 += s0 * kc, e1 += s1 * kc, e2 += s2 * kc, e3 += s3 * kc;
                } else {
                    for (int x = 0; x < nv; x++) {
                        row[x] *= dc;
                        e[x] += kc * row[x];
                    }
                }
            }
        }
        /* Write k (beta e)^T and read with q after the write. */
        if (vec) {
            v8f x0, x1, x2, x3, a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            v8_ld(&x0, vt), v8_ld(&x1, vt + 8), v8_ld(&x2, vt + 16), v8_ld(&x3, vt + 24);
            e0 = (x0 - e0) * b, e1 = (x1 - e1) * b, e2 = (x2 - e2) * b, e3 = (x3 - e3) * b;
            for (int c = 0; c < dk; c++) {
                float *row = Sh + (size_t)c * dv;
                const float kc = kt[c], qc = qt[c];
                v8f s0, s1, s2, s3;
                v8_ld(&s0, row), v8_ld(&s1, row + 8), v8_ld(&s2, row + 16), v8_ld(&s3, row + 24);
                s0 += e0 * kc, s1 += e1 * kc, s2 += e2 * kc, s3 += e3 * kc;
                v8_st(row, &s0), v8_st(row + 8, &s1), v8_st(row + 16, &s2), v8_st(row + 24, &s3);
                a0 += s0 * qc, a1 += s1 * qc, a2 += s2 * qc, a3 += s3 * qc;
            }
            float *ot = o + th * dv + v0;
            v8_st(ot, &a0), v8_st(ot + 8, &a1), v8_st(ot + 16, &a2), v8_st(ot + 24, &a3);
        } else {
            for (int x = 0; x < nv; x++) e[x] = b * (vt[x] - e[x]);
            for (int x = 0; x < nv; x++) acc[x] = 0.0f;
            for (int c = 0; c < dk; c++) {
                float *row = Sh + (size_t)c * dv;
                const float kc = kt[c], qc = qt[c];
                for (int x = 0; x < nv; x++) {
                    row[x] += kc * e[x];
                    acc[x] += qc * row[x];
                }
            }
            memcpy(o + th * dv + v0, acc, sizeof(float) * (size_t)nv);
        }
        if (S_rows)
            for (int c = 0; c < dk; c++)
                memcpy(S_rows + (th * dk + c) * dv + v0, Sh + (size_t)c * dv,
                       sizeof(float) * (size_t)nv);
    }
}

void ds_kda_recurrent(float *o, const float *q, const float *k, const float *v, const float *g,
                      const float *beta, float *S, float *S_rows, int T, int H, int dk, int dv) {
    if (T <= 0 || H <= 0) return;
    const int nvb = (dv + KDA_VB - 1) / KDA_VB;
#pragma omp parallel for schedule(static) if ((size_t)T * H * dk * dv > 16384)
    for (int it = 0; it < H * nvb; it++) {
        int h = it / nvb, v0 = (it % nvb) * KDA_VB;
        kda_recurrent_block(o, q, k, v, g, beta, S, S_rows, T, H, dk, dv, h, v0,
                            DS_MIN(KDA_VB, dv - v0));
    }
}

/* ---- chunked form ---------------------------------------------------------------------------- */

/* What one (head, chunk) needs from the key side, computed before the state is known
 * (docs/model.md §3.6, with n <= C tokens and D_ij = e^{Γ_i − Γ_j}, Γ inclusive of token i):
 *   A   [C][ld]  A[i][j] = Σ_c q_i D_ij k_j              (j <= i)
 *   L   [C][ld]  L[i][j] = β_i Σ_c k_i D_ij k_j          (j < i)
 *   Kg  [C][dk]  e^{Γ_i} ⊙ k_i     Qg [C][dk] e^{Γ_i} ⊙ q_i
 *   KdT [dk][ld] KdT[c][j] = e^{Γ_last − Γ_j}[c] k_j[c] (transposed for the state update)
 *   gl  [dk]     e^{Γ_last}
 * ld = C rounded up to 8, so that rows of A, L and KdT can be walked in whole vectors. */
typedef struct kda_prep {
    float *A, *L, *Kg, *Qg, *KdT, *gl;
    int ld;
} kda_prep;

static int kda_prep_ld(int C) {
    return (C + 7) & ~7;
}

static size_t kda_prep_floats(int C, int dk) {
    const size_t ld = (size_t)kda_prep_ld(C);
    return 2 * (size_t)C * ld + 2 * (size_t)C * dk + (size_t)dk * ld + (size_t)dk;
}

static kda_prep kda_prep_at(float *base, int C, int dk) {
    kda_prep p;
    p.ld = kda_prep_ld(C);
    p.A = base;
    p.L = p.A + (size_t)C * p.ld;
    p.Kg = p.L + (size_t)C * p.ld;
    p.Qg = p.Kg + (size_t)C * dk;
    p.KdT = p.Qg + (size_t)C * dk;
    p.gl = p.KdT + (size_t)dk * p.ld;
    return p;
}

/* One step of the key walk for columns [j0, j0 + 8*NV) of row i (see kda_prepare):
 * W[c][j] *= a_i[c]; A[i][j] = Σ_c q_i[c] W[c][j]; L[i][j] = b_i Σ_c k_i[c] W[c][j]. */
KDA_INLINE void kda_walk(float *W, int ld, const float *ai, const float *qi, const float *ki,
                         int dk, float bi, float *Ai, float *Li, const int NV) {
    v8f sa[4] = {{0}}, sl[4] = {{0}};
    for (int c = 0; c < dk; c++) {
        float *wc = W + (size_t)c * ld;
        const float a = ai[c], qc = qi[c], kc = ki[c];
        for (int x = 0; x < NV; x++) {
            v8f w;
            v8_ld(&w, wc + 8 * x);
            w *= a;
            v8_flush_tiny(&w);
            v8_st(wc + 8 * x, &w);
            sa[x] += w * qc;
            sl[x] += w * kc;
        }
    }
    for (int x = 0; x < NV; x++) {
        sl[x] *= bi;
        v8_st(Ai + 8 * x, &sa[x]);
        v8_st(Li + 8 * x, &sl[x]);
    }
}

/* Key side of tokens [t0, t0+n) of head h. work: [n][dk] floats.
 * The decays between token pairs are built as running products (see the top of the file), walked
 * down the chunk with the keys held transposed: after step i, W[c][j] = D_ij[c] k_j[c] for j <= i.
 * Step i decays every held column by a_i and contracts them with q_i and k_i, which gives row i of
 * A and L as whole vectors over j, and then takes on column i = k_i. After the last step W is KdT.
 */
static KDA_HOT void kda_prepare(const kda_prep *p, const float *q, const float *k, const float *g,
                                const float *beta, int t0, int n, int H, int dk, int h,
                                float *work) {
    const size_t ld = (size_t)H * dk; /* token stride of q, k, g */
    const float *q0 = q + (size_t)t0 * ld + (size_t)h * dk, *k0 = k + (size_t)t0 * ld + h * dk;
    const float *g0 = g + (size_t)t0 * ld + (size_t)h * dk;
    float *a = work; /* [n][dk] per-token decay factors e^{g_i} */

    /* Factors, and the prefix products e^{Γ_i} (held in gl while they run). */
    for (int c = 0; c < dk; c++) p->gl[c] = 1.0f;
    for (int i = 0; i < n; i++) {
        const float *qi = q0 + i * ld, *ki = k0 + i * ld;
        float *ai = a + (size_t)i * dk, *kg = p->Kg + (size_t)i * dk, *qg = p->Qg + (size_t)i * dk;
        exp_nonpos(ai, g0 + i * ld, dk);
        int c = 0;
        for (; c + 8 <= dk; c += 8) {
            v8f pc, x;
            v8_ld(&pc, p->gl + c);
            v8_ld(&x, ai + c);
            pc *= x;
            v8_flush_tiny(&pc);
            v8_st(p->gl + c, &pc);
            v8_ld(&x, ki + c), x *= pc, v8_st(kg + c, &x);
            v8_ld(&x, qi + c), x *= pc, v8_st(qg + c, &x);
        }
        for (; c < dk; c++) {
            const float pc = flush_tiny(p->gl[c] * ai[c]);
            p->gl[c] = pc;
            kg[c] = pc * ki[c];
            qg[c] = pc * qi[c];
        }
    }

    float *W = p->KdT; /* [dk][ld]; columns not yet taken on must be zero (they are walked too) */
    for (int c = 0; c < dk; c++) memset(W + (size_t)c * p->ld, 0, sizeof(float) * (size_t)p->ld);
    for (int i = 0; i < n; i++) {
        const float *ai = a + (size_t)i * dk, *qi = q0 + i * ld, *ki = k0 + i * ld;
        const float bi = beta[(size_t)(t0 + i) * H + h];
        float *Ai = p->A + (size_t)i * p->ld, *Li = p->L + (size_t)i * p->ld;
        /* Columns [0, i) in blocks of up to 4 vectors; a block's last vector may run past column
         * i - 1 into zero columns, whose results land in the unused upper triangle. */
        for (int j0 = 0; j0 < i; j0 += 32) {
            const int nv = DS_MIN(4, (i - j0 + 7) / 8);
            float *Wj = W + j0;
            if (nv == 4)
                kda_walk(Wj, p->ld, ai, qi, ki, dk, bi, Ai + j0, Li + j0, 4);
            else if (nv == 3)
                kda_walk(Wj, p->ld, ai, qi, ki, dk, bi, Ai + j0, Li + j0, 3);
            else if (nv == 2)
                kda_walk(Wj, p->ld, ai, qi, ki, dk, bi, Ai + j0, Li + j0, 2);
            else
                kda_walk(Wj, p->ld, ai, qi, ki, dk, bi, Ai + j0, Li + j0, 1);
        }
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int c = 0; c < dk; c++) s += qi[c] * ki[c];
        Ai[i] = s;
        for (int c = 0; c < dk; c++) W[(size_t)c * p->ld + i] = ki[c];
    }
}

/* State side of one chunk for columns [v0, v0+KDA_VB) of head h, on 8-wide vectors:
 *   U = (I+L)^{-1} diag(β) (V − Kg S)   (forward substitution; U is the chunk's β-scaled errors)
 *   O = Qg S + A U
 *   S ← diag(gl) S + KdT U
 * U: [n][KDA_VB] scratch. */
static KDA_HOT void kda_apply_vec(const kda_prep *p, float *o, const float *v, const float *beta,
                                  float *S, int t0, int n, int H, int dk, int dv, int h, int v0,
                                  float *U) {
    float *Sh = S + (size_t)h * dk * dv + v0; /* [dk] rows of stride dv, KDA_VB columns */
    const size_t ldv = (size_t)H * dv;
    const float *vh = v + (size_t)t0 * ldv + (size_t)h * dv + v0;
    float *oh = o + (size_t)t0 * ldv + (size_t)h * dv + v0;

    for (int i = 0; i < n; i++) {
        const float *kg = p->Kg + (size_t)i * dk, *qg = p->Qg + (size_t)i * dk;
        v8f y0 = {0}, y1 = {0}, y2 = {0}, y3 = {0}, z0 = {0}, z1 = {0}, z2 = {0}, z3 = {0};
        for (int c = 0; c < dk; c++) {
            const float *row = Sh + (size_t)c * dv;
            v8f s0, s1, s2, s3;
            v8_ld(&s0, row), v8_ld(&s1, row + 8), v8_ld(&s2, row + 16), v8_ld(&s3, row + 24);
            const float a = kg[c], b = qg[c];
            y0 += s0 * a, y1 += s1 * a, y2 += s2 * a, y3 += s3 * a;
            z0 += s0 * b, z1 += s1 * b, z2 += s2 * b, z3 += s3 * b;
        }
        const float bi = beta[(size_t)(t0 + i) * H + h];
        v8f x0, x1, x2, x3;
        const float *vi = vh + i * ldv;
        v8_ld(&x0, vi), v8_ld(&x1, vi + 8), v8_ld(&x2, vi + 16), v8_ld(&x3, vi + 24);
        x0 = (x0 - y0) * bi, x1 = (x1 - y1) * bi, x2 = (x2 - y2) * bi, x3 = (x3 - y3) * bi;
        float *ui = U + (size_t)i * KDA_VB, *oi = oh + i * ldv;
        v8_st(ui, &x0), v8_st(ui + 8, &x1), v8_st(ui + 16, &x2), v8_st(ui + 24, &x3);
        v8_st(oi, &z0), v8_st(oi + 8, &z1), v8_st(oi + 16, &z2), v8_st(oi + 24, &z3);
    }

    /* Row i of U needs the finished rows above it; the same pass adds them into O. */
    for (int i = 0; i < n; i++) {
        float *ui = U + (size_t)i * KDA_VB, *oi = oh + i * ldv;
        const float *Li = p->L + (size_t)i * p->ld, *Ai = p->A + (size_t)i * p->ld;
        v8f u0, u1, u2, u3, r0, r1, r2, r3;
        v8_ld(&u0, ui), v8_ld(&u1, ui + 8), v8_ld(&u2, ui + 16), v8_ld(&u3, ui + 24);
        v8_ld(&r0, oi), v8_ld(&r1, oi + 8), v8_ld(&r2, oi + 16), v8_ld(&r3, oi + 24);
        for (int j = 0; j < i; j++) {
            const float *uj = U + (size_t)j * KDA_VB;
            v8f w0, w1, w2, w3;
            v8_ld(&w0, uj), v8_ld(&w1, uj + 8), v8_ld(&w2, uj + 16), v8_ld(&w3, uj + 24);
            const float l = Li[j], a = Ai[j];
            u0 -= w0 * l, u1 -= w1 * l, u2 -= w2 * l, u3 -= w3 * l;
            r0 += w0 * a, r1 += w1 * a, r2 += w2 * a, r3 += w3 * a;
        }
        const float a = Ai[i];
        r0 += u0 * a, r1 += u1 * a, r2 += u2 * a, r3 += u3 * a;
        v8_st(ui, &u0), v8_st(ui + 8, &u1), v8_st(ui + 16, &u2), v8_st(ui + 24, &u3);
        v8_st(oi, &r0), v8_st(oi + 8, &r1), v8_st(oi + 16, &r2), v8_st(oi + 24, &r3);
    }

    for (int c = 0; c < dk; c++) {
        float *row = Sh + (size_t)c * dv;
        const float *kd = p->KdT + (size_t)c * p->ld;
        v8f s0, s1, s2, s3;
        v8_ld(&s0, row), v8_ld(&s1, row + 8), v8_ld(&s2, row + 16), v8_ld(&s3, row + 24);
        const float d = p->gl[c];
        s0 *= d, s1 *= d, s2 *= d, s3 *= d;
        for (int j = 0; j < n; j++) {
            const float *uj = U + (size_t)j * KDA_VB;
            v8f w0, w1, w2, w3;
            v8_ld(&w0, uj), v8_ld(&w1, uj + 8), v8_ld(&w2, uj + 16), v8_ld(&w3, uj + 24);
            const float x = kd[j];
            s0 += w0 * x, s1 += w1 * x, s2 += w2 * x, s3 += w3 * x;
        }
        v8_st(row, &s0), v8_st(row + 8, &s1), v8_st(row + 16, &s2), v8_st(row + 24, &s3);
    }
}

/* The same as kda_apply_vec for a narrower block (nv < KDA_VB columns, when KDA_VB ∤ dv). */
static void kda_apply_narrow(const kda_prep *p, float *o, const float *v, const float *beta,
                             float *S, int t0, int n, int H, int dk, int dv, int h, int v0, int nv,
                             float *U) {
    float *Sh = S + (size_t)h * dk * dv + v0;
    const size_t ldv = (size_t)H * dv;
    const float *vh = v + (size_t)t0 * ldv + (size_t)h * dv + v0;
    float *oh = o + (size_t)t0 * ldv + (size_t)h * dv + v0;
    float y[KDA_VB], z[KDA_VB]; /* [nv] */
    for (int i = 0; i < n; i++) {
        const float *kg = p->Kg + (size_t)i * dk, *qg = p->Qg + (size_t)i * dk;
        for (int x = 0; x < nv; x++) y[x] = z[x] = 0.0f;
        for (int c = 0; c < dk; c++) {
            const float *row = Sh + (size_t)c * dv;
            for (int x = 0; x < nv; x++) y[x] += row[x] * kg[c], z[x] += row[x] * qg[c];
        }
        const float bi = beta[(size_t)(t0 + i) * H + h];
        for (int x = 0; x < nv; x++) U[(size_t)i * KDA_VB + x] = (vh[i * ldv + x] - y[x]) * bi;
        memcpy(oh + i * ldv, z, sizeof(float) * (size_t)nv);
    }
    for (int i = 0; i < n; i++) {
        float *ui = U + (size_t)i * KDA_VB, *oi = oh + i * ldv;
        for (int j = 0; j < i; j++) {
            const float *uj = U + (size_t)j * KDA_VB;
            const float l = p->L[(size_t)i * p->ld + j], a = p->A[(size_t)i * p->ld + j];
            for (int x = 0; x < nv; x++) ui[x] -= uj[x] * l, oi[x] += uj[x] * a;
        }
        const float a = p->A[(size_t)i * p->ld + i];
        for (int x = 0; x < nv; x++) oi[x] += ui[x] * a;
    }
    for (int c = 0; c < dk; c++) {
        float *row = Sh + (size_t)c * dv;
        const float d = p->gl[c];
        for (int x = 0; x < nv; x++) row[x] *= d;
        for (int j = 0; j < n; j++) {
            const float *uj = U + (size_t)j * KDA_VB, kd = p->KdT[(size_t)c * p->ld + j];
            for (int x = 0; x < nv; x++) row[x] += uj[x] * kd;
        }
    }
}

void ds_kda_chunked(float *o, const float *q, const float *k, const float *v, const float *g,
                    const float *beta, float *S, int T, int H, int dk, int dv, int chunk) {
    if (T <= 0 || H <= 0) return;
    const int C = DS_MAX(1, DS_MIN(chunk, T)); /* a chunk longer than T only wastes scratch */
    const int nch = (T + C - 1) / C, nvb = (dv + KDA_VB - 1) / KDA_VB;
    const size_t per = kda_prep_floats(C, dk);
    /* Per thread: the key side's decay factors, or the state side's U. Padded to 64 bytes. */
    const size_t thr = (DS_MAX((size_t)C * dk, (size_t)C * KDA_VB) + 15) & ~(size_t)15;
    const int nthr = omp_get_max_threads();

    /* The key side of a window of chunks is prepared in parallel over (head, chunk); the state
     * then runs through the window in parallel over (head, column block). The window is as small
     * as keeps every thread busy in the first phase, so that its scratch stays in cache. */
    int win = DS_MIN(nch, DS_MAX(1, (2 * nthr + H - 1) / H));
    win = (int)DS_MIN((size_t)win, DS_MAX((size_t)1, KDA_SCRATCH_BYTES / (4 * per * H)));
    float *scratch = NULL;
    for (;;) {
        scratch = malloc(sizeof(float) * ((size_t)win * H * per + (size_t)nthr * thr));
        if (scratch || win == 1) break;
        win = (win + 1) / 2;
    }
    if (!scratch) { /* the recurrence needs no memory and gives the same result, only slower */
        ds_kda_recurrent(o, q, k, v, g, beta, S, NULL, T, H, dk, dv);
        return;
    }

#pragma omp parallel
    {
        float *mine = scratch + (size_t)win * H * per + (size_t)omp_get_thread_num() * thr;
        for (int w0 = 0; w0 < nch; w0 += win) {
            const int nw = DS_MIN(win, nch - w0);
#pragma omp for schedule(static)
            for (int it = 0; it < H * nw; it++) {
                const int h = it / nw, ci = it % nw, t0 = (w0 + ci) * C;
                kda_prep p = kda_prep_at(scratch + (size_t)it * per, C, dk);
                kda_prepare(&p, q, k, g, beta, t0, DS_MIN(C, T - t0), H, dk, h, mine);
            }
#pragma omp for schedule(static)
            for (int it = 0; it < H * nvb; it++) {
                const int h = it / nvb, v0 = (it % nvb) * KDA_VB, nv = DS_MIN(KDA_VB, dv - v0);
                for (int ci = 0; ci < nw; ci++) {
                    const int t0 = (w0 + ci) * C, n = DS_MIN(C, T - t0);
                    kda_prep p = kda_prep_at(scratch + ((size_t)h * nw + ci) * per, C, dk);
                    if (nv == KDA_VB)
                        kda_apply_vec(&p, o, v, beta, S, t0, n, H, dk, dv, h, v0, mine);
                    else
                        kda_apply_narrow(&p, o, v, beta, S, t0, n, H, dk, dv, h, v0, nv, mine);
                }
            }
        }
    }
    free(scratch);
}
