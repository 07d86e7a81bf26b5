/* test_kern_kvfp8.c — the quantized latent cache rows (docs/quantization.md §4,
 * kernels/shared/kv_row.h) and the CPU's absorbed attention over a pool of such rows: FP8's layout,
 * each tile's scale, the quantization error against float64 (within half an E4M3 step), the exact
 * round trip of values the format holds; BF16's layout and rounding; and the attention over FP8
 * and BF16 pools against a float64 reference of the dequantized math (and bit for bit against the
 * f32 kernel over the dequantized rows). */
#include "testutil.h"

#include "kernels/cpu/kernels.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* x [R + dr]: tile j of the latent part scaled by 10^(j - 2 + shift); tile `zero` all zeros; the
 * rope part normal-ish. */
static void kv_row(ds_rng *r, float *x, int R, int dr, int shift, int zero) {
    for (int k = 0; k < R + dr; k++) {
        const int j = k / DS_KV_FP8_TILE;
        const double u = 2.0 * ds_rng_uniform(r) - 1.0;
        x[k] = k < R ? (j == zero ? 0.0f : (float)(u * pow(10.0, j - 2 + shift))) : (float)(3 * u);
    }
}

static void test_layout(void **st) {
    (void)st;
    assert_int_equal(ds_kv_fp8_row_bytes(512, 64), 656);
    assert_int_equal(ds_kv_fp8_rope_at(512), 528);
    assert_int_equal(ds_kv_fp8_row_bytes(30, 6), 48);   /* 30 + 4 + 12 = 46, padded */
    assert_int_equal(ds_kv_fp8_row_bytes(200, 8), 224); /* 200 + 8 + 16 */
    ds_rng r;
    ds_rng_seed(&r, 5);
    float x[576];
    uint8_t row[656];
    memset(row, 0xee, sizeof row);
    kv_row(&r, x, 512, 64, 0, -1);
    ds_kv_fp8_quant_row(row, x, 512, 64);
    for (int b = 528 + 128; b < 656; b++) assert_int_equal(row[b], 0); /* padding */
    for (int k = 0; k < 64; k++) { /* the rope part is BF16, rounded to nearest even */
        uint16_t h;
        memcpy(&h, row + 528 + 2 * k, 2);
        assert_int_equal(h, ds_f32_to_bf16(x[512 + k]));
    }
}

/* Every tile's scale is max(amax / 448, 1 / (448 * 512)) and every value within half an E4M3
 * step of x (relative 2^-4 on the normal grid, 2^-10 s on the subnormal one). */
static void check_bound(int R, int dr, int shift, int zero, uint64_t seed) {
    ds_rng r;
    ds_rng_seed(&r, seed);
    float *x = malloc(sizeof(float) * (size_t)(R + dr)),
          *y = malloc(sizeof(float) * (size_t)(R + dr));
    uint8_t *row = malloc(ds_kv_fp8_row_bytes(R, dr));
    assert_non_null(x), assert_non_null(y), assert_non_null(row);
    kv_row(&r, x, R, dr, shift, zero);
    ds_kv_fp8_quant_row(row, x, R, dr);
    ds_kv_fp8_dequant_row(y, row, R, dr);
    double worst = 0; /* the largest error in half steps: near 1 when rounding really happens */
    for (int j = 0; j < ds_kv_fp8_tiles(R); j++) {
        const int a = j * DS_KV_FP8_TILE, n = DS_MIN(DS_KV_FP8_TILE, R - a);
        double amax = 0;
        for (int i = 0; i < n; i++) amax = fmax(amax, fabs((double)x[a + i]));
        const double s_ref = fmax(amax / 448.0, 1.0 / (448.0 * 512.0));
        const double s = ds_kv_fp8_scale(row, R, j);
        assert_true(fabs(s - s_ref) <= s_ref * 0x1p-24);
        for (int i = 0; i < n; i++) {
            const double xv = x[a + i], err = fabs((double)y[a + i] - xv);
            const double half = fmax(fabs(xv) * 0x1p-4, s * 0x1p-10);
            if (err > half * (1 + 1e-6) + 1e-30)
                fail_msg("R %d tile %d value %d: %.9g read back as %.9g (scale %g)", R, j, i, xv,
                         (double)y[a + i], s);
            worst = fmax(worst, err / half);
        }
    }
    assert_true(worst > 0.5); /* the values did get rounded */
    for (int k = 0; k < dr; k++)
        assert_true(fabs((double)y[R + k] - x[R + k]) <= fabs((double)x[R + k]) * 0x1p-8);
    free(x), free(y), free(row);
}

static void test_error_bound(void **st) {
    (void)st;
    check_bound(512, 64, 0, 2, 1);   /* tiles at 1e-2 .. 1e1, one zero (the floor scale) */
    check_bound(512, 64, -3, -1, 2); /* 1e-5 .. 1e-2: the first tiles below the floor scale */
    check_bound(512, 64, 2, -1, 3);  /* 1 .. 1e3 */
    check_bound(30, 6, 0, -1, 4);    /* one short tile */
    check_bound(200, 8, 1, -1, 5);   /* a whole tile and a partial one */
}

/* Values the format holds come back exactly: every finite E4M3 value times a power-of-two
 * scale, in a tile whose largest magnitude is 448 times that scale; BF16 rope values. */
static void test_exact_round_trip(void **st) {
    (void)st;
    enum { R = 512, DR = 64 };
    float x[R + DR], y[R + DR];
    uint8_t row[656];
    const float scales[4] = {0x1p-3f, 1.0f, 0x1p5f, 0x1p-12f};
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 128; i++) {
            /* codes 0x00..0x7e are the non-negative finite values; alternate signs */
            const uint8_t code = (uint8_t)(i == 0 ? 0x7e : (i * 37) % 0x7f);
            x[j * 128 + i] = ds_e4m3_to_f32(code) * scales[j] * (i & 1 ? -1.0f : 1.0f);
        }
    for (int k = 0; k < DR; k++) x[R + k] = ds_bf16_to_f32((uint16_t)(0x3f80 + 37 * k));
    ds_kv_fp8_quant_row(row, x, R, DR);
    ds_kv_fp8_dequant_row(y, row, R, DR);
    for (int j = 0; j < 4; j++) assert_true(ds_kv_fp8_scale(row, R, j) == scales[j]);
    assert_memory_equal(y, x, sizeof x);
}

/* BF16 rows: 16-byte multiples, every value rounded to nearest even (base's ds_f32_to_bf16, the
 * CPU's weight rounding), padding zero. */
static void test_bf16_rows(void **st) {
    (void)st;
    assert_int_equal(ds_kv_row_bytes(DS_KV_BF16, 512, 64), 1152);
    assert_int_equal(ds_kv_row_bytes(DS_KV_BF16, 30, 6), 80); /* 72, padded */
    assert_int_equal(ds_kv_row_bytes(DS_KV_F32, 30, 6), 144);
    assert_int_equal(ds_kv_row_bytes(DS_KV_FP8, 512, 64), 656);
    enum { R = 30, DR = 6 };
    float x[R + DR];
    ds_rng r;
    ds_rng_seed(&r, 21);
    kv_row(&r, x, R, DR, 0, -1);
    x[3] = 1.0f + 0x1p-8f;     /* a tie: rounds to the even 1.0 */
    x[4] = 1.0f + 3 * 0x1p-8f; /* a tie: rounds up to the even 1 + 2^-6 */
    x[5] = -0.0f;
    uint8_t row[80];
    memset(row, 0xee, sizeof row);
    ds_kv_bf16_row(row, x, R, DR);
    for (int i = 0; i < R + DR; i++) {
        const float want = ds_bf16_to_f32(ds_f32_to_bf16(x[i])), got = ds_kv_bf16_row_value(row, i);
        assert_memory_equal(&got, &want, 4);
        assert_true(fabsf(got - x[i]) <= fabsf(x[i]) * 0x1p-8f);
    }
    assert_true(ds_kv_bf16_row_value(row, 3) == 1.0f);
    assert_true(ds_kv_bf16_row_value(row, 4) == 1.0f + 0x1p-6f);
    assert_true(signbit(ds_kv_bf16_row_value(row, 5)));
    for (int b = 2 * (R + DR); b < 80; b++) assert_int_equal(row[b], 0);
}

/* ds_latent_store / ds_latent_load over a paged FP8 or BF16 view are the shared row functions,
 * and an f32 view copies rows unchanged. */
static void test_store_load(void **st) {
    (void)st;
    enum { R = 200, DR = 8, BS = 4 };
    const size_t rb = ds_kv_fp8_row_bytes(R, DR);
    const size_t rb16 = ds_kv_row_bytes(DS_KV_BF16, R, DR);
    uint8_t *pool = calloc(3 * BS, rb), *pool16 = calloc(3 * BS, rb16);
    float *pf = calloc(3 * BS, (R + DR) * sizeof(float));
    int32_t table[3] = {2, 0, 1};
    ds_latent_view v8 = {pool, table, BS, R + DR, R, DS_KV_FP8};
    ds_latent_view v16 = {pool16, table, BS, R + DR, R, DS_KV_BF16};
    ds_latent_view v32 = {pf, table, BS, R + DR, R, DS_KV_F32};
    ds_rng r;
    ds_rng_seed(&r, 9);
    for (int p = 0; p < 3 * BS; p++) {
        float x[R + DR], want[R + DR], c[R], kr[DR];
        kv_row(&r, x, R, DR, p % 3 - 1, -1);
        ds_latent_store(&v8, p, x);
        ds_latent_store(&v16, p, x);
        ds_latent_store(&v32, p, x);
        uint8_t ref[416]; /* the BF16 row; the FP8 one takes 224 */
        ds_kv_bf16_row(ref, x, R, DR);
        assert_memory_equal(ds_latent_at(&v16, p), ref, rb16);
        ds_latent_load(&v16, p, c, kr);
        for (int i = 0; i < R + DR; i++) want[i] = ds_kv_bf16_row_value(ref, i);
        assert_memory_equal(c, want, sizeof c);
        assert_memory_equal(kr, want + R, sizeof kr);
        ds_kv_fp8_quant_row(ref, x, R, DR);
        assert_memory_equal(ds_latent_at(&v8, p), ref, rb);
        ds_kv_fp8_dequant_row(want, ref, R, DR);
        ds_latent_load(&v8, p, c, kr);
        assert_memory_equal(c, want, sizeof c);
        assert_memory_equal(kr, want + R, sizeof kr);
        ds_latent_load(&v32, p, c, kr);
        assert_memory_equal(c, x, sizeof c);
        assert_memory_equal(kr, x + R, sizeof kr);
    }
    free(pool), free(pool16), free(pf);
}

/* The CPU kernels' own dequantization (vectorized) reads every code the quantizer can write as
 * ds_kv_fp8_value does, at several scales. */
static void test_every_code(void **st) {
    (void)st;
    enum { R = 256, DR = 2 };
    uint8_t row[272] = {0};
    int32_t table[1] = {0};
    ds_latent_view v = {row, table, 1, R + DR, R, DS_KV_FP8};
    const float scales[3] = {1.0f, 0.37f, 1.0f / (448.0f * 512.0f)};
    for (int k = 0; k < 3; k++) {
        for (int i = 0; i < R; i++) row[i] = (uint8_t)((i & 0x7f) == 0x7f ? 0x7e | (i & 0x80) : i);
        memcpy(row + R, &scales[k], 4);
        memcpy(row + R + 4, &scales[2 - k], 4);
        float c[R], kr[DR];
        ds_latent_load(&v, 0, c, kr);
        for (int i = 0; i < R; i++) {
            const float want = ds_kv_fp8_value(row, R, i);
            if (memcmp(&c[i], &want, 4) != 0)
                fail_msg("code 0x%02x scale %g: %.9g, want %.9g", row[i], (double)scales[k],
                         (double)c[i], (double)want);
        }
    }
}

/* The absorbed attention over an FP8 or BF16 pool (dtype dt; pages shuffled inside a larger pool
 * whose other rows read as NaN) against float64 over the dequantized rows, and bit for bit against
 * the f32 kernel over a pool of those dequantized rows. */
static void check_absorbed(int dt, int Ha, int R, int dr, int n_ctx, int T, int pos0, int causal,
                           uint64_t seed) {
    enum { BS = 16 };
    const int row = R + dr, nblk = (n_ctx + BS - 1) / BS, pool_blocks = 2 * nblk + 3;
    const size_t rb = ds_kv_row_bytes(dt, R, dr);
    ds_rng r;
    ds_rng_seed(&r, seed);
    int32_t *table = malloc(sizeof(int32_t) * (size_t)nblk);
    for (int i = 0; i < nblk; i++) table[i] = (int32_t)((i * 5 + 2) % pool_blocks);
    uint8_t *pool = malloc((size_t)pool_blocks * BS * rb);
    float *pool32 = malloc(sizeof(float) * (size_t)pool_blocks * BS * row);
    memset(pool, 0xff, (size_t)pool_blocks * BS * rb); /* NaN codes, scales and BF16 values */
    for (size_t i = 0; i < (size_t)pool_blocks * BS * row; i++) pool32[i] = NAN;
    ds_latent_view v8 = {pool, table, BS, row, R, dt}, v32 = {pool32, table, BS, row, R, 0};
    double *deq = malloc(sizeof(double) * (size_t)n_ctx * row); /* [n_ctx][row] */
    float *x = malloc(sizeof(float) * (size_t)row);
    for (int p = 0; p < n_ctx; p++) {
        kv_row(&r, x, R, dr, p % 3 - 2, -1);
        ds_latent_store(&v8, p, x);
        float *d = ds_latent_row(&v32, p);
        for (int k = 0; k < row; k++) d[k] = ds_kv_row_value(dt, ds_latent_at(&v8, p), R, k);
        for (int k = 0; k < row; k++) deq[(size_t)p * row + k] = d[k];
    }
    const size_t nq = (size_t)T * Ha;
    float *qbar = malloc(sizeof(float) * nq * R), *qr = malloc(sizeof(float) * nq * dr);
    for (size_t i = 0; i < nq * R; i++) qbar[i] = (float)(ds_rng_uniform(&r) - 0.5);
    for (size_t i = 0; i < nq * dr; i++) qr[i] = (float)(2 * ds_rng_uniform(&r) - 1);
    float *o8 = malloc(sizeof(float) * nq * R), *o32 = malloc(sizeof(float) * nq * R);
    double *ref = calloc(nq * R, sizeof(double)), *sc = malloc(sizeof(double) * (size_t)n_ctx);
    const float scale = 1.0f / sqrtf(192.0f);
    ds_mla_attend_absorbed(o8, qbar, qr, T, Ha, R, dr, &v8, pos0, n_ctx, causal, scale);
    ds_mla_attend_absorbed(o32, qbar, qr, T, Ha, R, dr, &v32, pos0, n_ctx, causal, scale);
    for (size_t q = 0; q < nq; q++) {
        const int t = (int)(q / Ha), lim = causal ? DS_MIN(pos0 + t + 1, n_ctx) : n_ctx;
        double mx = -INFINITY, sum = 0;
        for (int p = 0; p < lim; p++) {
            double s = 0;
            for (int k = 0; k < R; k++) s += (double)qbar[q * R + k] * deq[(size_t)p * row + k];
            for (int k = 0; k < dr; k++) s += (double)qr[q * dr + k] * deq[(size_t)p * row + R + k];
            sc[p] = s * scale;
            mx = fmax(mx, sc[p]);
        }
        for (int p = 0; p < lim; p++) sum += (sc[p] = exp(sc[p] - mx));
        for (int p = 0; p < lim; p++)
            for (int k = 0; k < R; k++) ref[q * R + k] += sc[p] / sum * deq[(size_t)p * row + k];
    }
    const double err = ds_test_rel_err(o8, ref, nq * R);
    print_message("%s absorbed Ha %d R %d ctx %d T %d: rel err %.2e\n",
                  dt == DS_KV_FP8 ? "fp8" : "bf16", Ha, R, n_ctx, T, err);
    assert_true(err < 1e-5);
    assert_memory_equal(o8, o32, sizeof(float) * nq * R);
    free(table), free(pool), free(pool32), free(deq), free(x), free(qbar), free(qr), free(o8);
    free(o32), free(ref), free(sc);
}

static void test_absorbed(void **st) {
    (void)st;
    for (int dt = DS_KV_FP8; dt <= DS_KV_BF16; dt++) {
        check_absorbed(dt, 8, 512, 64, 700, 1, 699, 1, 11);  /* a decode at 700: key ranges */
        check_absorbed(dt, 3, 512, 64, 45, 5, 40, 1, 12);    /* a verify */
        check_absorbed(dt, 16, 512, 64, 37, 37, 0, 1, 13);   /* a prefill from 0 */
        check_absorbed(dt, 4, 30, 6, 41, 8, 33, 0, 14);      /* a short tile, not causal */
        check_absorbed(dt, 2, 200, 8, 2100, 2, 2098, 1, 15); /* long: many ranges, merged */
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layout),           cmocka_unit_test(test_error_bound),
        cmocka_unit_test(test_exact_round_trip), cmocka_unit_test(test_store_load),
        cmocka_unit_test(test_every_code),       cmocka_unit_test(test_absorbed),
        cmocka_unit_test(test_bf16_rows),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
