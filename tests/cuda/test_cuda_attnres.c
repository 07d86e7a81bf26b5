/* test_cuda_attnres.c — the AttnRes mix against the CPU. */
#include "cuda_check.h"

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

/* the AttnRes mix */
void checks_attnres(ds_cu *c) {
    check_attnres(c, 3, 4, 2304);
    check_attnres(c, 1, 2, 100);
}
