/* test_cuda_rope.c — RoPE on GPT-J pairs against the CPU draft's formula. */
#include "cuda_check.h"

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

/* RoPE rows */
void checks_rope(ds_cu *c) {
    check_rope(c, 7, 576, 1, 32);    /* the draft's latent rows: rope lanes after R = 512 */
    check_rope(c, 7 * 4, 64, 4, 32); /* its queries' rope parts: 4 heads a position */
    check_rope(c, 3, 10, 1, 3);      /* odd widths; lanes past 2 half untouched */
}
