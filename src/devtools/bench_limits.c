/* bench_limits.c — machine limits for `bench` (see bench_limits.h).
 *
 * Bandwidth: each thread first-touches and then reads its own contiguous slice (so on NUMA hosts
 * pages sit next to their reader), summing with independent vector accumulators so the loop is
 * bound by loads, not by add latency. FMA peak: each thread runs a register-resident chain of
 * independent FMAs, more than latency x ports, so both FMA pipes stay busy. */
#include "devtools/bench_limits.h"

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "base/ds_base.h"

#define REPS 5

/* Thread t's slice [*lo, *hi) of n floats, in whole 32-float (128-byte) blocks. */
static void slice(size_t n, int t, int nt, size_t *lo, size_t *hi) {
    size_t blocks = n / 32, per = blocks / (size_t)nt, extra = blocks % (size_t)nt;
    size_t b0 = (size_t)t * per + DS_MIN((size_t)t, extra);
    *lo = 32 * b0;
    *hi = 32 * (b0 + per + ((size_t)t < extra));
}

__attribute__((target("avx2"))) static float read_avx2(const float *p, size_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < n; i += 32) { /* n is a multiple of 32, p 64-byte aligned */
        a0 = _mm256_add_ps(a0, _mm256_load_ps(p + i));
        a1 = _mm256_add_ps(a1, _mm256_load_ps(p + i + 8));
        a2 = _mm256_add_ps(a2, _mm256_load_ps(p + i + 16));
        a3 = _mm256_add_ps(a3, _mm256_load_ps(p + i + 24));
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    float lanes[8];
    _mm256_storeu_ps(lanes, s);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
}

static float read_scalar(const float *p, size_t n) {
    float a[8] = {0};
    for (size_t i = 0; i < n; i += 8)
        for (int j = 0; j < 8; j++) a[j] += p[i + j];
    return a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
}

double ds_bench_read_bandwidth(size_t bytes, int threads) {
    if (threads <= 0) threads = omp_get_max_threads();
    size_t n = bytes / sizeof(float) / 32 * 32; /* floats in the buffer */
    if (n < 32 * (size_t)threads) return -1.0;
    float *buf = ds_aligned_alloc(n * sizeof(float), NULL); /* [n] */
    if (!buf) return -1.0;
    const int avx2 = __builtin_cpu_supports("avx2");
#pragma omp parallel num_threads(threads)
    {
        size_t lo, hi;
        slice(n, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        for (size_t i = lo; i < hi; i++) buf[i] = (float)(i & 1023) * (1.0f / 1024);
    }
    double best = 0.0;
    volatile float sink = 0.0f; /* keeps the sums, so the reads cannot be optimised away */
    for (int rep = 0; rep < REPS; rep++) {
        float total = 0.0f;
        double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : total)
        {
            size_t lo, hi;
            slice(n, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
            total += avx2 ? read_avx2(buf + lo, hi - lo) : read_scalar(buf + lo, hi - lo);
        }
        double dt = omp_get_wtime() - t0;
        sink = sink + total;
        if (dt > 0) best = DS_MAX(best, (double)(n * sizeof(float)) / dt / 1e9);
    }
    (void)sink;
    free(buf);
    return best;
}

#define FMA_ACC                                                                                    \
    12 /* independent chains: > 4-cycle latency x 2 FMA ports, fits 16 ymm registers               \
        */

/* Runs iters rounds of FMA_ACC 8-lane FMAs; returns a value depending on all of them. */
__attribute__((target("avx2,fma"))) static float fma_avx2(long iters, float seed) {
    const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    __m256 a[FMA_ACC];
    for (int j = 0; j < FMA_ACC; j++) a[j] = _mm256_set1_ps(seed + 0.01f * (float)j);
    for (long i = 0; i < iters; i++) {
        /* Written out so every accumulator stays in a register. */
        a[0] = _mm256_fmadd_ps(a[0], m, c);
        a[1] = _mm256_fmadd_ps(a[1], m, c);
        a[2] = _mm256_fmadd_ps(a[2], m, c);
        a[3] = _mm256_fmadd_ps(a[3], m, c);
        a[4] = _mm256_fmadd_ps(a[4], m, c);
        a[5] = _mm256_fmadd_ps(a[5], m, c);
        a[6] = _mm256_fmadd_ps(a[6], m, c);
        a[7] = _mm256_fmadd_ps(a[7], m, c);
        a[8] = _mm256_fmadd_ps(a[8], m, c);
        a[9] = _mm256_fmadd_ps(a[9], m, c);
        a[10] = _mm256_fmadd_ps(a[10], m, c);
        a[11] = _mm256_fmadd_ps(a[11], m, c);
    }
    __m256 s = a[0];
    for (int j = 1; j < FMA_ACC; j++) s = _mm256_add_ps(s, a[j]);
    float lanes[8];
    _mm256_storeu_ps(lanes, s);
    return lanes[0] + lanes[7];
}

/* Same count of flops per round as fma_avx2 (FMA_ACC x 8 lanes x 2), in portable C. */
static float fma_scalar(long iters, float seed) {
    float a[FMA_ACC * 8];
    for (int j = 0; j < FMA_ACC * 8; j++) a[j] = seed + 0.01f * (float)j;
    for (long i = 0; i < iters; i++)
        for (int j = 0; j < FMA_ACC * 8; j++) a[j] = a[j] * 0.999999f + 1e-7f;
    float s = 0;
    for (int j = 0; j < FMA_ACC * 8; j++) s += a[j];
    return s;
}

double ds_bench_fma_peak(int threads) {
    if (threads <= 0) threads = omp_get_max_threads();
    const int fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const long iters = fma ? 20 * 1000 * 1000 : 2 * 1000 * 1000; /* ~0.05-0.1 s per rep */
    double best = 0.0;
    volatile float sink = 0.0f;
    for (int rep = 0; rep < REPS; rep++) {
        float total = 0.0f;
        int team = 1; /* threads OpenMP actually gave us */
        double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : total)
        {
            if (omp_get_thread_num() == 0) team = omp_get_num_threads();
            float seed = 0.5f + 0.001f * (float)omp_get_thread_num();
            total += fma ? fma_avx2(iters, seed) : fma_scalar(iters, seed);
        }
        double dt = omp_get_wtime() - t0;
        sink = sink + total;
        double flops = (double)team * (double)iters * FMA_ACC * 8 * 2;
        if (dt > 0) best = DS_MAX(best, flops / dt / 1e9);
    }
    (void)sink;
    return best;
}
