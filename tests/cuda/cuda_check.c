/* cuda_check.c — the harness of test_cuda_kernels: random inputs, device buffers, the error
 * measure and the report, timing, and the main that runs every op's checks (test_cuda_<op>.c, in
 * the order of the table below) and, with --bench, the ceilings and every op's timings.
 *
 *   test_cuda_kernels            checks only (exit 1 on any failure)
 *   test_cuda_kernels --bench    checks, then the ceilings and kernel timings
 *   test_cuda_kernels --bench kda,mla   ... of those sections only (matmul, kda, moe, mla, draw)
 *   test_cuda_kernels --bench-only [sections]   the timings alone (under a profiler)
 *   test_cuda_kernels --kda-io DIR T H D        the chunked KDA on a peer's inputs (kda_io)
 *
 * Checks follow the device method: fresh random inputs for every case (never zeros), outputs
 * poisoned with NaN bytes before each run so that an unwritten element fails, and the error as
 * ||gpu - cpu|| / ||cpu|| in double. f32 kernels must land under 1e-5; the matmul rounds its
 * activations to BF16 (cuBLAS BF16 x BF16 -> F32), so it is held to 1e-2 and its error printed.
 * Built and run on the GPU machine by tools/device/cuda_check.sh. */
#include "cuda_check.h"

int g_fail = 0;
ds_rng g_rng;

float urand(float lo, float hi) {
    return lo + (hi - lo) * (float)ds_rng_uniform(&g_rng);
}

float *rand_f32(size_t n, float lo, float hi) {
    float *p = malloc(n * sizeof *p);
    if (!p) DIE("out of memory");
    for (size_t i = 0; i < n; i++) p[i] = urand(lo, hi);
    return p;
}

uint16_t *rand_bf16(size_t n, float lo, float hi) {
    uint16_t *p = malloc(n * sizeof *p);
    if (!p) DIE("out of memory");
    for (size_t i = 0; i < n; i++) p[i] = ds_f32_to_bf16(urand(lo, hi));
    return p;
}

void *dev(ds_cu *c, const void *host, size_t bytes) {
    ds_err err = {{0}};
    void *d = ds_cu_alloc(c, bytes, &err);
    if (!d) DIE("%s", err.msg);
    if (host && ds_cu_upload(c, d, host, bytes, &err)) DIE("%s", err.msg);
    return d;
}

/* NaN bytes: a kernel that skips an element leaves a NaN, which every check rejects. */
void poison(ds_cu *c, void *d, size_t bytes) {
    ds_err err = {{0}};
    if (ds_cu_fill_bytes(c, d, 0xff, bytes, &err)) DIE("%s", err.msg);
}

void fetch(ds_cu *c, void *host, const void *d, size_t bytes) {
    ds_err err = {{0}};
    if (ds_cu_sync(c, &err) || ds_cu_download(c, host, d, bytes, &err)) DIE("%s", err.msg);
}

/* ||a - b|| / ||b|| over n, rows of `cols` at stride ld (ld = cols: packed); NaN anywhere: inf. */
double rel_err(const float *a, const float *b, size_t rows, size_t cols, size_t ld) {
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

void report(const char *what, double err, double tol) {
    int ok = err <= tol;
    printf("check %-44s rel err %.2e (tol %.0e) %s\n", what, err, tol, ok ? "ok" : "FAIL");
    if (!ok) g_fail = 1;
}

/* Each sequence's rows of state (n per sequence, `row` floats each, packed from off[z] rows in)
 * against the CPU's, for the sequences with keep[z]: the rollback rows of a verify. */
void report_seq_rows(const char *what, const float *got, const float *ref, const int *off,
                     const int *lens, const int *keep, int n_seq, size_t row, double tol) {
    char name[96];
    for (int z = 0; z < n_seq; z++) {
        if (!keep[z]) continue;
        snprintf(name, sizeof name, "%s: seq %d's rows", what, z);
        size_t at = (size_t)off[z] * row, n = (size_t)lens[z] * row;
        report(name, rel_err(got + at, ref + at, 1, n, n), tol);
    }
}

/* Bits that differ between two device results of n floats (words compared, NaN bytes too). */
size_t words_differ(const float *a, const float *b, size_t n) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += memcmp(&a[i], &b[i], 4) != 0;
    return bad;
}

int mla_batch_layout(const int *lens, const int *pos0, int n_seq, int bs, int *bt_off, int *tok_bt,
                     int *tok_pos, int *T, int *max_ctx, int32_t **tables) {
    int pages = 0;
    *T = *max_ctx = 0;
    for (int z = 0; z < n_seq; z++) {
        const int ctx = pos0[z] + lens[z];
        bt_off[z] = pages;
        pages += (ctx + bs - 1) / bs;
        *max_ctx = DS_MAX(*max_ctx, ctx);
        for (int t = 0; t < lens[z]; t++) tok_bt[*T + t] = bt_off[z], tok_pos[*T + t] = pos0[z] + t;
        *T += lens[z];
    }
    *tables = malloc((size_t)pages * 4);
    if (!*tables) DIE("out of memory");
    for (int i = 0; i < pages; i++) (*tables)[i] = (int32_t)((i * 7 + 3) % pages);
    return pages;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median milliseconds of `reps` runs after `warm` warm-ups, each timed with events. */
double median_ms(ds_cu *c, run_fn f, void *ctx, int warm, int reps) {
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

/* Is section `name` among the comma-separated `only` (NULL: every section)? */
static int wanted(const char *only, const char *name) {
    if (!only) return 1;
    size_t n = strlen(name);
    for (const char *p = only; (p = strstr(p, name)) != NULL; p += n)
        if ((p == only || p[-1] == ',') && (p[n] == ',' || p[n] == '\0')) return 1;
    return 0;
}

/* Every op's checks in the order they run: one random stream feeds them all, so this order fixes
 * each check's inputs (it is the order of the single file they came from). */
static const struct {
    const char *name;
    void (*fn)(ds_cu *c);
} cuda_checks[] = {
    {"matmul", checks_matmul},
    {"embed", checks_embed},
    {"norm rows", checks_norm_rows},
    {"activations", checks_act},
    {"kda", checks_kda},
    {"kda inputs", checks_kda_inputs},
    {"norm heads", checks_norm_heads},
    {"attnres", checks_attnres},
    {"mla", checks_mla},
    {"moe", checks_moe},
    {"kda batch", checks_kda_batch},
    {"copy", checks_copy},
    {"mla batch", checks_mla_batch},
    {"rope", checks_rope},
    {"argmax", checks_argmax},
    {"nccl", checks_nccl},
    {"draws", checks_draws},
    {"matmul fp8", checks_matmul_fp8}, /* (last: the inputs of the checks above stay the same) */
    {"moe mxfp4", checks_moe_mxfp4},
    {"kv rows", checks_kv_rows},
    {"moe fp8", checks_moe_fp8},
};

/* Every op's timings, by the section name --bench selects them with, in the order they run. */
static const struct {
    const char *name;
    void (*fn)(ds_cu *c, const cuda_ceilings *ceil);
} cuda_benches[] = {
    {"matmul", bench_matmul},  {"kda", bench_kda},          {"mla", bench_mla_expanded},
    {"moe", bench_moe},        {"mla", bench_mla_absorbed}, {"draw", bench_draw},
    {"fp8", bench_matmul_fp8}, {"mxfp4", bench_moe_mxfp4},  {"moefp8", bench_moe_fp8},
};

/* Every kernel against the CPU backend on fresh random inputs (g_fail counts what failed). */
static void run_checks(ds_cu *c) {
    /* DS_CUDA_CHECKS="matmul fp8,moe mxfp4": only those (their inputs then differ from a full
     * run's, the random stream being shared) */
    const char *only = getenv("DS_CUDA_CHECKS");
    for (size_t i = 0; i < DS_ARRAY_LEN(cuda_checks); i++)
        if (wanted(only && *only ? only : NULL, cuda_checks[i].name)) cuda_checks[i].fn(c);
}

/* The ceilings every timing is reported against: the copy rate and cuBLAS's BF16 GEMM rate. */
static cuda_ceilings bench_ceilings(ds_cu *c) {
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
    return (cuda_ceilings){copy_gbs, gemm_tf};
}

static void bench(ds_cu *c, const char *only) {
    const cuda_ceilings ceil = bench_ceilings(c);
    for (size_t i = 0; i < DS_ARRAY_LEN(cuda_benches); i++)
        if (wanted(only, cuda_benches[i].name)) cuda_benches[i].fn(c, &ceil);
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
