/* test_cuda_norm.c — the row norms against the CPU: RMSNorm (in place, wide rows), the fused
 * residual add, the per-head L2 and gated norms. */
#include "cuda_check.h"

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

/* RMSNorm and the fused residual add */
void checks_norm_rows(ds_cu *c) {
    check_rmsnorm(c, 5, 2304, 0);
    check_rmsnorm(c, 3, 100, 1);
    check_rmsnorm(c, 2, 7168, 1); /* wider than a block holds in registers */
    check_add_rmsnorm(c, 3, 2304);
    check_add_rmsnorm(c, 2, 7168);
}

/* the per-head norms */
void checks_norm_heads(ds_cu *c) {
    check_head_norms(c, 6, 32, 128);
}
