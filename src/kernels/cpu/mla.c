/* mla.c — multi-head latent attention (docs/model.md §4): the absorbed form over the paged latent
 * cache (decode, verify, chunked prefill) and the expanded form.
 *
 * Both forms run one engine. A group of up to MLA_QB queries that read the same keys walks those
 * keys in tiles of MLA_KB rows with an online softmax: a running max m, a running sum l and an
 * unnormalised output O per query, so every key row is loaded once per group. In the absorbed form
 * every head of every token reads the same latent rows [c | kR], so a group is consecutive
 * (token, head) pairs and the value is c itself; in the expanded form keys and values are per
 * head, so a group is consecutive tokens of one head. Long contexts also cut the keys into
 * ranges whose partial (m, l, O) are merged at the end (flash-decoding), so that one token's
 * attention over a long cache still uses every core.
 *
 * Determinism (docs/prefix-cache.md): in the absorbed form a group holds heads of one token only,
 * and its key ranges and tiles lie at absolute positions that depend on that token's position
 * alone, so a row's result is the same bits whether it runs alone (decode), as one row of a
 * verify, or inside a short prompt segment. The expanded form (prompt segments) cuts its ranges
 * from the segment's shape; neither depends on the number of threads.
 *
 * FP8 and BF16 rows (docs/quantization.md §4): the absorbed form widens each tile's rows once per
 * work item into the thread's workspace and runs the same tile code on those floats; the values
 * are kernels/shared/kv_row.h's, bit for bit. */
#include "kernels/cpu/kernels.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MLA_QB 8  /* queries per group */
#define MLA_KB 32 /* keys per tile */

/* The hot tile function gets an x86-64-v3 (AVX2) clone picked at load time and a baseline one. */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define MLA_HOT __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define MLA_HOT
#endif

/* Helpers are force-inlined so that each clone of a hot function compiles them for its own ISA. */
#define MLA_INLINE static inline __attribute__((always_inline))

typedef float v8f __attribute__((vector_size(32)));
MLA_INLINE void v8_ld(v8f *d, const float *p) {
    memcpy(d, p, sizeof *d);
}
MLA_INLINE void v8_st(float *p, const v8f *s) {
    memcpy(p, s, sizeof *s);
}
MLA_INLINE float v8_sum(const v8f *a) {
    v8f x = *a;
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

/* One attention call, in the terms the engine needs. Query th = t*Ha + h has pieces
 * q1 + th*q_ld (d1 floats) and q2 + th*q_ld2 (d2 floats); its key row p has pieces of the same
 * widths; its value row has dv floats; its output goes to out + th*dv. */
typedef struct mla_problem {
    int T, Ha, d1, d2, dv;
    const float *q1, *q2;
    size_t q_ld, q_ld2;
    float *out; /* [T][Ha][dv] */
    /* absorbed: lat != NULL, row p = [c (d1) | kR (d2)], value = c (dv == d1) */
    const ds_latent_view *lat;
    /* expanded: kN [n_ctx][Ha][d1], kR [n_ctx][d2], v [n_ctx][Ha][dv] */
    const float *kN, *kR, *v;
    int n_ctx, pos0, causal;
    float scale;
} mla_problem;

static void *mla_alloc(size_t n) {
    void *p = malloc(n);
    if (!p) {
        /* A kernel cannot report failure; its scratch is a few KB per thread, so running out
         * here means the process is already lost. */
        fprintf(stderr, "deltaserve: out of memory in MLA attention (%zu bytes)\n", n);
        abort();
    }
    return p;
}

/* The value of a written E4M3 code (ds_e4m3_to_f32 for every code but the NaNs, which the
 * quantizer never writes), branch-free so that a row's dequantization vectorizes: a normal code's
 * exponent is rebiased in the integer domain, a subnormal one is m 2^-9. No f32 subnormal is
 * formed, so the value does not depend on the FPU's flush modes. */
static inline __attribute__((always_inline)) float mla_e4m3(uint8_t b) {
    const uint32_t u = b & 0x7fu, sign = (uint32_t)(b & 0x80u) << 24;
    const float mag = u < 8 ? (float)u * (1.0f / 512.0f) : ds_bits_f32((u << 20) + (120u << 23));
    return ds_bits_f32(ds_f32_bits(mag) | sign);
}

/* c [R], kr [dr] <- the values of a stored row of dtype dt (ds_kv_fp8_value: the same f32
 * products; BF16: exact). */
static MLA_HOT void mla_dequant(float *c, float *kr, const uint8_t *row, int dt, int R, int dr) {
    if (dt == DS_KV_F32) {
        memcpy(c, row, (size_t)R * sizeof(float));
        memcpy(kr, row + (size_t)R * sizeof(float), (size_t)dr * sizeof(float));
        return;
    }
    if (dt == DS_KV_BF16) {
        const uint16_t *h = (const uint16_t *)row; /* rows are 16-byte aligned */
        for (int i = 0; i < R; i++) c[i] = ds_kv_bf16_value(h[i]);
        for (int i = 0; i < dr; i++) kr[i] = ds_kv_bf16_value(h[R + i]);
        return;
    }
    for (int j = 0; j * DS_KV_FP8_TILE < R; j++) {
        const int a = j * DS_KV_FP8_TILE, n = DS_MIN(DS_KV_FP8_TILE, R - a);
        const float sc = ds_kv_fp8_scale(row, R, j);
        for (int i = 0; i < n; i++) c[a + i] = mla_e4m3(row[a + i]) * sc;
    }
    const uint8_t *rp = row + ds_kv_fp8_rope_at(R);
    for (int i = 0; i < dr; i++) {
        uint16_t h;
        memcpy(&h, rp + 2 * (size_t)i, 2);
        kr[i] = ds_kv_bf16_value(h);
    }
}

void ds_latent_store(const ds_latent_view *v, int pos, const float *x) {
    ds_kv_row_store(v->dtype, ds_latent_at(v, pos), x, v->R, v->row - v->R);
}

void ds_latent_load(const ds_latent_view *v, int pos, float *c, float *kr) {
    mla_dequant(c, kr, ds_latent_at(v, pos), v->dtype, v->R, v->row - v->R);
}

/* Rows visible to token t: causal queries see 0..pos0+t (never past the cache's n_ctx rows). */
static int mla_limit(const mla_problem *pb, int t) {
    return pb->causal ? DS_MIN(pb->pos0 + t + 1, pb->n_ctx) : pb->n_ctx;
}

static int mla_groups_per_head(const mla_problem *pb) {
    return (pb->T + MLA_QB - 1) / MLA_QB;
}

/* Absorbed form: groups of one token's heads. */
static int mla_head_groups(const mla_problem *pb) {
    return (pb->Ha + MLA_QB - 1) / MLA_QB;
}
static int mla_num_groups(const mla_problem *pb) {
    if (pb->lat) return pb->T * mla_head_groups(pb);
    return pb->Ha * mla_groups_per_head(pb);
}

/* The queries of group g: th[i] for i < return value; *head is the head (expanded form only). */
static int mla_group(const mla_problem *pb, int g, int *th, int *head) {
    int n = 0;
    if (pb->lat) {
        int hg = mla_head_groups(pb), t = g / hg, h0 = (g % hg) * MLA_QB;
        for (int h = h0; h < DS_MIN(h0 + MLA_QB, pb->Ha); h++) th[n++] = t * pb->Ha + h;
        *head = -1;
    } else {
        int gph = mla_groups_per_head(pb), h = g / gph, t0 = (g % gph) * MLA_QB;
        for (int t = t0; t < DS_MIN(t0 + MLA_QB, pb->T); t++) th[n++] = t * pb->Ha + h;
        *head = h;
    }
    return n;
}

/* Pointers to the pieces of key rows [p0, p0+nk). FP8 and BF16 rows are widened into kd
 * [MLA_KB][d1 + d2] first. */
static void mla_gather(const mla_problem *pb, int h, int p0, int nk, const float **k1,
                       const float **k2, const float **vv, float *kd) {
    for (int j = 0; j < nk; j++) {
        int p = p0 + j;
        if (pb->lat && pb->lat->dtype != DS_KV_F32) {
            float *row = kd + (size_t)j * (pb->d1 + pb->d2);
            mla_dequant(row, row + pb->d1, ds_latent_at(pb->lat, p), pb->lat->dtype, pb->d1,
                        pb->d2);
            k1[j] = row, k2[j] = row + pb->d1, vv[j] = row;
        } else if (pb->lat) {
            const float *row = ds_latent_row(pb->lat, p);
            k1[j] = row, k2[j] = row + pb->d1, vv[j] = row;
        } else {
            k1[j] = pb->kN + ((size_t)p * pb->Ha + h) * pb->d1;
            k2[j] = pb->kR + (size_t)p * pb->d2;
            vv[j] = pb->v + ((size_t)p * pb->Ha + h) * pb->dv;
        }
    }
}

/* Σ_x a[x] * b_r[x] for four query vectors b_0..b_3 at once; adds into s[0..3]. */
MLA_INLINE void mla_dot4(const float *a, const float *b0, const float *b1, const float *b2,
                         const float *b3, int d, float *s) {
    v8f c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
    int x = 0;
    for (; x + 8 <= d; x += 8) {
        v8f av, bv;
        v8_ld(&av, a + x);
        v8_ld(&bv, b0 + x), c0 += av * bv;
        v8_ld(&bv, b1 + x), c1 += av * bv;
        v8_ld(&bv, b2 + x), c2 += av * bv;
        v8_ld(&bv, b3 + x), c3 += av * bv;
    }
    float r0 = v8_sum(&c0), r1 = v8_sum(&c1), r2 = v8_sum(&c2), r3 = v8_sum(&c3);
    for (; x < d; x++)
        r0 += a[x] * b0[x], r1 += a[x] * b1[x], r2 += a[x] * b2[x], r3 += a[x] * b3[x];
    s[0] += r0, s[1] += r1, s[2] += r2, s[3] += r3;
}

/* O[i] += Σ_j P[i][j] vv[j] for rows i and i2 (i2 may equal i, then only row i is stored). */
MLA_INLINE void mla_pv2(float *Oi, float *Oi2, const float *Pi, const float *Pi2,
                        const float *const *vv, int nk, int dv) {
    int x = 0;
    for (; x + 32 <= dv; x += 32) {
        v8f a0, a1, a2, a3, b0, b1, b2, b3;
        v8_ld(&a0, Oi + x), v8_ld(&a1, Oi + x + 8), v8_ld(&a2, Oi + x + 16),
            v8_ld(&a3, Oi + x + 24);
        v8_ld(&b0, Oi2 + x), v8_ld(&b1, Oi2 + x + 8), v8_ld(&b2, Oi2 + x + 16),
            v8_ld(&b3, Oi2 + x + 24);
        for (int j = 0; j < nk; j++) {
            const float *vj = vv[j] + x, p = Pi[j], p2 = Pi2[j];
            v8f w0, w1, w2, w3;
            v8_ld(&w0, vj), v8_ld(&w1, vj + 8), v8_ld(&w2, vj + 16), v8_ld(&w3, vj + 24);
            a0 += w0 * p, a1 += w1 * p, a2 += w2 * p, a3 += w3 * p;
            b0 += w0 * p2, b1 += w1 * p2, b2 += w2 * p2, b3 += w3 * p2;
        }
        /* Row i2 first: when it is row i, row i's store must be the one that lands. */
        v8_st(Oi2 + x, &b0), v8_st(Oi2 + x + 8, &b1), v8_st(Oi2 + x + 16, &b2),
            v8_st(Oi2 + x + 24, &b3);
        v8_st(Oi + x, &a0), v8_st(Oi + x + 8, &a1), v8_st(Oi + x + 16, &a2),
            v8_st(Oi + x + 24, &a3);
    }
    for (; x < dv; x++) {
        float a = Oi[x], b = Oi2[x];
        for (int j = 0; j < nk; j++) a += Pi[j] * vv[j][x], b += Pi2[j] * vv[j][x];
        Oi2[x] = b;
        Oi[x] = a;
    }
}

/* One tile of nk keys (positions p0..) for nq queries: scores, online-softmax update, P·V.
 * m, l: [nq]; O: [nq][dv] unnormalised; P: [nq][MLA_KB] scratch. */
static MLA_HOT void mla_tile(int nq, const float *const *q1, const float *const *q2, const int *lim,
                             int p0, int nk, const float *const *k1, const float *const *k2,
                             const float *const *vv, int d1, int d2, int dv, float scale, float *m,
                             float *l, float *O, float *P) {
    for (int i = 0; i < nq; i += 4) {
        /* A short last block repeats its last query; those results are not stored. */
        int r1 = DS_MIN(i + 1, nq - 1), r2 = DS_MIN(i + 2, nq - 1), r3 = DS_MIN(i + 3, nq - 1);
        for (int j = 0; j < nk; j++) {
            float s[4] = {0, 0, 0, 0};
            mla_dot4(k1[j], q1[i], q1[r1], q1[r2], q1[r3], d1, s);
            mla_dot4(k2[j], q2[i], q2[r1], q2[r2], q2[r3], d2, s);
            for (int r = 0; r < 4 && i + r < nq; r++)
                P[(size_t)(i + r) * MLA_KB + j] = p0 + j < lim[i + r] ? scale * s[r] : -INFINITY;
        }
    }
    for (int i = 0; i < nq; i++) {
        float *Pi = P + (size_t)i * MLA_KB, *Oi = O + (size_t)i * dv;
        float mx = -INFINITY;
        for (int j = 0; j < nk; j++) mx = Pi[j] > mx ? Pi[j] : mx;
        if (mx == -INFINITY) { /* every key of this tile is in the query's future */
            for (int j = 0; j < nk; j++) Pi[j] = 0.0f;
            continue;
        }
        const float mn = m[i] > mx ? m[i] : mx,
                    corr = expf(m[i] - mn); /* corr = 0 on the first tile */
        if (corr != 1.0f) {
            l[i] *= corr;
            for (int x = 0; x < dv; x++) Oi[x] *= corr;
        }
        float sum = 0.0f;
        for (int j = 0; j < nk; j++) {
            Pi[j] = expf(Pi[j] - mn);
            sum += Pi[j];
        }
        l[i] += sum;
        m[i] = mn;
    }
    for (int i = 0; i < nq; i += 2) {
        int i2 = DS_MIN(i + 1, nq - 1);
        mla_pv2(O + (size_t)i * dv, O + (size_t)i2 * dv, P + (size_t)i * MLA_KB,
                P + (size_t)i2 * MLA_KB, vv, nk, dv);
    }
}

/* The number of parallel work items the expanded form aims for when it splits keys: a constant,
 * not the thread count, so that the result does not depend on the machine. */
#define MLA_WORK 32

/* Absorbed form: the key range length for a token that sees lim rows — a multiple of the tile,
 * at least four tiles, at most MLA_MAX_SPLITS ranges. A function of lim alone. */
#define MLA_MAX_SPLITS 16
static int mla_split_len(int lim) {
    int sl = 4 * MLA_KB;
    while ((lim + sl - 1) / sl > MLA_MAX_SPLITS) sl *= 2;
    return sl;
}

/* Token t's work items (one per head group and key range) start at first[t]; a binary search. */
static int mla_item_token(const int *first, int T, int it) {
    int t = 0, lo = 0, hi = T - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (first[mid] <= it)
            t = mid, lo = mid + 1;
        else
            hi = mid - 1;
    }
    return t;
}

/* One thread's workspace for a work item (a head group over one key range): O [QB][dv],
 * P [QB][KB], m [QB], l [QB], with FP8 rows kd [KB][d1 + d2] (a tile's dequantized rows), and the
 * group's queries. */
typedef struct mla_ws {
    float *O, *P, *m, *l, *kd;
    int th[MLA_QB], lim[MLA_QB], nq, h;
    const float *q1[MLA_QB], *q2[MLA_QB];
    const float *k1[MLA_KB], *k2[MLA_KB], *vv[MLA_KB];
} mla_ws;

static void mla_ws_at(mla_ws *w, float *scratch, int dv) {
    w->O = scratch;
    w->P = w->O + (size_t)MLA_QB * dv;
    w->m = w->P + MLA_QB * MLA_KB;
    w->l = w->m + MLA_QB;
    w->kd = w->l + MLA_QB;
}

/* Floats of one thread's workspace (mla_ws_at). */
static size_t mla_ws_floats(const mla_problem *pb) {
    size_t n = (size_t)MLA_QB * ((size_t)pb->dv + MLA_KB + 2);
    if (pb->lat && pb->lat->dtype != DS_KV_F32) n += (size_t)MLA_KB * (size_t)(pb->d1 + pb->d2);
    return n;
}

/* Loads group g's queries and clears their running max, sum and output; returns the longest
 * key limit among them. */
static int mla_item_begin(const mla_problem *pb, mla_ws *w, int g) {
    int most = 0;
    w->nq = mla_group(pb, g, w->th, &w->h);
    for (int i = 0; i < w->nq; i++) {
        w->lim[i] = mla_limit(pb, w->th[i] / pb->Ha);
        most = DS_MAX(most, w->lim[i]);
        w->q1[i] = pb->q1 + (size_t)w->th[i] * pb->q_ld;
        w->q2[i] = pb->q2 + (size_t)w->th[i] * pb->q_ld2;
        w->m[i] = -INFINITY, w->l[i] = 0.0f;
    }
    memset(w->O, 0, sizeof(float) * (size_t)w->nq * pb->dv);
    return most;
}

/* Runs the loaded queries over keys [kb, ke) (absolute positions), a tile at a time. */
static void mla_item_keys(const mla_problem *pb, mla_ws *w, int kb, int ke) {
    for (int p0 = kb; p0 < ke; p0 += MLA_KB) {
        const int nk = DS_MIN(MLA_KB, ke - p0);
        mla_gather(pb, w->h, p0, nk, w->k1, w->k2, w->vv, w->kd);
        mla_tile(w->nq, w->q1, w->q2, w->lim, p0, nk, w->k1, w->k2, w->vv, pb->d1, pb->d2, pb->dv,
                 pb->scale, w->m, w->l, w->O, w->P);
    }
}

/* Writes the item's result: the normalised output when its range is the query's only one
 * (part NULL), else its partial (m, l, O) at part + (th[i] - th0) * (2 + dv). */
static void mla_item_end(const mla_problem *pb, const mla_ws *w, float *part, int th0) {
    const int dv = pb->dv;
    for (int i = 0; i < w->nq; i++) {
        const float *Oi = w->O + (size_t)i * dv;
        if (!part) {
            float *y = pb->out + (size_t)w->th[i] * dv;
            const float inv = w->l[i] > 0 ? 1.0f / w->l[i] : 0.0f; /* no keys: output 0 */
            for (int x = 0; x < dv; x++) y[x] = Oi[x] * inv;
        } else {
            float *d = part + (size_t)(w->th[i] - th0) * (2 + (size_t)dv);
            d[0] = w->m[i], d[1] = w->l[i];
            memcpy(d + 2, Oi, sizeof(float) * (size_t)dv);
        }
    }
}

/* Merges one query's ns partials (range s's at d0 + s * stride) in order: rescale each to the
 * common max, renormalise. */
static void mla_merge(float *y, const float *d0, size_t stride, int ns, int dv) {
    float M = -INFINITY, Lsum = 0.0f;
    for (int s = 0; s < ns; s++) M = fmaxf(M, d0[(size_t)s * stride]);
    memset(y, 0, sizeof(float) * (size_t)dv);
    if (M == -INFINITY) return;
    for (int s = 0; s < ns; s++) {
        const float *d = d0 + (size_t)s * stride;
        if (d[1] == 0.0f) continue;
        const float w = expf(d[0] - M);
        Lsum += d[1] * w;
        for (int x = 0; x < dv; x++) y[x] += d[2 + x] * w;
    }
    const float inv = 1.0f / Lsum;
    for (int x = 0; x < dv; x++) y[x] *= inv;
}

static void mla_run_absorbed(const mla_problem *pb) {
    const int T = pb->T, Ha = pb->Ha, hg = mla_head_groups(pb), dv = pb->dv;
    if (T * Ha <= 0) return;
    /* token t: ns[t] key ranges; its work items start at first[t]; with more than one range its
     * partials sit at poff[t] in part, laid out [range][head][2 + dv] (m, l, O) */
    int *ns = mla_alloc(sizeof(int) * (size_t)T * 2), *first = ns + T;
    size_t *poff = mla_alloc(sizeof(size_t) * (size_t)T);
    int n_items = 0;
    size_t n_part = 0;
    for (int t = 0; t < T; t++) {
        int lim = mla_limit(pb, t), sl = mla_split_len(lim);
        ns[t] = lim > 0 ? (lim + sl - 1) / sl : 1;
        first[t] = n_items;
        n_items += hg * ns[t];
        poff[t] = n_part;
        if (ns[t] > 1) n_part += (size_t)ns[t] * Ha * (2 + (size_t)dv);
    }
    float *part = n_part ? mla_alloc(sizeof(float) * n_part) : NULL;
    const int nthr = omp_get_max_threads();
    const size_t thr = mla_ws_floats(pb);
    float *scratch = mla_alloc(sizeof(float) * thr * (size_t)nthr);
    const size_t split_stride = (size_t)Ha * (2 + (size_t)dv);
#pragma omp parallel
    {
        mla_ws w;
        mla_ws_at(&w, scratch + thr * (size_t)omp_get_thread_num(), dv);
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < n_items; it++) {
            /* a group holds heads of one token, so its queries share the token's limit L */
            const int t = mla_item_token(first, T, it);
            const int r = it - first[t], g = t * hg + r / ns[t], s = r % ns[t];
            const int L = mla_item_begin(pb, &w, g), sl = mla_split_len(L);
            mla_item_keys(pb, &w, s * sl, DS_MIN(L, s * sl + sl));
            mla_item_end(pb, &w, ns[t] == 1 ? NULL : part + poff[t] + (size_t)s * split_stride,
                         t * Ha);
        }
        /* Merge each token's ranges in order. */
#pragma omp for schedule(static)
        for (int q = 0; q < T * Ha; q++) {
            const int t = q / Ha, h = q % Ha;
            if (ns[t] == 1) continue;
            mla_merge(pb->out + (size_t)q * dv, part + poff[t] + (size_t)h * (2 + (size_t)dv),
                      split_stride, ns[t], dv);
        }
    }
    free(scratch);
    free(part);
    free(poff);
    free(ns);
}

static void mla_run(const mla_problem *pb) {
    if (pb->lat) {
        mla_run_absorbed(pb);
        return;
    }
    const int nq_all = pb->T * pb->Ha, ng = mla_num_groups(pb), dv = pb->dv;
    if (nq_all <= 0) return;
    const int nthr = omp_get_max_threads();

    /* Key splits: only when groups alone are few (a constant, not the thread count), and never
     * below a few tiles per split. */
    int ns = 1;
    if (ng < MLA_WORK) {
        int want = (MLA_WORK + ng - 1) / ng, most = DS_MAX(1, pb->n_ctx / (4 * MLA_KB));
        ns = DS_MAX(1, DS_MIN(want, most));
    }
    float *part = NULL; /* [ns][nq_all][2 + dv]: m, l, O of each split */
    if (ns > 1) {
        part = malloc(sizeof(float) * (size_t)ns * nq_all * (2 + (size_t)dv));
        if (!part) ns = 1;
    }
    const size_t thr = mla_ws_floats(pb);
    float *scratch = mla_alloc(sizeof(float) * thr * (size_t)nthr);
    const size_t split_stride = (size_t)nq_all * (2 + (size_t)dv);
#pragma omp parallel
    {
        mla_ws w;
        mla_ws_at(&w, scratch + thr * (size_t)omp_get_thread_num(), dv);
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < ng * ns; it++) {
            const int g = it / ns, s = it % ns;
            const int most = mla_item_begin(pb, &w, g);
            mla_item_keys(pb, &w, (int)((long long)most * s / ns),
                          (int)((long long)most * (s + 1) / ns));
            mla_item_end(pb, &w, ns == 1 ? NULL : part + (size_t)s * split_stride, 0);
        }
        if (ns > 1) {
#pragma omp for schedule(static)
            for (int q = 0; q < nq_all; q++)
                mla_merge(pb->out + (size_t)q * dv, part + (size_t)q * (2 + (size_t)dv),
                          split_stride, ns, dv);
        }
    }
    free(scratch);
    free(part);
}

void ds_mla_attend_absorbed(float *obar, const float *qbar, const float *qr, int T, int Ha, int R,
                            int dr, const ds_latent_view *kv, int pos0, int n_ctx, int causal,
                            float scale) {
    mla_problem pb = {.T = T,
                      .Ha = Ha,
                      .d1 = R,
                      .d2 = dr,
                      .dv = R,
                      .q1 = qbar,
                      .q2 = qr,
                      .q_ld = (size_t)R,
                      .q_ld2 = (size_t)dr,
                      .out = obar,
                      .lat = kv,
                      .n_ctx = n_ctx,
                      .pos0 = pos0,
                      .causal = causal,
                      .scale = scale};
    mla_run(&pb);
}

void ds_mla_attend_expanded(float *o, const float *q, const float *kN, const float *kR,
                            const float *v, int T, int n_ctx, int Ha, int dn, int dr, int dvh,
                            int pos0, int causal, float scale) {
    mla_problem pb = {.T = T,
                      .Ha = Ha,
                      .d1 = dn,
                      .d2 = dr,
                      .dv = dvh,
                      .q1 = q,
                      .q2 = q + dn,
                      .q_ld = (size_t)(dn + dr),
                      .q_ld2 = (size_t)(dn + dr),
                      .out = o,
                      .kN = kN,
                      .kR = kR,
                      .v = v,
                      .n_ctx = n_ctx,
                      .pos0 = pos0,
                      .causal = causal,
                      .scale = scale};
    mla_run(&pb);
}
