/* quant_matmul_bench.c — ds_matmul over BF16, FP8 (ptpc) and MXFP4 matrices of one shape: the best
 * of `reps` calls, wall time and process CPU time (the second is what a loaded machine still
 * tells). Not part of the build; from a build folder (e.g. build-h):
 *   gcc -O2 -fopenmp -I../src ../bench/quant_matmul_bench.c -o qbench libds_kern.a libds_io.a \
 *       libds_base.a -ljansson -lm -lpthread
 *   OMP_NUM_THREADS=2 ./qbench N K T reps [letters of bf16/fp8/mxfp4: "bfm"]
 * e.g. T = 1 over 512 MiB of FP8: ./qbench 16384 32768 1 5; T = 512: ./qbench 4096 4096 512 3.
 * GB/s counts the bytes of the packed matrix (codes + scales). */
#include "kernels/cpu/kernels.h"
#include "kernels/shared/quant.h"
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
static ds_mat mk(ds_dtype dt, int N, int K, size_t *bytes) {
    ds_mat m = {0};
    m.dtype = dt;
    m.rows = N;
    m.cols = K;
    size_t n = (size_t)N * K;
    if (dt == DS_DT_BF16) {
        uint16_t *d = malloc(n * 2);
        for (size_t i = 0; i < n; i++)
            d[i] = ds_f32_to_bf16((float)((i * 2654435761u >> 7) % 2001) / 1000.0f - 1.0f);
        m.data = d;
        *bytes = n * 2;
    } else if (dt == DS_DT_F8_E4M3) {
        uint8_t *d = malloc(n);
        for (size_t i = 0; i < n; i++) {
            uint8_t c = (uint8_t)((i * 2654435761u) >> 13);
            if ((c & 0x7f) == 0x7f) c ^= 1;
            d[i] = c;
        }
        float *s = malloc(N * 4);
        for (int r = 0; r < N; r++) s[r] = 0.01f;
        m.data = d;
        m.scale = s;
        *bytes = n + N * 4;
    } else {
        uint8_t *d = malloc(n / 2);
        for (size_t i = 0; i < n / 2; i++) d[i] = (uint8_t)((i * 2654435761u) >> 13);
        uint8_t *s = malloc(n / 32);
        for (size_t i = 0; i < n / 32; i++) s[i] = 120 + i % 8;
        m.data = d;
        m.scale = s;
        *bytes = n / 2 + n / 32;
    }
    return m;
}
static double cpu(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
static double g_cpu;
static double run(const ds_mat *m, int T, const float *x, float *y, int reps) {
    ds_matmul(y, m->rows, x, m->cols, T, m);
    double best = 1e9;
    for (int r = 0; r < reps; r++) {
        double t0 = now(), c0 = cpu();
        ds_matmul(y, m->rows, x, m->cols, T, m);
        double dt = now() - t0, dc = cpu() - c0;
        if (dt < best) {
            best = dt;
            g_cpu = dc;
        }
    }
    return best;
}
int main(int argc, char **argv) {
    int N = argc > 1 ? atoi(argv[1]) : 16384, K = argc > 2 ? atoi(argv[2]) : 32768,
        T = argc > 3 ? atoi(argv[3]) : 1, reps = argc > 4 ? atoi(argv[4]) : 5;
    const char *which = argc > 5 ? argv[5] : "bfm";
    float *x = malloc((size_t)T * K * 4);
    for (size_t i = 0; i < (size_t)T * K; i++) x[i] = (float)((i * 7919) % 1000) / 500.0f - 1.0f;
    float *y = malloc((size_t)T * N * 4);
    ds_dtype dts[3] = {DS_DT_BF16, DS_DT_F8_E4M3, DS_DT_MXFP4};
    const char *nm[3] = {"bf16", "fp8", "mxfp4"};
    for (int d = 0; d < 3; d++) {
        if (!strchr(which, "bfm"[d])) continue;
        size_t bytes;
        ds_mat m = mk(dts[d], N, K, &bytes);
        double t = run(&m, T, x, y, reps);
        printf("cpu %.3f ms (%.2f GB/cpu-s) | ", g_cpu * 1e3, bytes / g_cpu / 1e9);
        printf("%-6s N=%d K=%d T=%d isa=%s thr=%d: %.3f ms  %.2f GB/s  %.1f GFLOP/s  %.1f "
               "tok-equiv/s\n",
               nm[d], N, K, T, ds_isa_name(ds_kernels_isa()), omp_get_max_threads(), t * 1e3,
               bytes / t / 1e9, 2.0 * N * K * T / t / 1e9, T / t);
        free((void *)m.data);
        free((void *)m.scale);
    }
    return 0;
}
