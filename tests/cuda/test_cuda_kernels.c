/* test_cuda_kernels.c — every CUDA kernel against the CPU backend (issue 9), then timings.
 *
 *   test_cuda_kernels            checks only (exit 1 on any failure)
 *   test_cuda_kernels --bench    checks, then the ceilings and kernel timings
 *   test_cuda_kernels --bench kda,mla   ... of those sections only (matmul, kda, moe, mla)
 *
 * Checks follow the device method: fresh random inputs for every case (never zeros), outputs
 * poisoned with NaN bytes before each run so that an unwritten element fails, and the error as
 * ||gpu - cpu|| / ||cpu|| in double. f32 kernels must land under 1e-5; the matmul rounds its
 * activations to BF16 (cuBLAS BF16 x BF16 -> F32), so it is held to 1e-2 and its error printed.
 * Built and run on the GPU machine by tools/device/cuda_check.sh. */
#include "kernels/cpu/kernels.h"
#include "kernels/cuda/cuda_kernels.h"
#include "backend/cuda/cuda.h"
#include "sample/sampler.h"
#include "../unit/draw_rows.h"
#ifdef DS_HAVE_NCCL
#include "transport/comm_nccl.h"
#endif

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_fail = 0;
static ds_rng g_rng;

#define DIE(...)                                                                                   \
    do {                                                                                           \
        fprintf(stderr, __VA_ARGS__);                                                              \
        fprintf(stderr, "\n");                                                                     \
        exit(2);                                                                                   \
    } while (0)

static float urand(float lo, float hi) {
    return lo + (hi - lo) * (float)ds_rng_uniform(&g_rng);
}

static float *rand_f32(size_t n, float lo, float hi) {
    float *p = malloc(n * sizeof *p);
    if (!p) DIE("out of memory");
    for (size_t i = 0; i < n; i++) p[i] = urand(lo, hi);
    return p;
}

static uint16_t *rand_bf16(size_t n, float lo, float hi) {
    uint16_t *p = malloc(n * sizeof *p);
    if (!p) DIE("out of memory");
    for (size_t i = 0; i < n; i++) p[i] = ds_f32_to_bf16(urand(lo, hi));
    return p;
}

static void *dev(ds_cu *c, const void *host, size_t bytes) {
    ds_err err = {{0}};
    void *d = ds_cu_alloc(c, bytes, &err);
    if (!d) DIE("%s", err.msg);
    if (host && ds_cu_upload(c, d, host, bytes, &err)) DIE("%s", err.msg);
    return d;
}

/* NaN bytes: a kernel that skips an element leaves a NaN, which every check rejects. */
static void poison(ds_cu *c, void *d, size_t bytes) {
    ds_err err = {{0}};
    if (ds_cu_fill_bytes(c, d, 0xff, bytes, &err)) DIE("%s", err.msg);
}

static void fetch(ds_cu *c, void *host, const void *d, size_t bytes) {
    ds_err err = {{0}};
    if (ds_cu_sync(c, &err) || ds_cu_download(c, host, d, bytes, &err)) DIE("%s", err.msg);
}

/* ||a - b|| / ||b|| over n, rows of `cols` at stride ld (ld = cols: packed); NaN anywhere: inf. */
static double rel_err(const float *a, const float *b, size_t rows, size_t cols, size_t ld) {
    double num = 0, den = 0;
    for (size_t r = 0; r < rows; r++)
        for (size_t i = 0; i < cols; i++) {
            double x = a[r * ld + i], y = b[r * ld + i];
            if (isnan(x) || isnan(y)) return INFINITY;
            num += (x - y) * (x - y);
            den += y * y;
        }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void report(const char *what, double err, double tol) {
    int ok = err <= tol;
    printf("check %-44s rel err %.2e (tol %.0e) %s\n", what, err, tol, ok ? "ok" : "FAIL");
    if (!ok) g_fail = 1;
}

/* Each sequence's rows of state (n per sequence, `row` floats each, packed from off[z] rows in)
 * against the CPU's, for the sequences with keep[z]: the rollback rows of a verify. */
static void report_seq_rows(const char *what, const float *got, const float *ref, const int *off,
                            const int *lens, const int *keep, int n_seq, size_t row, double tol) {
    char name[96];
    for (int z = 0; z < n_seq; z++) {
        if (!keep[z]) continue;
        snprintf(name, sizeof name, "%s: seq %d's rows", what, z);
        size_t at = (size_t)off[z] * row, n = (size_t)lens[z] * row;
        report(name, rel_err(got + at, ref + at, 1, n, n), tol);
    }
}

/* ---- checks --------------------------------------------------------------------------------- */

static void check_matmul(ds_cu *c, int T, int N, int K, int pad, double tol) {
    int ldx = K + pad, ldy = N + pad;
    float *x = rand_f32((size_t)T * ldx, -1, 1);
    uint16_t *w = rand_bf16((size_t)N * K, -0.05f, 0.05f);
    float *ref = calloc((size_t)T * ldy, sizeof *ref), *got = calloc((size_t)T * ldy, sizeof *got);
    ds_mat hw = {w, DS_DT_BF16, N, K};
    ds_matmul(ref, ldy, x, ldx, T, &hw);
    float *dx = dev(c, x, (size_t)T * ldx * 4), *dy = dev(c, NULL, (size_t)T * ldy * 4);
    uint16_t *dw = dev(c, w, (size_t)N * K * 2);
    poison(c, dy, (size_t)T * ldy * 4);
    ds_cu_mat m = {dw, N, K};
    ds_err err = {{0}};
    if (ds_cu_matmul(c, dy, ldy, dx, ldx, T, &m, &err)) DIE("%s", err.msg);
    fetch(c, got, dy, (size_t)T * ldy * 4);
    char what[96];
    snprintf(what, sizeof what, "matmul T=%d N=%d K=%d%s", T, N, K, pad ? " (strided)" : "");
    report(what, rel_err(got, ref, (size_t)T, (size_t)N, (size_t)ldy), tol);
    ds_cu_dealloc(dx), ds_cu_dealloc(dy), ds_cu_dealloc(dw);
    free(x), free(w), free(ref), free(got);
}

/* H per-head matmuls in one call (y_h = x_h W_h^T at head strides) against the CPU head by head. */
static void check_matmul_heads(ds_cu *c, int T, int H, int N, int K, int invariant, double tol) {
    int ldx = H * K, ldy = H * N;
    float *x = rand_f32((size_t)T * ldx, -1, 1);
    uint16_t *w = rand_bf16((size_t)H * N * K, -0.05f, 0.05f);
    float *ref = calloc((size_t)T * ldy, 4), *got = calloc((size_t)T * ldy, 4);
    for (int h = 0; h < H; h++) {
        ds_mat hw = {w + (size_t)h * N * K, DS_DT_BF16, N, K};
        ds_matmul(ref + (size_t)h * N, ldy, x + (size_t)h * K, ldx, T, &hw);
    }
    float *dx = dev(c, x, (size_t)T * ldx * 4), *dy = dev(c, NULL, (size_t)T * ldy * 4);
    uint16_t *dw = dev(c, w, (size_t)H * N * K * 2);
    poison(c, dy, (size_t)T * ldy * 4);
    ds_cu_mat m = {dw, N, K};
    ds_err err = {{0}};
    ds_cu_set_batch_invariant(c, invariant);
    if (ds_cu_matmul_heads(c, dy, ldy, (size_t)N, dx, ldx, (size_t)K, T, &m, (size_t)N * K, H,
                           &err))
        DIE("%s", err.msg);
    ds_cu_set_batch_invariant(c, 0);
    fetch(c, got, dy, (size_t)T * ldy * 4);
    char what[96];
    snprintf(what, sizeof what, "matmul heads T=%d H=%d N=%d K=%d%s", T, H, N, K,
             invariant ? " (invariant)" : "");
    report(what, rel_err(got, ref, (size_t)T, (size_t)ldy, (size_t)ldy), tol);
    ds_cu_dealloc(dx), ds_cu_dealloc(dy), ds_cu_dealloc(dw);
    free(x), free(w), free(ref), free(got);
}

/* The batch-invariant mode's promise: a token's output bits are the same at every T. */
static void check_matmul_invariance(ds_cu *c, int N, int K) {
    enum { T = 21 };
    float *x = rand_f32((size_t)T * K, -1, 1);
    uint16_t *w = rand_bf16((size_t)N * K, -0.05f, 0.05f);
    float *all = malloc((size_t)T * N * 4), *one = malloc((size_t)N * 4);
    float *dx = dev(c, x, (size_t)T * K * 4), *dy = dev(c, NULL, (size_t)T * N * 4);
    uint16_t *dw = dev(c, w, (size_t)N * K * 2);
    ds_cu_mat m = {dw, N, K};
    ds_err err = {{0}};
    ds_cu_set_batch_invariant(c, 1);
    if (ds_cu_matmul(c, dy, N, dx, K, T, &m, &err)) DIE("%s", err.msg);
    fetch(c, all, dy, (size_t)T * N * 4);
    int same = 1;
    for (int t = 0; t < T; t++) { /* token t alone, from the same row of x */
        if (ds_cu_matmul(c, dy, N, dx + (size_t)t * K, K, 1, &m, &err)) DIE("%s", err.msg);
        fetch(c, one, dy, (size_t)N * 4);
        same &= !memcmp(one, all + (size_t)t * N, (size_t)N * 4);
    }
    ds_cu_set_batch_invariant(c, 0);
    char what[96];
    snprintf(what, sizeof what, "matmul invariant N=%d K=%d: T=1 bits == T=%d bits", N, K, T);
    report(what, same ? 0.0 : 1.0, 0.0);
    ds_cu_dealloc(dx), ds_cu_dealloc(dy), ds_cu_dealloc(dw);
    free(x), free(w), free(all), free(one);
}

static void check_embed(ds_cu *c, int V, int D, int T) {
    uint16_t *e = rand_bf16((size_t)V * D, -1, 1);
    int32_t *ids = malloc((size_t)T * sizeof *ids);
    for (int t = 0; t < T; t++) ids[t] = (int32_t)(ds_rng_next(&g_rng) % (uint64_t)V);
    float *ref = malloc((size_t)T * D * 4), *got = malloc((size_t)T * D * 4);
    ds_mat he = {e, DS_DT_BF16, V, D};
    ds_embed(ref, &he, ids, T);
    uint16_t *de = dev(c, e, (size_t)V * D * 2);
    int32_t *dids = dev(c, ids, (size_t)T * 4);
    float *dout = dev(c, NULL, (size_t)T * D * 4);
    poison(c, dout, (size_t)T * D * 4);
    ds_cu_mat m = {de, V, D};
    ds_cu_embed(c, dout, &m, dids, T);
    fetch(c, got, dout, (size_t)T * D * 4);
    char what[96];
    snprintf(what, sizeof what, "embed V=%d D=%d T=%d", V, D, T);
    report(what, rel_err(got, ref, (size_t)T, (size_t)D, (size_t)D), 0.0);
    ds_cu_dealloc(de), ds_cu_dealloc(dids), ds_cu_dealloc(dout);
    free(e), free(ids), free(ref), free(got);
}

static void check_rmsnorm(ds_cu *c, int T, int D, int in_place) {
    float *x = rand_f32((size_t)T * D, -3, 3), *w = rand_f32((size_t)D, 0.5f, 1.5f);
    float *ref = malloc((size_t)T * D * 4), *got = malloc((size_t)T * D * 4);
    ds_rmsnorm(ref, x, w, T, D, 1e-6f);
    float *dx = dev(c, x, (size_t)T * D * 4), *dw = dev(c, w, (size_t)D * 4);
    float *dy = in_place ? dx : dev(c, NULL, (size_t)T * D * 4);
    if (!in_place) poison(c, dy, (size_t)T * D * 4);
    ds_cu_rmsnorm(c, dy, dx, dw, T, D, 1e-6f);
    fetch(c, got, dy, (size_t)T * D * 4);
    char what[96];
    snprintf(what, sizeof what, "rmsnorm T=%d D=%d%s", T, D, in_place ? " (in place)" : "");
    report(what, rel_err(got, ref, (size_t)T, (size_t)D, (size_t)D), 1e-5);
    if (!in_place) ds_cu_dealloc(dy);
    ds_cu_dealloc(dx), ds_cu_dealloc(dw);
    free(x), free(w), free(ref), free(got);
}

/* P += a, then y = norm(P): both outputs against the CPU's add and norm. */
static void check_add_rmsnorm(ds_cu *c, int T, int D) {
    size_t n = (size_t)T * D;
    float *P = rand_f32(n, -3, 3), *a = rand_f32(n, -1, 1), *w = rand_f32((size_t)D, 0.5f, 1.5f);
    float *sum = malloc(n * 4), *ref = malloc(n * 4), *got = malloc(n * 4), *gotP = malloc(n * 4);
    for (size_t i = 0; i < n; i++) sum[i] = P[i] + a[i];
    ds_rmsnorm(ref, sum, w, T, D, 1e-6f);
    float *dP = dev(c, P, n * 4), *da = dev(c, a, n * 4), *dw = dev(c, w, (size_t)D * 4);
    float *dy = dev(c, NULL, n * 4);
    poison(c, dy, n * 4);
    ds_cu_add_rmsnorm(c, dy, dP, da, dw, T, D, 1e-6f);
    fetch(c, got, dy, n * 4);
    fetch(c, gotP, dP, n * 4);
    char what[96];
    snprintf(what, sizeof what, "add + rmsnorm T=%d D=%d: sum", T, D);
    report(what, rel_err(gotP, sum, 1, n, n), 0.0);
    snprintf(what, sizeof what, "add + rmsnorm T=%d D=%d: norm", T, D);
    report(what, rel_err(got, ref, (size_t)T, (size_t)D, (size_t)D), 1e-5);
    ds_cu_dealloc(dP), ds_cu_dealloc(da), ds_cu_dealloc(dw), ds_cu_dealloc(dy);
    free(P), free(a), free(w), free(sum), free(ref), free(got), free(gotP);
}

static void check_swiglu(ds_cu *c, size_t n) {
    float *g = rand_f32(n, -6, 6), *u = rand_f32(n, -2, 2);
    float *ref = malloc(n * 4), *got = malloc(n * 4);
    ds_act_swiglu(ref, g, u, n);
    float *dg = dev(c, g, n * 4), *du = dev(c, u, n * 4), *dout = dev(c, NULL, n * 4);
    poison(c, dout, n * 4);
    ds_cu_swiglu(c, dout, dg, du, n);
    fetch(c, got, dout, n * 4);
    char what[96];
    snprintf(what, sizeof what, "swiglu n=%zu", n);
    report(what, rel_err(got, ref, 1, n, n), 1e-5);
    ds_cu_dealloc(dg), ds_cu_dealloc(du), ds_cu_dealloc(dout);
    free(g), free(u), free(ref), free(got);
}

/* h [rows][2I] (gate | up) -> act in the gate half, in place; the up half untouched. */
static void check_act_pairs(ds_cu *c, int rows, int I) {
    size_t n = (size_t)rows * 2 * I, half = (size_t)rows * I;
    float *h = rand_f32(n, -6, 6), *g = malloc(half * 4), *u = malloc(half * 4);
    float *ref = malloc(half * 4), *got = malloc(n * 4), *gg = malloc(half * 4);
    for (size_t r = 0; r < (size_t)rows; r++) {
        memcpy(g + r * I, h + r * 2 * I, (size_t)I * 4);
        memcpy(u + r * I, h + r * 2 * I + I, (size_t)I * 4);
    }
    ds_act_swiglu(ref, g, u, half);
    float *dh = dev(c, h, n * 4);
    ds_cu_act_pairs(c, dh, rows, I, 0, 0.0f, 0.0f);
    fetch(c, got, dh, n * 4);
    int up_kept = 1;
    for (size_t r = 0; r < (size_t)rows; r++) {
        memcpy(gg + r * I, got + r * 2 * I, (size_t)I * 4);
        up_kept &= !memcmp(got + r * 2 * I + I, u + r * I, (size_t)I * 4);
    }
    char what[96];
    snprintf(what, sizeof what, "act pairs rows=%d I=%d (swiglu)", rows, I);
    report(what, up_kept ? rel_err(gg, ref, 1, half, half) : INFINITY, 1e-5);
    ds_cu_dealloc(dh);
    free(h), free(g), free(u), free(ref), free(got), free(gg);
}

/* q, k as the model gives them: L2-normalised per head (q also scaled by dk^-1/2). */
static void norm_heads(float *x, int T, int H, int d, float scale) {
    for (int i = 0; i < T * H; i++) {
        double s = 0;
        for (int j = 0; j < d; j++) s += (double)x[i * d + j] * x[i * d + j];
        float inv = (float)(scale / sqrt(s + 1e-6));
        for (int j = 0; j < d; j++) x[i * d + j] *= inv;
    }
}

static void check_kda(ds_cu *c, int T, int H, int dk, int dv, int rows) {
    size_t nq = (size_t)T * H * dk, nv = (size_t)T * H * dv, ns = (size_t)H * dk * dv;
    float *q = rand_f32(nq, -1, 1), *k = rand_f32(nq, -1, 1), *v = rand_f32(nv, -1, 1);
    float *g = rand_f32(nq, -0.7f, 0), *beta = rand_f32((size_t)T * H, 0, 1);
    float *S0 = rand_f32(ns, -0.5f, 0.5f);
    norm_heads(q, T, H, dk, 1.0f / sqrtf((float)dk));
    norm_heads(k, T, H, dk, 1.0f);
    float *Sref = malloc(ns * 4), *Sgot = malloc(ns * 4);
    memcpy(Sref, S0, ns * 4);
    float *oref = malloc(nv * 4), *ogot = malloc(nv * 4);
    float *Rref = rows ? malloc((size_t)T * ns * 4) : NULL;
    float *Rgot = rows ? malloc((size_t)T * ns * 4) : NULL;
    ds_kda_recurrent(oref, q, k, v, g, beta, Sref, Rref, T, H, dk, dv);
    float *dq = dev(c, q, nq * 4), *dk_ = dev(c, k, nq * 4), *dv_ = dev(c, v, nv * 4);
    float *dg = dev(c, g, nq * 4), *db = dev(c, beta, (size_t)T * H * 4), *dS = dev(c, S0, ns * 4);
    float *dout = dev(c, NULL, nv * 4), *dR = rows ? dev(c, NULL, (size_t)T * ns * 4) : NULL;
    poison(c, dout, nv * 4);
    if (rows) poison(c, dR, (size_t)T * ns * 4);
    ds_err err = {{0}};
    if (ds_cu_kda_recurrent(c, dout, dq, dk_, dv_, dg, db, dS, dR, T, H, dk, dv, &err))
        DIE("%s", err.msg);
    fetch(c, ogot, dout, nv * 4);
    fetch(c, Sgot, dS, ns * 4);
    char what[96];
    snprintf(what, sizeof what, "kda_recurrent T=%d H=%d dk=%d dv=%d: out", T, H, dk, dv);
    report(what, rel_err(ogot, oref, 1, nv, nv), 1e-5);
    snprintf(what, sizeof what, "kda_recurrent T=%d H=%d dk=%d dv=%d: state", T, H, dk, dv);
    report(what, rel_err(Sgot, Sref, 1, ns, ns), 1e-5);
    if (rows) {
        fetch(c, Rgot, dR, (size_t)T * ns * 4);
        snprintf(what, sizeof what, "kda_recurrent T=%d H=%d dk=%d dv=%d: rows", T, H, dk, dv);
        report(what, rel_err(Rgot, Rref, 1, (size_t)T * ns, (size_t)T * ns), 1e-5);
        ds_cu_dealloc(dR);
    }
    ds_cu_dealloc(dq), ds_cu_dealloc(dk_), ds_cu_dealloc(dv_), ds_cu_dealloc(dg);
    ds_cu_dealloc(db), ds_cu_dealloc(dS), ds_cu_dealloc(dout);
    free(q), free(k), free(v), free(g), free(beta), free(S0), free(Sref), free(Sgot);
    free(oref), free(ogot), free(Rref), free(Rgot);
}

/* A step's KDA as the forward runs it: sequences of different lengths, each on its own state,
 * the recurrent kernel for all of them in one launch (with state rows where rows[z]) or, with
 * chunked_min > 0, the chunked form for those of at least that many tokens without rows:
 * outputs, final states and rows against the CPU's recurrence of each sequence alone. Decays as
 * strong as g_min per token (at -3, a chunk's running decay reaches e^-192: any exponent taken
 * the wrong way round overflows). */
static int g_kda_tc; /* ds_cu_set_kda_tc's mode as set by the caller (1 TF32, 3 3xTF32) */
static void check_kda_step(ds_cu *c, const int *lens, const int *rows, int n_seq, int H, int dk,
                           int dv, float g_min, int chunked_min) {
    int off[17], cs[16], cl[16], nc = 0;
    off[0] = 0;
    for (int z = 0; z < n_seq; z++) off[z + 1] = off[z] + lens[z];
    int T = off[n_seq];
    size_t nq = (size_t)T * H * dk, nv = (size_t)T * H * dv, ns = (size_t)H * dk * dv;
    float *q = rand_f32(nq, -1, 1), *k = rand_f32(nq, -1, 1), *v = rand_f32(nv, -1, 1);
    float *g = rand_f32(nq, g_min, 0), *beta = rand_f32((size_t)T * H, 0, 1);
    float *S0 = rand_f32(ns * n_seq, -0.5f, 0.5f);
    norm_heads(q, T, H, dk, 1.0f / sqrtf((float)dk));
    norm_heads(k, T, H, dk, 1.0f);
    float *Sref = malloc(ns * n_seq * 4), *Sgot = malloc(ns * n_seq * 4);
    float *oref = malloc(nv * 4), *ogot = malloc(nv * 4);
    float *Rref = malloc((size_t)T * ns * 4), *Rgot = malloc((size_t)T * ns * 4);
    memcpy(Sref, S0, ns * n_seq * 4);
    for (int z = 0; z < n_seq; z++) {
        size_t t0 = (size_t)off[z];
        ds_kda_recurrent(oref + t0 * H * dv, q + t0 * H * dk, k + t0 * H * dk, v + t0 * H * dv,
                         g + t0 * H * dk, beta + t0 * H, Sref + z * ns, Rref + t0 * ns, lens[z], H,
                         dk, dv);
    }
    float *dq = dev(c, q, nq * 4), *dk_ = dev(c, k, nq * 4), *dv_ = dev(c, v, nv * 4);
    float *dg = dev(c, g, nq * 4), *db = dev(c, beta, (size_t)T * H * 4);
    float *dS = dev(c, S0, ns * n_seq * 4), *dR = dev(c, NULL, (size_t)T * ns * 4);
    float *dout = dev(c, NULL, nv * 4);
    float *sp[16], *rp[16], *csp[16];
    for (int z = 0; z < n_seq; z++) {
        sp[z] = dS + z * ns, rp[z] = rows[z] ? dR + (size_t)off[z] * ns : NULL;
        if (chunked_min > 0 && !rows[z] && lens[z] >= chunked_min)
            cs[nc] = off[z], cl[nc] = lens[z], csp[nc++] = sp[z];
    }
    int32_t *doff = dev(c, off, (size_t)(n_seq + 1) * 4);
    float **dsp = dev(c, sp, (size_t)n_seq * sizeof *sp), **drp = dev(c, rp, n_seq * sizeof *rp);
    float **dcsp = dev(c, csp, (size_t)(nc ? nc : 1) * sizeof *csp);
    poison(c, dout, nv * 4);
    poison(c, dR, (size_t)T * ns * 4);
    ds_err err = {{0}};
    if (ds_cu_kda_recurrent_batch(c, dout, dq, dk_, dv_, dg, db, doff, dsp, drp, 0, n_seq, H, dk,
                                  dv, chunked_min, &err) ||
        (nc && ds_cu_kda_chunked(c, dout, dq, dk_, dv_, dg, db, cs, cl, dcsp, nc, H, dk, dv, &err)))
        DIE("%s", err.msg);
    fetch(c, ogot, dout, nv * 4);
    fetch(c, Sgot, dS, ns * n_seq * 4);
    fetch(c, Rgot, dR, (size_t)T * ns * 4);
    char what[96];
    /* the chunked form sums in another order; its TF32 passes round the operands */
    const double tol = !nc ? 1e-5 : g_kda_tc == 1 ? 1e-2 : 1e-4;
    snprintf(what, sizeof what, "kda %d seqs (T=%d, %d chunked%s) dk=%d dv=%d g>=%.1f: out", n_seq,
             T, nc,
             g_kda_tc == 1   ? ", tf32"
             : g_kda_tc == 3 ? ", 3xtf32"
                             : "",
             dk, dv, g_min);
    report(what, rel_err(ogot, oref, 1, nv, nv), tol);
    snprintf(what, sizeof what, "kda %d seqs (%d chunked) dk=%d dv=%d: states", n_seq, nc, dk, dv);
    report(what, rel_err(Sgot, Sref, 1, ns * n_seq, ns * n_seq), tol);
    snprintf(what, sizeof what, "kda %d seqs", n_seq);
    report_seq_rows(what, Rgot, Rref, off, lens, rows, n_seq, ns, 1e-5);
    ds_cu_dealloc(dq), ds_cu_dealloc(dk_), ds_cu_dealloc(dv_), ds_cu_dealloc(dg);
    ds_cu_dealloc(db), ds_cu_dealloc(dS), ds_cu_dealloc(dR), ds_cu_dealloc(dout);
    ds_cu_dealloc(doff), ds_cu_dealloc(dsp), ds_cu_dealloc(drp), ds_cu_dealloc(dcsp);
    free(q), free(k), free(v), free(g), free(beta), free(S0), free(Sref), free(Sgot);
    free(oref), free(ogot), free(Rref), free(Rgot);
}

static void check_short_conv(ds_cu *c, int T, int C, int W) {
    float *in = rand_f32((size_t)T * C, -2, 2), *w = rand_f32((size_t)C * W, -1, 1);
    float *tail = rand_f32((size_t)(W - 1) * C, -2, 2), *tail_ref = malloc((size_t)(W - 1) * C * 4);
    memcpy(tail_ref, tail, (size_t)(W - 1) * C * 4);
    float *ref = malloc((size_t)T * C * 4), *got = malloc((size_t)T * C * 4);
    float *tail_got = malloc((size_t)(W - 1) * C * 4);
    ds_short_conv_silu(ref, in, T, C, w, W, tail_ref);
    float *din = dev(c, in, (size_t)T * C * 4), *dw = dev(c, w, (size_t)C * W * 4);
    float *dtail = dev(c, tail, (size_t)(W - 1) * C * 4), *dout = dev(c, NULL, (size_t)T * C * 4);
    poison(c, dout, (size_t)T * C * 4);
    ds_err err = {{0}};
    if (ds_cu_short_conv_silu(c, dout, din, T, C, dw, W, dtail, &err)) DIE("%s", err.msg);
    fetch(c, got, dout, (size_t)T * C * 4);
    fetch(c, tail_got, dtail, (size_t)(W - 1) * C * 4);
    char what[96];
    snprintf(what, sizeof what, "short conv T=%d C=%d W=%d: out", T, C, W);
    report(what, rel_err(got, ref, 1, (size_t)T * C, (size_t)T * C), 1e-5);
    snprintf(what, sizeof what, "short conv T=%d C=%d W=%d: tail", T, C, W);
    report(what, rel_err(tail_got, tail_ref, 1, (size_t)(W - 1) * C, (size_t)(W - 1) * C), 0.0);
    ds_cu_dealloc(din), ds_cu_dealloc(dw), ds_cu_dealloc(dtail), ds_cu_dealloc(dout);
    free(in), free(w), free(tail), free(tail_ref), free(ref), free(got), free(tail_got);
}

static void check_kda_gate(ds_cu *c, int T, int H, int dk, int lb_form) {
    size_t n = (size_t)T * H * dk;
    float *f = rand_f32(n, -8, 8), *A = rand_f32((size_t)H, -2, 1),
          *b = rand_f32((size_t)H * dk, -1, 1);
    float *ref = malloc(n * 4), *got = malloc(n * 4);
    ds_kda_gate(ref, f, T, H, dk, A, b, lb_form, -5.0f);
    float *df = dev(c, f, n * 4), *dA = dev(c, A, (size_t)H * 4),
          *db = dev(c, b, (size_t)H * dk * 4);
    float *dg = dev(c, NULL, n * 4);
    /* beta from strided raw values in the same launch: bi [T][H + 3], columns [1, 1 + H) */
    const int ldb = H + 3;
    float *bi = rand_f32((size_t)T * ldb, -6, 6), *bref = malloc((size_t)T * H * 4),
          *bgot = malloc((size_t)T * H * 4);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) bref[t * H + h] = 1.0f / (1.0f + expf(-bi[t * ldb + 1 + h]));
    float *dbi = dev(c, bi, (size_t)T * ldb * 4), *dbeta = dev(c, NULL, (size_t)T * H * 4);
    poison(c, dg, n * 4);
    poison(c, dbeta, (size_t)T * H * 4);
    ds_cu_kda_gate(c, dg, df, T, H, dk, dA, db, lb_form, -5.0f, dbeta, dbi + 1, ldb);
    fetch(c, got, dg, n * 4);
    fetch(c, bgot, dbeta, (size_t)T * H * 4);
    char what[96];
    snprintf(what, sizeof what, "kda gate T=%d H=%d dk=%d (%s)", T, H, dk,
             lb_form ? "lower bound" : "softplus");
    report(what, rel_err(got, ref, 1, n, n), 1e-5);
    snprintf(what, sizeof what, "kda gate T=%d H=%d: beta", T, H);
    report(what, rel_err(bgot, bref, 1, (size_t)T * H, (size_t)T * H), 1e-6);
    ds_cu_dealloc(df), ds_cu_dealloc(dA), ds_cu_dealloc(db), ds_cu_dealloc(dg);
    ds_cu_dealloc(dbi), ds_cu_dealloc(dbeta);
    free(f), free(A), free(b), free(ref), free(got), free(bi), free(bref), free(bgot);
}

static void check_head_norms(ds_cu *c, int T, int H, int d) {
    size_t n = (size_t)T * H * d;
    float *x = rand_f32(n, -3, 3), *gate = rand_f32(n, -4, 4), *w = rand_f32((size_t)d, 0.5f, 1.5f);
    float *ref = malloc(n * 4), *got = malloc(n * 4);
    memcpy(ref, x, n * 4);
    ds_l2norm_heads(ref, T, H, d, 1e-6f, 0.125f);
    float *dx = dev(c, x, n * 4);
    ds_cu_l2norm_heads(c, dx, T, H, d, 1e-6f, 0.125f);
    fetch(c, got, dx, n * 4);
    char what[96];
    snprintf(what, sizeof what, "l2norm heads T=%d H=%d d=%d", T, H, d);
    report(what, rel_err(got, ref, 1, n, n), 1e-5);
    { /* two arrays, two scales, one launch: the second is gate, at scale 1 */
        float *ref2 = malloc(n * 4), *got2 = malloc(n * 4);
        memcpy(ref2, gate, n * 4);
        ds_l2norm_heads(ref2, T, H, d, 1e-6f, 1.0f);
        float *dx2 = dev(c, gate, n * 4);
        ds_cu_upload(c, dx, x, n * 4, NULL);
        ds_cu_l2norm_heads2(c, dx, 0.125f, dx2, 1.0f, T, H, d, 1e-6f);
        fetch(c, got, dx, n * 4);
        fetch(c, got2, dx2, n * 4);
        snprintf(what, sizeof what, "l2norm heads x2 T=%d H=%d d=%d", T, H, d);
        report(what, DS_MAX(rel_err(got, ref, 1, n, n), rel_err(got2, ref2, 1, n, n)), 1e-5);
        ds_cu_dealloc(dx2);
        free(ref2), free(got2);
    }
    ds_gated_rmsnorm_heads(ref, x, gate, w, T, H, d, 1e-5f);
    float *dg = dev(c, gate, n * 4), *dw = dev(c, w, (size_t)d * 4), *dy = dev(c, NULL, n * 4);
    ds_cu_upload(c, dx, x, n * 4, NULL);
    poison(c, dy, n * 4);
    ds_cu_gated_rmsnorm_heads(c, dy, dx, dg, dw, T, H, d, 1e-5f);
    fetch(c, got, dy, n * 4);
    snprintf(what, sizeof what, "gated rmsnorm heads T=%d H=%d d=%d", T, H, d);
    report(what, rel_err(got, ref, 1, n, n), 1e-5);
    ds_cu_dealloc(dx), ds_cu_dealloc(dg), ds_cu_dealloc(dw), ds_cu_dealloc(dy);
    free(x), free(gate), free(w), free(ref), free(got);
}

static void check_attnres(ds_cu *c, int m, int T, int D) {
    float *h[8], *dh[8];
    for (int j = 0; j < m; j++) {
        h[j] = rand_f32((size_t)T * D, -2, 2);
        dh[j] = dev(c, h[j], (size_t)T * D * 4);
    }
    float *np = rand_f32((size_t)D, -0.05f, 0.05f);
    float *ref = malloc((size_t)T * D * 4), *got = malloc((size_t)T * D * 4);
    ds_attnres_mix(ref, (const float *const *)h, m, np, T, D, 1e-6f);
    float *dnp = dev(c, np, (size_t)D * 4), *dout = dev(c, NULL, (size_t)T * D * 4);
    float **dptr = dev(c, dh, (size_t)m * sizeof *dh);
    poison(c, dout, (size_t)T * D * 4);
    ds_err err = {{0}};
    if (ds_cu_attnres_mix(c, dout, (const float *const *)dptr, m, dnp, T, D, 1e-6f, &err))
        DIE("%s", err.msg);
    fetch(c, got, dout, (size_t)T * D * 4);
    char what[96];
    snprintf(what, sizeof what, "attnres mix m=%d T=%d D=%d", m, T, D);
    report(what, rel_err(got, ref, 1, (size_t)T * D, (size_t)T * D), 1e-5);
    for (int j = 0; j < m; j++) ds_cu_dealloc(dh[j]), free(h[j]);
    ds_cu_dealloc(dnp), ds_cu_dealloc(dout), ds_cu_dealloc(dptr);
    free(np), free(ref), free(got);
}

/* Absorbed MLA over a paged pool whose block table is shuffled (pages out of order). */
static void check_mla(ds_cu *c, int T, int Ha, int R, int dr, int pos0, int n_ctx, int causal) {
    enum { BS = 16 };
    int rowf = R + dr, n_rows = n_ctx, n_pages = n_rows / BS + 2;
    float *pool = rand_f32((size_t)n_pages * BS * rowf, -1, 1);
    int32_t *table = malloc((size_t)n_pages * 4);
    for (int i = 0; i < n_pages; i++) table[i] = (int32_t)((i * 7 + 3) % n_pages);
    float *qbar = rand_f32((size_t)T * Ha * R, -0.2f, 0.2f),
          *qr = rand_f32((size_t)T * Ha * dr, -1, 1);
    float *ref = malloc((size_t)T * Ha * R * 4), *got = malloc((size_t)T * Ha * R * 4);
    ds_latent_view kv = {pool, table, BS, rowf};
    float scale = 1.0f / sqrtf(192.0f);
    ds_mla_attend_absorbed(ref, qbar, qr, T, Ha, R, dr, &kv, pos0, n_ctx, causal, scale);
    float *dpool = dev(c, pool, (size_t)n_pages * BS * rowf * 4);
    int32_t *dtable = dev(c, table, (size_t)n_pages * 4);
    float *dq = dev(c, qbar, (size_t)T * Ha * R * 4), *dqr = dev(c, qr, (size_t)T * Ha * dr * 4);
    float *dout = dev(c, NULL, (size_t)T * Ha * R * 4);
    poison(c, dout, (size_t)T * Ha * R * 4);
    ds_err err = {{0}};
    if (ds_cu_mla_attend_absorbed(c, dout, dq, dqr, T, Ha, R, dr, dpool, dtable, BS, rowf, pos0,
                                  n_ctx, causal, scale, &err))
        DIE("%s", err.msg);
    fetch(c, got, dout, (size_t)T * Ha * R * 4);
    char what[96];
    snprintf(what, sizeof what, "mla absorbed T=%d Ha=%d R=%d %s %d", T, Ha, R,
             causal ? "causal from" : "context", causal ? pos0 : n_ctx);
    report(what, rel_err(got, ref, 1, (size_t)T * Ha * R, (size_t)T * Ha * R), 1e-5);
    ds_cu_dealloc(dpool), ds_cu_dealloc(dtable), ds_cu_dealloc(dq), ds_cu_dealloc(dqr);
    ds_cu_dealloc(dout);
    free(pool), free(table), free(qbar), free(qr), free(ref), free(got);
}

/* A pitched copy (rows x width out of rows of lds into rows of ldd), exact. */
static void check_copy_2d(ds_cu *c, size_t rows, size_t width, size_t lds, size_t ldd) {
    float *src = rand_f32(rows * lds, -1, 1), *got = malloc(rows * ldd * 4);
    float *ref = rand_f32(rows * ldd, -1, 1); /* what lies between the rows stays */
    float *ds = dev(c, src, rows * lds * 4), *dd = dev(c, ref, rows * ldd * 4);
    for (size_t r = 0; r < rows; r++) memcpy(ref + r * ldd, src + r * lds + 3, width * 4);
    ds_err err = {{0}};
    if (ds_cu_copy_2d(c, dd, ldd, ds + 3, lds, width, rows, &err)) DIE("%s", err.msg);
    fetch(c, got, dd, rows * ldd * 4);
    char what[96];
    snprintf(what, sizeof what, "copy 2d %zu x %zu (pitches %zu, %zu)", rows, width, lds, ldd);
    report(what, memcmp(got, ref, rows * ldd * 4) ? INFINITY : 0.0, 0);
    ds_cu_dealloc(ds), ds_cu_dealloc(dd);
    free(src), free(got), free(ref);
}

/* Every segment of a step in one launch, each on its own tail; the segments with rollback rows get
 * the tail after each token (the CPU reference runs token by token and copies its tail). */
static void check_short_conv_batch(ds_cu *c, const int *lens, const int *want_rows, int n_seq,
                                   int C, int W) {
    int T = 0, off[17];
    for (int z = 0; z < n_seq; z++) off[z] = T, T += lens[z];
    off[n_seq] = T;
    size_t tn = (size_t)(W - 1) * C;
    float *in = rand_f32((size_t)T * C, -2, 2), *w = rand_f32((size_t)C * W, -1, 1);
    float *tails = rand_f32((size_t)n_seq * tn, -2, 2), *tails_ref = malloc((size_t)n_seq * tn * 4);
    memcpy(tails_ref, tails, (size_t)n_seq * tn * 4);
    float *ref = malloc((size_t)T * C * 4), *got = malloc((size_t)T * C * 4);
    float *rows_ref = calloc((size_t)T * tn, 4), *rows_got = malloc((size_t)T * tn * 4);
    for (int z = 0; z < n_seq; z++)
        for (int t = off[z]; t < off[z + 1]; t++) {
            ds_short_conv_silu(ref + (size_t)t * C, in + (size_t)t * C, 1, C, w, W,
                               tails_ref + (size_t)z * tn);
            memcpy(rows_ref + (size_t)t * tn, tails_ref + (size_t)z * tn, tn * 4);
        }
    float *din = dev(c, in, (size_t)T * C * 4), *dw = dev(c, w, (size_t)C * W * 4);
    float *dtails = dev(c, tails, (size_t)n_seq * tn * 4), *dout = dev(c, NULL, (size_t)T * C * 4);
    float *drows = dev(c, NULL, (size_t)T * tn * 4);
    poison(c, dout, (size_t)T * C * 4);
    poison(c, drows, (size_t)T * tn * 4);
    float *tp[16], *rp[16];
    for (int z = 0; z < n_seq; z++) {
        tp[z] = dtails + (size_t)z * tn;
        rp[z] = want_rows[z] ? drows + (size_t)off[z] * tn : NULL;
    }
    float **dtp = dev(c, tp, sizeof(float *) * n_seq), **drp = dev(c, rp, sizeof(float *) * n_seq);
    int32_t *doff = dev(c, off, sizeof(int32_t) * (n_seq + 1));
    ds_err err = {{0}};
    ds_cu_conv_batch cb = {1, C, W, din, C, dout, 0, dw, dtp, drp, tn, doff, n_seq, T};
    if (ds_cu_short_conv_silu_batch(c, &cb, &err)) DIE("%s", err.msg);
    fetch(c, got, dout, (size_t)T * C * 4);
    fetch(c, tails, dtails, (size_t)n_seq * tn * 4);
    fetch(c, rows_got, drows, (size_t)T * tn * 4);
    char what[96];
    snprintf(what, sizeof what, "short conv batch %d seqs C=%d: out", n_seq, C);
    report(what, rel_err(got, ref, 1, (size_t)T * C, (size_t)T * C), 1e-5);
    snprintf(what, sizeof what, "short conv batch %d seqs C=%d: tails", n_seq, C);
    report(what, rel_err(tails, tails_ref, 1, (size_t)n_seq * tn, (size_t)n_seq * tn), 1e-6);
    report_seq_rows("short conv batch", rows_got, rows_ref, off, lens, want_rows, n_seq, tn, 1e-6);
    ds_cu_dealloc(din), ds_cu_dealloc(dw), ds_cu_dealloc(dtails), ds_cu_dealloc(dout);
    ds_cu_dealloc(drows), ds_cu_dealloc(dtp), ds_cu_dealloc(drp), ds_cu_dealloc(doff);
    free(in), free(w), free(tails), free(tails_ref), free(ref), free(got), free(rows_ref);
    free(rows_got);
}

/* Bits that differ between two device results of n floats (words compared, NaN bytes too). */
static size_t words_differ(const float *a, const float *b, size_t n) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += memcmp(&a[i], &b[i], 4) != 0;
    return bad;
}

/* The fused KDA decode (ds_cu_kda_decode_fused) against the seven launches it stands in for —
 * convs, head norms, f_b's and g_b's matmuls (streamed, as at one token or in the
 * batch-invariant mode), gate and beta, recurrence, gated output norm — on the same inputs:
 * outputs, states and tails bit for bit (the seven are each checked against the CPU above). */
static void check_kda_decode_fused(ds_cu *c, int n_seq, int H, int Kf, int Kg, int lb_form) {
    const int dk = 128, W = 4, P = H * dk, nf = Kf + Kg, ld = 3 * P + nf + H;
    const size_t npre = (size_t)n_seq * ld, ns = (size_t)H * dk * dk, tn = (size_t)(W - 1) * P;
    const size_t nt = (size_t)n_seq * 3 * tn, nS = ns * n_seq, no = (size_t)n_seq * P;
    if (n_seq > 64) DIE("check_kda_decode_fused: at most 64 sequences");
    float *pre = rand_f32(npre, -2, 2), *cw = rand_f32((size_t)3 * P * W, -1, 1);
    float *tails = rand_f32(nt, -2, 2), *S0 = rand_f32(nS, -0.5f, 0.5f);
    uint16_t *fb = rand_bf16((size_t)P * Kf, -0.3f, 0.3f);
    uint16_t *gb = rand_bf16((size_t)P * Kg, -0.3f, 0.3f);
    float *A = rand_f32((size_t)H, -1, 1), *bias = rand_f32((size_t)P, -1, 1);
    float *nw = rand_f32((size_t)dk, 0.5f, 1.5f);
    float *dpre = dev(c, pre, npre * 4), *dcw = dev(c, cw, (size_t)3 * P * W * 4);
    uint16_t *dfb = dev(c, fb, (size_t)P * Kf * 2), *dgb = dev(c, gb, (size_t)P * Kg * 2);
    float *dA = dev(c, A, (size_t)H * 4), *dbias = dev(c, bias, (size_t)P * 4);
    float *dnw = dev(c, nw, (size_t)dk * 4);
    float *dqkv = dev(c, NULL, 3 * no * 4), *df = dev(c, NULL, no * 4), *dg = dev(c, NULL, no * 4);
    float *dgt = dev(c, NULL, no * 4), *dbeta = dev(c, NULL, (size_t)n_seq * H * 4);
    /* [2]: the seven launches' run, the fused one's; each from the same tails and states */
    float *dt[2], *dS[2], *dy[2], *got_y[2], *got_S[2], *got_t[2];
    float **dtp[2], **dsp[2];
    int32_t off[65];
    for (int z = 0; z <= n_seq; z++) off[z] = z;
    int32_t *doff = dev(c, off, (size_t)(n_seq + 1) * 4);
    for (int r = 0; r < 2; r++) {
        dt[r] = dev(c, tails, nt * 4), dS[r] = dev(c, S0, nS * 4), dy[r] = dev(c, NULL, no * 4);
        poison(c, dy[r], no * 4);
        float *tp[64], *sp[64];
        for (int z = 0; z < n_seq; z++) tp[z] = dt[r] + (size_t)z * 3 * tn, sp[z] = dS[r] + z * ns;
        dtp[r] = dev(c, tp, (size_t)n_seq * sizeof *tp);
        dsp[r] = dev(c, sp, (size_t)n_seq * sizeof *sp);
        got_y[r] = malloc(no * 4), got_S[r] = malloc(nS * 4), got_t[r] = malloc(nt * 4);
    }
    ds_err err = {{0}};
    const float qs = 1.0f / sqrtf((float)dk), lb = -5.0f, neps = 1e-5f;
    ds_cu_set_batch_invariant(c, 1); /* matmuls streamed at every batch, as the fused kernel sums */
    ds_cu_conv_batch cb = {3, P, W, dpre, ld, dqkv, no, dcw, dtp[0], NULL, 0, doff, n_seq, n_seq};
    const ds_cu_mat mf = {dfb, P, Kf}, mg = {dgb, P, Kg};
    if (ds_cu_short_conv_silu_batch(c, &cb, &err)) DIE("%s", err.msg);
    ds_cu_l2norm_heads2(c, dqkv, qs, dqkv + no, 1.0f, n_seq, H, dk, 1e-6f);
    if (ds_cu_matmul(c, df, P, dpre + 3 * P, ld, n_seq, &mf, &err) ||
        ds_cu_matmul(c, dgt, P, dpre + 3 * P + Kf, ld, n_seq, &mg, &err))
        DIE("%s", err.msg);
    ds_cu_kda_gate(c, dg, df, n_seq, H, dk, dA, dbias, lb_form, lb, dbeta, dpre + 3 * P + nf, ld);
    if (ds_cu_kda_recurrent_batch(c, df, dqkv, dqkv + no, dqkv + 2 * no, dg, dbeta, doff, dsp[0],
                                  NULL, 0, n_seq, H, dk, dk, 0, &err))
        DIE("%s", err.msg);
    ds_cu_gated_rmsnorm_heads(c, dy[0], df, dgt, dnw, n_seq, H, dk, neps);
    ds_cu_set_batch_invariant(c, 0);
    const ds_cu_kda_decode kd = {.pre = dpre,
                                 .ld = ld,
                                 .fa_off = 3 * P,
                                 .ga_off = 3 * P + Kf,
                                 .b_off = 3 * P + nf,
                                 .conv_w = dcw,
                                 .tails = dtp[1],
                                 .f_b = dfb,
                                 .g_b = dgb,
                                 .Kf = Kf,
                                 .Kg = Kg,
                                 .A_log = dA,
                                 .dt_bias = dbias,
                                 .o_norm = dnw,
                                 .lower_bound_form = lb_form,
                                 .lb = lb,
                                 .q_scale = qs,
                                 .eps = 1e-6f,
                                 .norm_eps = neps,
                                 .S = dsp[1],
                                 .y = dy[1],
                                 .n_seq = n_seq,
                                 .H = H,
                                 .dk = dk,
                                 .W = W};
    if (ds_cu_kda_decode_fused(c, &kd, &err)) DIE("%s", err.msg);
    for (int r = 0; r < 2; r++) {
        fetch(c, got_y[r], dy[r], no * 4);
        fetch(c, got_S[r], dS[r], nS * 4);
        fetch(c, got_t[r], dt[r], nt * 4);
    }
    const size_t by = words_differ(got_y[1], got_y[0], no);
    const size_t bS = words_differ(got_S[1], got_S[0], nS),
                 bt = words_differ(got_t[1], got_t[0], nt);
    char what[128];
    snprintf(what, sizeof what,
             "kda decode fused %d seqs H=%d Kf=%d Kg=%d lb=%d (%zu/%zu/%zu differ)", n_seq, H, Kf,
             Kg, lb_form, by, bS, bt);
    report(what, by || bS || bt ? INFINITY : 0.0, 0.0);
    /* both runs written (poisoned outputs would agree too), the states and tails moved */
    size_t nan = 0;
    for (size_t i = 0; i < no; i++) nan += isnan(got_y[1][i]) || isnan(got_y[0][i]);
    const size_t still = nS - words_differ(got_S[1], S0, nS);
    const size_t tstill = nt - words_differ(got_t[1], tails, nt);
    snprintf(what, sizeof what, "kda decode fused: %zu NaN, %zu states, %zu tails unmoved", nan,
             still, tstill);
    report(what, nan || still > nS / 2 || tstill > nt / 2 ? INFINITY : 0.0, 0.0);
    for (int r = 0; r < 2; r++) {
        ds_cu_dealloc(dt[r]), ds_cu_dealloc(dS[r]), ds_cu_dealloc(dy[r]);
        ds_cu_dealloc(dtp[r]), ds_cu_dealloc(dsp[r]);
        free(got_y[r]), free(got_S[r]), free(got_t[r]);
    }
    ds_cu_dealloc(dpre), ds_cu_dealloc(dcw), ds_cu_dealloc(dfb), ds_cu_dealloc(dgb);
    ds_cu_dealloc(dA), ds_cu_dealloc(dbias), ds_cu_dealloc(dnw), ds_cu_dealloc(dqkv);
    ds_cu_dealloc(df), ds_cu_dealloc(dg), ds_cu_dealloc(dgt), ds_cu_dealloc(dbeta);
    ds_cu_dealloc(doff);
    free(pre), free(cw), free(tails), free(S0), free(fb), free(gb), free(A), free(bias), free(nw);
}

/* Absorbed MLA for several sequences' tokens in one launch, each against its own block table and
 * positions, against the CPU one sequence at a time. */
/* all_heads: a block per token for every head (each latent row read once): 2 always, 1 when the
 * step fills the GPU (ds_cu_set_mla_all_heads). */
static void check_mla_batch(ds_cu *c, const int *lens, const int *pos0, int n_seq, int Ha, int R,
                            int dr, int all_heads) {
    enum { BS = 16 };
    int rowf = R + dr, T = 0, max_ctx = 0, pages = 0, bt_off[256], tok_bt[512], tok_pos[512];
    for (int z = 0; z < n_seq; z++) {
        int ctx = pos0[z] + lens[z];
        bt_off[z] = pages;
        pages += (ctx + BS - 1) / BS;
        max_ctx = DS_MAX(max_ctx, ctx);
        for (int t = 0; t < lens[z]; t++) tok_bt[T + t] = bt_off[z], tok_pos[T + t] = pos0[z] + t;
        T += lens[z];
    }
    int32_t *tables = malloc((size_t)pages * 4); /* a scrambled permutation of the pool's pages */
    for (int i = 0; i < pages; i++) tables[i] = (int32_t)((i * 7 + 3) % pages);
    float *pool = rand_f32((size_t)pages * BS * rowf, -1, 1);
    float *qbar = rand_f32((size_t)T * Ha * R, -0.2f, 0.2f),
          *qr = rand_f32((size_t)T * Ha * dr, -1, 1);
    float *ref = malloc((size_t)T * Ha * R * 4), *got = malloc((size_t)T * Ha * R * 4);
    float scale = 1.0f / sqrtf(192.0f);
    for (int z = 0, t0 = 0; z < n_seq; t0 += lens[z], z++) {
        ds_latent_view kv = {pool, tables + bt_off[z], BS, rowf};
        size_t at = (size_t)t0 * Ha;
        ds_mla_attend_absorbed(ref + at * R, qbar + at * R, qr + at * dr, lens[z], Ha, R, dr, &kv,
                               pos0[z], pos0[z] + lens[z], 1, scale);
    }
    float *dpool = dev(c, pool, (size_t)pages * BS * rowf * 4);
    int32_t *dtables = dev(c, tables, (size_t)pages * 4), *dbt = dev(c, tok_bt, (size_t)T * 4);
    int32_t *dpos = dev(c, tok_pos, (size_t)T * 4);
    /* the rope parts on the device at a wider stride, as the model passes them (read in place
     * from the full query rows) */
    const int ldqr = dr + 12;
    float *qrs = calloc((size_t)T * Ha * ldqr, 4); /* [T][Ha][ldqr] */
    for (size_t i = 0; i < (size_t)T * Ha; i++) memcpy(qrs + i * ldqr, qr + i * dr, (size_t)dr * 4);
    float *dq = dev(c, qbar, (size_t)T * Ha * R * 4), *dqr = dev(c, qrs, (size_t)T * Ha * ldqr * 4);
    float *dout = dev(c, NULL, (size_t)T * Ha * R * 4);
    poison(c, dout, (size_t)T * Ha * R * 4);
    ds_err err = {{0}};
    ds_cu_set_mla_all_heads(c, all_heads);
    if (ds_cu_mla_attend_absorbed_batch(c, dout, dq, dqr, ldqr, T, Ha, R, dr, dpool, dtables, dbt,
                                        dpos, max_ctx, BS, rowf, scale, &err))
        DIE("%s", err.msg);
    ds_cu_set_mla_all_heads(c, 0);
    fetch(c, got, dout, (size_t)T * Ha * R * 4);
    char what[96];
    snprintf(what, sizeof what, "mla absorbed batch %d seqs Ha=%d R=%d%s", n_seq, Ha, R,
             all_heads ? " (all heads)" : "");
    report(what, rel_err(got, ref, 1, (size_t)T * Ha * R, (size_t)T * Ha * R), 1e-5);
    ds_cu_dealloc(dpool), ds_cu_dealloc(dtables), ds_cu_dealloc(dbt), ds_cu_dealloc(dpos);
    ds_cu_dealloc(dq), ds_cu_dealloc(dqr), ds_cu_dealloc(dout);
    free(tables), free(pool), free(qbar), free(qr), free(qrs), free(ref), free(got);
}

/* Router: the same experts (exactly) and weights (to f32 rounding) as the CPU, token by token;
 * ties are made likely by quantising the logits. */
static void check_moe_route(ds_cu *c, int T, int E, int k, int n_group, int topk_group, int quirk,
                            int ties) {
    float *z = rand_f32((size_t)T * E, -4, 4), *bias = rand_f32((size_t)E, -0.1f, 0.1f);
    if (ties)
        for (size_t i = 0; i < (size_t)T * E; i++) z[i] = roundf(z[i]);
    int32_t *iref = malloc((size_t)T * k * 4), *igot = malloc((size_t)T * k * 4);
    float *wref = malloc((size_t)T * k * 4), *wgot = malloc((size_t)T * k * 4);
    for (int t = 0; t < T; t++)
        ds_moe_route(iref + (size_t)t * k, wref + (size_t)t * k, z + (size_t)t * E,
                     ties ? NULL : bias, E, k, n_group, topk_group, 1, 2.5f, quirk);
    float *dz = dev(c, z, (size_t)T * E * 4), *db = dev(c, bias, (size_t)E * 4);
    int32_t *di = dev(c, NULL, (size_t)T * k * 4);
    float *dw = dev(c, NULL, (size_t)T * k * 4);
    poison(c, dw, (size_t)T * k * 4);
    ds_err err = {{0}};
    if (ds_cu_moe_route(c, di, dw, dz, ties ? NULL : db, T, E, k, n_group, topk_group, 1, 2.5f,
                        quirk, &err))
        DIE("%s", err.msg);
    fetch(c, igot, di, (size_t)T * k * 4);
    fetch(c, wgot, dw, (size_t)T * k * 4);
    int same = !memcmp(igot, iref, (size_t)T * k * 4);
    char what[96];
    snprintf(what, sizeof what, "moe route T=%d E=%d k=%d groups %d/%d%s%s: weights", T, E, k,
             topk_group, n_group, quirk ? " quirk" : "", ties ? " ties" : "");
    report(what, same ? rel_err(wgot, wref, 1, (size_t)T * k, (size_t)T * k) : INFINITY, 1e-6);
    if (!same) printf("       (expert ids differ from the CPU's)\n");
    ds_cu_dealloc(dz), ds_cu_dealloc(db), ds_cu_dealloc(di), ds_cu_dealloc(dw);
    free(z), free(bias), free(iref), free(igot), free(wref), free(wgot);
}

/* Routed experts against the CPU composed from its own kernels: per (token, slot) the expert's
 * gate and up rows (ds_matmul on BF16), the activation, the down projection, then the weighted
 * sum in slot order. */
/* gemm: the tensor-core path for long steps (activations in BF16: held to 1e-2). half: this rank
 * holds experts [E/2, E) only, as under tensor parallelism: rows routed to the others add
 * nothing. */
static void check_moe_experts_mode(ds_cu *c, int T, int k, int E, int D, int I, int situ, int gemm,
                                   int half) {
    const int e0 = half ? E / 2 : 0, El = E - e0;
    uint16_t *gu = rand_bf16((size_t)E * 2 * I * D, -0.1f, 0.1f);
    uint16_t *dn = rand_bf16((size_t)E * D * I, -0.1f, 0.1f);
    float *x = rand_f32((size_t)T * D, -1, 1), *w = rand_f32((size_t)T * k, 0, 1);
    float *base = rand_f32((size_t)T * D, -1, 1);
    int32_t *idx = malloc((size_t)T * k * 4);
    for (int i = 0; i < T * k; i++) idx[i] = (int32_t)(ds_rng_next(&g_rng) % (uint64_t)E);
    if (gemm == 2) /* skewed: most rows on one local expert (the per-expert GEMM fallback) */
        for (int i = 0; i < T * k; i += 3) idx[i] = e0;
    float *ref = malloc((size_t)T * D * 4), *got = malloc((size_t)T * D * 4);
    float *hgu = malloc((size_t)2 * I * 4), *a = malloc((size_t)I * 4), *yr = malloc((size_t)D * 4);
    for (int t = 0; t < T; t++) {
        float *o = ref + (size_t)t * D;
        for (int d = 0; d < D; d++) o[d] = 0.0f;
        for (int j = 0; j < k; j++) {
            int e = idx[t * k + j];
            if (e < e0) continue; /* another rank's */
            ds_mat mgu = {gu + (size_t)e * 2 * I * D, DS_DT_BF16, 2 * I, D};
            ds_mat mdn = {dn + (size_t)e * D * I, DS_DT_BF16, D, I};
            ds_matmul(hgu, 2 * I, x + (size_t)t * D, D, 1, &mgu);
            if (situ)
                ds_act_situ(a, hgu, hgu + I, (size_t)I, 4.0f, 6.0f);
            else
                ds_act_swiglu(a, hgu, hgu + I, (size_t)I);
            ds_matmul(yr, D, a, I, 1, &mdn);
            for (int d = 0; d < D; d++) o[d] += w[t * k + j] * yr[d];
        }
        for (int d = 0; d < D; d++) o[d] += base[(size_t)t * D + d]; /* accumulate mode */
    }
    uint16_t *dgu = dev(c, gu + (size_t)e0 * 2 * I * D, (size_t)El * 2 * I * D * 2);
    uint16_t *ddn = dev(c, dn + (size_t)e0 * D * I, (size_t)El * D * I * 2);
    float *dx = dev(c, x, (size_t)T * D * 4), *dw = dev(c, w, (size_t)T * k * 4);
    float *dout = dev(c, base, (size_t)T * D * 4);
    int32_t *didx = dev(c, idx, (size_t)T * k * 4);
    ds_err err = {{0}};
    ds_cu_set_expert_gemm(c, gemm == 1 || gemm == 2);
    ds_cu_set_expert_mma(c, gemm >= 3);
    ds_cu_set_expert_tc(c, gemm == 4);
    ds_cu_set_expert_mma_min(c, gemm >= 3 ? 16 : 0); /* (the engine's is 40 tokens) */
    if (ds_cu_moe_experts(c, dout, dx, didx, dw, T, k, El, e0, D, I, dgu, ddn, situ, 4.0f, 6.0f, 1,
                          &err))
        DIE("%s", err.msg);
    ds_cu_set_expert_gemm(c, 0);
    ds_cu_set_expert_mma(c, 0);
    ds_cu_set_expert_tc(c, 0);
    ds_cu_set_expert_mma_min(c, 0);
    fetch(c, got, dout, (size_t)T * D * 4);
    char what[160];
    snprintf(what, sizeof what, "moe experts T=%d k=%d E=%d D=%d I=%d %s%s%s", T, k, E, D, I,
             situ ? "situ" : "swiglu",
             gemm == 4   ? " (tensor cores, streaming)"
             : gemm == 3 ? " (tensor cores)"
             : gemm == 2 ? " (gemm, skewed)"
             : gemm      ? " (gemm)"
                         : "",
             half ? " (half the experts)" : "");
    report(what, rel_err(got, ref, 1, (size_t)T * D, (size_t)T * D), gemm ? 1e-2 : 1e-5);
    ds_cu_dealloc(dgu), ds_cu_dealloc(ddn), ds_cu_dealloc(dx), ds_cu_dealloc(dw);
    ds_cu_dealloc(dout), ds_cu_dealloc(didx);
    free(gu), free(dn), free(x), free(w), free(base), free(idx), free(ref), free(got);
    free(hgu), free(a), free(yr);
}

static void check_moe_experts(ds_cu *c, int T, int k, int E, int D, int I, int situ) {
    check_moe_experts_mode(c, T, k, E, D, I, situ, 0, 0);
}

/* Greedy choice of every row, ties and NaN included, exactly as the CPU. */
#ifdef DS_HAVE_NCCL
/* The NCCL binding on one GPU: a group of one rank joins, and its sum of a buffer on the
 * backend's stream is the buffer, bit for bit (the sum between GPUs needs two of them:
 * tools/device/cuda_pp_check.sh on nvidia-h200-x2). */
static void check_nccl_one_rank(ds_cu *c) {
    unsigned char id[DS_NCCL_ID_BYTES];
    ds_nccl *n = NULL;
    ds_err err = {{0}};
    if (ds_nccl_unique_id(id, &err) || ds_nccl_init(&n, id, 1, 0, 0, &err)) DIE("%s", err.msg);
    const size_t len = 100003;
    float *x = rand_f32(len, -3, 3), *got = malloc(len * 4);
    float *d = dev(c, x, len * 4);
    if (ds_nccl_allreduce_sum(n, d, len, ds_cu_stream(c), &err) || ds_cu_sync(c, &err))
        DIE("%s", err.msg);
    fetch(c, got, d, len * 4);
    report("nccl one rank: all-reduce is the identity", rel_err(got, x, 1, len, len), 0.0);
    ds_nccl_free(n);
    ds_cu_dealloc(d);
    free(x), free(got);
}
#endif

/* RoPE on strided rows, `per` rows sharing a rotation (the draft's queries: every head of a token),
 * against the CPU draft's formula (whether this compiler fuses its products decides the last bit,
 * so within 1e-6). */
static void check_rope(ds_cu *c, int rows, int ldx, int per, int half) {
    float *x = rand_f32((size_t)rows * ldx, -2, 2), *cs = rand_f32((size_t)rows * half * 2, -1, 1);
    float *ref = malloc((size_t)rows * ldx * 4), *got = malloc((size_t)rows * ldx * 4);
    memcpy(ref, x, (size_t)rows * ldx * 4);
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < half; i++) {
            float *xr = ref + (size_t)r * ldx;
            const float *p = cs + ((size_t)(r / per) * half + i) * 2;
            float a = xr[2 * i], b = xr[2 * i + 1];
            float ac = a * p[0], bs = b * p[1], as = a * p[1], bc = b * p[0];
            xr[2 * i] = ac - bs;
            xr[2 * i + 1] = as + bc;
        }
    float *dx = dev(c, x, (size_t)rows * ldx * 4), *dcs = dev(c, cs, (size_t)rows * half * 2 * 4);
    ds_err err = {{0}};
    if (ds_cu_rope_pairs(c, dx, ldx, rows, per, dcs, half, &err)) DIE("%s", err.msg);
    fetch(c, got, dx, (size_t)rows * ldx * 4);
    char what[96];
    snprintf(what, sizeof what, "rope rows=%d ld=%d per=%d half=%d", rows, ldx, per, half);
    report(what, rel_err(got, ref, (size_t)rows, (size_t)ldx, (size_t)ldx), 1e-6);
    ds_cu_dealloc(dx), ds_cu_dealloc(dcs);
    free(x), free(cs), free(ref), free(got);
}

static void check_argmax(ds_cu *c, int rows, int V, int parts) {
    float *x = rand_f32((size_t)rows * V, -5, 5);
    for (int r = 0; r < rows; r++) {
        float *xr = x + (size_t)r * V;
        if (r % 8 == 1) /* a tie: the same maximum at two places */
            xr[V / 3] = xr[2 * V / 3] = 9.0f;
        if (r % 8 == 2) /* NaN scattered in */
            for (int i = 0; i < V; i += 7) xr[i] = NAN;
        if (r % 8 == 4) /* -0 and +0 the largest: equal, so the first of them */
            for (int i = 0; i < V; i++)
                xr[i] = i == V / 2 ? -0.0f : i == V / 4 ? 0.0f : -xr[i] * xr[i] - 1;
        if (r % 8 == 5) /* -0 first, then +0 */
            for (int i = 0; i < V; i++) xr[i] = i == V / 5 ? -0.0f : i == V - 1 ? 0.0f : -1.0f;
        if (r % 8 == 6) /* all -inf but for NaN in front: the first -inf */
            for (int i = 0; i < V; i++) xr[i] = i < V / 3 ? NAN : -INFINITY;
        if (r % 8 == 7 && r == rows - 1) /* a row of NaN */
            for (int i = 0; i < V; i++) xr[i] = NAN;
    }
    int32_t *ref = malloc((size_t)rows * 4), *got = malloc((size_t)rows * 4);
    for (int r = 0; r < rows; r++) ref[r] = ds_argmax(x + (size_t)r * V, V);
    float *dx = dev(c, x, (size_t)rows * V * 4);
    if (!parts) parts = ds_cu_argmax_parts(rows, V);
    uint64_t *dkeys = dev(c, NULL, (size_t)rows * parts * 8),
             *keys = malloc((size_t)rows * parts * 8);
    ds_cu_argmax_rows(c, dkeys, dx, rows, V, parts);
    fetch(c, keys, dkeys, (size_t)rows * parts * 8);
    for (int r = 0; r < rows; r++) got[r] = ds_cu_argmax_token(keys + (size_t)r * parts, parts);
    int bad = 0;
    for (int r = 0; r < rows; r++) bad += got[r] != ref[r];
    char what[96];
    snprintf(what, sizeof what, "argmax rows=%d V=%d in %d parts (%d rows differ)", rows, V, parts,
             bad);
    report(what, bad ? INFINITY : 0.0, 0.0);
    ds_cu_dealloc(dx), ds_cu_dealloc(dkeys);
    free(x), free(ref), free(got), free(keys);
}

/* ---- draws: ds_cu_draw_rows against ds_sample_row, token for token ---- */

/* The parameters of draw i (a cycle of top-k, top-p, min-p, penalties, masks, greedy) and its
 * counts and mask (static storage of the caller). */
static ds_row_draw draw_case(int i, int V, double u, ds_token_count *counts, int32_t *mask) {
    ds_sample_params p;
    ds_sample_params_default(&p);
    const float temps[] = {1.0f, 0.8f, 1.3f, 0.05f, 2.0f, 0.0f};
    const float top_ps[] = {1.0f, 0.9f, 0.5f, 0.999f, 1.0f, 0.0f};
    const int top_ks[] = {0, 0, 40, 0, 300, 7, 1};
    p.temperature = temps[i % 6];
    p.top_p = top_ps[(i / 2) % 6];
    p.top_k = top_ks[(i / 3) % 7];
    p.min_p = i % 5 == 3 ? 0.05f : 0.0f;
    ds_row_draw d = {p, u, NULL, 0, NULL, 0};
    if (i % 4 == 1) { /* penalties over a few generated ids */
        d.p.presence_penalty = 0.5f;
        d.p.frequency_penalty = 0.25f;
        for (int j = 0; j < 6; j++) counts[j] = (ds_token_count){(j * 7919 + i) % V, 1 + j % 3};
        counts[6] = (ds_token_count){-1, 4}; /* an empty slot: skipped */
        d.counts = counts;
        d.n_counts = 7;
    }
    if (i % 3 == 2) { /* stops masked, one twice and one outside the vocabulary */
        mask[0] = (i * 31) % V, mask[1] = mask[0], mask[2] = V + 3, mask[3] = (i * 17 + 1) % V;
        d.mask = mask;
        d.n_mask = 4;
    }
    return d;
}

static void check_draws(ds_cu *c, int rows, int V) {
    ds_rng rng;
    ds_rng_seed(&rng, (uint64_t)rows * 131 + (uint64_t)V);
    size_t nx = (size_t)rows * V;
    float *x = malloc(nx * 4), *work = malloc((size_t)V * 4);
    for (int r = 0; r < rows; r++) draw_row_fill(x + (size_t)r * V, V, r % DRAW_ROW_SHAPES, &rng);
    ds_token_count(*counts)[8] = calloc((size_t)rows, sizeof *counts);
    int32_t(*mask)[4] = calloc((size_t)rows, sizeof *mask);
    ds_row_draw *d = malloc((size_t)rows * sizeof *d);
    ds_cu_draw *cd = malloc((size_t)rows * sizeof *cd);
    int32_t *ed = malloc((size_t)rows * 18 * 4), *got = malloc((size_t)rows * 4);
    int32_t *ref = malloc((size_t)rows * 4);
    const double ends[] = {0.0, 1.0 - 0x1p-53};
    size_t ne = 0;
    ds_err err = {{0}};
    ds_sample_scratch *sc = ds_sample_scratch_new(V, &err);
    for (int r = 0; r < rows; r++) {
        double u = r % 7 < 2 ? ends[r % 7] : ds_rng_uniform(&rng);
        d[r] = draw_case(r, V, u, counts[r], mask[r]);
        memcpy(work, x + (size_t)r * V, (size_t)V * 4);
        ref[r] = ds_sample_row(work, V, &d[r], sc);
        ne += ds_cuda_pack_draw(&d[r], V, r, ne, ed, &cd[r]); /* as the model packs them */
    }
    float *dx = dev(c, x, nx * 4);
    if (ds_cu_draw_rows(c, got, dx, (size_t)V, V, cd, rows, ed, ne, &err)) DIE("%s", err.msg);
    int bad = 0, first = -1;
    for (int r = 0; r < rows; r++)
        if (got[r] != ref[r] && bad++ == 0) first = r;
    char what[128];
    snprintf(what, sizeof what, "draws rows=%d V=%d (%d differ%s)", rows, V, bad,
             bad ? ", see below" : "");
    report(what, bad ? INFINITY : 0.0, 0.0);
    if (bad)
        printf("  first: row %d (shape %d, T %g, top_p %g, top_k %d, min_p %g, u %.17g): GPU %d, "
               "CPU %d\n",
               first, first % DRAW_ROW_SHAPES, d[first].p.temperature, d[first].p.top_p,
               d[first].p.top_k, d[first].p.min_p, d[first].u, got[first], ref[first]);
    ds_cu_dealloc(dx);
    ds_sample_scratch_free(sc);
    free(x), free(work), free(counts), free(mask), free(d), free(cd), free(ed), free(got);
    free(ref);
}

/* gemm: the tensor-core path for long segments (BF16 operands and probabilities: 2e-2). */
static void check_mla_expanded_mode(ds_cu *c, int T, int Ha, int dn, int dr, int dvh, int pos0,
                                    int n_ctx, int causal, int gemm) {
    size_t nq = (size_t)T * Ha * (dn + dr), nk = (size_t)n_ctx * Ha * dn, nr = (size_t)n_ctx * dr;
    size_t nv = (size_t)n_ctx * Ha * dvh, no = (size_t)T * Ha * dvh;
    float *q = rand_f32(nq, -0.3f, 0.3f), *kN = rand_f32(nk, -1, 1), *kR = rand_f32(nr, -1, 1);
    float *v = rand_f32(nv, -1, 1), *ref = malloc(no * 4), *got = malloc(no * 4);
    float scale = 1.0f / sqrtf((float)(dn + dr));
    ds_mla_attend_expanded(ref, q, kN, kR, v, T, n_ctx, Ha, dn, dr, dvh, pos0, causal, scale);
    float *dq = dev(c, q, nq * 4), *dkN = dev(c, kN, nk * 4), *dkR = dev(c, kR, nr * 4);
    float *dv_ = dev(c, v, nv * 4), *dout = dev(c, NULL, no * 4);
    poison(c, dout, no * 4);
    ds_err err = {{0}};
    ds_cu_set_mla_gemm(c, gemm != 0);
    ds_cu_set_mla_flash(c, gemm == 2); /* the fused kernel, where the head shape has one */
    if (ds_cu_mla_attend_expanded(c, dout, dq, dkN, dkR, dv_, T, n_ctx, Ha, dn, dr, dvh, pos0,
                                  causal, scale, &err))
        DIE("%s", err.msg);
    ds_cu_set_mla_gemm(c, 0);
    ds_cu_set_mla_flash(c, 0);
    fetch(c, got, dout, no * 4);
    char what[96];
    snprintf(what, sizeof what, "mla expanded T=%d Ha=%d ctx %d%s%s", T, Ha, n_ctx,
             causal ? " causal" : "",
             gemm == 2   ? " (fused)"
             : gemm == 1 ? " (gemm)"
                         : "");
    report(what, rel_err(got, ref, 1, no, no), gemm ? 2e-2 : 1e-5);
    ds_cu_dealloc(dq), ds_cu_dealloc(dkN), ds_cu_dealloc(dkR), ds_cu_dealloc(dv_);
    ds_cu_dealloc(dout);
    free(q), free(kN), free(kR), free(v), free(ref), free(got);
}

static void check_mla_expanded(ds_cu *c, int T, int Ha, int dn, int dr, int dvh, int pos0,
                               int n_ctx, int causal) {
    check_mla_expanded_mode(c, T, Ha, dn, dr, dvh, pos0, n_ctx, causal, 0);
}

/* ---- timings -------------------------------------------------------------------------------- */

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef void (*run_fn)(ds_cu *c, void *ctx);

/* Median milliseconds of `reps` runs after `warm` warm-ups, each timed with events. */
static double median_ms(ds_cu *c, run_fn f, void *ctx, int warm, int reps) {
    for (int i = 0; i < warm; i++) f(c, ctx);
    double t[64];
    if (reps > 64) reps = 64;
    for (int i = 0; i < reps; i++) {
        ds_cu_timer *tm = ds_cu_timer_start(c);
        f(c, ctx);
        t[i] = ds_cu_timer_stop(c, tm);
    }
    ds_err err = {{0}};
    if (ds_cu_sync(c, &err)) DIE("%s", err.msg);
    qsort(t, (size_t)reps, sizeof *t, cmp_d);
    return t[reps / 2];
}

typedef struct copy_ctx {
    void *dst[2];
    const void *src[2];
    size_t bytes;
    int i;
} copy_ctx;
static void run_copy(ds_cu *c, void *p) {
    copy_ctx *x = p;
    ds_err err;
    x->i ^= 1; /* alternate two buffer pairs so that nothing is served from L2 */
    if (ds_cu_copy_d2d(c, x->dst[x->i], x->src[x->i], x->bytes, &err)) DIE("%s", err.msg);
}

typedef struct gemm_ctx {
    uint16_t *C;
    const uint16_t *A, *B;
    int m, n, k;
} gemm_ctx;
static void run_gemm(ds_cu *c, void *p) {
    gemm_ctx *x = p;
    ds_err err;
    if (ds_cu_gemm_bf16(c, x->C, x->A, x->B, x->m, x->n, x->k, &err)) DIE("%s", err.msg);
}

typedef struct mm_ctx {
    float *y, *x;
    ds_cu_mat w[4]; /* rotated: each more than L2 on its own */
    int T, i;
} mm_ctx;
static void run_mm(ds_cu *c, void *p) {
    mm_ctx *x = p;
    ds_err err;
    x->i = (x->i + 1) % 4;
    if (ds_cu_matmul(c, x->y, x->w[x->i].rows, x->x, x->w[x->i].cols, x->T, &x->w[x->i], &err))
        DIE("%s", err.msg);
}

typedef struct kda_ctx {
    float *o, *q, *k, *v, *g, *beta, *S;
    float **Sp; /* [n_seq] device pointers into S */
    int32_t *off;
    int T, H, dk, dv, n_seq, batched, chunked;
} kda_ctx;
static void run_kda(ds_cu *c, void *p) {
    kda_ctx *x = p;
    ds_err err;
    size_t ns = (size_t)x->H * x->dk * x->dv;
    if (x->chunked) { /* one sequence of T tokens */
        int start = 0;
        if (ds_cu_kda_chunked(c, x->o, x->q, x->k, x->v, x->g, x->beta, &start, &x->T, x->Sp, 1,
                              x->H, x->dk, x->dv, &err))
            DIE("%s", err.msg);
        return;
    }
    if (x->batched) {
        if (ds_cu_kda_recurrent_batch(c, x->o, x->q, x->k, x->v, x->g, x->beta, x->off, x->Sp, NULL,
                                      0, x->n_seq, x->H, x->dk, x->dv, 0, &err))
            DIE("%s", err.msg);
        return;
    }
    for (int s = 0; s < x->n_seq; s++) /* one launch per sequence */
        if (ds_cu_kda_recurrent(c, x->o, x->q, x->k, x->v, x->g, x->beta, x->S + s * ns, NULL, x->T,
                                x->H, x->dk, x->dv, &err))
            DIE("%s", err.msg);
}

typedef struct mla_ctx {
    float *obar, *qbar, *qr, *pool;
    int32_t *table;
    int Ha, n_ctx;
} mla_ctx;
static void run_mla(ds_cu *c, void *p) {
    mla_ctx *x = p;
    ds_err err;
    if (ds_cu_mla_attend_absorbed(c, x->obar, x->qbar, x->qr, 1, x->Ha, 512, 64, x->pool, x->table,
                                  16, 576, x->n_ctx - 1, x->n_ctx, 1, 0.07f, &err))
        DIE("%s", err.msg);
}

/* Absorbed MLA of a decode batch: one token for each of n_seq sequences of n_ctx rows */
typedef struct mla_batch_ctx {
    float *obar, *qbar, *qr, *pool;
    int32_t *tables, *tok_bt, *tok_pos;
    int n_seq, n_ctx;
} mla_batch_ctx;
static void run_mla_batch(ds_cu *c, void *p) {
    mla_batch_ctx *x = p;
    ds_err err;
    if (ds_cu_mla_attend_absorbed_batch(c, x->obar, x->qbar, x->qr, 64, x->n_seq, 32, 512, 64,
                                        x->pool, x->tables, x->tok_bt, x->tok_pos, x->n_ctx, 16,
                                        576, 0.07f, &err))
        DIE("%s", err.msg);
}

/* Is section `name` among the comma-separated `only` (NULL: every section)? */
static int wanted(const char *only, const char *name) {
    if (!only) return 1;
    size_t n = strlen(name);
    for (const char *p = only; (p = strstr(p, name)) != NULL; p += n)
        if ((p == only || p[-1] == ',') && (p[n] == ',' || p[n] == '\0')) return 1;
    return 0;
}

/* Routed experts at the 48B widths (256 experts of 2304 x 1024, 8 a token), T tokens with
 * distinct experts each: bytes = every expert some token picked, read once (gate, up, down). */
typedef struct moe_ctx {
    float *out, *x, *w;
    int32_t *idx;
    uint16_t *gu, *dn;
    int T;
} moe_ctx;
static void run_moe(ds_cu *c, void *p) {
    moe_ctx *m = p;
    ds_err err;
    if (ds_cu_moe_experts(c, m->out, m->x, m->idx, m->w, m->T, 8, 256, 0, 2304, 1024, m->gu, m->dn,
                          0, 0.0f, 0.0f, 0, &err))
        DIE("%s", err.msg);
}

typedef struct draw_ctx {
    float *x; /* [256][V] device */
    int V, rows;
    ds_sample_params p;
    ds_cu_draw d[256];
    int32_t tok[256];
} draw_ctx;

static void run_draw(ds_cu *c, void *ctx) {
    draw_ctx *dc = ctx;
    ds_err err = {{0}};
    if (ds_cu_draw_rows(c, dc->tok, dc->x, (size_t)dc->V, dc->V, dc->d, dc->rows, NULL, 0, &err))
        DIE("%s", err.msg);
}

static void bench(ds_cu *c, const char *only) {
    ds_err err = {{0}};
    /* 1. copy bandwidth: 2 x 2 GiB pairs, bytes read + written */
    size_t cb = (size_t)2 << 30;
    copy_ctx cc = {
        {dev(c, NULL, cb), dev(c, NULL, cb)}, {dev(c, NULL, cb), dev(c, NULL, cb)}, cb, 0};
    for (int i = 0; i < 2; i++) /* random-ish bytes, not zeros */
        if (ds_cu_fill_bytes(c, (void *)cc.src[i], 0x3c + i, cb, &err)) DIE("%s", err.msg);
    double ms = median_ms(c, run_copy, &cc, 3, 20);
    double copy_gbs = 2.0 * (double)cb / (ms * 1e-3) / 1e9;
    printf("bench copy d2d %zu MiB: %.3f ms, %.0f GB/s (read + write)\n", cb >> 20, ms, copy_gbs);
    for (int i = 0; i < 2; i++) ds_cu_dealloc(cc.dst[i]), ds_cu_dealloc((void *)cc.src[i]);

    /* 2. cuBLAS BF16 GEMM rate, 8192^3 on random data */
    int n = 8192;
    uint16_t *A = rand_bf16((size_t)n * n, -1, 1);
    gemm_ctx gc = {dev(c, NULL, (size_t)n * n * 2),
                   dev(c, A, (size_t)n * n * 2),
                   dev(c, A, (size_t)n * n * 2),
                   n,
                   n,
                   n};
    free(A);
    ms = median_ms(c, run_gemm, &gc, 3, 10);
    double gemm_tf = 2.0 * n * (double)n * n / (ms * 1e-3) / 1e12;
    printf("bench gemm bf16 %d^3: %.3f ms, %.0f TFLOP/s\n", n, ms, gemm_tf);
    ds_cu_dealloc(gc.C), ds_cu_dealloc((void *)gc.A), ds_cu_dealloc((void *)gc.B);

    /* 3. decode-shaped matmuls at Kimi-Linear-48B-A3B's hidden size 2304: bytes a step must
     *    read (the weights, BF16) over time, against the copy ceiling */
    static const int shapes[][2] = {{4096, 2304}, {2304, 4096}, {163840, 2304}};
    static const int Ts[] = {1, 2, 8, 64, 256};
    for (size_t si = 0; si < DS_ARRAY_LEN(shapes) && wanted(only, "matmul"); si++) {
        int N = shapes[si][0], K = shapes[si][1];
        mm_ctx mc = {0};
        uint16_t *w = rand_bf16((size_t)N * K, -0.05f, 0.05f);
        for (int i = 0; i < 4; i++) mc.w[i] = (ds_cu_mat){dev(c, w, (size_t)N * K * 2), N, K};
        free(w);
        float *x = rand_f32((size_t)256 * K, -1, 1);
        mc.x = dev(c, x, (size_t)256 * K * 4);
        free(x);
        mc.y = dev(c, NULL, (size_t)256 * N * 4);
        for (size_t ti = 0; ti < DS_ARRAY_LEN(Ts); ti++) {
            mc.T = Ts[ti];
            ms = median_ms(c, run_mm, &mc, 3, 30);
            double bytes = (double)N * K * 2 + (double)mc.T * (K * 4 + N * 4);
            double flops = 2.0 * N * (double)K * mc.T;
            printf("bench matmul N=%d K=%d T=%d: %.4f ms, %.0f GB/s (%.0f%% of copy), %.1f "
                   "TFLOP/s (%.1f%% of gemm)\n",
                   N, K, mc.T, ms, bytes / (ms * 1e-3) / 1e9,
                   100.0 * bytes / (ms * 1e-3) / 1e9 / copy_gbs, flops / (ms * 1e-3) / 1e12,
                   100.0 * flops / (ms * 1e-3) / 1e12 / gemm_tf);
        }
        for (int i = 0; i < 4; i++) ds_cu_dealloc((void *)mc.w[i].data);
        ds_cu_dealloc(mc.x), ds_cu_dealloc(mc.y);
    }

    /* 4. KDA decode: Kimi-Linear's 32 heads of 128 x 128, one token per sequence, 1 to 256
     *    sequences, one launch per sequence or one for the batch; bytes = each state read and
     *    written once (q, k, v, g are small beside it) */
    static const int seqs[] = {1, 64, 256};
    for (size_t i = 0; i < DS_ARRAY_LEN(seqs) && wanted(only, "kda"); i++)
        for (int batched = 0; batched < 2; batched++) {
            kda_ctx kc = {0};
            kc.T = 1, kc.H = 32, kc.dk = 128, kc.dv = 128, kc.n_seq = seqs[i];
            kc.batched = batched;
            if (!batched && kc.n_seq > 64) continue;
            size_t nq = (size_t)kc.H * kc.dk * kc.n_seq, ns = (size_t)kc.H * kc.dk * kc.dv;
            float *h = rand_f32(ns * (size_t)kc.n_seq, -0.5f, 0.5f);
            kc.S = dev(c, h, ns * (size_t)kc.n_seq * 4);
            free(h);
            h = rand_f32(nq, -0.1f, 0.1f);
            kc.q = dev(c, h, nq * 4), kc.k = dev(c, h, nq * 4), kc.v = dev(c, h, nq * 4);
            kc.g = dev(c, h, nq * 4), kc.beta = dev(c, h, (size_t)kc.H * kc.n_seq * 4);
            kc.o = dev(c, NULL, nq * 4);
            free(h);
            float **sp = malloc((size_t)kc.n_seq * sizeof *sp);
            int32_t *off = malloc((size_t)(kc.n_seq + 1) * 4);
            for (int z = 0; z <= kc.n_seq; z++) off[z] = z;
            for (int z = 0; z < kc.n_seq; z++) sp[z] = kc.S + (size_t)z * ns;
            kc.Sp = dev(c, sp, (size_t)kc.n_seq * sizeof *sp);
            kc.off = dev(c, off, (size_t)(kc.n_seq + 1) * 4);
            free(sp), free(off);
            ms = median_ms(c, run_kda, &kc, 3, 30);
            double bytes = 2.0 * (double)ns * 4 * kc.n_seq;
            printf("bench kda decode H=32 dk=dv=128, %d sequence(s), %s: %.4f ms, %.0f GB/s "
                   "(%.0f%% of copy)\n",
                   kc.n_seq, batched ? "one launch" : "a launch each", ms,
                   bytes / (ms * 1e-3) / 1e9, 100.0 * bytes / (ms * 1e-3) / 1e9 / copy_gbs);
            ds_cu_dealloc(kc.S), ds_cu_dealloc(kc.q), ds_cu_dealloc(kc.k), ds_cu_dealloc(kc.v);
            ds_cu_dealloc(kc.g), ds_cu_dealloc(kc.beta), ds_cu_dealloc(kc.o);
            ds_cu_dealloc(kc.Sp), ds_cu_dealloc(kc.off);
        }

    /* 4b. KDA over a prompt with the recurrent kernel: 8192 tokens, 32 heads of 128 x 128 (the
     *     baseline a chunked kernel has to beat; it walks the tokens in order) */
    if (wanted(only, "kda")) {
        kda_ctx kc = {0};
        kc.T = 8192, kc.H = 32, kc.dk = 128, kc.dv = 128, kc.n_seq = 1;
        size_t nq = (size_t)kc.T * kc.H * kc.dk, ns = (size_t)kc.H * kc.dk * kc.dv;
        float *h = rand_f32(nq, -0.1f, 0.1f);
        kc.q = dev(c, h, nq * 4), kc.k = dev(c, h, nq * 4), kc.v = dev(c, h, nq * 4);
        kc.g = dev(c, h, nq * 4), kc.beta = dev(c, h, (size_t)kc.T * kc.H * 4);
        kc.o = dev(c, NULL, nq * 4);
        free(h);
        h = rand_f32(ns, -0.5f, 0.5f);
        kc.S = dev(c, h, ns * 4);
        free(h);
        ms = median_ms(c, run_kda, &kc, 1, 5);
        printf("bench kda recurrent prefill T=8192 H=32 dk=dv=128: %.3f ms, %.0f tokens/s\n", ms,
               kc.T / (ms * 1e-3));
        kc.chunked = 1; /* the same in chunks of 64 (the forward's prefill path) */
        kc.Sp = dev(c, &kc.S, sizeof kc.S);
        double clk[6];
        ds_cu_kda_prep_clocks(clk); /* (zeroes them) */
        ms = median_ms(c, run_kda, &kc, 2, 10);
        printf("bench kda chunked prefill T=8192 H=32 dk=dv=128: %.3f ms, %.0f tokens/s\n", ms,
               kc.T / (ms * 1e-3));
        if (!ds_cu_kda_prep_clocks(clk)) { /* the timing build: where pass 1's time goes */
            static const char *phase[6] = {"stage", "sums", "A,P", "P,Qp,Kc", "A store", "solve"};
            double tot = 0;
            for (int i = 0; i < 6; i++) tot += clk[i];
            printf("bench kda pass 1 phases (share of block cycles):");
            for (int i = 0; i < 6; i++) printf(" %s %.1f%%", phase[i], 100.0 * clk[i] / tot);
            printf("\n");
        }
        /* the scan and outputs on tensor cores: TF32, then 3xTF32 */
        for (int mode = 1; mode <= 3; mode += 2) {
            ds_cu_set_kda_tc(c, mode);
            ms = median_ms(c, run_kda, &kc, 2, 10);
            printf(
                "bench kda chunked prefill T=8192 H=32 dk=dv=128 (%s scan and outputs): %.3f ms, "
                "%.0f tokens/s\n",
                mode == 1 ? "tf32" : "3xtf32", ms, kc.T / (ms * 1e-3));
        }
        ds_cu_set_kda_tc(c, 0);
        ds_cu_dealloc(kc.Sp);
        ds_cu_dealloc(kc.S), ds_cu_dealloc(kc.q), ds_cu_dealloc(kc.k), ds_cu_dealloc(kc.v);
        ds_cu_dealloc(kc.g), ds_cu_dealloc(kc.beta), ds_cu_dealloc(kc.o);
    }

    /* 4c. expanded MLA over a prompt: 8192 tokens, 32 heads of 128 + 64 / 128 (causal), the
     *     cuBLAS path against the fused kernel; FLOPs: the causal half of QK^T and PV */
    if (wanted(only, "mla")) {
        const int T = 8192, Ha = 32, dn = 128, dr = 64, dvh = 128;
        size_t nq = (size_t)T * Ha * (dn + dr), nk = (size_t)T * Ha * dn, nv = (size_t)T * Ha * dvh;
        float *h = rand_f32(nq, -0.3f, 0.3f);
        float *dq = dev(c, h, nq * 4), *dk = dev(c, h, nk * 4),
              *dr_ = dev(c, h, (size_t)T * dr * 4);
        float *dv_ = dev(c, h, nv * 4), *dout = dev(c, NULL, nv * 4);
        free(h);
        double flops = 2.0 * (double)T * T / 2 * Ha * (dn + dr + dvh);
        for (int fused = 0; fused < 2; fused++) {
            ds_cu_set_mla_gemm(c, 1);
            ds_cu_set_mla_flash(c, fused);
            double best = 1e30;
            for (int r = 0; r < 3; r++) {
                ds_cu_timer *tm = ds_cu_timer_start(c);
                if (ds_cu_mla_attend_expanded(c, dout, dq, dk, dr_, dv_, T, T, Ha, dn, dr, dvh, 0,
                                              1, 0.07f, &err))
                    DIE("%s", err.msg);
                double t = ds_cu_timer_stop(c, tm);
                if (r && t < best) best = t;
            }
            printf("bench mla expanded prefill T=8192 Ha=32 (%s): %.3f ms, %.0f TFLOP/s\n",
                   fused ? "fused" : "cublas", best, flops / (best * 1e-3) / 1e12);
        }
        ds_cu_set_mla_gemm(c, 0);
        ds_cu_set_mla_flash(c, 0);
        ds_cu_dealloc(dq), ds_cu_dealloc(dk), ds_cu_dealloc(dr_), ds_cu_dealloc(dv_);
        ds_cu_dealloc(dout);
    }

    /* 4d. routed experts at batch 1 and 8 (graph-free launches, so launch gaps included) */
    if (wanted(only, "moe")) {
        const size_t per = (size_t)2304 * 1024;
        moe_ctx mc = {0};
        mc.gu = ds_cu_alloc(c, 256 * 2 * per * 2, &err);
        mc.dn = ds_cu_alloc(c, 256 * per * 2, &err);
        if (!mc.gu || !mc.dn ||
            ds_cu_fill_random_bf16(c, mc.gu, 256 * 2 * per, 1, 7, 0, 0, 1, 0.03f, &err) ||
            ds_cu_fill_random_bf16(c, mc.dn, 256 * per, 1, 8, 0, 0, 1, 0.03f, &err))
            DIE("%s", err.msg);
        float *h = rand_f32((size_t)8 * 2304, -1, 1);
        mc.x = dev(c, h, (size_t)8 * 2304 * 4);
        free(h);
        h = rand_f32(64, 0, 1);
        mc.w = dev(c, h, 64 * 4);
        free(h);
        int32_t ids[64]; /* 37 i mod 256: 64 distinct experts (37 is odd) */
        for (int i = 0; i < 64; i++) ids[i] = (int32_t)((i * 37) % 256);
        mc.idx = dev(c, ids, sizeof ids);
        mc.out = dev(c, NULL, (size_t)8 * 2304 * 4);
        static const int mts[] = {1, 8};
        for (size_t i = 0; i < DS_ARRAY_LEN(mts); i++) {
            mc.T = mts[i];
            ms = median_ms(c, run_moe, &mc, 3, 20);
            double bytes = (double)mc.T * 8 * 3 * per * 2;
            printf("bench moe experts T=%d (8 of 256, 2304 x 1024): %.4f ms, %.0f GB/s (%.0f%% of "
                   "copy)\n",
                   mc.T, ms, bytes / (ms * 1e-3) / 1e9,
                   100.0 * bytes / (ms * 1e-3) / 1e9 / copy_gbs);
        }
        /* batches: random routing (the bytes: every expert some token picked), the wmma kernel
         * against the streaming one */
        ds_cu_set_expert_mma(c, 1);
        static const int bts[] = {64, 256};
        for (size_t i = 0; i < DS_ARRAY_LEN(bts); i++) {
            const int T = bts[i];
            int32_t *bid = malloc((size_t)T * 8 * 4);
            int used[256] = {0}, n_used = 0;
            for (int t = 0; t < T; t++) /* 8 distinct experts a token */
                for (int j = 0; j < 8; j++) {
                    int e, dup;
                    do {
                        e = (int)(ds_rng_next(&g_rng) % 256), dup = 0;
                        for (int q = 0; q < j; q++) dup |= bid[t * 8 + q] == e;
                    } while (dup);
                    bid[t * 8 + j] = e;
                    n_used += !used[e], used[e] = 1;
                }
            float *hx = rand_f32((size_t)T * 2304, -1, 1), *hw = rand_f32((size_t)T * 8, 0, 1);
            moe_ctx bc = mc;
            bc.T = T, bc.x = dev(c, hx, (size_t)T * 2304 * 4), bc.w = dev(c, hw, (size_t)T * 32);
            bc.idx = dev(c, bid, (size_t)T * 32), bc.out = dev(c, NULL, (size_t)T * 2304 * 4);
            for (int tc = 0; tc <= 1; tc++) {
                ds_cu_set_expert_tc(c, tc);
                ms = median_ms(c, run_moe, &bc, 3, 20);
                double bytes = (double)n_used * 3 * per * 2;
                printf("bench moe experts T=%d (%d experts, %s): %.4f ms, %.0f GB/s (%.0f%% of "
                       "copy)\n",
                       T, n_used, tc ? "streaming mma" : "wmma", ms, bytes / (ms * 1e-3) / 1e9,
                       100.0 * bytes / (ms * 1e-3) / 1e9 / copy_gbs);
            }
            ds_cu_set_expert_tc(c, 0);
            ds_cu_dealloc(bc.x), ds_cu_dealloc(bc.w), ds_cu_dealloc(bc.idx), ds_cu_dealloc(bc.out);
            free(hx), free(hw), free(bid);
        }
        ds_cu_set_expert_mma(c, 0);
        ds_cu_dealloc(mc.gu), ds_cu_dealloc(mc.dn), ds_cu_dealloc(mc.x), ds_cu_dealloc(mc.w);
        ds_cu_dealloc(mc.idx), ds_cu_dealloc(mc.out);
    }

    /* 5. MLA absorbed decode, one token, 32 heads (Kimi-Linear), R 512 + dr 64, f32 cache; the
     *    bytes that must be read: the context's latent rows once */
    static const int ctxs[] = {4096, 32768};
    for (size_t i = 0; i < DS_ARRAY_LEN(ctxs) && wanted(only, "mla"); i++) {
        mla_ctx mc = {0};
        mc.Ha = 32, mc.n_ctx = ctxs[i];
        int pages = mc.n_ctx / 16;
        float *h = rand_f32((size_t)mc.n_ctx * 576, -1, 1);
        mc.pool = dev(c, h, (size_t)mc.n_ctx * 576 * 4);
        free(h);
        int32_t *tb = malloc((size_t)pages * 4);
        for (int p = 0; p < pages; p++) tb[p] = (int32_t)((p * 7 + 3) % pages);
        mc.table = dev(c, tb, (size_t)pages * 4);
        free(tb);
        h = rand_f32((size_t)32 * 512, -0.1f, 0.1f);
        mc.qbar = dev(c, h, (size_t)32 * 512 * 4), mc.qr = dev(c, h, (size_t)32 * 64 * 4);
        free(h);
        mc.obar = dev(c, NULL, (size_t)32 * 512 * 4);
        ms = median_ms(c, run_mla, &mc, 3, 20);
        double bytes = (double)mc.n_ctx * 576 * 4;
        printf("bench mla absorbed decode Ha=32, %d context rows: %.4f ms, %.0f GB/s of cache "
               "(%.0f%% of copy)\n",
               mc.n_ctx, ms, bytes / (ms * 1e-3) / 1e9,
               100.0 * bytes / (ms * 1e-3) / 1e9 / copy_gbs);
        ds_cu_dealloc(mc.pool), ds_cu_dealloc(mc.table), ds_cu_dealloc(mc.qbar);
        ds_cu_dealloc(mc.qr), ds_cu_dealloc(mc.obar);
    }
    /* 5b. a decode batch's MLA: 64 and 256 sequences of 512 rows, every head's query against its
     *     own sequence (pages scattered through one pool), all heads a block against a block a
     *     head */
    static const int bseqs[] = {64, 256};
    for (size_t i = 0; i < DS_ARRAY_LEN(bseqs) && wanted(only, "mla"); i++) {
        mla_batch_ctx bc = {0};
        bc.n_seq = bseqs[i], bc.n_ctx = 512;
        const int per_seq = bc.n_ctx / 16, pages = bc.n_seq * per_seq;
        float *h = rand_f32((size_t)pages * 16 * 576, -1, 1);
        bc.pool = dev(c, h, (size_t)pages * 16 * 576 * 4);
        free(h);
        int32_t *tb = malloc((size_t)pages * 4), *bt = malloc((size_t)bc.n_seq * 4),
                *pos = malloc((size_t)bc.n_seq * 4);
        if (!tb || !bt || !pos) DIE("out of memory");
        for (int p = 0; p < pages; p++) tb[p] = (int32_t)(((long)p * 7 + 3) % pages);
        for (int z = 0; z < bc.n_seq; z++) bt[z] = z * per_seq, pos[z] = bc.n_ctx - 1;
        bc.tables = dev(c, tb, (size_t)pages * 4), bc.tok_bt = dev(c, bt, (size_t)bc.n_seq * 4);
        bc.tok_pos = dev(c, pos, (size_t)bc.n_seq * 4);
        free(tb), free(bt), free(pos);
        h = rand_f32((size_t)bc.n_seq * 32 * 512, -0.1f, 0.1f);
        bc.qbar = dev(c, h, (size_t)bc.n_seq * 32 * 512 * 4);
        bc.qr = dev(c, h, (size_t)bc.n_seq * 32 * 64 * 4);
        free(h);
        bc.obar = dev(c, NULL, (size_t)bc.n_seq * 32 * 512 * 4);
        for (int ah = 2; ah >= 0; ah -= 2) {
            ds_cu_set_mla_all_heads(c, ah);
            ms = median_ms(c, run_mla_batch, &bc, 3, 20);
            const double bytes = (double)bc.n_seq * bc.n_ctx * 576 * 4;
            printf("bench mla absorbed decode batch %d x %d rows, Ha=32 (%s): %.4f ms, %.0f GB/s "
                   "of cache (%.0f%% of copy)\n",
                   bc.n_seq, bc.n_ctx, ah ? "all heads" : "a block a head", ms,
                   bytes / (ms * 1e-3) / 1e9, 100.0 * bytes / (ms * 1e-3) / 1e9 / copy_gbs);
        }
        ds_cu_set_mla_all_heads(c, 0);
        ds_cu_dealloc(bc.pool), ds_cu_dealloc(bc.tables), ds_cu_dealloc(bc.tok_bt);
        ds_cu_dealloc(bc.tok_pos), ds_cu_dealloc(bc.qbar), ds_cu_dealloc(bc.qr);
        ds_cu_dealloc(bc.obar);
    }

    /* 6. draws at the 48B vocabulary: the whole call (draws and edits up, tokens down) on rows of
     *    N(0, 2) logits — near-flat, the sampler's worst case — against one host thread */
    for (int top = 0; top < 2 && wanted(only, "draw"); top++) {
        static const int rows_of[] = {1, 8, 64, 256};
        const int V = 163840;
        ds_rng rng;
        ds_rng_seed(&rng, 7);
        draw_ctx dc = {0};
        dc.V = V;
        float *h = malloc((size_t)256 * V * 4);
        for (size_t i = 0; i < (size_t)256 * V; i++) h[i] = (float)(2.0 * ds_rng_normal(&rng));
        dc.x = dev(c, h, (size_t)256 * V * 4);
        for (int r = 0; r < 256; r++) {
            ds_sample_params_default(&dc.p);
            dc.p.top_p = top ? 0.95f : 1.0f;
            dc.d[r] =
                (ds_cu_draw){ds_rng_uniform(&rng), 1.0f, dc.p.top_p, 0, 0, 0, 0, 0, r, 0, 0, 0};
        }
        ds_err e2 = {{0}};
        ds_sample_scratch *sc = ds_sample_scratch_new(V, &e2);
        float *work = malloc((size_t)V * 4);
        double t0 = ds_now();
        for (int r = 0; r < 8; r++) {
            memcpy(work, h + (size_t)r * V, (size_t)V * 4);
            ds_row_draw rd = {dc.p, dc.d[r].u, NULL, 0, NULL, 0};
            (void)ds_sample_row(work, V, &rd, sc);
        }
        double host_ms = (ds_now() - t0) * 1e3 / 8;
        for (size_t i = 0; i < DS_ARRAY_LEN(rows_of); i++) {
            dc.rows = rows_of[i];
            ms = median_ms(c, run_draw, &dc, 2, 10);
            printf("bench draw V=%d top_p %.2f, %d row(s): %.3f ms (host, one thread: %.3f ms a "
                   "row)\n",
                   V, dc.p.top_p, dc.rows, ms, host_ms);
        }
        ds_cu_dealloc(dc.x);
        ds_sample_scratch_free(sc);
        free(h), free(work);
    }
}

/* Every kernel against the CPU backend on fresh random inputs (g_fail counts what failed). */
static void run_checks(ds_cu *c) {

    /* T = 1 with K % 8 == 0: the f32 GEMV (held to f32 accuracy); else cuBLAS on BF16 x */
    check_matmul(c, 1, 4096, 2304, 0, 1e-5);
    check_matmul(c, 1, 12576, 2304, 0, 1e-5); /* KDA's stacked inputs at the 48B shape */
    ds_cu_set_gemv_wide(c, 1); /* the same through the experts' kernel, and its bits */
    check_matmul(c, 1, 12576, 2304, 0, 1e-5);
    check_matmul(c, 1, 5003, 2048, 4, 1e-5); /* tail rows; one warp a row on 132 SMs */
    check_matmul_invariance(c, 5000, 2304);
    ds_cu_set_wide_early(c, 1); /* its first weights before the wait: the same sums */
    check_matmul(c, 1, 5003, 2048, 4, 1e-5);
    check_matmul(c, 1, 12576, 2304, 0, 1e-5);
    check_matmul_invariance(c, 5000, 2304);
    ds_cu_set_wide_early(c, 0);
    ds_cu_set_gemv_wide(c, 0);
    check_matmul(c, 1, 1003, 2048, 4, 1e-5);
    check_matmul(c, 2, 1003, 2048, 4, 1e-2);
    check_matmul(c, 3, 1003, 2048, 4, 1e-2);
    check_matmul(c, 8, 163840, 256, 0, 1e-2);
    check_matmul(c, 7, 1000, 333, 0, 1e-2);
    check_matmul(c, 64, 2304, 4096, 0, 1e-2);
    check_matmul(c, 5, 257, 130, 3, 1e-2);
    check_matmul_heads(c, 1, 32, 512, 128, 0, 1e-5);
    check_matmul_heads(c, 5, 4, 128, 512, 1, 1e-5);
    check_matmul_heads(c, 9, 4, 128, 512, 0, 1e-2);
    check_matmul_invariance(c, 1000, 2304);
    /* few rows: warps share a row (split K), the router's shape and a tiny one */
    check_matmul(c, 1, 256, 2304, 0, 1e-5);
    check_matmul(c, 1, 5, 4096, 0, 1e-5);
    check_matmul_invariance(c, 256, 2304);
    check_matmul_invariance(c, 77, 100); /* K % 8 != 0: the element-wise kernel */
    check_embed(c, 1000, 2304, 13);
    check_rmsnorm(c, 5, 2304, 0);
    check_rmsnorm(c, 3, 100, 1);
    check_rmsnorm(c, 2, 7168, 1); /* wider than a block holds in registers */
    check_add_rmsnorm(c, 3, 2304);
    check_add_rmsnorm(c, 2, 7168);
    check_swiglu(c, 1000003);
    check_act_pairs(c, 3, 1024);   /* a decode step's shared experts */
    check_act_pairs(c, 66000, 40); /* more rows than a grid's y: the row loop */
    check_kda(c, 1, 4, 128, 128, 1);
    check_kda(c, 9, 3, 64, 96, 1);
    check_kda(c, 33, 2, 32, 40, 0);
    check_kda(c, 5, 32, 128, 128, 0);
    static const int lens_a[] = {1, 3, 1, 5, 2}, lens_b[] = {1, 1, 1, 1, 1, 1, 1, 1};
    const int all_rows[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    check_kda_step(c, lens_a, all_rows, 5, 4, 128, 128, -0.7f, 0);
    check_kda_step(c, lens_b, all_rows, 8, 3, 64, 72, -0.7f, 0);
    {
        int lens[7] = {1, 63, 64, 65, 300, 20, 130}, rows[7] = {0, 0, 0, 0, 0, 1, 0};
        check_kda_step(c, lens, rows, 7, 4, 128, 128, -0.7f, 16);
        check_kda_step(c, lens, rows, 7, 3, 64, 64, -0.7f, 16);
        check_kda_step(c, lens, rows, 7, 2, 128, 128, -3.0f, 16); /* strong decay */
        check_kda_step(c, lens, rows, 7, 2, 128, 128, -12.0f, 16);
        int one[1] = {1000}, none[1] = {0};
        check_kda_step(c, one, none, 1, 8, 128, 128, -0.1f, 16); /* weak decay, long memory */
        /* the scan and output passes on TF32 tensor cores */
        ds_cu_set_kda_tc(c, g_kda_tc = 1);
        check_kda_step(c, lens, rows, 7, 4, 128, 128, -0.7f, 16);
        check_kda_step(c, lens, rows, 7, 3, 64, 64, -0.7f, 16);
        check_kda_step(c, lens, rows, 7, 2, 128, 128, -3.0f, 16);
        /* ... split into two TF32 parts each: held to f32's tolerance */
        ds_cu_set_kda_tc(c, g_kda_tc = 3);
        check_kda_step(c, lens, rows, 7, 4, 128, 128, -0.7f, 16);
        check_kda_step(c, lens, rows, 7, 3, 64, 64, -0.7f, 16);
        check_kda_step(c, lens, rows, 7, 2, 128, 128, -3.0f, 16);
        /* decays that empty the state within a few tokens: pass 1's exponents through a block's
         * first row must neither overflow nor lose what they keep */
        check_kda_step(c, lens, rows, 7, 2, 128, 128, -12.0f, 16);
        check_kda_step(c, one, none, 1, 8, 128, 128, -0.1f, 16);
        ds_cu_set_kda_tc(c, g_kda_tc = 0);
    }
    check_short_conv(c, 7, 300, 4);
    check_short_conv(c, 1, 4096, 4);
    check_kda_gate(c, 5, 4, 128, 0);
    check_kda_gate(c, 3, 4, 64, 1);
    check_kda_gate(c, 66000, 2, 32, 0); /* more rows than a grid's y: the row loop */
    check_head_norms(c, 6, 32, 128);
    check_attnres(c, 3, 4, 2304);
    check_attnres(c, 1, 2, 100);
    check_mla(c, 1, 16, 512, 64, 700, 701, 1);
    check_mla(c, 5, 4, 512, 64, 40, 45, 1);
    check_mla(c, 4, 3, 512, 64, 30, 32, 1); /* the last two queries are capped at n_ctx */
    check_mla(c, 3, 2, 64, 16, 0, 37, 0);
    check_mla(c, 3, 2, 30, 6, 0, 37, 0);       /* rows not a multiple of 4 floats: scalar loads */
    check_mla(c, 2, 4, 512, 64, 0, 1000, 0);   /* 4 splits, one partial */
    check_mla(c, 3, 2, 512, 64, 255, 258, 1);  /* token 0 ends on a split's last row */
    check_mla(c, 2, 64, 512, 64, 300, 302, 1); /* 64 heads: the block-per-head fallback */
    check_mla_expanded(c, 40, 4, 128, 64, 128, 0, 40, 1);  /* a first prompt chunk */
    check_mla_expanded(c, 33, 3, 64, 32, 64, 300, 333, 1); /* a later chunk, 2 splits */
    check_mla_expanded(c, 5, 2, 32, 16, 48, 0, 600, 0);
    check_mla_expanded_mode(c, 300, 4, 128, 64, 128, 0, 300, 1, 1); /* a prompt, tensor cores */
    /* the fused kernel: a prompt, a later chunk (a partial last block of queries and keys), not
     * causal (every row sees all keys), one short of a block */
    check_mla_expanded_mode(c, 300, 4, 128, 64, 128, 0, 300, 1, 2);
    check_mla_expanded_mode(c, 130, 3, 128, 64, 128, 77, 207, 1, 2);
    check_mla_expanded_mode(c, 150, 2, 128, 64, 128, 0, 170, 0, 2);
    check_mla_expanded_mode(c, 129, 5, 128, 64, 128, 1, 130, 1, 2);
    check_mla_expanded_mode(c, 40, 2, 128, 64, 128, 590, 630, 1, 2); /* partial key tiles */
    check_mla_expanded_mode(c, 200, 3, 64, 32, 64, 500, 700, 1, 1);  /* a later chunk */
    check_mla_expanded_mode(c, 130, 2, 32, 16, 48, 0, 1000, 0, 1);   /* not causal */
    check_moe_route(c, 7, 256, 8, 8, 4, 0, 0);
    check_moe_route(c, 5, 64, 6, 1, 1, 0, 0);
    check_moe_route(c, 9, 32, 4, 4, 2, 1, 0);
    check_moe_route(c, 6, 48, 5, 1, 1, 0, 1);
    check_moe_experts(c, 3, 8, 64, 2304, 256, 0);
    /* one token: its routed rows straight from idx, no grouping (the 48B widths; SiTU with other
     * ranks' rows) */
    check_moe_experts(c, 1, 8, 256, 2304, 1024, 0);
    /* the down pass reading its routing before the wait: one token (direct rows), grouped rows */
    ds_cu_set_early_experts(c, 1);
    check_moe_experts(c, 1, 8, 256, 2304, 1024, 0);
    check_moe_experts(c, 40, 8, 64, 512, 256, 0);
    ds_cu_set_early_experts(c, 0);
    check_moe_experts_mode(c, 1, 8, 64, 512, 256, 1, 0, 1);
    check_moe_experts(c, 5, 2, 4, 200, 72, 1);
    check_moe_experts(c, 40, 8, 64, 512, 256, 0); /* grouped: ~5 rows per expert */
    check_moe_experts(c, 6, 3, 5, 100, 36, 1);    /* D % 8 != 0: one row at a time */
    /* tensor cores from 64 rows per expert on average: padded panels, batched GEMMs */
    check_moe_experts_mode(c, 300, 8, 32, 512, 256, 0, 1, 0); /* 2400 rows */
    check_moe_experts_mode(c, 600, 8, 64, 256, 128, 1, 1, 0); /* 4800 rows, SiTU */
    check_moe_experts_mode(c, 300, 8, 32, 512, 256, 0, 2, 0); /* skewed: several size buckets */
    check_moe_experts_mode(c, 40, 8, 64, 512, 256, 0, 0, 1);  /* TP: half the experts */
    check_moe_experts_mode(c, 6, 3, 8, 100, 36, 1, 0, 1);     /* ... one row at a time */
    check_moe_experts_mode(c, 200, 8, 32, 512, 256, 0, 1, 1); /* ... tensor cores (16 local) */
    check_moe_experts_mode(c, 160, 8, 64, 512, 256, 0, 0, 0); /* >= 1024 rows: chunked layout */
    check_moe_experts_mode(c, 700, 6, 48, 256, 128, 1, 0, 1); /* ... with other ranks' rows */
    /* a batch's grouped experts on tensor cores: few rows per expert, more than 16 for some,
     * other ranks' rows, a K that is not a whole number of 256-wide chunks */
    check_moe_experts_mode(c, 40, 8, 64, 512, 256, 0, 3, 0);
    check_moe_experts_mode(c, 256, 8, 32, 768, 384, 1, 3, 1);
    check_moe_experts_mode(c, 16, 8, 64, 2304, 1024, 0, 3, 0); /* the 48B widths, batch 16 */
    /* the same through the streaming tensor-core kernel: 8, 16 and 32 tokens a pass (more rows
     * than that on an expert: another pass), other ranks' rows, SiTU, the 48B widths */
    check_moe_experts_mode(c, 40, 8, 64, 512, 256, 0, 4, 0);
    check_moe_experts_mode(c, 256, 8, 32, 768, 384, 1, 4, 1);
    check_moe_experts_mode(c, 16, 8, 64, 2304, 1024, 0, 4, 0);
    check_moe_experts_mode(c, 200, 8, 16, 512, 192, 1, 4, 0); /* ~100 rows an expert */
    check_moe_experts_mode(c, 64, 8, 256, 2304, 1024, 1, 4, 1);
    check_moe_experts_mode(c, 256, 8, 256, 2304, 1024, 0, 4, 0); /* 16 tokens a pass */
    {
        int lens[5] = {1, 4, 1, 9, 2}, rows[5] = {0, 1, 0, 1, 0};
        check_short_conv_batch(c, lens, rows, 5, 4096, 4);
        /* prefill lengths: time chunks (long segments split, short ones in chunk 0 alone) */
        int plens[5] = {2, 130, 1, 900, 3}, prows[5] = {1, 1, 0, 0, 1};
        check_short_conv_batch(c, plens, prows, 5, 512, 4);
        check_short_conv_batch(c, plens, prows, 5, 512, 3); /* a width the fixed form lacks */
        check_kda_decode_fused(c, 1, 32, 128, 128, 0);      /* the 48B shape at batch 1 */
        check_kda_decode_fused(c, 5, 4, 128, 128, 1);       /* the gate's lower bound */
        check_kda_decode_fused(c, 3, 8, 64, 32, 0);         /* narrower f_a and g_a */
        ds_cu_set_conv_fixed(c, 1); /* the width-4 form: registers, inputs loaded ahead */
        check_short_conv_batch(c, lens, rows, 5, 4096, 4);
        check_short_conv_batch(c, plens, prows, 5, 512, 4);
        ds_cu_set_conv_fixed(c, 0);
        check_copy_2d(c, 32, 64, 192, 64);      /* a narrow strided copy (few rows) */
        check_copy_2d(c, 70000, 128, 256, 130); /* prefill's keys: a grid-stride loop */
        int mlens[4] = {1, 3, 1, 5}, mpos[4] = {0, 300, 700, 17};
        check_mla_batch(c, mlens, mpos, 4, 8, 512, 64, 0);
        check_mla_batch(c, mlens, mpos, 4, 8, 512, 64, 2);
        int dlens[3] = {1, 1, 1}, dpos[3] = {1000, 5, 257}; /* decode rows across splits */
        check_mla_batch(c, dlens, dpos, 3, 32, 512, 64, 2);
        check_mla_batch(c, dlens, dpos, 3, 32, 512, 64, 0); /* a block per head (batch 1) */
        check_mla_batch(c, mlens, mpos, 4, 2, 30, 6, 0);    /* scalar loads */
        int blens[160], bpos[160]; /* a decode batch that fills the GPU: splits of > 64 rows */
        for (int i = 0; i < 160; i++) blens[i] = 1 + (i % 7 == 0), bpos[i] = (i * 397) % 1200;
        check_mla_batch(c, blens, bpos, 160, 16, 512, 64, 1);
    }
    check_rope(c, 7, 576, 1, 32);    /* the draft's latent rows: rope lanes after R = 512 */
    check_rope(c, 7 * 4, 64, 4, 32); /* its queries' rope parts: 4 heads a position */
    check_rope(c, 3, 10, 1, 3);      /* odd widths; lanes past 2 half untouched */
    check_argmax(c, 8, 163840, 0);   /* parts as the model takes them */
    check_argmax(c, 8, 163840, 1);
    check_argmax(c, 1, 163840, 0);
    check_argmax(c, 300, 5003, 0);
    check_argmax(c, 12, 100, 7); /* parts of 15, the last one short */
#ifdef DS_HAVE_NCCL
    check_nccl_one_rank(c);
#endif
    check_argmax(c, 12, 100, 0);
    check_draws(c, 84, 6000);   /* every case of draw_case over every row shape, twice */
    check_draws(c, 24, 163840); /* the 48B vocabulary */
    check_draws(c, 7, 33);      /* fewer ids than threads */
}

/* Reads n floats from dir/name into a new buffer. */
static float *read_f32(const char *dir, const char *name, size_t n) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) DIE("%s: cannot open", path);
    float *p = malloc(n * sizeof *p);
    if (!p) DIE("out of memory");
    const size_t got = fread(p, sizeof *p, n, f);
    const int extra = fgetc(f) != EOF;
    fclose(f);
    if (got != n || extra) DIE("%s: want exactly %zu floats", path, n);
    return p;
}

static void write_f32(const char *dir, const char *name, const float *p, size_t n) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, sizeof *p, n, f) != n || fclose(f)) DIE("%s: cannot write", path);
}

/* --kda-io DIR T H D: the chunked KDA on inputs a peer wrote (tools/device/fla_kda_bench.py, so
 * that both are scored against one float64 reference): DIR/{q,k,v,g}.f32 [T][H][D],
 * beta.f32 [T][H], s0.f32 [H][D][D]; writes out_M.f32 [T][H][D] and state_M.f32 [H][D][D] for
 * the scan modes M = 0 (f32), 1 (TF32), 3 (3xTF32). */
static void kda_io(ds_cu *c, const char *dir, int T, int H, int D) {
    if (T < 1 || H < 1 || !ds_cu_kda_chunked_supports(D, D)) DIE("--kda-io: bad shape");
    const size_t nq = (size_t)T * H * D, ns = (size_t)H * D * D;
    kda_ctx kc = {0};
    kc.T = T, kc.H = H, kc.dk = kc.dv = D, kc.n_seq = 1, kc.chunked = 1;
    static const char *in[4] = {"q.f32", "k.f32", "v.f32", "g.f32"};
    float **dst[4] = {&kc.q, &kc.k, &kc.v, &kc.g};
    for (int i = 0; i < 4; i++) {
        float *h = read_f32(dir, in[i], nq);
        *dst[i] = dev(c, h, nq * 4);
        free(h);
    }
    float *h = read_f32(dir, "beta.f32", (size_t)T * H);
    kc.beta = dev(c, h, (size_t)T * H * 4);
    free(h);
    float *s0 = read_f32(dir, "s0.f32", ns), *o = malloc(nq * 4), *st = malloc(ns * 4);
    if (!o || !st) DIE("out of memory");
    kc.S = dev(c, NULL, ns * 4), kc.o = dev(c, NULL, nq * 4);
    kc.Sp = dev(c, &kc.S, sizeof kc.S);
    static const int modes[3] = {0, 1, 3};
    for (int i = 0; i < 3; i++) {
        ds_err err = {{0}};
        if (ds_cu_upload(c, kc.S, s0, ns * 4, &err)) DIE("%s", err.msg);
        ds_cu_set_kda_tc(c, modes[i]);
        run_kda(c, &kc);
        fetch(c, o, kc.o, nq * 4);
        fetch(c, st, kc.S, ns * 4);
        char name[32];
        snprintf(name, sizeof name, "out_%d.f32", modes[i]);
        write_f32(dir, name, o, nq);
        snprintf(name, sizeof name, "state_%d.f32", modes[i]);
        write_f32(dir, name, st, ns);
    }
    printf("kda-io: %d tokens x %d heads of %d, modes 0 1 3 written to %s\n", T, H, D, dir);
    free(s0), free(o), free(st);
    ds_cu_dealloc(kc.q), ds_cu_dealloc(kc.k), ds_cu_dealloc(kc.v), ds_cu_dealloc(kc.g);
    ds_cu_dealloc(kc.beta), ds_cu_dealloc(kc.S), ds_cu_dealloc(kc.o), ds_cu_dealloc(kc.Sp);
}

int main(int argc, char **argv) {
    /* --bench [sections]: matmul, kda, moe, mla, comma-separated (default: all), after the
     * checks; --bench-only [sections]: the timings alone (under a profiler) */
    const int bench_only = argc > 1 && !strcmp(argv[1], "--bench-only");
    const int do_bench = bench_only || (argc > 1 && !strcmp(argv[1], "--bench"));
    const char *only = do_bench && argc > 2 ? argv[2] : NULL;
    ds_kernels_init();
    ds_rng_seed(&g_rng, 20261201);
    ds_cu *c;
    ds_err err = {{0}};
    if (ds_cu_create(0, &c, &err)) DIE("%s", err.msg);
    printf("device: %s; CPU kernels: %s\n", ds_cu_device_name(c), ds_isa_name(ds_kernels_isa()));
    if (argc == 6 && !strcmp(argv[1], "--kda-io")) {
        kda_io(c, argv[2], atoi(argv[3]), atoi(argv[4]), atoi(argv[5]));
        ds_cu_free(c);
        return 0;
    }
    if (!bench_only) {
        run_checks(c);
        printf("checks: %s\n", g_fail ? "FAILED" : "all passed");
    }
    if (do_bench && !g_fail) bench(c, only);
    ds_cu_free(c);
    return g_fail;
}
